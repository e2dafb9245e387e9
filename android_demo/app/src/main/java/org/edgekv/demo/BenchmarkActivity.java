package org.edgekv.demo;

import android.app.Activity;
import android.content.Intent;
import android.os.Bundle;
import android.os.Handler;
import android.os.Looper;
import android.util.Log;
import android.view.WindowManager;
import android.widget.ScrollView;
import android.widget.TextView;
import java.io.File;
import java.io.IOException;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.atomic.AtomicBoolean;
import org.edgekv.core.Backend;
import org.edgekv.core.Benchmark;
import org.edgekv.core.BenchmarkArgs;
import org.edgekv.core.IO;
import org.edgekv.core.Manifest;
import org.edgekv.core.MemorySampler;

/**
 * Runs an edgekv export on this phone and writes report.json (edgekv/profile/report.schema.json) into the app's
 * files folder, then copies it to the app's external files folder, which adb can pull without root:
 *
 * <pre>
 * adb shell am start -S -W -n org.edgekv.demo/.BenchmarkActivity \
 *     --es export_dir /data/local/tmp/edgekv/smollm2 --es runtime ort --es ctx 512 --es steps 64
 * adb logcat -s edgekv            # "EDGEKV_REPORT path" lines, then "EDGEKV_DONE ok" or "EDGEKV_DONE error: ..."
 * adb pull /sdcard/Android/data/org.edgekv.demo/files/report.json
 * </pre>
 *
 * All logic that is not Android-specific lives in org.edgekv.core (android_demo/core), tested on the host.
 */
public class BenchmarkActivity extends Activity {
    static final String TAG = "edgekv";
    private static final AtomicBoolean RUNNING = new AtomicBoolean(false);

    private final List<Integer> trimLevels = new CopyOnWriteArrayList<>();
    private TextView text;
    private final Handler ui = new Handler(Looper.getMainLooper());

    @Override
    protected void onCreate(Bundle savedInstanceState) {
        super.onCreate(savedInstanceState);
        getWindow().addFlags(WindowManager.LayoutParams.FLAG_KEEP_SCREEN_ON); // no doze/throttling mid-run
        text = new TextView(this);
        text.setTextIsSelectable(true);
        text.setPadding(24, 24, 24, 24);
        ScrollView scroll = new ScrollView(this);
        scroll.addView(text);
        setContentView(scroll);
        start(getIntent());
    }

    @Override
    protected void onNewIntent(Intent intent) {
        super.onNewIntent(intent);
        setIntent(intent);
        start(intent);
    }

    @Override
    public void onTrimMemory(int level) {
        super.onTrimMemory(level);
        trimLevels.add(level);
        Log.w(TAG, "onTrimMemory level " + level);
    }

    private void log(final String line) {
        Log.i(TAG, line);
        ui.post(new Runnable() {
            @Override
            public void run() {
                text.append(line + "\n");
            }
        });
    }

    /** Intent extras as strings (--es, --ei, --el, --ez all work). */
    @SuppressWarnings("deprecation")
    static Map<String, String> extras(Intent intent) {
        Map<String, String> m = new LinkedHashMap<>();
        Bundle b = intent == null ? null : intent.getExtras();
        if (b != null) {
            for (String k : b.keySet()) {
                Object v = b.get(k);
                if (v != null) {
                    m.put(k, String.valueOf(v));
                }
            }
        }
        return m;
    }

    private void start(Intent intent) {
        final Map<String, String> extras = extras(intent);
        if (!RUNNING.compareAndSet(false, true)) {
            log("a benchmark is already running; start with `am start -S` to stop it first");
            return;
        }
        Thread t = new Thread(new Runnable() {
            @Override
            public void run() {
                try {
                    benchmark(extras);
                } finally {
                    RUNNING.set(false);
                }
            }
        }, "edgekv-benchmark");
        t.start();
    }

    private File[] reportFiles(String name) {
        File ext = getExternalFilesDir(null);
        return ext == null ? new File[] {new File(getFilesDir(), name)}
                : new File[] {new File(getFilesDir(), name), new File(ext, name)};
    }

    private void benchmark(Map<String, String> extras) {
        String reportName = "report.json";
        Backend<?> backend = null;
        try {
            log("edgekv benchmark, extras " + extras);
            BenchmarkArgs args = BenchmarkArgs.fromExtras(extras);
            reportName = args.reportName;
            for (File f : reportFiles(reportName)) {
                deleteQuietly(f);
                deleteQuietly(new File(f.getParentFile(), errorName(reportName)));
            }
            Manifest m = Benchmark.prepare(args, new Benchmark.Log() {
                @Override
                public void line(String s) {
                    log(s);
                }
            });
            backend = args.format(m).equals("onnx") ? new OrtBackend() : new ExecuTorchBackend();
            log("export " + args.exportDir + ": " + m.modelName + " (" + m.strategyLabel + "), max_ctx " + m.maxCtx
                    + ", " + args.format(m) + ", contexts " + args.contexts(m) + ", " + args.steps + " steps");
            File[] files = reportFiles(reportName);
            runWith(backend, args, m, files[0]);
            if (files.length > 1) {
                IO.writeAtomically(files[1], IO.readText(files[0]));
            }
            for (File f : files) {
                log("EDGEKV_REPORT " + f.getAbsolutePath());
            }
            log("EDGEKV_DONE ok");
        } catch (Throwable e) {
            String msg = e.getMessage() != null ? e.getMessage() : e.getClass().getName();
            Log.e(TAG, "benchmark failed", e);
            for (File f : reportFiles(reportName)) {
                try {
                    IO.writeAtomically(new File(f.getParentFile(), errorName(reportName)), msg + "\n");
                } catch (IOException ignored) {
                    // nothing more to do
                }
            }
            log("EDGEKV_DONE error: " + msg.split("\n", 2)[0]);
        } finally {
            if (backend != null) {
                backend.close();
            }
        }
    }

    private <T> void runWith(Backend<T> backend, BenchmarkArgs args, Manifest m, File report) throws Exception {
        MemorySampler mem = new MemorySampler();
        Map<String, Object> host = AndroidHost.describe(this, args, trimLevels);
        MemorySampler.Probe[] probes = AndroidHost.probes(this);
        Benchmark.run(args, m, backend, mem, host, probes, report, new Benchmark.Log() {
            @Override
            public void line(String s) {
                log(s);
            }
        });
    }

    static String errorName(String reportName) {
        return reportName.replaceAll("\\.json$", "") + ".error.txt";
    }

    private static void deleteQuietly(File f) {
        if (f.exists() && !f.delete()) {
            Log.w(TAG, "could not delete old " + f);
        }
    }
}
