package org.edgekv.core;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

/**
 * The state of one sequence between calls, in the manifest's feed-back order: {@code past(i)} is what the next call
 * takes as input {@code state.tensors[i].input}; the runtime hands each output {@code state.tensors[i].output} back
 * with {@link #putPresent}; {@link #swap()} makes the presents the next pasts (present.3.key becomes
 * past_key_values.3.key) and returns the old pasts so the caller can recycle or free them.
 *
 * <p>Byte counts are checked against the manifest at allocation and at every put, so a runtime that returns a
 * different dtype or shape fails on the tensor's name instead of corrupting the next step. {@code T} is whatever
 * holds a tensor for the runtime: a direct ByteBuffer ({@link #DIRECT_BUFFERS}, used by the app for both runtimes
 * and by the tests), or a runtime's own tensor type.
 */
public final class StateBook<T> {

    /** How to make and measure one state value. */
    public interface Slots<T> {
        /** A zero-filled value of spec's shape and dtype. */
        T zeros(Manifest.StateTensor spec);

        /** The bytes a value holds. */
        long byteSize(T value);

        /** Called for values the book drops (on reset); the default does nothing. */
        void release(T value);
    }

    /** Direct, native-order ByteBuffers: zero-filled by the JVM, usable as ONNX Runtime and ExecuTorch tensor data. */
    public static final Slots<ByteBuffer> DIRECT_BUFFERS = new Slots<ByteBuffer>() {
        @Override
        public ByteBuffer zeros(Manifest.StateTensor spec) {
            if (spec.bytes > Integer.MAX_VALUE) {
                throw new EdgekvException(spec.input + ": " + spec.bytes + " bytes is more than one Java buffer "
                        + "holds (2 GiB); export with a smaller max_ctx");
            }
            return ByteBuffer.allocateDirect((int) spec.bytes).order(ByteOrder.nativeOrder());
        }

        @Override
        public long byteSize(ByteBuffer value) {
            return value.capacity();
        }

        @Override
        public void release(ByteBuffer value) {
            // direct buffers are freed by the GC
        }
    };

    private final List<Manifest.StateTensor> specs;
    private final Slots<T> slots;
    private final List<T> past;
    private final List<T> present;
    private int steps;

    public StateBook(Manifest manifest, Slots<T> slots) {
        this(manifest.state, slots);
    }

    public StateBook(List<Manifest.StateTensor> specs, Slots<T> slots) {
        this.specs = Collections.unmodifiableList(new ArrayList<>(specs));
        this.slots = slots;
        this.past = new ArrayList<>(specs.size());
        this.present = new ArrayList<>(specs.size());
        for (Manifest.StateTensor s : this.specs) {
            past.add(zeros(s));
            present.add(null);
        }
    }

    private T zeros(Manifest.StateTensor s) {
        T v = slots.zeros(s);
        check(s, v, "allocated");
        return v;
    }

    private void check(Manifest.StateTensor s, T v, String how) {
        if (v == null) {
            throw new EdgekvException(s.output + ": no value " + how);
        }
        long got = slots.byteSize(v);
        if (got != s.bytes) {
            throw new EdgekvException(s.output + ": " + got + " bytes " + how + " but the manifest says " + s.bytes
                    + " (" + s.dtype + " " + java.util.Arrays.toString(s.shape) + "): the runtime and the export "
                    + "disagree on this state tensor");
        }
    }

    public int size() {
        return specs.size();
    }

    public Manifest.StateTensor spec(int i) {
        return specs.get(i);
    }

    /** The value to feed as {@code spec(i).input} on the next call. */
    public T past(int i) {
        return past.get(i);
    }

    /** All pasts, in feed order (the order of the entry point's state inputs). */
    public List<T> pasts() {
        return Collections.unmodifiableList(new ArrayList<>(past));
    }

    /** The present already put for tensor i in this step, or null. */
    public T present(int i) {
        return present.get(i);
    }

    public void putPresent(int i, T value) {
        Manifest.StateTensor s = specs.get(i);
        if (present.get(i) != null) {
            throw new EdgekvException(s.output + ": put twice in one step");
        }
        check(s, value, "returned");
        present.set(i, value);
    }

    /** Puts by output name (present.3.key); unknown names are an error naming the expected ones. */
    public void putPresent(String outputName, T value) {
        for (int i = 0; i < specs.size(); i++) {
            if (specs.get(i).output.equals(outputName)) {
                putPresent(i, value);
                return;
            }
        }
        throw new EdgekvException(outputName + ": not a state output of this export (expected "
                + specs.get(0).output + " .. " + specs.get(specs.size() - 1).output + ")");
    }

    /**
     * Ends a step: every present must have been put; they become the pasts. Returns the previous pasts (same order)
     * for the caller to recycle as the next step's present buffers, or to free; null where the present is the past
     * itself (a state the runtime updated in place: it stays, nothing to free).
     */
    public List<T> swap() {
        List<String> missing = new ArrayList<>();
        for (int i = 0; i < specs.size(); i++) {
            if (present.get(i) == null) {
                missing.add(specs.get(i).output);
            }
        }
        if (!missing.isEmpty()) {
            throw new EdgekvException("step " + steps + ": the runtime did not return " + missing.size()
                    + " state output(s): " + (missing.size() > 4 ? missing.subList(0, 4) + " ..." : missing));
        }
        List<T> old = new ArrayList<>(past);
        for (int i = 0; i < specs.size(); i++) {
            if (present.get(i) == past.get(i)) {
                old.set(i, null);
            }
            past.set(i, present.get(i));
            present.set(i, null);
        }
        steps++;
        return old;
    }

    /** Back to an all-zero state (a new sequence): releases every held value and allocates fresh zeros. */
    public void reset() {
        for (int i = 0; i < specs.size(); i++) {
            slots.release(past.get(i));
            if (present.get(i) != null) {
                slots.release(present.get(i));
            }
            past.set(i, zeros(specs.get(i)));
            present.set(i, null);
        }
        steps = 0;
    }

    /** Completed swaps since construction or reset. */
    public int steps() {
        return steps;
    }

    /** Sum of the state tensors' bytes (= manifest state.bytes; the book holds up to twice this between swaps). */
    public long bytes() {
        long n = 0;
        for (Manifest.StateTensor s : specs) {
            n += s.bytes;
        }
        return n;
    }
}
