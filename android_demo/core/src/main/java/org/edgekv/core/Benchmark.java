package org.edgekv.core;

import java.io.File;
import java.io.IOException;
import java.text.SimpleDateFormat;
import java.util.ArrayList;
import java.util.Date;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.TimeZone;

/**
 * The benchmark, runtime-agnostic: verify the export, sample the runtime baseline, load, then per context length:
 * reset the state, prefill (ctx - steps) prompt tokens, decode {@code steps} tokens greedily with the state fed back
 * per the manifest, and record peak memory, tokens/s and per-token latency into a {@link Report}. The report is
 * rewritten after every run ("complete": false until the last), so a run the system kills still leaves the earlier
 * ones behind.
 *
 * <p>Peak memory of a run: max(the peak while loading, the peak during the run). With VmHWM reset before each run
 * (see {@link MemorySampler#resetPeak()}) the run's peak is VmHWM; otherwise the sampled maximum of VmRSS
 * ("peak_source" says which). Taking the load peak in as well makes each run's number what a fresh process needs
 * for that context, which is how the Python side measures (one process per configuration).
 */
public final class Benchmark {
    private Benchmark() {}

    public interface Log {
        void line(String s);
    }

    /** How many generated token ids each run keeps in the report (to compare with a host run of the same export). */
    public static final int KEEP_IDS = 16;

    /** Loads the manifest, checks the settings against it, and (with verify) every file's sha256. */
    public static Manifest prepare(BenchmarkArgs args, Log log) {
        Manifest m = Manifest.load(args.exportDir);
        m.artifact(args.format(m)); // fails clearly if the export lacks that format
        args.contexts(m);
        if (args.verify) {
            long t0 = System.nanoTime();
            m.verifyFiles(args.exportDir);
            log.line("sha256 of " + m.files.size() + " files ok (" + String.format(Locale.ROOT, "%.1f",
                    (System.nanoTime() - t0) / 1e9) + " s)");
        }
        return m;
    }

    public static <T> Report run(BenchmarkArgs args, Manifest m, Backend<T> backend, MemorySampler mem,
                                 Map<String, Object> host, MemorySampler.Probe[] probes, File reportFile, Log log)
            throws Exception {
        String format = args.format(m);
        Manifest.Artifact art = m.artifact(format);
        List<Integer> ctxs = args.contexts(m);

        backend.init(args);
        long baseline = mem.rss();
        log.line("runtime " + backend.runtime() + " loaded; baseline RSS " + mib(baseline));
        boolean loadReset = mem.resetPeak();
        long t0 = System.nanoTime();
        backend.load(m, art, args.exportDir);
        double loadSeconds = (System.nanoTime() - t0) / 1e9;
        StateBook<T> book = new StateBook<>(m, backend.slots());
        MemorySampler.Status afterLoad = mem.read();
        // the peak over [baseline, now] is at least the baseline itself, whatever the reset did
        long loadPeak = Math.max(baseline, Math.max(afterLoad.vmHwm, afterLoad.vmRss));
        log.line("loaded " + art.file + " in " + String.format(Locale.ROOT, "%.2f", loadSeconds) + " s; peak "
                + mib(loadPeak) + (loadReset ? "" : " (VmHWM since process start)"));

        Report report = new Report(new File(args.exportDir, art.file).getPath(), backend.runtime(), host);
        Map<String, Object> x = report.extra();
        x.put("created_utc", utcNow());
        x.put("complete", false);
        x.put("model", m.modelName);
        x.put("strategy", m.strategyLabel);
        x.put("format", format);
        x.put("max_ctx", (long) m.maxCtx);
        x.put("weights_bytes", m.weightsBytes);
        x.put("state_bytes", m.stateBytes);
        x.put("load_seconds", Report.round(loadSeconds, 3));
        x.put("load_peak_bytes", loadPeak);
        x.put("edgekv_version", m.edgekvVersion);

        for (int i = 0; i < ctxs.size(); i++) {
            Report.Run r = runOne(args, m, art, backend, book, mem, probes, ctxs.get(i), baseline, loadPeak, log);
            report.addRun(r);
            if (i == ctxs.size() - 1) {
                x.put("complete", true);
            }
            if (reportFile != null) {
                report.write(reportFile);
            }
        }
        return report;
    }

