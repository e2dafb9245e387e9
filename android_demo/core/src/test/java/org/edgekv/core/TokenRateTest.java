package org.edgekv.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;

import org.junit.Test;

public class TokenRateTest {
    private static final double EPS = 1e-9;

    @Test
    public void percentilesByHand() {
        // five tokens: 10, 20, 30, 40, 50 ms (added out of order)
        TokenRate r = new TokenRate();
        for (long ms : new long[] {40, 10, 50, 30, 20}) {
            r.add(ms * 1_000_000L);
        }
        // p50: h = 4 * 0.5 = 2 -> 30 ms; p90: h = 4 * 0.9 = 3.6 -> 40 + 0.6 * (50 - 40) = 46 ms
        assertEquals(30.0, r.percentileMs(50), EPS);
        assertEquals(46.0, r.percentileMs(90), EPS);
        assertEquals(10.0, r.percentileMs(0), EPS);
        assertEquals(50.0, r.percentileMs(100), EPS);
        assertEquals(30.0, r.meanMs(), EPS);
        // 5 tokens in 150 ms
        assertEquals(5 / 0.150, r.tokensPerSecond(), 1e-6);
        assertEquals(5, r.tokens());
    }

    @Test
    public void evenCountInterpolates() {
        double[] x = {1, 2, 3, 4};
        // numpy.percentile([1,2,3,4], 50) = 2.5, 90 -> h = 2.7 -> 3 + 0.7 = 3.7
        assertEquals(2.5, TokenRate.percentile(x, 50), EPS);
        assertEquals(3.7, TokenRate.percentile(x, 90), EPS);
        assertEquals(7.0, TokenRate.percentile(new double[] {7}, 90), EPS);
    }

    @Test
    public void tokensPerSecondCountsTokensNotCalls() {
        TokenRate prefill = new TokenRate();
        prefill.add(500_000_000L, 64);
        prefill.add(250_000_000L, 32);
        assertEquals(96 / 0.75, prefill.tokensPerSecond(), 1e-9);
        assertEquals(2, prefill.calls());
    }

    @Test
    public void emptyGivesNulls() {
        TokenRate r = new TokenRate();
        assertNull(r.tokensPerSecond());
        assertNull(r.percentileMs(50));
        assertNull(r.meanMs());
    }
}
