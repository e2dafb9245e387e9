package org.edgekv.core;

import java.io.File;
import java.io.IOException;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The report JSON in the schema of edgekv/profile/report.schema.json (the same one `edgekv profile --json` prints):
 * {"artifact", "runtime", "host": {...}, "runs": [{"ctx", "predicted_bytes", "measured_bytes",
 * "runtime_baseline_bytes", "tokens_per_s", "roofline_tokens_per_s", "latency_ms": {"p50", "p90"}, "fits"}, ...]}
 * where measured_bytes is the peak minus the runtime baseline. Runs may carry extras (steps, prefill_seconds,
 * peak_bytes, predicted_components, error_pct, reached_step, status, ...).
 */
public final class Report {
    public static final int SCHEMA_VERSION = 1;

    /** One context length. Fill the fields, then {@link #toJson()}; required keys are always written. */
    public static final class Run {
        public int ctx;
        public long predictedBytes;
        /** Peak resident bytes (VmHWM or sampled maximum); null if the run measured nothing. */
        public Long peakBytes;
        public long runtimeBaselineBytes;
        public Double tokensPerS;
        public Double rooflineTokensPerS;
        public Double latencyP50Ms;
        public Double latencyP90Ms;
        public boolean fits;
        public String status = "ok";
        /** Extra latency numbers (p99, mean, n) written inside latency_ms. */
        public final Map<String, Object> latencyExtra = new LinkedHashMap<>();
        /** Extras written after the required keys, in insertion order. */
        public final Map<String, Object> extra = new LinkedHashMap<>();

        /** peak - baseline, or null without a peak. */
        public Long measuredBytes() {
            return peakBytes == null ? null : peakBytes - runtimeBaselineBytes;
        }

        /** (measured - predicted) / predicted * 100, or null. */
        public Double errorPct() {
            Long m = measuredBytes();
            return m == null || predictedBytes <= 0 ? null : (m - predictedBytes) * 100.0 / predictedBytes;
        }

        /** Fills tokens/s and the latency percentiles from decode timings. */
        public Run decode(TokenRate rate) {
            tokensPerS = rate.tokensPerSecond();
            latencyP50Ms = rate.percentileMs(50);
            latencyP90Ms = rate.percentileMs(90);
            latencyExtra.put("p99", round(rate.percentileMs(99), 3));
            latencyExtra.put("mean", round(rate.meanMs(), 3));
            latencyExtra.put("n", (long) rate.calls());
            return this;
        }

        public Map<String, Object> toJson() {
            if (ctx < 1) {
                throw new IllegalStateException("a run needs ctx >= 1");
            }
            Map<String, Object> m = new LinkedHashMap<>();
            m.put("ctx", (long) ctx);
            m.put("predicted_bytes", predictedBytes);
            m.put("measured_bytes", measuredBytes());
            m.put("runtime_baseline_bytes", runtimeBaselineBytes);
            m.put("tokens_per_s", round(tokensPerS, 3));
            m.put("roofline_tokens_per_s", round(rooflineTokensPerS, 3));
            Map<String, Object> lat = new LinkedHashMap<>();
            lat.put("p50", round(latencyP50Ms, 3));
            lat.put("p90", round(latencyP90Ms, 3));
            for (Map.Entry<String, Object> e : latencyExtra.entrySet()) {
                if (!lat.containsKey(e.getKey())) {
                    lat.put(e.getKey(), e.getValue());
                }
            }
            m.put("latency_ms", lat);
            m.put("fits", fits);
            m.put("peak_bytes", peakBytes);
            Double err = errorPct();
            m.put("error_pct", round(err, 2));
            m.put("status", status);
            for (Map.Entry<String, Object> e : extra.entrySet()) {
                if (m.containsKey(e.getKey())) {
                    throw new IllegalArgumentException("run extra '" + e.getKey() + "' would replace a field the "
                            + "report writes itself");
                }
                m.put(e.getKey(), e.getValue());
            }
            return m;
        }
    }

    private final String artifact;
    private final String runtime;
    private final Map<String, Object> host;
    private final List<Run> runs = new ArrayList<>();
    private final Map<String, Object> extra = new LinkedHashMap<>();

    public Report(String artifact, String runtime, Map<String, Object> host) {
        if (artifact == null || artifact.isEmpty() || runtime == null || runtime.isEmpty()) {
            throw new IllegalArgumentException("a report needs an artifact and a runtime");
        }
        if (host == null || !(host.get("kind") instanceof String)) {
            throw new IllegalArgumentException("host needs a 'kind' (e.g. 'android', 'linux-x86_64')");
        }
        this.artifact = artifact;
        this.runtime = runtime;
        this.host = new LinkedHashMap<>(host);
    }

    public Run addRun(Run r) {
        runs.add(r);
        return r;
    }

    public List<Run> runs() {
        return Collections.unmodifiableList(runs);
    }

    /** Top-level extras (model, created_utc, complete, ...), written after the required keys. */
    public Map<String, Object> extra() {
        return extra;
    }

    public Map<String, Object> toJson() {
        if (runs.isEmpty()) {
            throw new IllegalStateException("a report needs at least one run");
        }
        Map<String, Object> m = new LinkedHashMap<>();
        m.put("schema_version", (long) SCHEMA_VERSION);
        m.put("artifact", artifact);
        m.put("runtime", runtime);
        m.put("host", host);
        List<Object> rs = new ArrayList<>();
        for (Run r : runs) {
            rs.add(r.toJson());
        }
        m.put("runs", rs);
        for (Map.Entry<String, Object> e : extra.entrySet()) {
            if (!m.containsKey(e.getKey())) {
                m.put(e.getKey(), e.getValue());
            }
        }
        return m;
    }

    public String toJsonText() {
        return Json.pretty(toJson());
    }

    /** Writes the report atomically (a reader polling for the file never sees half of it). */
    public void write(File f) throws IOException {
        IO.writeAtomically(f, toJsonText());
    }

    /** Roofline decode rate: bandwidth / bytes read per token (weights + state), or null if bandwidth is unknown. */
    public static Double roofline(Double bandwidthBytesPerS, long bytesPerToken) {
        if (bandwidthBytesPerS == null || bandwidthBytesPerS <= 0 || bytesPerToken <= 0) {
            return null;
        }
        return bandwidthBytesPerS / bytesPerToken;
    }

    static Double round(Double v, int places) {
        if (v == null || v.isNaN() || v.isInfinite()) {
            return null;
        }
        double f = Math.pow(10, places);
        return Math.round(v * f) / f;
    }
}
