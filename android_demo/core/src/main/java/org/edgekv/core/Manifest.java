package org.edgekv.core;

import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * An edgekv export's manifest.json (edgekv/export/manifest.schema.json), read the way an app needs it: the
 * artifacts and their entry points with every input/output, the state tensors in feed-back order, the weights and
 * state bytes, and the sha256 of every file.
 *
 * <p>Parsing checks what a runtime relies on, beyond the JSON types: every state tensor's bytes equal its shape
 * times its dtype size, they add up to state.bytes, and every entry point takes tokens, pos and then the state
 * inputs in the manifest's order and returns logits and then the state outputs in the same order.
 */
public final class Manifest {
    public static final String FILE = "manifest.json";
    /** The input naming the rows of a call whose logits come back (edgekv.export.manifest ROWS). */
    public static final String ROWS = "rows";

    /** One program input or output: a name, a dtype and a shape whose entries are Long or String (a dynamic axis). */
    public static final class TensorSpec {
        public final String name;
        public final DType dtype;
        public final List<Object> shape;

        TensorSpec(String name, DType dtype, List<Object> shape) {
            this.name = name;
            this.dtype = dtype;
            this.shape = Collections.unmodifiableList(shape);
        }

        /** The shape with each dynamic axis replaced by {@code dynamic}. */
        public long[] concreteShape(long dynamic) {
            long[] out = new long[shape.size()];
            for (int k = 0; k < out.length; k++) {
                Object d = shape.get(k);
                out[k] = d instanceof Long ? (Long) d : dynamic;
            }
            return out;
        }

        @Override
        public String toString() {
            return name + " " + dtype + " " + shape;
        }
    }

    /** One state tensor: program input name, program output name, fixed shape, dtype, and its bytes. */
    public static final class StateTensor {
        public final int index;
        public final String input;
        public final String output;
        public final long[] shape;
        public final DType dtype;
        public final int layer;
        public final String role;
        public final long bytes;
        public final Integer packedBits;

        StateTensor(int index, String input, String output, long[] shape, DType dtype, int layer, String role,
                    long bytes, Integer packedBits) {
            this.index = index;
            this.input = input;
            this.output = output;
            this.shape = shape;
            this.dtype = dtype;
            this.layer = layer;
            this.role = role;
            this.bytes = bytes;
            this.packedBits = packedBits;
        }

        public long elements() {
            long n = 1;
            for (long d : shape) {
                n *= d;
            }
            return n;
        }
    }

    /** A method (pte) or graph (onnx) with its token count per call: fixed, or a named dynamic axis. */
    public static final class EntryPoint {
        public final String name;
        /** Tokens per call when fixed; null when dynamic. */
        public final Long fixedTokens;
        /** The dynamic axis name when the token count is dynamic; null when fixed. */
        public final String tokensAxis;
        /** A dynamic axis's most tokens per call (max_tokens; the .pte {@code forward} method's memory is planned
         * for it); null: max_ctx. */
        public final Long maxTokens;
        public final List<TensorSpec> inputs;
        public final List<TensorSpec> outputs;
        /** Fixed-size prefill only: how a shorter last chunk runs: "pad" (pad with token 0; only for caches with a
         * slot per position) or "decode" (one token at a time through decode: recurrent states and rolling
         * windows, which padding would corrupt). */
        public final String tail;
        /** Whether the entry point takes {@code rows} after the state (exports since 2026-12-01): the indices of
         * the call's tokens whose logits come back ([R] int64; logits [1, R, vocab]). Without it every row comes
         * back. */
        public final boolean takesRows;

        EntryPoint(String name, Long fixedTokens, String tokensAxis, Long maxTokens, List<TensorSpec> inputs,
                   List<TensorSpec> outputs, String tail) {
            this.name = name;
            this.tail = tail;
            this.takesRows = !inputs.isEmpty() && inputs.get(inputs.size() - 1).name.equals(ROWS);
            this.fixedTokens = fixedTokens;
            this.tokensAxis = tokensAxis;
            this.maxTokens = maxTokens;
            this.inputs = Collections.unmodifiableList(inputs);
            this.outputs = Collections.unmodifiableList(outputs);
        }

