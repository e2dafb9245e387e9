package org.edgekv.core;

import java.io.File;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The benchmark's settings, from string key/values (the app's intent extras; `adb shell am start ... --es KEY VALUE`).
 *
 * <pre>
 * export_dir             export folder on the device     default /data/local/tmp/edgekv/NAME
 * name                   export name for the default      default "model"
 * runtime                ort | executorch                 default: the manifest's first artifact
 * ctx                    context length(s), "512" or "128,512"   default: the export's max_ctx
 * steps                  decode steps per run             default 64 (the prompt is ctx - steps tokens)
 * threads                runtime threads, 0 = its default default 0
 * prefill_chunk          most tokens per ONNX call        default: the export's recorded size, else 128
 * verify                 check every file's sha256 first  default true
 * seed                   prompt token seed                default 0
 * load_mode              executorch: mmap | file          default mmap
 * sample_ms              memory sampling period           default 20
 * bandwidth_bytes_per_s  for the roofline (the host passes its device profile's)   default: none (roofline null)
 * predicted_bytes        the planner's prediction         default: manifest weights.bytes + state.bytes
 * budget_bytes           memory budget for "fits"         default: none (fits = the run finished)
 * device                 a device profile id for the report's host.device   default: Build model
 * report                 report file name                 default report.json
 * </pre>
 */
public final class BenchmarkArgs {
    public static final String DEFAULT_ROOT = "/data/local/tmp/edgekv/";
    public static final String[] KEYS = {"export_dir", "name", "runtime", "ctx", "steps", "threads", "prefill_chunk",
        "verify", "seed", "load_mode", "sample_ms", "bandwidth_bytes_per_s", "predicted_bytes", "budget_bytes",
        "device", "report"};

    public File exportDir;
    /** "ort" or "executorch"; null = the manifest's first artifact. */
    public String runtime;
    /** Empty = [max_ctx]. */
    public List<Integer> ctxs = new ArrayList<>();
    public int steps = 64;
    public int threads = 0;
    /** null: the export's recorded ONNX call size (deployment.formats.onnx.prefill_chunk), else 128. */
    public Integer prefillChunk = null;
    public boolean verify = true;
    public long seed = 0;
    public String loadMode = "mmap";
    public long sampleMs = 20;
    public Double bandwidthBytesPerS;
    public Long predictedBytes;
    public Long budgetBytes;
    public String device;
    public String reportName = "report.json";

    public static BenchmarkArgs fromExtras(Map<String, String> extras) {
        Map<String, String> x = new LinkedHashMap<>();
        for (Map.Entry<String, String> e : extras.entrySet()) {
            if (e.getValue() != null) {
                x.put(e.getKey(), e.getValue().trim());
            }
        }
        BenchmarkArgs a = new BenchmarkArgs();
        String name = x.containsKey("name") ? x.get("name") : "model";
        if (name.isEmpty() || name.contains("/")) {
            throw new EdgekvException("name '" + name + "': give a folder name under " + DEFAULT_ROOT
                    + " (or a full export_dir)");
        }
        a.exportDir = new File(x.containsKey("export_dir") ? x.get("export_dir") : DEFAULT_ROOT + name);
        if (x.containsKey("runtime")) {
            a.runtime = runtime(x.get("runtime"));
        }
        if (x.containsKey("ctx")) {
            for (String part : x.get("ctx").split(",")) {
                if (!part.trim().isEmpty()) {
                    a.ctxs.add((int) integer("ctx", part.trim(), 2, Integer.MAX_VALUE));
                }
            }
            if (a.ctxs.isEmpty()) {
                throw new EdgekvException("ctx '" + x.get("ctx") + "': give one or more context lengths, e.g. 512 "
                        + "or 128,512");
            }
        }
        if (x.containsKey("steps")) {
            a.steps = (int) integer("steps", x.get("steps"), 1, Integer.MAX_VALUE);
        }
        if (x.containsKey("threads")) {
            a.threads = (int) integer("threads", x.get("threads"), 0, 256);
        }
        if (x.containsKey("prefill_chunk")) {
            a.prefillChunk = (int) integer("prefill_chunk", x.get("prefill_chunk"), 1, Integer.MAX_VALUE);
        }
        if (x.containsKey("verify")) {
            a.verify = bool("verify", x.get("verify"));
        }
        if (x.containsKey("seed")) {
            a.seed = integer("seed", x.get("seed"), Long.MIN_VALUE, Long.MAX_VALUE);
        }
        if (x.containsKey("load_mode")) {
            String m = x.get("load_mode").toLowerCase(java.util.Locale.ROOT);
            if (!m.equals("mmap") && !m.equals("file")) {
                throw new EdgekvException("load_mode '" + x.get("load_mode") + "': use mmap or file");
            }
            a.loadMode = m;
        }
        if (x.containsKey("sample_ms")) {
            a.sampleMs = integer("sample_ms", x.get("sample_ms"), 1, 60_000);
        }
        if (x.containsKey("bandwidth_bytes_per_s")) {
            try {
                a.bandwidthBytesPerS = Double.parseDouble(x.get("bandwidth_bytes_per_s"));
            } catch (NumberFormatException e) {
                throw new EdgekvException("bandwidth_bytes_per_s '" + x.get("bandwidth_bytes_per_s")
                        + "': not a number");
            }
            if (!(a.bandwidthBytesPerS > 0)) {
                throw new EdgekvException("bandwidth_bytes_per_s must be positive");
            }
        }
        if (x.containsKey("predicted_bytes")) {
            a.predictedBytes = integer("predicted_bytes", x.get("predicted_bytes"), 0, Long.MAX_VALUE);
        }
        if (x.containsKey("budget_bytes")) {
            a.budgetBytes = integer("budget_bytes", x.get("budget_bytes"), 1, Long.MAX_VALUE);
        }
        if (x.containsKey("device")) {
            a.device = x.get("device");
        }
        if (x.containsKey("report")) {
            String r = x.get("report");
            if (r.isEmpty() || r.contains("/")) {
                throw new EdgekvException("report '" + r + "': give a file name (it goes into the app's files "
                        + "folder)");
            }
            a.reportName = r;
        }
        return a;
    }

    static String runtime(String v) {
        String s = v.toLowerCase(java.util.Locale.ROOT);
        if (s.equals("ort") || s.equals("onnx") || s.equals("onnxruntime")) {
            return "ort";
        }
        if (s.equals("executorch") || s.equals("et") || s.equals("pte")) {
            return "executorch";
        }
        throw new EdgekvException("runtime '" + v + "': use ort (ONNX Runtime, model.onnx) or executorch (model.pte)");
    }

    private static long integer(String key, String v, long min, long max) {
        long n;
        try {
            n = Long.parseLong(v);
        } catch (NumberFormatException e) {
            throw new EdgekvException(key + " '" + v + "': not an integer");
        }
        if (n < min || n > max) {
            throw new EdgekvException(key + " " + n + ": must be " + (max == Long.MAX_VALUE || max == Integer.MAX_VALUE
                    ? "at least " + min : "between " + min + " and " + max));
        }
        return n;
    }

    private static boolean bool(String key, String v) {
        String s = v.toLowerCase(java.util.Locale.ROOT);
        if (s.equals("true") || s.equals("1") || s.equals("yes")) {
            return true;
        }
        if (s.equals("false") || s.equals("0") || s.equals("no")) {
            return false;
        }
        throw new EdgekvException(key + " '" + v + "': use true or false");
    }

    /** "onnx" or "pte": the artifact format this run uses for manifest m. */
    public String format(Manifest m) {
        if (runtime == null) {
            return m.artifacts.get(0).format;
        }
        return runtime.equals("ort") ? "onnx" : "pte";
    }

    /** The context lengths to run, checked against the export (each needs ctx - steps >= 1 prompt tokens). */
    public List<Integer> contexts(Manifest m) {
        List<Integer> out = ctxs.isEmpty() ? Collections.singletonList(m.maxCtx) : ctxs;
        for (int c : out) {
            if (c > m.maxCtx) {
                throw new EdgekvException("ctx " + c + " is beyond this export's max_ctx " + m.maxCtx
                        + " (export again with a larger --max-ctx)");
            }
            if (c - steps < 1) {
                throw new EdgekvException("ctx " + c + " with " + steps + " decode steps leaves no prompt; pass a "
                        + "larger ctx or fewer steps");
            }
        }
        return out;
    }
}
