package org.edgekv.demo;

import android.app.ActivityManager;
import android.content.Context;
import android.os.Build;
import android.os.Debug;
import android.os.SystemClock;
import java.io.File;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.edgekv.core.BenchmarkArgs;
import org.edgekv.core.IO;
import org.edgekv.core.MemorySampler;

/** The report's host object on Android, and the memory probes sampled next to VmRSS. */
final class AndroidHost {
    private AndroidHost() {}

    static Map<String, Object> describe(Context ctx, BenchmarkArgs args, List<Integer> trimLevels) {
        ActivityManager am = (ActivityManager) ctx.getSystemService(Context.ACTIVITY_SERVICE);
        ActivityManager.MemoryInfo mi = new ActivityManager.MemoryInfo();
        am.getMemoryInfo(mi);
        Map<String, Object> h = new LinkedHashMap<>();
        h.put("kind", "android");
        h.put("device", args.device != null ? args.device : Build.MANUFACTURER + " " + Build.MODEL);
        h.put("ram_bytes", mi.totalMem);
        h.put("bandwidth_bytes_per_s", args.bandwidthBytesPerS);
        h.put("cores", (long) Runtime.getRuntime().availableProcessors());
        h.put("model", Build.MODEL);
        h.put("manufacturer", Build.MANUFACTURER);
        h.put("soc", Build.VERSION.SDK_INT >= 31 ? Build.SOC_MODEL : Build.HARDWARE);
        h.put("sdk", (long) Build.VERSION.SDK_INT);
        h.put("release", Build.VERSION.RELEASE);
        h.put("abi", Build.SUPPORTED_ABIS.length > 0 ? Build.SUPPORTED_ABIS[0] : null);
        // ActivityManager.MemoryInfo at start: what lmkd will let this app have is roughly availMem - threshold
        h.put("avail_mem_bytes", mi.availMem);
        h.put("threshold_bytes", mi.threshold);
        h.put("low_memory", mi.lowMemory);
        h.put("memory_class_mb", (long) am.getMemoryClass());
        h.put("large_memory_class_mb", (long) am.getLargeMemoryClass());
        try {
            Map<String, Long> meminfo = MemorySampler.parseMeminfo(IO.readText(new File("/proc/meminfo")));
            h.put("mem_available_bytes", meminfo.get("MemAvailable"));
            h.put("swap_total_bytes", meminfo.get("SwapTotal"));
        } catch (java.io.IOException ignored) {
            // not readable on this build
        }
        h.put("trim_memory_levels", trimLevels); // onTrimMemory levels seen while running (filled in later)
        return h;
    }

    /**
     * PSS (Debug.getPss, the number Android's own tools and lmkd accounting use) and ActivityManager's availMem.
     * Both are slower than reading /proc/self/status, so each is refreshed at most every 250 ms.
     */
    static MemorySampler.Probe[] probes(Context ctx) {
        final ActivityManager am = (ActivityManager) ctx.getSystemService(Context.ACTIVITY_SERVICE);
        return new MemorySampler.Probe[] {
            new Throttled("pss", 250) {
                @Override
                long measure() {
                    return Debug.getPss() * 1024; // kB -> bytes
                }
            },
            new Throttled("avail_mem", 250) {
                @Override
                long measure() {
                    ActivityManager.MemoryInfo mi = new ActivityManager.MemoryInfo();
                    am.getMemoryInfo(mi);
                    return mi.availMem;
                }
            },
        };
    }

    private abstract static class Throttled implements MemorySampler.Probe {
        private final String name;
        private final long periodMs;
        private long lastAt = -1;
        private long last = -1;

        Throttled(String name, long periodMs) {
            this.name = name;
            this.periodMs = periodMs;
        }

        abstract long measure();

        @Override
        public String name() {
            return name;
        }

        @Override
        public synchronized long bytes() {
            long now = SystemClock.elapsedRealtime();
            if (lastAt < 0 || now - lastAt >= periodMs) {
                last = measure();
                lastAt = now;
            }
            return last;
        }
    }
}
