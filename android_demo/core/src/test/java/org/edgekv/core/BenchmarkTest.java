package org.edgekv.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;
import static org.junit.Assume.assumeTrue;

import java.io.File;
import java.nio.ByteBuffer;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Deque;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.junit.Test;

/**
 * The whole benchmark loop on the real fixture manifest with a fake runtime that checks the state it is fed: every
 * call must get, as past_key_values.L.{key,value}, exactly what the previous call returned as present.L.{key,value},
 * at the right position, with the right padding.
 */
public class BenchmarkTest {

    /** Writes (call number, tensor index) into every present and checks the pasts carry the previous call's marks. */
    static final class FakeBackend implements Backend<ByteBuffer> {
        final Deque<ByteBuffer> spare = new ArrayDeque<>();
        final List<String> calls = new ArrayList<>();
        int callNo;
        int nextPos;
        int failAtCall = -1;
        boolean loaded;
        Manifest manifest;

        @Override
        public void init(BenchmarkArgs args) {}

        @Override
        public String runtime() {
            return "fake 1.0";
        }

        @Override
        public void load(Manifest m, Manifest.Artifact a, File dir) {
            manifest = m;
            loaded = true;
        }

        @Override
        public StateBook.Slots<ByteBuffer> slots() {
            return StateBook.DIRECT_BUFFERS;
        }

        @Override
        public float[] call(StepPlan.Call c, long[] tokens, StateBook<ByteBuffer> book) {
            assertTrue(loaded);
            if (callNo == failAtCall) {
                failAtCall = -1; // once
                throw new IllegalStateException("injected failure\nsecond line");
            }
            if (c.pos == 0) {
                nextPos = 0;
                for (int i = 0; i < book.size(); i++) {
                    assertEquals("a new sequence starts from zeros", 0L, book.past(i).getLong(0));
                }
            } else {
                for (int i = 0; i < book.size(); i++) {
                    assertEquals(book.spec(i).input, (long) (callNo - 1) * 1000 + i, book.past(i).getLong(0));
                }
            }
            assertEquals("positions advance by the tokens of each call", nextPos, c.pos);
            assertEquals(c.padded, tokens.length);
            for (int k = c.n; k < c.padded; k++) {
                assertEquals("padding is token 0", 0L, tokens[k]);
            }
            nextPos = c.pos + c.n;
            calls.add(c.toString());
            for (int i = 0; i < book.size(); i++) {
                ByteBuffer b = spare.isEmpty() ? StateBook.DIRECT_BUFFERS.zeros(book.spec(i)) : spare.pop();
                b.putLong(0, (long) callNo * 1000 + i);
                book.putPresent(i, b);
            }
            callNo++;
            float[] logits = new float[manifest.vocab];
            logits[(int) ((tokens[c.n - 1] + 1) % manifest.vocab)] = 5f; // greedy next = last token + 1
            return logits;
        }

        @Override
        public void recycle(List<ByteBuffer> old) {
            for (ByteBuffer b : old) {
                b.putLong(0, -1);
                spare.push(b);
            }
        }

        @Override
        public void close() {}
    }

    private static BenchmarkArgs args(String... kv) {
        Map<String, String> m = new LinkedHashMap<>();
        m.put("export_dir", TestSupport.fixtureExport().getPath());
        for (int i = 0; i < kv.length; i += 2) {
            m.put(kv[i], kv[i + 1]);
        }
        return BenchmarkArgs.fromExtras(m);
    }

