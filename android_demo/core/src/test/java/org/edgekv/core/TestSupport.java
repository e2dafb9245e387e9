package org.edgekv.core;

import java.io.File;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.StandardCopyOption;

/** Paths the tests share (run_core_tests.sh sets the properties; the defaults work from android_demo/). */
final class TestSupport {
    private TestSupport() {}

    static File resources() {
        return new File(System.getProperty("edgekv.test.resources", "core/src/test/resources"));
    }

    /** The realistic export fixture: smollm2-135m, strategy kv (fp16), max_ctx 512, onnx + pte. */
    static File fixtureExport() {
        return new File(resources(), "smollm2-135m-kv");
    }

    static File reportSchema() {
        return new File(System.getProperty("edgekv.report.schema", "../edgekv/profile/report.schema.json"));
    }

    /** A fresh empty folder under the build folder. */
    static File tmpDir(String name) throws IOException {
        File root = new File(System.getProperty("edgekv.test.tmp", "core/build/tmp"));
        File d = new File(root, name + "-" + System.nanoTime());
        if (!d.mkdirs()) {
            throw new IOException("cannot create " + d);
        }
        return d;
    }

    static File copyDir(File from, File to) throws IOException {
        File[] files = from.listFiles();
        if (files == null) {
            throw new IOException("cannot list " + from);
        }
        for (File f : files) {
            Files.copy(f.toPath(), new File(to, f.getName()).toPath(), StandardCopyOption.REPLACE_EXISTING);
        }
        return to;
    }

    static Manifest fixtureManifest() {
        return Manifest.load(fixtureExport());
    }
}
