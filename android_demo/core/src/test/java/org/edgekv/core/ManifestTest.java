package org.edgekv.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.RandomAccessFile;
import java.nio.charset.StandardCharsets;
import org.junit.Test;

public class ManifestTest {
    @Test
    public void readsTheRealFixture() {
        Manifest m = TestSupport.fixtureManifest();
        assertEquals("smollm2-135m", m.modelName);
        assertEquals(30, m.nLayers);
        assertEquals(49152, m.vocab);
        assertEquals(512, m.maxCtx);
        assertEquals(538060032L, m.weightsBytes);
        assertEquals(Long.valueOf(1), m.bosTokenId);
        assertEquals(1, m.eosTokenIds.size());

        // 30 layers x (key, value), fp16 [1, 3 KV heads, 512, 64]: 196,608 bytes each, 11,796,480 in all
        assertEquals(60, m.state.size());
        assertEquals(11796480L, m.stateBytes);
        for (int i = 0; i < m.state.size(); i++) {
            Manifest.StateTensor s = m.state.get(i);
            int layer = i / 2;
            String role = i % 2 == 0 ? "key" : "value";
            assertEquals(i, s.index);
            assertEquals("past_key_values." + layer + "." + role, s.input);
            assertEquals("present." + layer + "." + role, s.output);
            assertEquals(layer, s.layer);
            assertEquals(role, s.role);
            assertEquals(DType.FLOAT16, s.dtype);
            assertArrayEquals(new long[] {1, 3, 512, 64}, s.shape);
            assertEquals(196608L, s.bytes);
        }
        assertEquals("present.29.value", m.stateByInput("past_key_values.29.value").output);
        assertEquals("past_key_values.7.key", m.stateByOutput("present.7.key").input);
        assertNull(m.stateByInput("nope"));
    }

    @Test
    public void readsTheEntryPoints() {
        Manifest m = TestSupport.fixtureManifest();
        assertEquals(2, m.artifacts.size());
        Manifest.Artifact onnx = m.artifact("onnx");
        assertEquals("model.onnx", onnx.file);
        Manifest.EntryPoint fwd = onnx.entryPoint("forward");
        assertTrue(fwd.isDynamic());
        assertEquals("seq", fwd.tokensAxis);
        assertEquals(62, fwd.inputs.size());
        assertEquals(61, fwd.outputs.size());
        assertEquals("tokens", fwd.inputs.get(0).name);
        assertEquals(DType.INT64, fwd.inputs.get(0).dtype);
        assertArrayEquals(new long[] {1, 7}, fwd.inputs.get(0).concreteShape(7));
        assertEquals("pos", fwd.inputs.get(1).name);
        assertEquals("logits", fwd.outputs.get(0).name);
        assertArrayEquals(new long[] {1, 7, 49152}, fwd.outputs.get(0).concreteShape(7));

        Manifest.Artifact pte = m.artifact("pte");
        assertEquals("xnnpack", pte.backend);
        assertEquals(Long.valueOf(32), pte.entryPoint("prefill").fixedTokens);
        assertEquals(Long.valueOf(1), pte.entryPoint("decode").fixedTokens);
        assertFalse(pte.entryPoint("decode").isDynamic());
    }

