package org.edgekv.core;

import java.io.File;
import java.util.List;

/**
 * One runtime (ONNX Runtime or ExecuTorch) behind the benchmark loop. The app implements it with the runtimes'
 * Android libraries; the tests with a fake. {@code T} is what the runtime's state values are held in (see
 * {@link StateBook.Slots}).
 */
public interface Backend<T> {
    /** Loads the runtime's native library (nothing of the model yet): what the runtime baseline includes. */
    void init(BenchmarkArgs args) throws Exception;

    /** Runtime and version for the report, e.g. "onnxruntime-android 1.30.0". */
    String runtime();

    /** Loads the artifact's program from dir. */
    void load(Manifest manifest, Manifest.Artifact artifact, File dir) throws Exception;

    StateBook.Slots<T> slots();

    /**
     * Runs one call: tokens (already padded to call.padded) at positions call.pos.., with book's pasts as the state
     * inputs in manifest order. Puts every state output into the book ({@link StateBook#putPresent}) and returns the
     * logits of the last real token (call.n - 1), vocab floats.
     */
    float[] call(StepPlan.Call call, long[] tokens, StateBook<T> book) throws Exception;

    /** The pasts a swap gave back: reuse them as the next call's present buffers, or free them. */
    void recycle(List<T> old);

    /** Frees the program and the runtime's resources. */
    void close();
}