        public boolean isDynamic() {
            return fixedTokens == null;
        }
    }

    public static final class Artifact {
        public final String format;
        public final String file;
        public final String runtime;
        public final String backend;
        public final List<EntryPoint> entryPoints;
        /**
         * ONNX: each present.* output may be bound to its past.* input's buffer (the graph's attention writes the
         * new rows in place), so the state exists once. False for older exports and for graphs without it.
         */
        public final boolean stateInPlace;
        /** The ONNX graph's external weights file (artifacts[].external_data), or null. */
        public final String externalData;

        Artifact(String format, String file, String runtime, String backend, List<EntryPoint> entryPoints,
                 boolean stateInPlace, String externalData) {
            this.format = format;
            this.file = file;
            this.externalData = externalData;
            this.runtime = runtime;
            this.backend = backend;
            this.entryPoints = Collections.unmodifiableList(entryPoints);
            this.stateInPlace = stateInPlace;
        }

        public EntryPoint entryPoint(String name) {
            for (EntryPoint e : entryPoints) {
                if (e.name.equals(name)) {
                    return e;
                }
            }
            return null;
        }
    }

    public static final class FileEntry {
        public final String name;
        public final String sha256;
        public final long bytes;

        FileEntry(String name, String sha256, long bytes) {
            this.name = name;
            this.sha256 = sha256;
            this.bytes = bytes;
        }
    }

    public final String where;
    public final String edgekvVersion;
    public final String modelName;
    public final long nParams;
    public final int vocab;
    public final int nLayers;
    public final String strategyLabel;
    public final int maxCtx;
    public final String weightsDtype;
    public final long weightsBytes;
    public final int stateCtx;
    public final long stateBytes;
    public final List<StateTensor> state;
    public final List<Artifact> artifacts;
    public final Map<String, FileEntry> files;
    public final Long bosTokenId;
    public final List<Long> eosTokenIds;
    /** Tokens per ONNX prefill call the planner's prediction assumes (deployment.formats.onnx.prefill_chunk);
     * null for an export that records none. */
    public final Integer onnxPrefillChunk;

