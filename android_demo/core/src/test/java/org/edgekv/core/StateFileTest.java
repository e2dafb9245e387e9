package org.edgekv.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.io.File;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.Random;
import org.junit.Test;

/**
 * StateFile against Python's writer: tiny-llama-kv-int4-state holds a tiny Llama export's manifest (4-bit cache:
 * uint8 codes, float16 scales and zeros, max_ctx 32) and the state `edgekv run --save-state` wrote after the prompt
 * "The cat sat" and 4 greedy tokens (android_demo/make_state_fixture.sh remakes both).
 */
public class StateFileTest {
    private static final String FIXTURE = "tiny-llama-kv-int4-state";

    private static File fixtureDir() {
        return new File(TestSupport.resources(), FIXTURE);
    }

    private static Manifest tiny() {
        return Manifest.load(fixtureDir());
    }

    private static File pythonState() {
        return new File(fixtureDir(), "state.safetensors");
    }

    private static StateBook<ByteBuffer> book(Manifest m) {
        return new StateBook<>(m, StateBook.DIRECT_BUFFERS);
    }

    private static byte[] bytes(File f) throws IOException {
        return Files.readAllBytes(f.toPath());
    }

    private static File copy(File f, String name) throws IOException {
        File to = new File(TestSupport.tmpDir("state"), name);
        Files.write(to.toPath(), bytes(f));
        return to;
    }

    private static long headerLength(byte[] b) {
        return ByteBuffer.wrap(b, 0, 8).order(ByteOrder.LITTLE_ENDIAN).getLong();
    }

    /** The file with its JSON header edited (then re-padded to 8 bytes), the data as it was. */
    private interface Edit {
        void apply(Map<String, Object> header);
    }

    @SuppressWarnings("unchecked")
    private static File edited(String name, Edit edit) throws IOException {
        byte[] b = bytes(pythonState());
        int n = (int) headerLength(b);
        Map<String, Object> h = (Map<String, Object>) Json.parse(new String(b, 8, n, StandardCharsets.UTF_8));
        edit.apply(h);
        StringBuilder s = new StringBuilder(Json.write(h));
        while (s.length() % 8 != 0) {
            s.append(' ');
        }
        byte[] head = s.toString().getBytes(StandardCharsets.UTF_8);
        ByteBuffer out = ByteBuffer.allocate(8 + head.length + b.length - 8 - n).order(ByteOrder.LITTLE_ENDIAN);
        out.putLong(head.length).put(head).put(b, 8 + n, b.length - 8 - n);
        File f = new File(TestSupport.tmpDir("state"), name);
        Files.write(f.toPath(), out.array());
        return f;
    }

    @SuppressWarnings("unchecked")
    private static Map<String, Object> meta(Map<String, Object> h) {
        return (Map<String, Object>) h.get("__metadata__");
    }

    @SuppressWarnings("unchecked")
    private static Map<String, Object> entry(Map<String, Object> h, String name) {
        return (Map<String, Object>) h.get(name);
    }

    /** f is refused with a message containing every part, and the book is left all zero. */
    private static void refused(File f, Manifest m, String runtime, String... parts) {
        StateBook<ByteBuffer> book = book(m);
        for (ByteBuffer b : book.pasts()) {
            b.put(0, (byte) 7); // something a refused load must not leave behind
        }
        try {
            StateFile.load(f, m, runtime, book);
            fail("loaded " + f);
        } catch (EdgekvException e) {
            for (String p : parts) {
                assertTrue(e.getMessage() + " does not say " + p, e.getMessage().contains(p));
            }
            assertFalse(e.getMessage(), e.getMessage().contains("\n"));
        }
        for (ByteBuffer b : book.pasts()) {
            for (int k = 0; k < b.capacity(); k++) {
                assertEquals(0, b.get(k));
            }
        }
    }

