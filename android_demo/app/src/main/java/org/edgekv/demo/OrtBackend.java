package org.edgekv.demo;

import ai.onnxruntime.OnnxJavaType;
import ai.onnxruntime.OnnxTensor;
import ai.onnxruntime.OnnxValue;
import ai.onnxruntime.OrtEnvironment;
import ai.onnxruntime.OrtException;
import ai.onnxruntime.OrtSession;
import ai.onnxruntime.TensorInfo;
import java.io.File;
import java.nio.ByteBuffer;
import java.nio.FloatBuffer;
import java.nio.LongBuffer;
import java.util.Collections;
import java.util.HashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Set;
import org.edgekv.core.Backend;
import org.edgekv.core.BenchmarkArgs;
import org.edgekv.core.DType;
import org.edgekv.core.EdgekvException;
import org.edgekv.core.Manifest;
import org.edgekv.core.StateBook;
import org.edgekv.core.StepPlan;

/**
 * ONNX Runtime Android (com.microsoft.onnxruntime:onnxruntime-android), CPU execution provider.
 *
 * <p>The state lives in OnnxTensors: the zero state wraps direct ByteBuffers (no copy), and each call's state
 * outputs are fed back as they are (ORT allocated them; no copy either). A Result is never closed as a whole: the
 * logits are closed after reading, the state tensors when the book hands them back after the next call.
 */
final class OrtBackend implements Backend<OnnxTensor> {
    private OrtEnvironment env;
    private OrtSession.SessionOptions options;
    private OrtSession session;
    private Manifest manifest;
    private boolean inPlace;
    private final Set<String> outputNames = new LinkedHashSet<>();

    @Override
    public void init(BenchmarkArgs args) throws OrtException {
        env = OrtEnvironment.getEnvironment(); // loads libonnxruntime.so and its JNI library
        options = new OrtSession.SessionOptions();
        if (args.threads > 0) {
            options.setIntraOpNumThreads(args.threads);
        }
        options.setOptimizationLevel(OrtSession.SessionOptions.OptLevel.ALL_OPT);
        // as edgekv's OrtStepper (lean) and the manifest's deployment.formats.onnx.session_options: without these
        // ORT keeps the blocks of earlier calls and peak memory drifts above the plan (benchmarks/plan_accuracy.py)
        options.setCPUArenaAllocator(false);
        options.setMemoryPatternOptimization(false);
    }

    @Override
    public String runtime() {
        return "onnxruntime-android " + BuildConfig.ORT_VERSION;
    }

    @Override
    public void load(Manifest m, Manifest.Artifact a, File dir) throws OrtException {
        manifest = m;
        inPlace = a.stateInPlace;
        File model = new File(dir, a.file);
        try {
            session = env.createSession(model.getPath(), options);
        } catch (OrtException e) {
            throw new EdgekvException(model + ": ONNX Runtime cannot load it (" + e.getMessage() + ")", e);
        }
        Manifest.EntryPoint ep = a.entryPoints.get(0);
        for (Manifest.TensorSpec t : ep.outputs) {
            outputNames.add(t.name);
        }
        for (Manifest.TensorSpec t : ep.inputs) {
            if (!session.getInputNames().contains(t.name)) {
                throw new EdgekvException(model + ": the graph has no input '" + t.name + "' that the manifest lists "
                        + "(inputs: " + session.getInputNames() + ")");
            }
        }
    }

    private static OnnxJavaType javaType(DType d) {
        switch (d) {
            case FLOAT32: return OnnxJavaType.FLOAT;
            case FLOAT16: return OnnxJavaType.FLOAT16;
            case BFLOAT16: return OnnxJavaType.BFLOAT16;
            case INT8: return OnnxJavaType.INT8;
            case UINT8: return OnnxJavaType.UINT8;
            case INT32: return OnnxJavaType.INT32;
            case INT64: return OnnxJavaType.INT64;
            default: throw new EdgekvException("ONNX Runtime's Java API has no tensor type for " + d);
        }
    }

    private static int elementBytes(OnnxJavaType t) {
        switch (t) {
            case FLOAT: case INT32: return 4;
            case FLOAT16: case BFLOAT16: case INT16: return 2;
            case INT8: case UINT8: case BOOL: return 1;
            case DOUBLE: case INT64: return 8;
            default: throw new EdgekvException("no element size for ONNX type " + t);
        }
    }

