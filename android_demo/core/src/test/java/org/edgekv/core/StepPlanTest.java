package org.edgekv.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.io.File;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.List;
import org.junit.Test;

public class StepPlanTest {
    @Test
    public void onnxSplitsAPromptIntoDynamicChunks() {
        Manifest.Artifact onnx = TestSupport.fixtureManifest().artifact("onnx");
        List<StepPlan.Call> calls = StepPlan.prefill(onnx, 0, 150, 64, 512);
        assertEquals(3, calls.size());
        assertEquals("forward@0+64", calls.get(0).toString());
        assertEquals("forward@64+64", calls.get(1).toString());
        assertEquals("forward@128+22", calls.get(2).toString());
        assertEquals(22, calls.get(2).padded);
        StepPlan.Call d = StepPlan.decode(onnx, 150, 512);
        assertEquals("forward@150+1", d.toString());
    }

    @Test
    public void ptePadsToItsFixedPrefillAndDecodesOneToken() {
        Manifest.Artifact pte = TestSupport.fixtureManifest().artifact("pte");
        List<StepPlan.Call> calls = StepPlan.prefill(pte, 0, 70, 64, 512); // maxChunk does not apply to fixed sizes
        assertEquals(3, calls.size());
        assertEquals("prefill@0+32", calls.get(0).toString());
        assertEquals("prefill@32+32", calls.get(1).toString());
        assertEquals("prefill@64+6 (padded to 32)", calls.get(2).toString());
        // a one-token remainder goes to decode, as edgekv/export/runtime.py does
        List<StepPlan.Call> c33 = StepPlan.prefill(pte, 0, 33, 64, 512);
        assertEquals("decode@32+1", c33.get(1).toString());
        assertEquals("decode@447+1", StepPlan.decode(pte, 447, 512).toString());
    }

    @Test
    public void refusesToRunPastMaxCtx() {
        Manifest.Artifact onnx = TestSupport.fixtureManifest().artifact("onnx");
        try {
            StepPlan.prefill(onnx, 500, 13, 64, 512);
            fail();
        } catch (EdgekvException e) {
            assertEquals("513 tokens exceed this export's max_ctx 512", e.getMessage());
        }
        try {
            StepPlan.decode(onnx, 512, 512);
            fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage().contains("outside this export's max_ctx 512"));
        }
    }

    /** The fixture manifest's text with edits (the same export as written by a newer edgekv). */
    private static Manifest edited(String from, String to) throws Exception {
        File f = new File(TestSupport.fixtureExport(), Manifest.FILE);
        String text = new String(Files.readAllBytes(f.toPath()), StandardCharsets.UTF_8);
        assertTrue("fixture text changed: " + from, text.contains(from));
        return Manifest.parse(text.replace(from, to), f.getPath());
    }

    @Test
    public void aDecodeTailRunsTheShortLastChunkOneTokenAtATime() throws Exception {
        // edgekv/export/pipeline.py pads_safely: a recurrent state or a rolling window must not see padding tokens
        Manifest m = edited("\"name\": \"prefill\",\n          \"tokens\": 32,",
                "\"name\": \"prefill\",\n          \"tokens\": 32,\n          \"tail\": \"decode\",");
        List<StepPlan.Call> calls = StepPlan.prefill(m.artifact("pte"), 0, 35, 64, 512);
        assertEquals(4, calls.size());
        assertEquals("prefill@0+32", calls.get(0).toString());
        assertEquals("decode@32+1", calls.get(1).toString());
        assertEquals("decode@34+1", calls.get(3).toString());
        try {
            edited("\"name\": \"prefill\",\n          \"tokens\": 32,",
                    "\"name\": \"prefill\",\n          \"tokens\": 32,\n          \"tail\": \"skip\",");
            fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().contains("not pad or decode"));
        }
    }

    @Test
    public void anInPlacePteForwardTakesUnpaddedCallsOfAtMostItsMaxTokens() throws Exception {
        // edgekv's .pte of a plain kv cache: one method, a dynamic token axis of 1..max_tokens, the state in place
        String pte = "\"name\": \"prefill\",\n          \"tokens\": 32,";
        Manifest m = edited(pte, "\"name\": \"forward\",\n          \"tokens\": \"seq\",\n"
                + "          \"max_tokens\": 24,");
        Manifest.Artifact a = m.artifact("pte");
        assertEquals(Long.valueOf(24), a.entryPoint("forward").maxTokens);
        List<StepPlan.Call> calls = StepPlan.prefill(a, 466, 46, 64, 512); // ends at max_ctx, no padding past it
        assertEquals(2, calls.size());
        assertEquals("forward@466+24", calls.get(0).toString()); // max_tokens caps the run's 64
        assertEquals("forward@490+22", calls.get(1).toString());
        assertEquals(22, calls.get(1).padded);
    }

    @Test
    public void theOnnxCallSizeComesFromTheRunThenTheExportThenDefaults() throws Exception {
        Manifest recorded = edited("\"max_ctx\": 512,",
                "\"max_ctx\": 512,\n  \"deployment\": {\"formats\": {\"onnx\": {\"prefill_chunk\": 48}}},");
        BenchmarkArgs args = new BenchmarkArgs();
        assertEquals(48, Benchmark.prefillChunk(args, recorded));
        assertEquals(128, Benchmark.prefillChunk(args, TestSupport.fixtureManifest())); // an older export
        args.prefillChunk = 16;
        assertEquals(16, Benchmark.prefillChunk(args, recorded));
        List<StepPlan.Call> calls = StepPlan.prefill(recorded.artifact("onnx"), 0, 100, 48, 512);
        assertEquals("forward@96+4", calls.get(2).toString());
    }
}