    private Manifest(Json.Node root) {
        where = root.where();
        Json.Node sv = root.get("schema_version");
        if (sv.integer() != 1) {
            throw sv.error("schema_version " + sv.value + " is not supported (this app reads version 1)");
        }
        edgekvVersion = root.get("edgekv_version").str();
        Json.Node model = root.get("model");
        modelName = model.get("name").str();
        nParams = model.get("n_params").integer();
        vocab = (int) model.get("vocab").integer();
        nLayers = (int) model.get("n_layers").integer();
        strategyLabel = root.get("strategy").get("label").str();
        maxCtx = (int) positive(root.get("max_ctx"));
        Json.Node w = root.get("weights");
        weightsDtype = w.get("dtype").str();
        weightsBytes = nonNegative(w.get("bytes"));

        Json.Node st = root.get("state");
        stateCtx = (int) positive(st.get("ctx"));
        stateBytes = nonNegative(st.get("bytes"));
        Json.Node tensors = st.get("tensors");
        if (tensors.size() == 0) {
            throw tensors.error("no state tensors");
        }
        List<StateTensor> sts = new ArrayList<>();
        long sum = 0;
        for (int k = 0; k < tensors.size(); k++) {
            Json.Node t = tensors.at(k);
            Json.Node shapeNode = t.get("shape");
            long[] shape = new long[shapeNode.size()];
            for (int d = 0; d < shape.length; d++) {
                shape[d] = positive(shapeNode.at(d));
            }
            DType dtype = dtype(t.get("dtype"));
            Json.Node pb = t.opt("packed_bits");
            StateTensor s = new StateTensor(k, t.get("input").str(), t.get("output").str(), shape, dtype,
                    (int) nonNegative(t.get("layer")), t.get("role").str(), nonNegative(t.get("bytes")),
                    pb.isNull() ? null : (int) pb.integer());
            long expect = s.elements() * dtype.bytes;
            if (expect != s.bytes) {
                throw t.get("bytes").error("is " + s.bytes + " but shape " + java.util.Arrays.toString(shape)
                        + " of " + dtype + " is " + expect + " bytes");
            }
            sum += s.bytes;
            sts.add(s);
        }
        if (sum != stateBytes) {
            throw st.get("bytes").error("is " + stateBytes + " but the state tensors add up to " + sum);
        }
        state = Collections.unmodifiableList(sts);

        Integer chunk = null;
        Json.Node dep = root.opt("deployment");
        if (!dep.isNull() && dep.has("formats") && dep.get("formats").has("onnx")
                && dep.get("formats").get("onnx").has("prefill_chunk")) {
            chunk = (int) positive(dep.get("formats").get("onnx").get("prefill_chunk"));
        }
        onnxPrefillChunk = chunk;

        Json.Node arts = root.get("artifacts");
        if (arts.size() == 0) {
            throw arts.error("no artifacts");
        }
        List<Artifact> as = new ArrayList<>();
        for (int k = 0; k < arts.size(); k++) {
            as.add(artifact(arts.at(k)));
        }
        artifacts = Collections.unmodifiableList(as);

        Json.Node fs = root.get("files");
        Map<String, FileEntry> fm = new LinkedHashMap<>();
        for (String name : fs.map().keySet()) {
            Json.Node f = fs.get(name);
            String sha = f.get("sha256").str();
            if (!sha.matches("[0-9a-f]{64}")) {
                throw f.get("sha256").error("is not 64 lowercase hex digits");
            }
            fm.put(name, new FileEntry(name, sha, nonNegative(f.get("bytes"))));
        }
        if (fm.isEmpty()) {
            throw fs.error("lists no files");
        }
        files = Collections.unmodifiableMap(fm);
        for (Artifact a : artifacts) {
            if (!files.containsKey(a.file)) {
                throw fs.error("does not list the artifact file '" + a.file + "'");
            }
        }

        Json.Node tok = root.get("tokenizer");
        if (tok.isNull()) {
            bosTokenId = null;
            eosTokenIds = Collections.emptyList();
        } else {
            Json.Node bos = tok.get("bos_token_id");
            bosTokenId = bos.isNull() ? null : bos.integer();
            List<Long> eos = new ArrayList<>();
            Json.Node en = tok.get("eos_token_ids");
            for (int k = 0; k < en.size(); k++) {
                eos.add(en.at(k).integer());
            }
            eosTokenIds = Collections.unmodifiableList(eos);
        }
    }

    private static long positive(Json.Node n) {
        long v = n.integer();
        if (v < 1) {
            throw n.error("must be at least 1, got " + v);
        }
        return v;
    }

    private static long nonNegative(Json.Node n) {
        long v = n.integer();
        if (v < 0) {
            throw n.error("must not be negative, got " + v);
        }
        return v;
    }

    private static DType dtype(Json.Node n) {
        try {
            return DType.of(n.str());
        } catch (EdgekvException e) {
            throw n.error(e.getMessage());
        }
    }