    @Test
    public void readsTheStatePythonWrote() throws IOException {
        Manifest m = tiny();
        StateBook<ByteBuffer> book = book(m);
        StateFile.Saved s = StateFile.load(pythonState(), m, "ort", book);
        assertEquals(14, s.position);
        assertEquals('e', s.pending); // the byte tokenizer's greedy continuation of "The cat sat th"
        assertArrayEquals("The cat sat th".getBytes(StandardCharsets.US_ASCII), toBytes(s.tokens));
        // every buffer holds exactly the file's bytes of its tensor, in the manifest's order
        byte[] file = bytes(pythonState());
        int at = 8 + (int) headerLength(file);
        for (int i = 0; i < book.size(); i++) {
            ByteBuffer b = book.past(i);
            byte[] got = new byte[b.capacity()];
            b.duplicate().get(got);
            assertArrayEquals(book.spec(i).input, Arrays.copyOfRange(file, at, at + got.length), got);
            at += got.length;
        }
        assertEquals(file.length, at + 8 * 14);
        // the layout read right: past_key_values.0.key [1, 4, 32, 24] uint8 has codes at the 14 consumed positions
        // of every head and none after them
        Manifest.StateTensor k0 = book.spec(0);
        assertEquals("past_key_values.0.key", k0.input);
        assertArrayEquals(new long[] {1, 4, 32, 24}, k0.shape);
        for (int h = 0; h < 4; h++) {
            for (int t = 0; t < 32; t++) {
                boolean any = false;
                for (int c = 0; c < 24; c++) {
                    any |= book.past(0).get((h * 32 + t) * 24 + c) != 0;
                }
                assertEquals("head " + h + " position " + t, t < 14, any);
            }
        }
    }

    private static byte[] toBytes(long[] tokens) {
        byte[] b = new byte[tokens.length];
        for (int k = 0; k < b.length; k++) {
            b[k] = (byte) tokens[k];
        }
        return b;
    }

    @Test
    public void writingItBackGivesPythonsBytes() throws IOException {
        Manifest m = tiny();
        StateBook<ByteBuffer> book = book(m);
        StateFile.Saved s = StateFile.load(pythonState(), m, "ort", book);
        File out = new File(TestSupport.tmpDir("state"), "java.safetensors");
        long n = StateFile.save(out, m, "ort", book, s.tokens, s.pending);
        assertEquals(out.length(), n);
        assertArrayEquals(bytes(pythonState()), bytes(out));
        File[] left = out.getParentFile().listFiles();
        assertEquals(1, left.length); // no temporary file left beside it
    }

    @Test
    public void roundTripsARandomStateOfTheSmolLm2Manifest() throws IOException {
        Manifest m = TestSupport.fixtureManifest(); // 60 float16 tensors, onnx + pte
        for (String runtime : new String[] {"ort", "executorch"}) {
            StateBook<ByteBuffer> book = book(m);
            Random r = new Random(7);
            for (ByteBuffer b : book.pasts()) {
                for (int k = 0; k < b.capacity(); k += 2) {
                    b.putShort(k, (short) (r.nextInt(0x7800) | (r.nextBoolean() ? 0x8000 : 0))); // finite fp16
                }
            }
            long[] tokens = {1, 504, 2, 49151};
            File f = new File(TestSupport.tmpDir("state"), "s.safetensors");
            StateFile.save(f, m, runtime, book, tokens, 17);
            StateBook<ByteBuffer> back = book(m);
            StateFile.Saved s = StateFile.load(f, m, runtime, back);
            assertArrayEquals(tokens, s.tokens);
            assertEquals(17, s.pending);
            for (int i = 0; i < book.size(); i++) {
                assertEquals(book.spec(i).input, book.past(i), back.past(i));
            }
            // saved for one runtime, refused by the other (their state layouts may differ)
            String other = runtime.equals("ort") ? "executorch" : "ort";
            refused(f, m, other, "saved for another export or runtime", "runtime '" + runtime + "'");
        }
    }

    @Test
    public void bindingIsPythonsMetadata() throws IOException {
        Map<String, String> b = StateFile.binding(tiny(), "ort");
        byte[] file = bytes(pythonState());
        @SuppressWarnings("unchecked")
        Map<String, Object> h = (Map<String, Object>) Json.parse(
                new String(file, 8, (int) headerLength(file), StandardCharsets.UTF_8));
        for (Map.Entry<String, String> e : b.entrySet()) {
            assertEquals(e.getKey(), meta(h).get(e.getKey()), e.getValue());
        }
        assertTrue(b.get("artifact_sha256").contains("model.onnx.data")); // the external weights are bound too
    }

    @Test
    public void refusesAStateOfAnotherExport() throws IOException {
        refused(pythonState(), TestSupport.fixtureManifest(), "ort", "saved for another export or runtime",
                "model 'llama', this one 'smollm2-135m'");
        refused(pythonState(), tiny(), "executorch", "no pte artifact");
        // the same model and strategy, other weights: the manifest's sha256 of model.onnx.data changed
        File dir = TestSupport.tmpDir("manifest");
        String text = new String(bytes(new File(fixtureDir(), "manifest.json")), StandardCharsets.UTF_8);
        String sha = Manifest.load(fixtureDir()).files.get("model.onnx.data").sha256;
        Files.write(new File(dir, "manifest.json").toPath(),
                text.replace(sha, sha.substring(1) + "0").getBytes(StandardCharsets.UTF_8));
        refused(pythonState(), Manifest.load(dir), "ort", "artifact sha256");
        // and a manifest whose strategy differs
        Files.write(new File(dir, "manifest.json").toPath(),
                text.replace("\"kv-int4:group=16\"", "\"kv-int4:group=8\"").getBytes(StandardCharsets.UTF_8));
        refused(pythonState(), Manifest.load(dir), "ort", "strategy 'kv-int4:group=16'");
    }

