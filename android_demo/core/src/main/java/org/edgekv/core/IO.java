package org.edgekv.core;

import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.nio.charset.StandardCharsets;

/** File helpers limited to what Android's Java has at minSdk 26 (and Java 8). */
public final class IO {
    private IO() {}

    public static byte[] readAll(File f) throws IOException {
        try (InputStream in = new FileInputStream(f)) {
            return readAll(in);
        }
    }

    public static byte[] readAll(InputStream in) throws IOException {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        byte[] buf = new byte[1 << 16];
        int n;
        while ((n = in.read(buf)) > 0) {
            out.write(buf, 0, n);
        }
        return out.toByteArray();
    }

    public static String readText(File f) throws IOException {
        return new String(readAll(f), StandardCharsets.UTF_8);
    }

    /** Writes to a sibling temporary file and renames it into place, so a reader never sees half a file. */
    public static void writeAtomically(File f, String text) throws IOException {
        File dir = f.getAbsoluteFile().getParentFile();
        if (dir != null && !dir.isDirectory() && !dir.mkdirs()) {
            throw new IOException("cannot create folder " + dir);
        }
        File tmp = new File(dir, "." + f.getName() + ".tmp");
        try (OutputStream out = new FileOutputStream(tmp)) {
            out.write(text.getBytes(StandardCharsets.UTF_8));
            out.flush();
        }
        if (!tmp.renameTo(f)) {
            if (!f.delete() || !tmp.renameTo(f)) {
                throw new IOException("cannot move " + tmp + " to " + f);
            }
        }
    }
}