    static <T> Report.Run runOne(BenchmarkArgs args, Manifest m, Manifest.Artifact art, Backend<T> backend,
                                 StateBook<T> book, MemorySampler mem, MemorySampler.Probe[] probes, int ctx,
                                 long baseline, long loadPeak, Log log) {
        int prompt = ctx - args.steps;
        Report.Run r = new Report.Run();
        r.ctx = ctx;
        r.runtimeBaselineBytes = baseline;
        if (args.predictedBytes != null) {
            r.predictedBytes = args.predictedBytes;
            r.extra.put("predicted_source", "planner (passed by the host)");
        } else {
            r.predictedBytes = m.weightsBytes + m.stateBytes;
            Map<String, Object> parts = new LinkedHashMap<>();
            parts.put("weights", m.weightsBytes);
            parts.put("state", m.stateBytes);
            r.extra.put("predicted_components", parts);
            r.extra.put("predicted_source", "manifest (weights + state)");
        }
        r.rooflineTokensPerS = Report.roofline(args.bandwidthBytesPerS, m.weightsBytes + m.stateBytes);
        r.extra.put("steps", (long) args.steps);
        r.extra.put("prompt_tokens", (long) prompt);

        TokenRate prefillRate = new TokenRate();
        TokenRate decodeRate = new TokenRate();
        List<Long> generated = new ArrayList<>();
        int reached = 0;
        String status = "ok";
        book.reset();
        boolean reset = mem.resetPeak();
        mem.start(args.sampleMs, probes);
        try {
            long[] ids = promptIds(args.seed, prompt, m.vocab, m.bosTokenId);
            float[] logits = null;
            for (StepPlan.Call c : StepPlan.prefill(art, 0, prompt, prefillChunk(args, m), m.maxCtx)) {
                long[] tokens = new long[c.padded];
                System.arraycopy(ids, c.pos, tokens, 0, c.n); // the rest is padding (token 0)
                long t = System.nanoTime();
                logits = backend.call(c, tokens, book);
                backend.recycle(book.swap());
                prefillRate.add(System.nanoTime() - t, c.n);
            }
            long next = argmax(logits, m.vocab);
            for (int s = 0; s < args.steps; s++) {
                if (generated.size() < KEEP_IDS) {
                    generated.add(next);
                }
                StepPlan.Call c = StepPlan.decode(art, prompt + s, m.maxCtx);
                long[] tokens = new long[c.padded];
                tokens[0] = next;
                long t = System.nanoTime();
                logits = backend.call(c, tokens, book);
                backend.recycle(book.swap());
                decodeRate.add(System.nanoTime() - t);
                next = argmax(logits, m.vocab);
                reached = s + 1;
            }
        } catch (OutOfMemoryError e) {
            status = "oom: Java heap (" + e.getMessage() + ")";
        } catch (Exception e) {
            status = "error: " + e.getClass().getSimpleName() + ": " + firstLine(e.getMessage());
        }
        MemorySampler.Summary seen = mem.stop();
        MemorySampler.Status end = mem.read();
        long runPeak = reset ? Math.max(end.vmHwm, seen.maxRss) : seen.maxRss;
        r.peakBytes = Math.max(runPeak, loadPeak);
        r.decode(decodeRate);
        r.status = status;
        r.fits = status.equals("ok") && (args.budgetBytes == null || r.peakBytes <= args.budgetBytes);
        r.extra.put("reached_step", (long) reached);
        r.extra.put("prefill_seconds", Report.round(prefillRate.totalSeconds(), 4));
        r.extra.put("prefill_tokens_per_s", Report.round(prefillRate.tokensPerSecond(), 3));
        r.extra.put("prefill_calls", (long) prefillRate.calls());
        r.extra.put("peak_source", reset ? "VmHWM (reset before the run)" : "sampled VmRSS every " + args.sampleMs
                + " ms");
        r.extra.put("run_peak_bytes", runPeak);
        r.extra.put("load_peak_bytes", loadPeak);
        r.extra.put("rss_end_bytes", end.vmRss);
        if (end.rssAnon >= 0) {
            r.extra.put("rss_anon_end_bytes", end.rssAnon);
            r.extra.put("rss_file_end_bytes", end.rssFile);
        }
        for (Map.Entry<String, Long> e : seen.maxProbe.entrySet()) {
            r.extra.put("peak_" + e.getKey() + "_bytes", e.getValue());
        }
        for (Map.Entry<String, Long> e : seen.minProbe.entrySet()) {
            r.extra.put("min_" + e.getKey() + "_bytes", e.getValue());
        }
        r.extra.put("memory_samples", (long) seen.samples);
        if (args.budgetBytes != null) {
            r.extra.put("budget_bytes", args.budgetBytes);
        }
        r.extra.put("threads", (long) args.threads);
        r.extra.put("prompt_seed", args.seed);
        r.extra.put("generated_ids", generated);
        log.line("ctx " + ctx + ": " + status + ", " + reached + "/" + args.steps + " steps, "
                + (r.tokensPerS == null ? "-" : String.format(Locale.ROOT, "%.1f", r.tokensPerS)) + " tok/s, p50 "
                + (r.latencyP50Ms == null ? "-" : String.format(Locale.ROOT, "%.1f", r.latencyP50Ms)) + " ms, peak "
                + mib(r.peakBytes) + ", measured " + mib(r.measuredBytes()) + " vs predicted "
                + mib(r.predictedBytes));
        return r;
    }

