package org.edgekv.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.io.File;
import java.io.IOException;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.junit.Test;

public class ReportTest {
    static MiniSchema schema() throws IOException {
        return new MiniSchema(Json.parse(IO.readText(TestSupport.reportSchema())));
    }

    /** Validates the JSON text (what the host reads), not the in-memory map. */
    static List<String> validate(String text) throws IOException {
        return schema().check(Json.parse(text));
    }

    static Map<String, Object> androidHost() {
        Map<String, Object> h = new LinkedHashMap<>();
        h.put("kind", "android");
        h.put("device", "Google Pixel 8");
        h.put("ram_bytes", 7_836_244L * 1024);
        h.put("bandwidth_bytes_per_s", 68.2e9);
        h.put("cores", 9L);
        h.put("sdk", 34L);
        h.put("abi", "arm64-v8a");
        h.put("avail_mem_bytes", 2_440_000_000L);
        h.put("low_memory", false);
        return h;
    }

    static Report.Run okRun() {
        TokenRate rate = new TokenRate();
        for (long ms : new long[] {30, 31, 29, 35, 30, 33, 80, 30}) {
            rate.add(ms * 1_000_000L);
        }
        Report.Run r = new Report.Run();
        r.ctx = 512;
        r.predictedBytes = 549_856_512L;
        r.peakBytes = 760_000_000L;
        r.runtimeBaselineBytes = 150_000_000L;
        r.rooflineTokensPerS = Report.roofline(68.2e9, 549_856_512L);
        r.fits = true;
        r.decode(rate);
        r.extra.put("steps", 8L);
        r.extra.put("reached_step", 8L);
        r.extra.put("prefill_seconds", 1.25);
        Map<String, Object> parts = new LinkedHashMap<>();
        parts.put("weights", 538_060_032L);
        parts.put("state", 11_796_480L);
        r.extra.put("predicted_components", parts);
        return r;
    }

    @Test
    public void aFullReportValidatesAgainstTheSharedSchema() throws IOException {
        Report rep = new Report("/data/local/tmp/edgekv/smollm2/model.onnx", "onnxruntime-android 1.30.0",
                androidHost());
        rep.addRun(okRun());
        rep.extra().put("complete", true);
        String text = rep.toJsonText();
        assertEquals(Arrays.asList(), validate(text));

        @SuppressWarnings("unchecked")
        Map<String, Object> doc = (Map<String, Object>) Json.parse(text);
        assertEquals(Arrays.asList("schema_version", "artifact", "runtime", "host", "runs", "complete"),
                new java.util.ArrayList<>(doc.keySet()));
        @SuppressWarnings("unchecked")
        Map<String, Object> run = (Map<String, Object>) ((List<Object>) doc.get("runs")).get(0);
        assertEquals(Arrays.asList("ctx", "predicted_bytes", "measured_bytes", "runtime_baseline_bytes",
                "tokens_per_s", "roofline_tokens_per_s", "latency_ms", "fits"),
                new java.util.ArrayList<>(run.keySet()).subList(0, 8));
        assertEquals(610_000_000L, run.get("measured_bytes")); // peak - baseline
        assertEquals(760_000_000L, run.get("peak_bytes"));
        assertEquals(10.94, (Double) run.get("error_pct"), 1e-9); // (610 - 549.86) / 549.86 = +10.94 %
        @SuppressWarnings("unchecked")
        Map<String, Object> lat = (Map<String, Object>) run.get("latency_ms");
        assertEquals(30.5, (Double) lat.get("p50"), 1e-9); // 29 30 30 30 | 31 33 35 80
        assertEquals(48.5, (Double) lat.get("p90"), 1e-9); // h = 6.3 -> 35 + 0.3 * 45
        assertEquals(8L, lat.get("n"));
        assertEquals(8 / 0.298, (Double) run.get("tokens_per_s"), 1e-3);
        assertEquals(124.03, (Double) run.get("roofline_tokens_per_s"), 0.01);
    }

