package org.edgekv.core;

import java.util.Arrays;

/**
 * Per-token decode latencies -> p50/p90 (ms) and tokens/s.
 *
 * <p>Percentiles interpolate linearly between the closest ranks, as numpy.percentile does by default (so the Python
 * side and the app agree on the same numbers): for sorted x[0..n-1] and q in [0, 100], h = (n - 1) * q / 100 and the
 * result is x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]).
 *
 * <p>tokens/s is tokens / total seconds (not 1 / mean of rates), so a slow outlier weighs as much as it cost.
 */
public final class TokenRate {
    private long[] nanos = new long[64];
    private int n;
    private long tokens;

    /** One call that produced {@code tokens} tokens in {@code elapsedNanos}. */
    public void add(long elapsedNanos, int tokens) {
        if (elapsedNanos < 0 || tokens < 0) {
            throw new IllegalArgumentException("negative time or token count");
        }
        if (n == nanos.length) {
            nanos = Arrays.copyOf(nanos, n * 2);
        }
        nanos[n++] = elapsedNanos;
        this.tokens += tokens;
    }

    /** One decode token. */
    public void add(long elapsedNanos) {
        add(elapsedNanos, 1);
    }

    public int calls() {
        return n;
    }

    public long tokens() {
        return tokens;
    }

    public double totalSeconds() {
        long sum = 0;
        for (int i = 0; i < n; i++) {
            sum += nanos[i];
        }
        return sum / 1e9;
    }

    /** Tokens per second, or null with no time measured. */
    public Double tokensPerSecond() {
        double s = totalSeconds();
        return s > 0 ? tokens / s : null;
    }

    /** Per-call latency percentile in milliseconds (q in 0..100), or null with no calls. */
    public Double percentileMs(double q) {
        if (n == 0) {
            return null;
        }
        double[] ms = new double[n];
        for (int i = 0; i < n; i++) {
            ms[i] = nanos[i] / 1e6;
        }
        Arrays.sort(ms);
        return percentile(ms, q);
    }

    public Double meanMs() {
        return n == 0 ? null : totalSeconds() * 1e3 / n;
    }

    /** numpy.percentile(sorted, q) with the default linear method; sorted must be ascending and non-empty. */
    public static double percentile(double[] sorted, double q) {
        if (sorted.length == 0) {
            throw new IllegalArgumentException("no values");
        }
        if (q < 0 || q > 100) {
            throw new IllegalArgumentException("percentile " + q + " is outside 0..100");
        }
        double h = (sorted.length - 1) * q / 100.0;
        int lo = (int) Math.floor(h);
        int hi = Math.min(lo + 1, sorted.length - 1);
        return sorted[lo] + (h - lo) * (sorted[hi] - sorted[lo]);
    }
}
