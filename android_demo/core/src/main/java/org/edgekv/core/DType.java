package org.edgekv.core;

/** The element types a manifest names, with their sizes (the same table as edgekv.strategies.DTYPE_BYTES). */
public enum DType {
    FLOAT32("float32", 4),
    FLOAT16("float16", 2),
    BFLOAT16("bfloat16", 2),
    FLOAT8_E4M3FN("float8_e4m3fn", 1),
    INT64("int64", 8),
    INT32("int32", 4),
    INT8("int8", 1),
    UINT8("uint8", 1);

    public final String manifestName;
    public final int bytes;

    DType(String manifestName, int bytes) {
        this.manifestName = manifestName;
        this.bytes = bytes;
    }

    public static DType of(String name) {
        for (DType d : values()) {
            if (d.manifestName.equals(name)) {
                return d;
            }
        }
        StringBuilder known = new StringBuilder();
        for (DType d : values()) {
            known.append(known.length() == 0 ? "" : ", ").append(d.manifestName);
        }
        throw new EdgekvException("unknown dtype '" + name + "' (known: " + known + ")");
    }

    @Override
    public String toString() {
        return manifestName;
    }
}
