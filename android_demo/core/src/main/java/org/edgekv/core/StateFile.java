package org.edgekv.core;

import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.RandomAccessFile;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.CharBuffer;
import java.nio.channels.FileChannel;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;

/**
 * Prefill once: a sequence's state kept in a file between runs, in the format of {@code edgekv run --save-state FILE
 * / --resume FILE} (edgekv/export/statefile.py), so a state saved by the desktop tool resumes here and the other way
 * round.
 *
 * <p>The file is a safetensors file (8-byte little-endian header length N, N bytes of JSON header {name: {dtype,
 * shape, data_offsets: [begin, end]}, "__metadata__": {str: str}} padded with spaces to a multiple of 8, then the
 * tensors' bytes in header order). It holds every state tensor under its manifest input name in the manifest's dtype
 * and shape, {@value #TOKENS} (int64 [position]: the token ids the state has consumed), and metadata binding it to
 * one export and runtime: the model's name and parameter count, the strategy label, the runtime (ort for the ONNX
 * artifact, executorch for the .pte), the artifact's files with their sha256 from the manifest's file table (the
 * weights are in them), max_ctx, the position and the pending token (the last generated one, not yet fed; -1 when
 * none).
 *
 * <p>Reading trusts nothing in the file: the declared header length is bounded by {@link #MAX_HEADER} and the file
 * size before it is read; every tensor's name, dtype, shape and byte range must be the manifest's, the ranges must
 * tile the data exactly, float tensors must be finite and token ids inside the vocabulary. Every failure is one
 * {@link EdgekvException} line naming the file; a failed load leaves the buffers zeroed. Writing produces the bytes
 * Python's writer produces for the same state (a sibling temporary file, synced, then renamed over the target); an
 * existing file that is not an edgekv state file is never replaced.
 */
public final class StateFile {
    public static final String FORMAT = "edgekv-state";
    public static final int FORMAT_VERSION = 1;
    public static final String TOKENS = "edgekv.tokens";
    /** 16 MiB: a state of thousands of tensors has a header of a few hundred KiB. */
    public static final long MAX_HEADER = 16L << 20;
    /** The metadata a file must agree on with the export and runtime reading it (statefile.binding's keys). */
    static final String[] BOUND = {"model", "model_params", "strategy", "runtime", "max_ctx", "artifact_sha256"};

    private StateFile() {}

    /** What a resumed sequence continues from. */
    public static final class Saved {
        /** Tokens the state has consumed (the next token goes at this position). */
        public final int position;
        public final long[] tokens;
        /** The last generated token, not yet fed to the model; -1 when none. */
        public final long pending;

        Saved(int position, long[] tokens, long pending) {
            this.position = position;
            this.tokens = tokens;
            this.pending = pending;
        }
    }

    /** safetensors' dtype codes (safetensors Dtype) for the dtypes a state holds. */
    static String code(DType d) {
        switch (d) {
            case FLOAT32: return "F32";
            case FLOAT16: return "F16";
            case INT64: return "I64";
            case INT8: return "I8";
            case UINT8: return "U8";
            default: return null;
        }
    }

    /** The runtime a state file names for an artifact format: ort (onnx) or executorch (pte). */
    public static String runtimeFor(String format) {
        if (format.equals("onnx")) {
            return "ort";
        }
        if (format.equals("pte")) {
            return "executorch";
        }
        throw new EdgekvException("no explicit-state runtime for format '" + format + "' (onnx or pte)");
    }

    private static String formatFor(String runtime) {
        if (runtime.equals("ort")) {
            return "onnx";
        }
        if (runtime.equals("executorch")) {
            return "pte";
        }
        throw new EdgekvException("a state file is read by ort or executorch, not '" + runtime + "'");
    }

    /** The metadata strings a state file must hold for this export and runtime (statefile.binding). */
    public static Map<String, String> binding(Manifest m, String runtime) {
        Manifest.Artifact a = m.artifact(formatFor(runtime));
        List<String> files = new ArrayList<>();
        files.add(a.file);
        if (a.externalData != null) {
            files.add(a.externalData);
        }
        TreeMap<String, String> sha = new TreeMap<>(); // json.dumps(sort_keys=True): code-point order
        for (String f : files) {
            Manifest.FileEntry fe = m.files.get(f);
            sha.put(f, fe == null ? null : fe.sha256);
        }
        StringBuilder s = new StringBuilder("{");
        for (Map.Entry<String, String> e : sha.entrySet()) {
            s.append(s.length() == 1 ? "" : ", ");
            pyQuote(s, e.getKey());
            s.append(": ");
            if (e.getValue() == null) {
                s.append("null");
            } else {
                pyQuote(s, e.getValue());
            }
        }
        Map<String, String> out = new LinkedHashMap<>();
        out.put("format", FORMAT);
        out.put("format_version", String.valueOf(FORMAT_VERSION));
        out.put("model", m.modelName);
        out.put("model_params", String.valueOf(m.nParams));
        out.put("strategy", m.strategyLabel);
        out.put("runtime", runtime);
        out.put("artifact_sha256", s.append('}').toString());
        out.put("max_ctx", String.valueOf(m.maxCtx));
        return out;
    }

