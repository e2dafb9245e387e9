package org.edgekv.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.io.File;
import java.util.Arrays;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Map;
import org.junit.Test;

public class BenchmarkArgsTest {
    private static Map<String, String> extras(String... kv) {
        Map<String, String> m = new LinkedHashMap<>();
        for (int i = 0; i < kv.length; i += 2) {
            m.put(kv[i], kv[i + 1]);
        }
        return m;
    }

    @Test
    public void defaults() {
        BenchmarkArgs a = BenchmarkArgs.fromExtras(extras());
        assertEquals(new File("/data/local/tmp/edgekv/model"), a.exportDir);
        assertNull(a.runtime);
        assertEquals(64, a.steps);
        assertTrue(a.verify);
        assertEquals("report.json", a.reportName);
        Manifest m = TestSupport.fixtureManifest();
        assertEquals("onnx", a.format(m)); // the manifest's first artifact
        assertEquals(Collections.singletonList(512), a.contexts(m));
        assertEquals(new File("/data/local/tmp/edgekv/smollm2"), BenchmarkArgs.fromExtras(extras("name", "smollm2"))
                .exportDir);
    }

    @Test
    public void parsesEveryExtra() {
        BenchmarkArgs a = BenchmarkArgs.fromExtras(extras("export_dir", "/sdcard/x", "runtime", "ExecuTorch",
                "ctx", "128, 512", "steps", "32", "threads", "4", "prefill_chunk", "16", "verify", "false", "seed", "7",
                "load_mode", "file", "sample_ms", "5", "bandwidth_bytes_per_s", "6.8e10", "predicted_bytes", "600000000",
                "budget_bytes", "3000000000", "device", "pixel8", "report", "r.json"));
        assertEquals(new File("/sdcard/x"), a.exportDir);
        assertEquals("executorch", a.runtime);
        assertEquals("pte", a.format(TestSupport.fixtureManifest()));
        assertEquals(Arrays.asList(128, 512), a.ctxs);
        assertEquals(32, a.steps);
        assertEquals(4, a.threads);
        assertEquals(Integer.valueOf(16), a.prefillChunk);
        assertEquals(false, a.verify);
        assertEquals(7, a.seed);
        assertEquals("file", a.loadMode);
        assertEquals(5, a.sampleMs);
        assertEquals(6.8e10, a.bandwidthBytesPerS, 0);
        assertEquals(Long.valueOf(600000000L), a.predictedBytes);
        assertEquals(Long.valueOf(3000000000L), a.budgetBytes);
        assertEquals("pixel8", a.device);
        assertEquals("r.json", a.reportName);
        assertEquals("ort", BenchmarkArgs.fromExtras(extras("runtime", "onnx")).runtime);
    }

    private static void assertBad(String expected, String... kv) {
        try {
            BenchmarkArgs a = BenchmarkArgs.fromExtras(extras(kv));
            a.contexts(TestSupport.fixtureManifest());
            fail("accepted " + Arrays.toString(kv));
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().contains(expected));
        }
    }

    @Test
    public void badValuesGetOneClearLine() {
        assertBad("runtime 'tflite': use ort (ONNX Runtime, model.onnx) or executorch (model.pte)", "runtime", "tflite");
        assertBad("ctx 'abc': not an integer", "ctx", "abc");
        assertBad("ctx 1: must be at least 2", "ctx", "1");
        assertBad("ctx 1024 is beyond this export's max_ctx 512", "ctx", "1024");
        assertBad("ctx 64 with 64 decode steps leaves no prompt", "ctx", "64");
        assertBad("threads 999: must be between 0 and 256", "threads", "999");
        assertBad("verify 'maybe': use true or false", "verify", "maybe");
        assertBad("report '../x': give a file name", "report", "../x");
        assertBad("name 'a/b'", "name", "a/b");
        assertBad("bandwidth_bytes_per_s 'fast': not a number", "bandwidth_bytes_per_s", "fast");
    }
}
