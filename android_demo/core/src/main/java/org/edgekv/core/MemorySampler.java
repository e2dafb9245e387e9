package org.edgekv.core;

import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.nio.charset.StandardCharsets;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * Resident memory of this process from /proc/self/status (Linux and Android alike): VmRSS now, VmHWM (the kernel's
 * peak of VmRSS), and a background thread that samples VmRSS plus optional extra probes (the app adds PSS from
 * android.os.Debug and ActivityManager's availMem) while a run is going.
 *
 * <p>VmHWM is reset by writing "5" to /proc/self/clear_refs (Linux 4.0+). Where that is refused (some Android
 * SELinux policies), the sampled maximum of VmRSS stands in for the peak; {@link #resetPeak()} says which.
 */
public final class MemorySampler {

    /** The /proc/self/status fields this class reads, in bytes; -1 where the kernel did not print the field. */
    public static final class Status {
        public final long vmRss;
        public final long vmHwm;
        public final long vmPeak;
        public final long vmSize;
        public final long rssAnon;
        public final long rssFile;
        public final long vmSwap;
        public final int threads;

        Status(Map<String, Long> kb, int threads) {
            vmRss = bytes(kb, "VmRSS");
            vmHwm = bytes(kb, "VmHWM");
            vmPeak = bytes(kb, "VmPeak");
            vmSize = bytes(kb, "VmSize");
            rssAnon = bytes(kb, "RssAnon");
            rssFile = bytes(kb, "RssFile");
            vmSwap = bytes(kb, "VmSwap");
            this.threads = threads;
        }

        private static long bytes(Map<String, Long> kb, String key) {
            Long v = kb.get(key);
            return v == null ? -1 : v * 1024;
        }
    }

    /** An extra number sampled alongside VmRSS (e.g. PSS); return a negative value when unavailable. */
    public interface Probe {
        String name();

        long bytes();
    }

    /** What one sampling period saw. */
    public static final class Summary {
        public final long maxRss;
        public final long minRss;
        public final int samples;
        public final Map<String, Long> maxProbe;
        public final Map<String, Long> minProbe;
        public final double seconds;

        Summary(long maxRss, long minRss, int samples, Map<String, Long> maxProbe, Map<String, Long> minProbe,
                double seconds) {
            this.maxRss = maxRss;
            this.minRss = minRss;
            this.samples = samples;
            this.maxProbe = maxProbe;
            this.minProbe = minProbe;
            this.seconds = seconds;
        }
    }

    private final File statusFile;
    private final File clearRefsFile;

    private volatile boolean running;
    private Thread thread;
    private long maxRss;
    private long minRss;
    private int samples;
    private long startNanos;
    private final Map<String, Long> maxProbe = new LinkedHashMap<>();
    private final Map<String, Long> minProbe = new LinkedHashMap<>();

    /** This process: /proc/self/status and /proc/self/clear_refs. */
    public MemorySampler() {
        this(new File("/proc/self/status"), new File("/proc/self/clear_refs"));
    }

    public MemorySampler(File statusFile, File clearRefsFile) {
        this.statusFile = statusFile;
        this.clearRefsFile = clearRefsFile;
    }

    /** Parses the text of a /proc/PID/status file ("VmRSS:\t  123456 kB" lines). Fields without "kB" are skipped. */
    public static Status parseStatus(String text) {
        Map<String, Long> kb = new LinkedHashMap<>();
        int threads = -1;
        for (String line : text.split("\n")) {
            int colon = line.indexOf(':');
            if (colon <= 0) {
                continue;
            }
            String key = line.substring(0, colon).trim();
            String rest = line.substring(colon + 1).trim();
            if (key.equals("Threads")) {
                try {
                    threads = Integer.parseInt(rest);
                } catch (NumberFormatException ignored) {
                    // leave -1
                }
                continue;
            }
            if (!rest.endsWith("kB")) {
                continue;
            }
            try {
                kb.put(key, Long.parseLong(rest.substring(0, rest.length() - 2).trim()));
            } catch (NumberFormatException ignored) {
                // not a size line
            }
        }
        return new Status(kb, threads);
    }

    /** /proc/meminfo text -> {MemTotal, MemAvailable, ...} in bytes. */
    public static Map<String, Long> parseMeminfo(String text) {
        Map<String, Long> out = new LinkedHashMap<>();
        for (String line : text.split("\n")) {
            int colon = line.indexOf(':');
            if (colon <= 0) {
                continue;
            }
            String rest = line.substring(colon + 1).trim();
            long mult = 1;
            if (rest.endsWith("kB")) {
                rest = rest.substring(0, rest.length() - 2).trim();
                mult = 1024;
            }
            try {
                out.put(line.substring(0, colon).trim(), Long.parseLong(rest) * mult);
            } catch (NumberFormatException ignored) {
                // skip
            }
        }
        return out;
    }

    /** Reads the status file now. */
    public Status read() {
        try {
            return parseStatus(IO.readText(statusFile));
        } catch (IOException e) {
            throw new EdgekvException(statusFile + ": cannot read it (" + e.getMessage() + "); memory cannot be "
                    + "measured on this system");
        }
    }

    /** VmRSS now, in bytes. */
    public long rss() {
        long v = read().vmRss;
        if (v < 0) {
            throw new EdgekvException(statusFile + " has no VmRSS line");
        }
        return v;
    }

    /**
     * Resets VmHWM to the current VmRSS. Returns true when the kernel took it (VmHWM afterwards is no higher than
     * VmRSS was just before plus what the process grew in between); false when the write was refused or had no
     * effect, in which case use the sampled maximum as the peak.
     */
    public boolean resetPeak() {
        Status before;
        Status after;
        try {
            before = read();
            try (OutputStream out = new FileOutputStream(clearRefsFile)) {
                out.write("5".getBytes(StandardCharsets.US_ASCII));
            }
            after = read();
        } catch (IOException | SecurityException | EdgekvException e) {
            return false;
        }
        if (after.vmHwm < 0 || after.vmRss < 0) {
            return false;
        }
        // effective if the mark came down to (about) the current RSS, or was already equal to it
        return after.vmHwm <= Math.max(after.vmRss, before.vmRss) + (1 << 20) || before.vmHwm == before.vmRss;
    }

    /** Starts sampling VmRSS (and probes) every periodMs on a daemon thread; restarts the counters. */
    public void start(final long periodMs, final Probe... probes) {
        stop();
        synchronized (this) {
            maxRss = Long.MIN_VALUE;
            minRss = Long.MAX_VALUE;
            samples = 0;
            maxProbe.clear();
            minProbe.clear();
            startNanos = System.nanoTime();
            running = true;
        }
        sampleOnce(probes);
        Thread t = new Thread(new Runnable() {
            @Override
            public void run() {
                while (running) {
                    try {
                        Thread.sleep(Math.max(1, periodMs));
                    } catch (InterruptedException e) {
                        return;
                    }
                    sampleOnce(probes);
                }
            }
        }, "edgekv-memory-sampler");
        t.setDaemon(true);
        synchronized (this) {
            thread = t;
        }
        t.start();
    }

    private void sampleOnce(Probe[] probes) {
        long rss;
        try {
            rss = rss();
        } catch (EdgekvException e) {
            return;
        }
        synchronized (this) {
            maxRss = Math.max(maxRss, rss);
            minRss = Math.min(minRss, rss);
            samples++;
        }
        for (Probe p : probes) {
            long v;
            try {
                v = p.bytes();
            } catch (RuntimeException e) {
                continue;
            }
            if (v < 0) {
                continue;
            }
            synchronized (this) {
                Long mx = maxProbe.get(p.name());
                maxProbe.put(p.name(), mx == null ? v : Math.max(mx, v));
                Long mn = minProbe.get(p.name());
                minProbe.put(p.name(), mn == null ? v : Math.min(mn, v));
            }
        }
    }

    /** Stops the thread (after one last sample) and returns what it saw; null if it was not running. */
    public Summary stop() {
        Thread t;
        synchronized (this) {
            if (!running) {
                return null;
            }
            running = false;
            t = thread;
            thread = null;
        }
        if (t != null) {
            t.interrupt();
            try {
                t.join(1000);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }
        sampleOnce(new Probe[0]);
        synchronized (this) {
            return new Summary(maxRss, minRss, samples, new LinkedHashMap<>(maxProbe), new LinkedHashMap<>(minProbe),
                    (System.nanoTime() - startNanos) / 1e9);
        }
    }
}