    @Test
    public void anExportWithRowsReturnsTheLastRowOnly() throws IOException {
        // the manifest of a real export made by edgekv export (tiny Llama, kv fp16, onnx + pte) since 2026-12-01
        File dir = new File(TestSupport.resources(), "tiny-llama-kv-rows");
        Manifest m = Manifest.load(dir);
        for (String fmt : new String[] {"onnx", "pte"}) {
            Manifest.EntryPoint fwd = m.artifact(fmt).entryPoint("forward");
            assertTrue(fwd.takesRows);
            assertEquals(m.state.size() + 3, fwd.inputs.size());
            Manifest.TensorSpec rows = fwd.inputs.get(fwd.inputs.size() - 1);
            assertEquals(Manifest.ROWS, rows.name);
            assertEquals(DType.INT64, rows.dtype);
            assertArrayEquals(new long[] {1}, rows.concreteShape(1));
            StepPlan.Call call = new StepPlan.Call(fwd, 16, 5, 5);
            assertArrayEquals(new long[] {4}, call.lastRow());
            assertEquals(0, call.lastRowIndex()); // logits [1, 1, vocab]
        }
        // an export from before rows: every row comes back, the last real one at n - 1
        Manifest.EntryPoint old = TestSupport.fixtureManifest().artifact("onnx").entryPoint("forward");
        assertFalse(old.takesRows);
        assertEquals(4, new StepPlan.Call(old, 16, 5, 5).lastRowIndex());

        String text = new String(IO.readAll(new File(dir, Manifest.FILE)), StandardCharsets.UTF_8);
        String bad = text.replaceFirst("\"name\": \"rows\",\\s*\"dtype\": \"int64\"",
                "\"name\": \"rows\", \"dtype\": \"float32\"");
        assertFalse(bad.equals(text));
        try {
            Manifest.parse(bad, "m.json");
            fail("a float rows input was accepted");
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().contains("rows must be int64"));
        }
    }

    @Test
    public void verifiesTheFixtureFiles() {
        Manifest m = TestSupport.fixtureManifest();
        assertEquals(3, m.files.size());
        m.verifyFiles(TestSupport.fixtureExport()); // no exception
    }

    @Test
    public void aTamperedFileFailsWithBothHashes() throws IOException {
        File dir = TestSupport.copyDir(TestSupport.fixtureExport(), TestSupport.tmpDir("tampered"));
        File onnx = new File(dir, "model.onnx");
        try (RandomAccessFile f = new RandomAccessFile(onnx, "rw")) { // same size, one byte flipped
            f.seek(3);
            int b = f.read();
            f.seek(3);
            f.write(b ^ 0x01);
        }
        Manifest m = Manifest.load(dir);
        String want = m.files.get("model.onnx").sha256;
        try {
            m.verifyFiles(dir);
            fail("a tampered model passed");
        } catch (EdgekvException e) {
            String msg = e.getMessage();
            assertTrue(msg, msg.startsWith(onnx.getPath() + ": sha256 does not match the manifest (expected " + want
                    + ", got "));
            assertTrue(msg, msg.contains(Manifest.sha256(onnx)));
            assertTrue(msg, msg.endsWith("changed or corrupted since export; push it again or export again"));
        }
    }

    @Test
    public void aTruncatedOrMissingFileFails() throws IOException {
        File dir = TestSupport.copyDir(TestSupport.fixtureExport(), TestSupport.tmpDir("truncated"));
        try (FileOutputStream out = new FileOutputStream(new File(dir, "model.pte"))) {
            out.write("short".getBytes(StandardCharsets.UTF_8));
        }
        try {
            Manifest.load(dir).verifyFiles(dir);
            fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().contains("model.pte: 5 bytes but the manifest says 64"));
        }
        dir = TestSupport.copyDir(TestSupport.fixtureExport(), TestSupport.tmpDir("missing"));
        assertTrue(new File(dir, "tokenizer.json").delete());
        try {
            Manifest.load(dir).verifyFiles(dir);
            fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().contains("listed in the manifest but missing"));
        }
    }

    @Test
    public void aFolderWithoutManifestSaysSo() throws IOException {
        File dir = TestSupport.tmpDir("empty");
        try {
            Manifest.load(dir);
            fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().contains("no manifest.json there"));
        }
    }

    private static String fixtureText() throws IOException {
        return IO.readText(new File(TestSupport.fixtureExport(), Manifest.FILE));
    }

    private static void assertRejected(String json, String expected) {
        try {
            Manifest.parse(json, "manifest.json");
            fail("accepted a manifest that should fail with: " + expected);
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().contains(expected));
        }
    }

    @Test
    public void rejectsInconsistentStateBytes() throws IOException {
        String t = fixtureText();
        assertRejected(t.replaceFirst("\"bytes\": 196608", "\"bytes\": 196600"),
                "state.tensors[0].bytes: is 196600 but shape [1, 3, 512, 64] of float16 is 196608 bytes");
        assertRejected(t.replace("\"bytes\": 11796480", "\"bytes\": 11796481"),
                "state.bytes: is 11796481 but the state tensors add up to 11796480");
    }

    @Test
    public void rejectsAnEntryPointWhoseStateOrderDiffers() throws IOException {
        String t = fixtureText();
        // swap key and value of layer 0 in the first entry point's inputs only
        int at = t.indexOf("\"entry_points\"");
        String head = t.substring(0, at);
        String tail = t.substring(at);
        tail = tail.replaceFirst("\"past_key_values.0.key\"", "\"TMP\"")
                .replaceFirst("\"past_key_values.0.value\"", "\"past_key_values.0.key\"")
                .replaceFirst("\"TMP\"", "\"past_key_values.0.value\"");
        assertRejected(head + tail, "the feed-back order must match");
    }

    @Test
    public void rejectsWrongTypesAndVersions() throws IOException {
        String t = fixtureText();
        assertRejected(t.replace("\"schema_version\": 1", "\"schema_version\": 2"), "schema_version 2 is not supported");
        assertRejected(t.replace("\"max_ctx\": 512", "\"max_ctx\": \"512\""), "max_ctx: expected an integer, got a string");
        assertRejected(t.replace("\"dtype\": \"float16\"", "\"dtype\": \"float17\""), "unknown dtype 'float17'");
        assertRejected("{\"schema_version\": 1", "manifest.json: invalid JSON at line 1");
    }

    @Test
    public void readsWhetherTheStateMayBeUpdatedInPlace() throws IOException {
        String t = fixtureText();
        assertFalse(Manifest.parse(t, "manifest.json").artifact("onnx").stateInPlace); // an export from before it
        Manifest m = Manifest.parse(t.replace("\"opset\": 18,", "\"opset\": 18, \"state_in_place\": true,"),
                "manifest.json");
        assertTrue(m.artifact("onnx").stateInPlace);
        assertFalse(m.artifact("pte").stateInPlace);
        assertRejected(t.replace("\"opset\": 18,", "\"opset\": 18, \"state_in_place\": \"yes\","), "state_in_place");
    }

    @Test
    public void sendsAnArtifactForARuntimesLlmApiToThatApi() throws IOException {
        String t = fixtureText();
        // the explicit-state artifacts say runners ["edgekv"] (edgekv export since issue 26): accepted as before
        Manifest.parse(t.replace("\"opset\": 18,", "\"opset\": 18, \"runners\": [\"edgekv\"],"), "manifest.json");
        assertRejected(t.replace("\"opset\": 18,", "\"opset\": 18, \"runners\": [\"edgekv\", \"onnxruntime-genai\"],"),
                "load the folder with GenAI's Java API");
        assertRejected(t.replace("\"format\": \"pte\",", "\"format\": \"pte\", \"runners\": [\"executorch-llm-runner\"],"),
                "load it with LlmModule");
    }

    @Test
    public void namesTheFormatsAnExportHas() {
        Manifest m = TestSupport.fixtureManifest();
        try {
            m.artifact("gguf");
            fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().endsWith("this export has no gguf artifact (it has: onnx, pte)"));
        }
    }
}