    // ---- writing ----

    /**
     * Writes the state (one buffer per manifest state tensor, in order, each holding the tensor's bytes in native
     * order from position 0), the tokens it has consumed and the pending token. Returns the bytes written.
     */
    public static long save(File f, Manifest m, String runtime, List<ByteBuffer> state, long[] tokens,
                            long pending) {
        if (f.isDirectory()) {
            throw new EdgekvException(f + ": is a folder");
        }
        if (f.exists() && !isStateFile(f)) {
            throw new EdgekvException(f + ": exists and is not an edgekv state file; not replaced (remove it or "
                    + "choose another name)");
        }
        List<Manifest.StateTensor> specs = m.state;
        if (state.size() != specs.size()) {
            throw new EdgekvException(f + ": " + state.size() + " state buffers for the manifest's " + specs.size()
                    + " state tensors");
        }
        int position = tokens.length;
        if (position < 1 || position >= m.maxCtx) {
            throw new EdgekvException(f + ": position " + position + " is outside 1.." + (m.maxCtx - 1));
        }
        Map<String, String> meta = binding(m, runtime);
        meta.put("position", String.valueOf(position));
        meta.put("pending", String.valueOf(pending));
        StringBuilder t = new StringBuilder("[");
        for (Manifest.StateTensor s : specs) {
            checkStored(s, f);
            t.append(t.length() == 1 ? "[" : ", [");
            pyQuote(t, s.input);
            t.append(", ");
            pyQuote(t, s.dtype.manifestName);
            t.append(", ").append(shapeText(s.shape, ", ")).append(']');
        }
        meta.put("tensors", t.append(']').toString());

        StringBuilder h = new StringBuilder("{\"__metadata__\":{");
        boolean first = true;
        for (Map.Entry<String, String> e : meta.entrySet()) {
            h.append(first ? "" : ",");
            first = false;
            pyQuote(h, e.getKey());
            h.append(':');
            pyQuote(h, e.getValue());
        }
        h.append('}');
        long at = 0;
        for (int i = 0; i <= specs.size(); i++) {
            boolean tok = i == specs.size();
            String name = tok ? TOKENS : specs.get(i).input;
            String dt = tok ? "I64" : code(specs.get(i).dtype);
            long[] shape = tok ? new long[] {position} : specs.get(i).shape;
            long n = tok ? 8L * position : specs.get(i).bytes;
            if (!tok && state.get(i).capacity() < n) {
                throw new EdgekvException(f + ": state buffer " + name + " holds " + state.get(i).capacity()
                        + " bytes; the manifest says " + n);
            }
            h.append(',');
            pyQuote(h, name);
            h.append(":{\"dtype\":\"").append(dt).append("\",\"shape\":").append(shapeText(shape, ","))
                    .append(",\"data_offsets\":[").append(at).append(',').append(at + n).append("]}");
            at += n;
        }
        h.append('}');
        while (h.length() % 8 != 0) {
            h.append(' ');
        }
        byte[] header = h.toString().getBytes(StandardCharsets.US_ASCII); // pyQuote escapes everything else

        File dir = f.getAbsoluteFile().getParentFile();
        File tmp = new File(dir, "." + f.getName() + ".tmp");
        boolean done = false;
        try (FileOutputStream out = new FileOutputStream(tmp)) {
            FileChannel ch = out.getChannel();
            ByteBuffer len = ByteBuffer.allocate(8).order(ByteOrder.LITTLE_ENDIAN);
            len.putLong(0, header.length);
            writeFully(ch, len);
            writeFully(ch, ByteBuffer.wrap(header));
            for (int i = 0; i < specs.size(); i++) {
                ByteBuffer src = state.get(i).duplicate();
                src.clear().limit((int) specs.get(i).bytes);
                writeFully(ch, littleEndian(src, specs.get(i).dtype.bytes));
            }
            ByteBuffer tb = ByteBuffer.allocate(8 * position).order(ByteOrder.LITTLE_ENDIAN);
            for (long x : tokens) {
                tb.putLong(x);
            }
            tb.flip();
            writeFully(ch, tb);
            out.getFD().sync();
            done = true;
        } catch (IOException e) {
            throw new EdgekvException(f + ": cannot write it (" + e.getMessage() + ")");
        } finally {
            if (!done && !tmp.delete() && tmp.exists()) {
                tmp.deleteOnExit();
            }
        }
        if (!tmp.renameTo(f) && !(f.delete() && tmp.renameTo(f))) {
            tmp.delete();
            throw new EdgekvException(f + ": cannot move the written state into place (from " + tmp + ")");
        }
        return 8 + header.length + at;
    }

