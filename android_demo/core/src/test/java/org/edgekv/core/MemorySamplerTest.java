package org.edgekv.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNotNull;
import static org.junit.Assert.assertTrue;
import static org.junit.Assume.assumeTrue;

import java.io.File;
import java.nio.ByteBuffer;
import java.util.Map;
import org.junit.Test;

public class MemorySamplerTest {
    /** An Android 14 app process's /proc/self/status, trimmed. */
    static final String FIXTURE = "Name:\torg.edgekv.demo\n"
            + "Umask:\t0077\n"
            + "State:\tS (sleeping)\n"
            + "Tgid:\t12345\n"
            + "VmPeak:\t 17291220 kB\n"
            + "VmSize:\t 17125124 kB\n"
            + "VmLck:\t       0 kB\n"
            + "VmHWM:\t  812344 kB\n"
            + "VmRSS:\t  701236 kB\n"
            + "RssAnon:\t  130112 kB\n"
            + "RssFile:\t  570388 kB\n"
            + "RssShmem:\t     736 kB\n"
            + "VmSwap:\t   10240 kB\n"
            + "Threads:\t27\n"
            + "Cpus_allowed_list:\t0-7\n";

    @Test
    public void parsesTheFixture() {
        MemorySampler.Status s = MemorySampler.parseStatus(FIXTURE);
        assertEquals(701236L * 1024, s.vmRss);
        assertEquals(812344L * 1024, s.vmHwm);
        assertEquals(17291220L * 1024, s.vmPeak);
        assertEquals(17125124L * 1024, s.vmSize);
        assertEquals(130112L * 1024, s.rssAnon);
        assertEquals(570388L * 1024, s.rssFile);
        assertEquals(10240L * 1024, s.vmSwap);
        assertEquals(27, s.threads);
    }

    @Test
    public void missingFieldsAreMinusOne() {
        MemorySampler.Status s = MemorySampler.parseStatus("Name:\tx\nVmRSS:\t 4 kB\n");
        assertEquals(4096L, s.vmRss);
        assertEquals(-1L, s.vmHwm);
        assertEquals(-1L, s.rssAnon);
        assertEquals(-1, s.threads);
    }

    @Test
    public void parsesMeminfo() {
        Map<String, Long> m = MemorySampler.parseMeminfo("MemTotal:        7836244 kB\nMemAvailable:    2440000 kB\n"
                + "HugePages_Total:       0\n");
        assertEquals(Long.valueOf(7836244L * 1024), m.get("MemTotal"));
        assertEquals(Long.valueOf(2440000L * 1024), m.get("MemAvailable"));
        assertEquals(Long.valueOf(0), m.get("HugePages_Total"));
    }

    private static boolean linux() {
        return new File("/proc/self/status").canRead();
    }

    @Test
    public void readsThisProcessOnLinux() {
        assumeTrue("needs /proc (Linux or Android)", linux());
        MemorySampler mem = new MemorySampler();
        MemorySampler.Status s = mem.read();
        assertTrue("VmRSS " + s.vmRss, s.vmRss > 1 << 20); // a JVM is more than 1 MiB
        assertTrue(s.vmHwm >= s.vmRss);
        assertTrue(s.vmSize >= s.vmRss);
        assertTrue(s.threads >= 1);
        assertEquals(s.vmRss, mem.rss(), 64L << 20); // the same number, give or take what the JVM did in between
    }

    @Test
    public void theSamplerSeesMemoryGrowAndThePeakCanBeReset() throws Exception {
        assumeTrue("needs /proc (Linux or Android)", linux());
        MemorySampler mem = new MemorySampler();
        long before = mem.rss();
        final long[] calls = {0};
        mem.start(2, new MemorySampler.Probe() {
            @Override
            public String name() {
                return "probe";
            }

            @Override
            public long bytes() {
                return 1000 + calls[0]++;
            }
        });
        ByteBuffer big = ByteBuffer.allocateDirect(64 << 20);
        for (int i = 0; i < big.capacity(); i += 4096) {
            big.put(i, (byte) 1); // touch every page so it becomes resident
        }
        Thread.sleep(30);
        MemorySampler.Summary sum = mem.stop();
        assertNotNull(sum);
        assertTrue("samples " + sum.samples, sum.samples >= 2);
        assertTrue("max " + sum.maxRss + " before " + before, sum.maxRss >= before + (48L << 20));
        assertTrue(sum.minRss <= sum.maxRss);
        assertTrue(sum.maxProbe.get("probe") >= 1001);
        assertEquals(Long.valueOf(1000), sum.minProbe.get("probe"));
        assertEquals(null, mem.stop()); // already stopped

        // the peak now includes the 64 MiB; after the buffer is gone and the peak is reset it need not
        long hwm = mem.read().vmHwm;
        assertTrue(hwm >= before + (48L << 20));
        boolean reset = mem.resetPeak(); // allowed or refused depending on the kernel / sandbox: must not throw
        if (reset) {
            MemorySampler.Status s = mem.read();
            assertTrue(s.vmHwm <= s.vmRss + (64L << 20));
        }
        big.put(0, (byte) 2);
    }

    @Test
    public void anUnreadableStatusFileIsOneClearError() {
        MemorySampler mem = new MemorySampler(new File("/nonexistent/status"), new File("/nonexistent/clear_refs"));
        try {
            mem.rss();
            org.junit.Assert.fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().startsWith("/nonexistent/status: cannot read it"));
        }
        assertEquals(false, mem.resetPeak()); // no exception either
    }
}