    @Test
    public void runsPrefillAndDecodeWithTheStateFedBack() throws Exception {
        assumeTrue("needs /proc (Linux or Android)", new File("/proc/self/status").canRead());
        BenchmarkArgs a = args("runtime", "executorch", "ctx", "40,100", "steps", "5", "seed", "3",
                "bandwidth_bytes_per_s", "5e10", "sample_ms", "2");
        List<String> log = new ArrayList<>();
        Manifest m = Benchmark.prepare(a, log::add);
        assertTrue(log.get(0), log.get(0).startsWith("sha256 of 3 files ok"));
        FakeBackend be = new FakeBackend();
        File out = new File(TestSupport.tmpDir("bench"), "report.json");
        Report rep = Benchmark.run(a, m, be, new MemorySampler(), Benchmark.jvmHost(), new MemorySampler.Probe[0],
                out, log::add);

        // ctx 40 = 35 prompt tokens (prefill 32 + 3 padded to 32) + 5 decode steps; then ctx 100 = 95 + 5
        assertEquals(Arrays.asList("prefill@0+32", "prefill@32+3 (padded to 32)", "decode@35+1", "decode@36+1",
                "decode@37+1", "decode@38+1", "decode@39+1"), be.calls.subList(0, 7));
        assertEquals(Arrays.asList("prefill@0+32", "prefill@32+32", "prefill@64+31 (padded to 32)", "decode@95+1"),
                be.calls.subList(7, 11));
        assertEquals(15, be.calls.size());

        String text = IO.readText(out);
        assertEquals(rep.toJsonText(), text);
        assertEquals(Arrays.asList(), ReportTest.validate(text));
        @SuppressWarnings("unchecked")
        Map<String, Object> doc = (Map<String, Object>) Json.parse(text);
        assertEquals(true, doc.get("complete"));
        assertEquals(new File(TestSupport.fixtureExport(), "model.pte").getPath(), doc.get("artifact"));
        assertEquals("fake 1.0", doc.get("runtime"));
        @SuppressWarnings("unchecked")
        List<Map<String, Object>> runs = (List<Map<String, Object>>) (List<?>) doc.get("runs");
        assertEquals(2, runs.size());
        Map<String, Object> r0 = runs.get(0);
        assertEquals(40L, r0.get("ctx"));
        assertEquals("ok", r0.get("status"));
        assertEquals(true, r0.get("fits"));
        assertEquals(5L, r0.get("reached_step"));
        assertEquals(35L, r0.get("prompt_tokens"));
        assertEquals(538060032L + 11796480L, r0.get("predicted_bytes"));
        long peak = (Long) r0.get("peak_bytes");
        long base = (Long) r0.get("runtime_baseline_bytes");
        assertEquals(peak - base, (long) (Long) r0.get("measured_bytes"));
        assertTrue(peak >= base);
        assertEquals(5e10 / (538060032L + 11796480L), (Double) r0.get("roofline_tokens_per_s"), 1e-3);
        assertTrue((Double) r0.get("tokens_per_s") > 0);
        // greedy ids: the fake's next token is last + 1, starting from the prompt's last id
        long[] prompt = Benchmark.promptIds(3, 35, 49152, 1L);
        List<Object> want = new ArrayList<>();
        for (int s = 0; s < 5; s++) {
            want.add((prompt[34] + 1 + s) % 49152);
        }
        assertEquals(want, r0.get("generated_ids"));
        assertEquals(100L, runs.get(1).get("ctx"));
    }

    @Test
    public void aFailingRunIsReportedAndTheNextStartsClean() throws Exception {
        assumeTrue("needs /proc (Linux or Android)", new File("/proc/self/status").canRead());
        BenchmarkArgs a = args("runtime", "ort", "ctx", "20,30", "steps", "4", "verify", "false");
        Manifest m = Benchmark.prepare(a, s -> { });
        FakeBackend be = new FakeBackend();
        be.failAtCall = 2; // ctx 20: 1 prefill call (16 tokens), 1 decode, then the 2nd decode fails
        Report rep = Benchmark.run(a, m, be, new MemorySampler(), Benchmark.jvmHost(), new MemorySampler.Probe[0],
                null, s -> { });
        Map<String, Object> r0 = rep.runs().get(0).toJson();
        assertEquals("error: IllegalStateException: injected failure", r0.get("status"));
        assertEquals(false, r0.get("fits"));
        assertEquals(1L, r0.get("reached_step"));
        Map<String, Object> r1 = rep.runs().get(1).toJson();
        assertEquals("ok", r1.get("status")); // the fake checks the second run starts from a zero state
        assertEquals(4L, r1.get("reached_step"));
        assertEquals(Arrays.asList(), ReportTest.validate(rep.toJsonText()));
        assertFalse(be.calls.isEmpty());
    }

    @Test
    public void promptIdsAreReproducible() {
        long[] a = Benchmark.promptIds(0, 6, 49152, 1L);
        long[] b = Benchmark.promptIds(0, 6, 49152, 1L);
        assertTrue(Arrays.equals(a, b));
        assertEquals(1L, a[0]);
        for (long id : a) {
            assertTrue(id >= 0 && id < 49152);
        }
        assertFalse(Arrays.equals(a, Benchmark.promptIds(1, 6, 49152, 1L)));
        assertEquals(3L, Benchmark.argmax(new float[] {0, 1, Float.NaN, 7, 7}, 5));
    }
}
