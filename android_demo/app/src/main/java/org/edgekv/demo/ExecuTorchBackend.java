package org.edgekv.demo;

import java.io.File;
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.List;
import org.edgekv.core.Backend;
import org.edgekv.core.BenchmarkArgs;
import org.edgekv.core.EdgekvException;
import org.edgekv.core.Manifest;
import org.edgekv.core.StateBook;
import org.edgekv.core.StepPlan;
import org.pytorch.executorch.EValue;
import org.pytorch.executorch.Module;
import org.pytorch.executorch.Tensor;

/**
 * ExecuTorch Android (org.pytorch:executorch-android), the .pte's own delegates (XNNPACK for edgekv exports).
 *
 * <p>The state lives in direct ByteBuffers, double-buffered: each call reads the pasts (wrapped as Tensors without a
 * copy) and copies each state output into a spare buffer, which becomes the next past; the buffers a swap returns
 * are the next spares. The copy is deliberate: an output Tensor views the method's planned memory, which the next
 * execute reuses (feeding it straight back could overwrite one state input while another is being read). float16
 * state needs executorch-android 1.1.0 or later (Tensor.fromBlob(ShortBuffer)).
 *
 * <p>When the manifest says {@code state_in_place} (a plain or quantized kv cache: one {@code forward} method with
 * a dynamic token axis writes its rows into the past tensors, a quantized cache's codes, scales and zeros alike,
 * with index_put_, and attends with llama::custom_sdpa; the app's ExecuTorch library must include those kernels and,
 * for an int8 cache, quantized_decomposed::dequantize_per_token), the inputs are not planned memory: the method
 * writes into the direct buffers wrapped above, and each state stays where it is, with no copy and no spare.
 */
final class ExecuTorchBackend implements Backend<ByteBuffer> {
    private Module module;
    private Manifest manifest;
    private int threads;
    private String loadMode;
    private final List<ByteBuffer> spare = new ArrayList<>();
    private boolean inPlace;

    @Override
    public void init(BenchmarkArgs args) throws ClassNotFoundException {
        threads = args.threads;
        loadMode = args.loadMode;
        // Module's static initializer loads libexecutorch.so (and fbjni): part of the runtime baseline
        Class.forName("org.pytorch.executorch.Module", true, getClass().getClassLoader());
    }

    @Override
    public String runtime() {
        return "executorch-android " + BuildConfig.EXECUTORCH_VERSION;
    }

    @Override
    public void load(Manifest m, Manifest.Artifact a, File dir) {
        manifest = m;
        inPlace = a.stateInPlace;
        File program = new File(dir, a.file);
        int mode = loadMode.equals("file") ? Module.LOAD_MODE_FILE : Module.LOAD_MODE_MMAP;
        try {
            module = Module.load(program.getPath(), mode, threads);
        } catch (RuntimeException e) {
            throw new EdgekvException(program + ": ExecuTorch cannot load it (" + e.getMessage() + ")", e);
        }
        for (Manifest.EntryPoint ep : a.entryPoints) {
            // executorch-android 1.5 (Module.kt): loadMethod returns nothing and throws ExecutorchRuntimeException
            // (a RuntimeException carrying the error code in its message) where older releases returned the code
            try {
                module.loadMethod(ep.name);
            } catch (RuntimeException e) {
                throw new EdgekvException(program + ": method '" + ep.name + "' failed to load (" + e.getMessage()
                        + ")", e);
            }
        }
        for (int i = 0; i < m.state.size(); i++) {
            spare.add(null);
        }
    }

    @Override
    public StateBook.Slots<ByteBuffer> slots() {
        return StateBook.DIRECT_BUFFERS;
    }

    /** A Tensor over the buffer's memory (no copy), typed by the manifest's dtype. */
    private static Tensor wrap(ByteBuffer b, Manifest.StateTensor s) {
        switch (s.dtype) {
            case FLOAT32: return Tensor.fromBlob(b.asFloatBuffer(), s.shape);
            case FLOAT16: return Tensor.fromBlob(b.asShortBuffer(), s.shape);
            case INT8: return Tensor.fromBlob(b, s.shape);
            case UINT8: return Tensor.fromBlobUnsigned(b, s.shape);
            default: throw new EdgekvException(s.input + ": ExecuTorch's Java API cannot pass " + s.dtype + " tensors");
        }
    }

    /** Copies an output tensor's data into dst (same dtype and size, checked by the book afterwards). */
    private static void copy(Tensor t, ByteBuffer dst, Manifest.StateTensor s) {
        switch (s.dtype) {
            case FLOAT32: dst.asFloatBuffer().put(t.getDataAsFloatArray()); break;
            case FLOAT16: dst.asShortBuffer().put(t.getDataAsShortArray()); break;
            case INT8: dst.duplicate().put(t.getDataAsByteArray()); break;
            case UINT8: dst.duplicate().put(t.getDataAsUnsignedByteArray()); break;
            default: throw new EdgekvException(s.output + ": cannot read " + s.dtype + " from ExecuTorch");
        }
    }

    @Override
    public float[] call(StepPlan.Call call, long[] tokens, StateBook<ByteBuffer> book) {
        int n = book.size();
        boolean rows = call.entry.takesRows;
        EValue[] in = new EValue[n + 2 + (rows ? 1 : 0)];
        in[0] = EValue.from(Tensor.fromBlob(tokens, new long[] {1, call.padded}));
        in[1] = EValue.from(Tensor.fromBlob(new long[] {call.pos}, new long[] {1}));
        for (int i = 0; i < n; i++) {
            in[i + 2] = EValue.from(wrap(book.past(i), book.spec(i)));
        }
        if (rows) { // the last real token's logits only: the output matrix runs over one row
            in[n + 2] = EValue.from(Tensor.fromBlob(call.lastRow(), new long[] {1}));
        }
        EValue[] out = module.execute(call.entry.name, in);
        if (out.length != n + 1) {
            throw new EdgekvException("method '" + call.entry.name + "' returned " + out.length + " values; the "
                    + "manifest lists " + (n + 1) + " (logits and " + n + " state tensors)");
        }
        float[] all = out[0].toTensor().getDataAsFloatArray(); // [1, 1, vocab], or [1, padded, vocab] without rows
        int vocab = manifest.vocab;
        float[] last = new float[vocab];
        System.arraycopy(all, call.lastRowIndex() * vocab, last, 0, vocab);
        for (int i = 0; i < n; i++) {
            if (inPlace) { // the method wrote its rows into the past buffer: the present is the past
                book.putPresent(i, book.past(i));
                continue;
            }
            Manifest.StateTensor s = book.spec(i);
            ByteBuffer dst = spare.get(i);
            if (dst == null) {
                dst = StateBook.DIRECT_BUFFERS.zeros(s);
            }
            spare.set(i, null);
            copy(out[i + 1].toTensor(), dst, s);
            book.putPresent(i, dst);
        }
        return last;
    }

    @Override
    public void recycle(List<ByteBuffer> old) {
        for (int i = 0; i < old.size(); i++) {
            spare.set(i, old.get(i)); // the pasts just read become the next call's output buffers
        }
    }

    @Override
    public void close() {
        if (module != null) {
            module.destroy();
        }
    }
}