    /** Writes a book's pasts (the state between steps). */
    public static long save(File f, Manifest m, String runtime, StateBook<ByteBuffer> book, long[] tokens,
                            long pending) {
        return save(f, m, runtime, book.pasts(), tokens, pending);
    }

    private static void writeFully(FileChannel ch, ByteBuffer b) throws IOException {
        while (b.hasRemaining()) {
            ch.write(b);
        }
    }

    /** b's bytes in little-endian element order (a copy with the elements swapped on a big-endian machine). */
    private static ByteBuffer littleEndian(ByteBuffer b, int size) {
        if (ByteOrder.nativeOrder() == ByteOrder.LITTLE_ENDIAN || size == 1) {
            return b;
        }
        ByteBuffer c = ByteBuffer.allocate(b.remaining());
        c.put(b.duplicate()).flip();
        swap(c, size);
        return c;
    }

    private static void swap(ByteBuffer b, int size) {
        for (int k = 0; k + size <= b.limit(); k += size) {
            for (int i = 0, j = size - 1; i < j; i++, j--) {
                byte x = b.get(k + i);
                b.put(k + i, b.get(k + j));
                b.put(k + j, x);
            }
        }
    }

    // ---- reading ----

    /** Whether f has a safetensors header naming the edgekv-state format (whatever export it is for). */
    public static boolean isStateFile(File f) {
        try (RandomAccessFile raf = new RandomAccessFile(f, "r")) {
            header(f, raf);
            return true;
        } catch (EdgekvException | IOException e) {
            return false;
        }
    }

    /**
     * Checks f against the manifest and runtime, then reads its state into {@code into} (one buffer per manifest
     * state tensor, written from position 0 in native order). On any failure every buffer is zeroed and one
     * EdgekvException says what is wrong.
     */
    public static Saved load(File f, Manifest m, String runtime, List<ByteBuffer> into) {
        try {
            return read(f, m, runtime, into);
        } catch (RuntimeException | StackOverflowError e) {
            for (ByteBuffer b : into) {
                ByteBuffer z = b.duplicate();
                z.clear();
                while (z.hasRemaining()) {
                    z.put((byte) 0);
                }
            }
            if (e instanceof EdgekvException) {
                throw (EdgekvException) e;
            }
            throw new EdgekvException(f + ": damaged state file (" + e + ")");
        }
    }

    /** Reads f into a book's pasts (between steps); the book is reset when the file is refused. */
    public static Saved load(File f, Manifest m, String runtime, StateBook<ByteBuffer> book) {
        try {
            return load(f, m, runtime, book.pasts());
        } catch (EdgekvException e) {
            book.reset();
            throw e;
        }
    }

    private static final class Header {
        final Json.Node root;
        final long start;
        final long size;

        Header(Json.Node root, long start, long size) {
            this.root = root;
            this.start = start;
            this.size = size;
        }
    }