    /**
     * The prompt: bos (when the export has one) then pseudo-random ids in [0, vocab) from a 64-bit LCG
     * (x = x * 6364136223846793005 + 1442695040888963407, id = (x >>> 33) mod vocab), seeded with seed. The content
     * does not change the cost of a step; it only has to be reproducible.
     */
    public static long[] promptIds(long seed, int n, int vocab, Long bos) {
        long[] ids = new long[n];
        long x = seed;
        for (int i = 0; i < n; i++) {
            x = x * 6364136223846793005L + 1442695040888963407L;
            ids[i] = (x >>> 33) % vocab;
        }
        if (bos != null && n > 0) {
            ids[0] = bos;
        }
        return ids;
    }

    /** Index of the largest logit (the first on ties); NaNs are skipped. */
    public static long argmax(float[] logits, int vocab) {
        if (logits == null || logits.length == 0) {
            throw new EdgekvException("the runtime returned no logits");
        }
        if (logits.length != vocab) {
            throw new EdgekvException("the runtime returned " + logits.length + " logits for a vocab of " + vocab);
        }
        int best = -1;
        for (int i = 0; i < logits.length; i++) {
            if (!Float.isNaN(logits[i]) && (best < 0 || logits[i] > logits[best])) {
                best = i;
            }
        }
        if (best < 0) {
            throw new EdgekvException("every logit is NaN");
        }
        return best;
    }

    /** host for a plain JVM (tests; a Linux box): kind "linux-x86_64" etc., RAM from /proc/meminfo, cores. */
    public static Map<String, Object> jvmHost() {
        Map<String, Object> h = new LinkedHashMap<>();
        String os = System.getProperty("os.name", "unknown").toLowerCase(Locale.ROOT).replace(' ', '_');
        String arch = System.getProperty("os.arch", "unknown").toLowerCase(Locale.ROOT);
        if (arch.equals("amd64")) {
            arch = "x86_64";
        } else if (arch.equals("arm64")) {
            arch = "aarch64";
        }
        h.put("kind", os + "-" + arch);
        h.put("device", null);
        Long ram = null;
        try {
            ram = MemorySampler.parseMeminfo(IO.readText(new File("/proc/meminfo"))).get("MemTotal");
        } catch (IOException e) {
            // not Linux
        }
        h.put("ram_bytes", ram);
        h.put("bandwidth_bytes_per_s", null);
        h.put("cores", (long) Runtime.getRuntime().availableProcessors());
        h.put("java", System.getProperty("java.version"));
        return h;
    }

    public static String utcNow() {
        SimpleDateFormat f = new SimpleDateFormat("yyyy-MM-dd'T'HH:mm:ss'Z'", Locale.ROOT);
        f.setTimeZone(TimeZone.getTimeZone("UTC"));
        return f.format(new Date());
    }

    static String mib(Long bytes) {
        return bytes == null ? "-" : String.format(Locale.ROOT, "%.1f MiB", bytes / 1048576.0);
    }

    static String firstLine(String s) {
        if (s == null) {
            return "";
        }
        String line = s.split("\n", 2)[0];
        return line.length() > 300 ? line.substring(0, 300) + "..." : line;
    }

    /** Tokens per ONNX prefill call: the run's own setting, else what the export's plan assumed (edgekv's
     * OrtStepper does the same), else 128. A .pte's calls are capped by its method: its fixed prefill size, or its
     * dynamic {@code forward}'s max_tokens (StepPlan.maxTokensPerCall). */
    static int prefillChunk(BenchmarkArgs args, Manifest m) {
        if (args.prefillChunk != null) {
            return args.prefillChunk;
        }
        return m.onnxPrefillChunk != null ? m.onnxPrefillChunk : 128;
    }
}