    @Test
    public void aRunThatDidNotFinishStillValidates() throws IOException {
        Report.Run r = new Report.Run();
        r.ctx = 8192;
        r.predictedBytes = 3_000_000_000L;
        r.runtimeBaselineBytes = 150_000_000L;
        r.status = "error: OrtException: failed to allocate";
        r.fits = false;
        r.decode(new TokenRate());
        Report rep = new Report("export/x/model.pte", "executorch-android 1.5.1", Benchmark.jvmHost());
        rep.addRun(r);
        String text = rep.toJsonText();
        assertEquals(Arrays.asList(), validate(text));
        @SuppressWarnings("unchecked")
        Map<String, Object> run = (Map<String, Object>) ((List<Object>) ((Map<String, Object>) Json.parse(text))
                .get("runs")).get(0);
        assertTrue(run.containsKey("measured_bytes"));
        assertNull(run.get("measured_bytes"));
        assertNull(run.get("tokens_per_s"));
        assertEquals(false, run.get("fits"));
    }

    @Test
    @SuppressWarnings("unchecked")
    public void theCheckerCatchesWhatTheSchemaForbids() throws IOException {
        Report rep = new Report("a", "r", androidHost());
        rep.addRun(okRun());
        @SuppressWarnings("unchecked")
        Map<String, Object> doc = (Map<String, Object>) Json.parse(rep.toJsonText());
        @SuppressWarnings("unchecked")
        Map<String, Object> run = (Map<String, Object>) ((List<Object>) doc.get("runs")).get(0);

        run.remove("runtime_baseline_bytes");
        run.put("predicted_bytes", 1.5);          // bytes must be integers
        run.put("fits", "yes");
        ((Map<String, Object>) run.get("latency_ms")).remove("p90");
        ((Map<String, Object>) doc.get("host")).remove("kind");
        doc.remove("runtime");
        List<String> errors = schema().check(doc);
        String all = errors.toString();
        assertTrue(all, all.contains("$: missing required key 'runtime'"));
        assertTrue(all, all.contains("$.host: missing required key 'kind'"));
        assertTrue(all, all.contains("$.runs[0]: missing required key 'runtime_baseline_bytes'"));
        assertTrue(all, all.contains("$.runs[0].predicted_bytes: expected [integer], got Double 1.5"));
        assertTrue(all, all.contains("$.runs[0].fits: expected [boolean]"));
        assertTrue(all, all.contains("$.runs[0].latency_ms: missing required key 'p90'"));
        assertEquals(all, 6, errors.size());

        doc.put("runs", Arrays.asList());
        assertTrue(schema().check(doc).toString().contains("$.runs: fewer than 1 items"));
    }

    @Test
    public void theJvmHostIsAValidHost() throws IOException {
        Map<String, Object> h = Benchmark.jvmHost();
        assertTrue(((String) h.get("kind")).matches("[a-z_]+-[a-z0-9_]+"));
        Report rep = new Report("a", "r", h);
        rep.addRun(okRun());
        assertEquals(Arrays.asList(), validate(rep.toJsonText()));
    }

    @Test
    public void writesTheFileAtomically() throws IOException {
        File dir = TestSupport.tmpDir("report");
        File f = new File(dir, "report.json");
        Report rep = new Report("a", "r", androidHost());
        rep.addRun(okRun());
        rep.write(f);
        rep.write(f); // overwrite
        assertEquals(rep.toJsonText(), IO.readText(f));
        assertFalse(new File(dir, ".report.json.tmp").exists());
    }

    @Test
    public void refusesIncompleteReports() {
        try {
            new Report("a", "r", new LinkedHashMap<String, Object>());
            fail();
        } catch (IllegalArgumentException e) {
            assertTrue(e.getMessage().contains("kind"));
        }
        try {
            new Report("a", "r", androidHost()).toJson();
            fail();
        } catch (IllegalStateException e) {
            assertTrue(e.getMessage().contains("at least one run"));
        }
        Report.Run r = okRun();
        r.extra.put("fits", false);
        try {
            r.toJson();
            fail();
        } catch (IllegalArgumentException e) {
            assertTrue(e.getMessage().contains("'fits'"));
        }
    }
}
