package org.edgekv.core;

/** One clear line for the user: what is wrong and where (a file, a manifest path, a tensor name). */
public class EdgekvException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    public EdgekvException(String message) {
        super(message);
    }

    public EdgekvException(String message, Throwable cause) {
        super(message, cause);
    }
}