    private static Header header(File f, RandomAccessFile raf) throws IOException {
        long size = raf.length();
        if (size < 8) {
            throw new EdgekvException(f + ": not an edgekv state file (too short: " + size + " bytes)");
        }
        ByteBuffer len = ByteBuffer.allocate(8).order(ByteOrder.LITTLE_ENDIAN);
        raf.getChannel().read(len, 0);
        long n = len.getLong(0);
        if (n < 2 || n > MAX_HEADER || 8 + n > size) {
            throw new EdgekvException(f + ": not an edgekv state file (header length " + Long.toUnsignedString(n)
                    + " is outside 2.." + MAX_HEADER + " or past the end of the " + size + "-byte file)");
        }
        byte[] raw = new byte[(int) n];
        raf.seek(8);
        raf.readFully(raw);
        String text;
        try {
            CharBuffer cb = StandardCharsets.UTF_8.newDecoder().onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT).decode(ByteBuffer.wrap(raw));
            text = cb.toString();
        } catch (CharacterCodingException e) {
            throw new EdgekvException(f + ": not an edgekv state file (its header is not JSON)");
        }
        Object doc;
        try {
            doc = Json.parse(text);
        } catch (Json.ParseException | StackOverflowError e) {
            throw new EdgekvException(f + ": not an edgekv state file (its header is not JSON)");
        }
        Json.Node root = Json.Node.root(doc, f.getPath());
        if (!(doc instanceof Map) || !(root.opt("__metadata__").value instanceof Map)
                || !FORMAT.equals(root.get("__metadata__").opt("format").value)) {
            throw new EdgekvException(f + ": not an edgekv state file (no '" + FORMAT + "' format in its metadata)");
        }
        return new Header(root, 8 + n, size);
    }

    private static long integer(Map<String, Object> meta, String key, File f) {
        Object v = meta.get(key);
        if (!(v instanceof String) || !((String) v).matches("-?[0-9]{1,19}")) {
            throw new EdgekvException(f + ": damaged state file (" + key + " is " + show(v) + ", not an integer)");
        }
        return Long.parseLong((String) v);
    }

    private static String show(Object v) {
        return v instanceof String ? "'" + v + "'" : String.valueOf(v);
    }

    private static Saved read(File f, Manifest m, String runtime, List<ByteBuffer> into) {
        if (!f.isFile()) {
            throw new EdgekvException(f + ": no such file");
        }
        if (into.size() != m.state.size()) {
            throw new EdgekvException(f + ": " + into.size() + " state buffers for the manifest's " + m.state.size()
                    + " state tensors");
        }
        try (RandomAccessFile raf = new RandomAccessFile(f, "r")) {
            Header hd = header(f, raf);
            Map<String, Object> meta = hd.root.get("__metadata__").map();
            if (!String.valueOf(FORMAT_VERSION).equals(meta.get("format_version"))) {
                throw new EdgekvException(f + ": state file format version " + show(meta.get("format_version"))
                        + "; this app reads " + FORMAT_VERSION);
            }
            Map<String, String> want = binding(m, runtime);
            for (String key : BOUND) {
                if (!want.get(key).equals(meta.get(key))) {
                    throw new EdgekvException(f + ": saved for another export or runtime ("
                            + (key.equals("artifact_sha256") ? "artifact sha256" : key) + " " + show(meta.get(key))
                            + ", this one '" + want.get(key) + "')");
                }
            }
            long position = integer(meta, "position", f);
            long pending = integer(meta, "pending", f);
            if (position < 1 || position >= m.maxCtx) {
                throw new EdgekvException(f + ": position " + position + " is outside 1.." + (m.maxCtx - 1)
                        + " (max_ctx " + m.maxCtx + ")");
            }
            if (pending < -1 || pending >= m.vocab) {
                throw new EdgekvException(f + ": damaged state file (pending token " + pending
                        + " outside the vocabulary)");
            }
            List<String> names = new ArrayList<>();
            List<String> dtypes = new ArrayList<>();
            List<long[]> shapes = new ArrayList<>();
            List<Long> sizes = new ArrayList<>();
            for (Manifest.StateTensor s : m.state) {
                checkStored(s, f);
                names.add(s.input);
                dtypes.add(code(s.dtype));
                shapes.add(s.shape);
                sizes.add(s.bytes);
            }
            names.add(TOKENS);
            dtypes.add("I64");
            shapes.add(new long[] {position});
            sizes.add(8 * position);
            Set<String> have = new LinkedHashSet<>(hd.root.map().keySet());
            have.remove("__metadata__");
            if (!have.equals(new LinkedHashSet<>(names))) {
                List<String> ex = new ArrayList<>(have);
                ex.removeAll(names);
                List<String> missing = new ArrayList<>(names);
                missing.removeAll(have);
                throw new EdgekvException(f + ": its tensors are not this export's state (extra: " + few(ex)
                        + "; missing: " + few(missing) + ")");
            }
            long at = 0;
            for (int i = 0; i < names.size(); i++) {
                Json.Node h = hd.root.get(names.get(i));
                long n = sizes.get(i);
                boolean ok = h.value instanceof Map && dtypes.get(i).equals(h.opt("dtype").value)
                        && longs(h.opt("shape").value, shapes.get(i))
                        && longs(h.opt("data_offsets").value, new long[] {at, at + n});
                if (!ok) {
                    throw new EdgekvException(f + ": tensor " + names.get(i) + " is " + describe(h)
                            + "; this export's state has " + dtypes.get(i) + " " + Arrays.toString(shapes.get(i))
                            + " at [" + at + ", " + (at + n) + "]");
                }
                at += n;
            }
            if (hd.start + at != hd.size) {
                throw new EdgekvException(f + ": truncated or damaged (" + hd.size + " bytes; its header describes "
                        + (hd.start + at) + ")");
            }
            FileChannel ch = raf.getChannel();
            long off = hd.start;
            for (int i = 0; i < m.state.size(); i++) {
                Manifest.StateTensor s = m.state.get(i);
                ByteBuffer dst = into.get(i).duplicate();
                if (dst.capacity() < s.bytes) {
                    throw new EdgekvException(f + ": state buffer " + s.input + " holds " + dst.capacity()
                            + " bytes; the manifest says " + s.bytes);
                }
                dst.clear().limit((int) s.bytes);
                off = readFully(ch, dst, off, f, s.input);
                dst.flip();
                if (ByteOrder.nativeOrder() != ByteOrder.LITTLE_ENDIAN) {
                    swap(dst, s.dtype.bytes);
                }
                if (!finite(dst, s.dtype)) {
                    throw new EdgekvException(f + ": damaged state file (" + s.input + " holds NaN or infinity)");
                }
            }
            ByteBuffer tb = ByteBuffer.allocate((int) (8 * position)).order(ByteOrder.LITTLE_ENDIAN);
            readFully(ch, tb, off, f, TOKENS);
            long[] tokens = new long[(int) position];
            for (int k = 0; k < tokens.length; k++) {
                tokens[k] = tb.getLong(8 * k);
                if (tokens[k] < 0 || tokens[k] >= m.vocab) {
                    throw new EdgekvException(f + ": damaged state file (a token id outside the vocabulary 0.."
                            + (m.vocab - 1) + ")");
                }
            }
            return new Saved((int) position, tokens, pending);
        } catch (IOException e) {
            throw new EdgekvException(f + ": cannot read it (" + e.getMessage() + ")");
        }
    }

    private static long readFully(FileChannel ch, ByteBuffer dst, long off, File f, String name) throws IOException {
        while (dst.hasRemaining()) {
            int n = ch.read(dst, off);
            if (n < 0) {
                throw new EdgekvException(f + ": truncated while reading " + name);
            }
            off += n;
        }
        return off;
    }

    private static void checkStored(Manifest.StateTensor s, File f) {
        if (code(s.dtype) == null) {
            throw new EdgekvException(f + ": state tensor " + s.input + " is " + s.dtype + "; a state file holds "
                    + "float32, float16, int64, int8, uint8");
        }
    }

    private static boolean finite(ByteBuffer b, DType d) {
        ByteBuffer v = b.duplicate().order(ByteOrder.nativeOrder());
        if (d == DType.FLOAT32) {
            for (int k = 0; k + 4 <= v.limit(); k += 4) {
                if ((v.getInt(k) & 0x7f800000) == 0x7f800000) {
                    return false;
                }
            }
        } else if (d == DType.FLOAT16) {
            for (int k = 0; k + 2 <= v.limit(); k += 2) {
                if ((v.getShort(k) & 0x7c00) == 0x7c00) {
                    return false;
                }
            }
        }
        return true;
    }

    private static boolean longs(Object v, long[] want) {
        if (!(v instanceof List) || ((List<?>) v).size() != want.length) {
            return false;
        }
        for (int k = 0; k < want.length; k++) {
            Object x = ((List<?>) v).get(k);
            if (!(x instanceof Long) || (Long) x != want[k]) {
                return false;
            }
        }
        return true;
    }

    private static String describe(Json.Node h) {
        if (!(h.value instanceof Map)) {
            return String.valueOf(h.value);
        }
        return h.opt("dtype").value + " " + Json.write(h.opt("shape").value) + " at "
                + Json.write(h.opt("data_offsets").value);
    }

    private static String few(List<String> names) {
        if (names.isEmpty()) {
            return "-";
        }
        List<String> sorted = new ArrayList<>(names);
        java.util.Collections.sort(sorted);
        return String.join(", ", sorted.subList(0, Math.min(4, sorted.size())));
    }

    private static String shapeText(long[] shape, String sep) {
        StringBuilder b = new StringBuilder("[");
        for (int k = 0; k < shape.length; k++) {
            b.append(k == 0 ? "" : sep).append(shape[k]);
        }
        return b.append(']').toString();
    }

    /** A JSON string as Python's json.dumps writes it (ensure_ascii: every character outside space..~ escaped). */
    static void pyQuote(StringBuilder b, String s) {
        Json.quote(b, s, true);
    }
}