    private final StateBook.Slots<OnnxTensor> slots = new StateBook.Slots<OnnxTensor>() {
        @Override
        public OnnxTensor zeros(Manifest.StateTensor spec) {
            ByteBuffer b = StateBook.DIRECT_BUFFERS.zeros(spec);
            try {
                return OnnxTensor.createTensor(env, b, spec.shape, javaType(spec.dtype));
            } catch (OrtException e) {
                throw new EdgekvException(spec.input + ": cannot create the zero state (" + e.getMessage() + ")", e);
            }
        }

        @Override
        public long byteSize(OnnxTensor value) {
            TensorInfo info = value.getInfo();
            long n = 1;
            for (long d : info.getShape()) {
                n *= d;
            }
            return n * elementBytes(info.type);
        }

        @Override
        public void release(OnnxTensor value) {
            value.close();
        }
    };

    @Override
    public StateBook.Slots<OnnxTensor> slots() {
        return slots;
    }

    @Override
    public float[] call(StepPlan.Call call, long[] tokens, StateBook<OnnxTensor> book) throws OrtException {
        Map<String, OnnxTensor> in = new HashMap<>();
        OnnxTensor tok = OnnxTensor.createTensor(env, LongBuffer.wrap(tokens), new long[] {1, call.padded});
        OnnxTensor pos = OnnxTensor.createTensor(env, LongBuffer.wrap(new long[] {call.pos}), new long[] {1});
        in.put("tokens", tok);
        in.put("pos", pos);
        OnnxTensor rows = null;
        if (call.entry.takesRows) { // the last real token's logits only: the output matrix runs over one row
            rows = OnnxTensor.createTensor(env, LongBuffer.wrap(call.lastRow()), new long[] {1});
            in.put(Manifest.ROWS, rows);
        }
        for (int i = 0; i < book.size(); i++) {
            in.put(book.spec(i).input, book.past(i));
        }
        OrtSession.Result r;
        try {
            if (inPlace) {
                // the manifest's state_in_place: each present.* is pinned to its past.* tensor, so ORT's
                // GroupQueryAttention writes the new rows into the state where it lies (as edgekv's OrtStepper
                // binds them); only the logits come back as a new tensor
                Map<String, OnnxTensor> pinned = new HashMap<>();
                for (int i = 0; i < book.size(); i++) {
                    pinned.put(book.spec(i).output, book.past(i));
                }
                r = session.run(in, Collections.singleton("logits"), pinned);
            } else {
                r = session.run(in, outputNames);
            }
        } finally {
            tok.close();
            pos.close();
            if (rows != null) {
                rows.close();
            }
        }
        float[] last;
        OnnxTensor logits = (OnnxTensor) value(r, "logits");
        try {
            FloatBuffer all = logits.getFloatBuffer(); // a copy of [1, padded, vocab]
            int vocab = manifest.vocab;
            last = new float[vocab];
            // [1, 1, vocab], or [1, padded, vocab]; through Buffer: JDK 9+ declares a covariant FloatBuffer.position,
            // a method older Android releases do not have
            ((java.nio.Buffer) all).position(call.lastRowIndex() * vocab);
            all.get(last);
        } finally {
            logits.close();
        }
        for (int i = 0; i < book.size(); i++) {
            book.putPresent(i, inPlace ? book.past(i) : (OnnxTensor) value(r, book.spec(i).output));
        }
        return last;
    }

    private static OnnxValue value(OrtSession.Result r, String name) {
        Optional<OnnxValue> v = r.get(name);
        if (!v.isPresent()) {
            throw new EdgekvException("ONNX Runtime returned no output '" + name + "'");
        }
        return v.get();
    }

    @Override
    public void recycle(List<OnnxTensor> old) {
        for (OnnxTensor t : old) {
            if (t != null) { // null: a state updated in place, still live
                t.close(); // the previous step's state: ORT's memory (or the zero buffers) goes back
            }
        }
    }

    @Override
    public void close() {
        try {
            if (session != null) {
                session.close();
            }
            if (options != null) {
                options.close();
            }
        } catch (OrtException ignored) {
            // closing on the way out
        }
    }
}