    @Test
    public void refusesDamagedFiles() throws IOException {
        Manifest m = tiny();
        byte[] good = bytes(pythonState());
        File dir = TestSupport.tmpDir("bad");

        refused(new File(dir, "absent.safetensors"), m, "ort", "no such file");
        File f = new File(dir, "short");
        Files.write(f.toPath(), new byte[] {1, 2, 3});
        refused(f, m, "ort", "too short");
        Files.write(f.toPath(), Arrays.copyOf(good, good.length - 1));
        refused(f, m, "ort", "truncated or damaged");
        byte[] huge = good.clone();
        ByteBuffer.wrap(huge).order(ByteOrder.LITTLE_ENDIAN).putLong(0, Long.MAX_VALUE);
        Files.write(f.toPath(), huge);
        refused(f, m, "ort", "header length");
        byte[] notJson = good.clone();
        notJson[8] = '#';
        Files.write(f.toPath(), notJson);
        refused(f, m, "ort", "header is not JSON");

        refused(edited("plain", h -> h.remove("__metadata__")), m, "ort", "not an edgekv state file");
        refused(edited("v2", h -> meta(h).put("format_version", "2")), m, "ort", "format version '2'");
        refused(edited("pos", h -> meta(h).put("position", "32")), m, "ort", "position 32 is outside 1..31");
        refused(edited("pos2", h -> meta(h).put("position", "x1")), m, "ort", "position is 'x1', not an integer");
        refused(edited("pending", h -> meta(h).put("pending", "256")), m, "ort", "pending token 256");
        refused(edited("missing", h -> h.remove("past_key_values.3.value.zero")), m, "ort",
                "missing: past_key_values.3.value.zero");
        refused(edited("shape", h -> entry(h, "past_key_values.0.key")
                .put("shape", Arrays.asList(1L, 4L, 24L, 32L))), m, "ort", "tensor past_key_values.0.key is U8 [1,4,24,32]");
        refused(edited("dtype", h -> entry(h, "past_key_values.0.key.scale")
                .put("dtype", "F32")), m, "ort", "tensor past_key_values.0.key.scale is F32");

        // a NaN in a float16 scale, and a token id outside the 256-byte vocabulary
        int start = 8 + (int) headerLength(good);
        byte[] nan = good.clone();
        nan[start + 4 * 32 * 24 + 1] = (byte) 0x7e; // past_key_values.0.key.scale's first element: 0x7eXX is NaN
        Files.write(f.toPath(), nan);
        refused(f, m, "ort", "past_key_values.0.key.scale holds NaN or infinity");
        byte[] tok = good.clone();
        tok[good.length - 8 * 14 + 1] = 1; // the first token id + 256
        Files.write(f.toPath(), tok);
        refused(f, m, "ort", "token id outside the vocabulary");
    }

    @Test
    public void neverReplacesAFileThatIsNotAStateFile() throws IOException {
        Manifest m = tiny();
        StateBook<ByteBuffer> book = book(m);
        StateFile.Saved s = StateFile.load(pythonState(), m, "ort", book);
        File notes = new File(TestSupport.tmpDir("keep"), "notes.txt");
        Files.write(notes.toPath(), "mine".getBytes(StandardCharsets.UTF_8));
        try {
            StateFile.save(notes, m, "ort", book, s.tokens, s.pending);
            fail("replaced " + notes);
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().contains("is not an edgekv state file; not replaced"));
        }
        assertEquals("mine", new String(bytes(notes), StandardCharsets.UTF_8));
        // a state file is replaced
        File again = copy(pythonState(), "again.safetensors");
        StateFile.save(again, m, "ort", book, Arrays.copyOf(s.tokens, 3), -1);
        assertEquals(3, StateFile.load(again, m, "ort", book).position);
    }

    @Test
    public void aStateFileIsRecognisedWhateverItsExport() throws IOException {
        assertTrue(StateFile.isStateFile(pythonState()));
        assertFalse(StateFile.isStateFile(new File(fixtureDir(), "manifest.json")));
        List<Manifest.StateTensor> specs = tiny().state;
        assertEquals(24, specs.size());
    }
}