    private Artifact artifact(Json.Node a) {
        String format = a.get("format").str();
        if (!format.equals("onnx") && !format.equals("pte")) {
            throw a.get("format").error("must be 'onnx' or 'pte', got '" + format + "'");
        }
        // an artifact made for a runtime's own LLM API (edgekv export --runner; manifest runners): its entry point
        // is not the explicit-state step this app's backends call
        Json.Node runners = a.opt("runners");
        for (int k = 0; !runners.isNull() && k < runners.size(); k++) {
            String r = runners.at(k).str();
            if (r.equals("onnxruntime-genai")) {
                throw runners.error("this graph is for ONNX Runtime GenAI (inputs input_ids, attention_mask): load "
                        + "the folder with GenAI's Java API (ai.onnxruntime.genai.Model / Generator), or export "
                        + "without --runner genai for this app");
            }
            if (r.equals("executorch-llm-runner")) {
                throw runners.error("this .pte is for ExecuTorch's LLM runner (its cache lives in the program): "
                        + "load it with LlmModule (org.pytorch.executorch.extension.llm), or export without "
                        + "--runner executorch for this app");
            }
        }
        Json.Node eps = a.get("entry_points");
        if (eps.size() == 0) {
            throw eps.error("no entry points");
        }
        List<EntryPoint> list = new ArrayList<>();
        for (int k = 0; k < eps.size(); k++) {
            Json.Node e = eps.at(k);
            Json.Node tokens = e.get("tokens");
            Long fixed = null;
            String axis = null;
            if (tokens.isString()) {
                axis = tokens.str();
            } else {
                fixed = positive(tokens);
            }
            Json.Node tail = e.opt("tail");
            String tailRule = tail.isNull() ? "pad" : tail.str();
            if (!tailRule.equals("pad") && !tailRule.equals("decode")) {
                throw tail.error("is " + tailRule + ", not pad or decode");
            }
            Json.Node most = e.opt("max_tokens");
            Long maxTokens = most.isNull() ? null : positive(most);
            EntryPoint ep = new EntryPoint(e.get("name").str(), fixed, axis, maxTokens, specs(e.get("inputs")),
                    specs(e.get("outputs")), tailRule);
            checkStateIo(e, ep);
            list.add(ep);
        }
        Json.Node backend = a.opt("backend");
        Json.Node inPlace = a.opt("state_in_place");
        Json.Node external = a.opt("external_data");
        return new Artifact(format, a.get("file").str(), a.get("runtime").str(),
                backend.isNull() ? null : backend.str(), list, !inPlace.isNull() && inPlace.bool(),
                external.isNull() ? null : external.str());
    }

    private static List<TensorSpec> specs(Json.Node arr) {
        List<TensorSpec> out = new ArrayList<>();
        for (int k = 0; k < arr.size(); k++) {
            Json.Node t = arr.at(k);
            Json.Node sh = t.get("shape");
            List<Object> shape = new ArrayList<>();
            for (int d = 0; d < sh.size(); d++) {
                Json.Node dim = sh.at(d);
                shape.add(dim.isString() ? (Object) dim.str() : (Object) dim.integer());
            }
            out.add(new TensorSpec(t.get("name").str(), dtype(t.get("dtype")), shape));
        }
        return out;
    }

    /** inputs = tokens, pos, state inputs in order (then rows, if it takes them); outputs = logits, state outputs
     * in order; same dtypes/shapes. */
    private void checkStateIo(Json.Node e, EntryPoint ep) {
        int n = state.size();
        int rows = ep.takesRows ? 1 : 0;
        if (ep.inputs.size() != n + 2 + rows || ep.outputs.size() != n + 1) {
            throw e.error("has " + ep.inputs.size() + " inputs and " + ep.outputs.size() + " outputs; expected "
                    + (n + 2 + rows) + " (tokens, pos, " + n + " state" + (rows == 1 ? ", rows" : "") + ") and "
                    + (n + 1) + " (logits, " + n + " state)");
        }
        if (ep.takesRows && ep.inputs.get(n + 2).dtype != DType.INT64) {
            throw e.get("inputs").error("rows must be int64, not " + ep.inputs.get(n + 2).dtype);
        }
        if (!ep.inputs.get(0).name.equals("tokens") || !ep.inputs.get(1).name.equals("pos")) {
            throw e.get("inputs").error("must start with 'tokens' and 'pos', got '" + ep.inputs.get(0).name
                    + "', '" + ep.inputs.get(1).name + "'");
        }
        for (int k = 0; k < n; k++) {
            StateTensor s = state.get(k);
            TensorSpec in = ep.inputs.get(k + 2);
            TensorSpec out = ep.outputs.get(k + 1);
            if (!in.name.equals(s.input) || !out.name.equals(s.output)) {
                throw e.error("state tensor " + k + " is " + s.input + " -> " + s.output + " in state.tensors but "
                        + in.name + " -> " + out.name + " in this entry point (the feed-back order must match)");
            }
            for (TensorSpec t : new TensorSpec[] {in, out}) {
                if (t.dtype != s.dtype || !java.util.Arrays.equals(t.concreteShape(-1), s.shape)) {
                    throw e.error(t.name + " is " + t.dtype + " " + t.shape + " but state.tensors says " + s.dtype
                            + " " + java.util.Arrays.toString(s.shape));
                }
            }
        }
    }

    // ---- loading ----

    public static Manifest parse(String json, String where) {
        Object doc;
        try {
            doc = Json.parse(json);
        } catch (Json.ParseException e) {
            throw new EdgekvException(where + ": " + e.getMessage());
        }
        return new Manifest(Json.Node.root(doc, where));
    }

    /** Reads dir/manifest.json (without checking the files; see {@link #verifyFiles}). */
    public static Manifest load(File dir) {
        File f = new File(dir, FILE);
        if (!f.isFile()) {
            throw new EdgekvException(dir + ": no " + FILE + " there (not an edgekv export? push the whole export "
                    + "folder)");
        }
        try {
            return parse(new String(IO.readAll(f), StandardCharsets.UTF_8), f.getPath());
        } catch (IOException e) {
            throw new EdgekvException(f + ": cannot read it (" + e.getMessage() + ")");
        }
    }

    /** Every file the manifest lists must exist in dir with its size and sha256; throws on the first that does not. */
    public void verifyFiles(File dir) {
        for (FileEntry fe : files.values()) {
            File f = new File(dir, fe.name);
            if (!f.isFile()) {
                throw new EdgekvException(f + ": listed in the manifest but missing (push the whole export folder)");
            }
            if (f.length() != fe.bytes) {
                throw new EdgekvException(f + ": " + f.length() + " bytes but the manifest says " + fe.bytes
                        + " (truncated or replaced since export; push it again or export again)");
            }
            String got = sha256(f);
            if (!got.equals(fe.sha256)) {
                throw new EdgekvException(f + ": sha256 does not match the manifest (expected " + fe.sha256
                        + ", got " + got + "): changed or corrupted since export; push it again or export again");
            }
        }
    }

    public static String sha256(File f) {
        MessageDigest md;
        try {
            md = MessageDigest.getInstance("SHA-256");
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException("this Java has no SHA-256", e);
        }
        byte[] buf = new byte[1 << 20];
        try (InputStream in = new FileInputStream(f)) {
            int n;
            while ((n = in.read(buf)) > 0) {
                md.update(buf, 0, n);
            }
        } catch (IOException e) {
            throw new EdgekvException(f + ": cannot read it (" + e.getMessage() + ")");
        }
        StringBuilder b = new StringBuilder();
        for (byte x : md.digest()) {
            b.append(Character.forDigit((x >> 4) & 0xf, 16)).append(Character.forDigit(x & 0xf, 16));
        }
        return b.toString();
    }

    // ---- queries ----

    /** The artifact of a format ("onnx" or "pte"); a clear error naming the formats this export has. */
    public Artifact artifact(String format) {
        StringBuilder have = new StringBuilder();
        for (Artifact a : artifacts) {
            if (a.format.equals(format)) {
                return a;
            }
            have.append(have.length() == 0 ? "" : ", ").append(a.format);
        }
        throw new EdgekvException(where + ": this export has no " + format + " artifact (it has: " + have + ")");
    }

    public StateTensor stateByInput(String input) {
        for (StateTensor s : state) {
            if (s.input.equals(input)) {
                return s;
            }
        }
        return null;
    }

    public StateTensor stateByOutput(String output) {
        for (StateTensor s : state) {
            if (s.output.equals(output)) {
                return s;
            }
        }
        return null;
    }
}
