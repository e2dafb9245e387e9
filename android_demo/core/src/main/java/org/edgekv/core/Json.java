package org.edgekv.core;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * A small JSON reader/writer, no dependencies (the app must not pull a JSON library just for the manifest).
 *
 * <p>Reading gives: {@code Map<String,Object>} (LinkedHashMap, key order kept), {@code List<Object>}, {@code String},
 * {@code Long} (integers that fit), {@code BigInteger} (larger integers), {@code Double} (anything with a fraction or
 * exponent), {@code Boolean}, and {@code null}. Writing accepts the same plus other {@code Number}s; NaN and
 * infinities are written as null, since JSON has no spelling for them.
 */
public final class Json {
    private Json() {}

    /** Parses one JSON value; anything after it other than whitespace is an error. */
    public static Object parse(String text) {
        Parser p = new Parser(text);
        p.skipWs();
        Object v = p.value();
        p.skipWs();
        if (p.i != text.length()) {
            throw p.error("unexpected text after the JSON value");
        }
        return v;
    }

    /** Thrown for malformed JSON, with line and column. */
    public static final class ParseException extends EdgekvException {
        private static final long serialVersionUID = 1L;

        public ParseException(String message) {
            super(message);
        }
    }

    private static final class Parser {
        final String s;
        int i;

        Parser(String s) {
            this.s = s;
        }

        ParseException error(String what) {
            int line = 1, col = 1;
            for (int k = 0; k < i && k < s.length(); k++) {
                if (s.charAt(k) == '\n') {
                    line++;
                    col = 1;
                } else {
                    col++;
                }
            }
            return new ParseException("invalid JSON at line " + line + ", column " + col + ": " + what);
        }

        void skipWs() {
            while (i < s.length()) {
                char c = s.charAt(i);
                if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
                    i++;
                } else {
                    break;
                }
            }
        }

        Object value() {
            if (i >= s.length()) {
                throw error("unexpected end of input");
            }
            char c = s.charAt(i);
            switch (c) {
                case '{':
                    return object();
                case '[':
                    return array();
                case '"':
                    return string();
                case 't':
                    return literal("true", Boolean.TRUE);
                case 'f':
                    return literal("false", Boolean.FALSE);
                case 'n':
                    return literal("null", null);
                default:
                    if (c == '-' || (c >= '0' && c <= '9')) {
                        return number();
                    }
                    throw error("unexpected character '" + c + "'");
            }
        }

        Object literal(String word, Object v) {
            if (!s.startsWith(word, i)) {
                throw error("expected " + word);
            }
            i += word.length();
            return v;
        }

        Map<String, Object> object() {
            Map<String, Object> m = new LinkedHashMap<>();
            i++; // {
            skipWs();
            if (i < s.length() && s.charAt(i) == '}') {
                i++;
                return m;
            }
            while (true) {
                skipWs();
                if (i >= s.length() || s.charAt(i) != '"') {
                    throw error("expected a string key");
                }
                String k = string();
                skipWs();
                if (i >= s.length() || s.charAt(i) != ':') {
                    throw error("expected ':' after key \"" + k + "\"");
                }
                i++;
                skipWs();
                if (m.containsKey(k)) {
                    throw error("duplicate key \"" + k + "\"");
                }
                m.put(k, value());
                skipWs();
                if (i >= s.length()) {
                    throw error("unexpected end of input in an object");
                }
                char c = s.charAt(i++);
                if (c == '}') {
                    return m;
                }
                if (c != ',') {
                    i--;
                    throw error("expected ',' or '}'");
                }
            }
        }

        List<Object> array() {
            List<Object> a = new ArrayList<>();
            i++; // [
            skipWs();
            if (i < s.length() && s.charAt(i) == ']') {
                i++;
                return a;
            }
            while (true) {
                skipWs();
                a.add(value());
                skipWs();
                if (i >= s.length()) {
                    throw error("unexpected end of input in an array");
                }
                char c = s.charAt(i++);
                if (c == ']') {
                    return a;
                }
                if (c != ',') {
                    i--;
                    throw error("expected ',' or ']'");
                }
            }
        }

        String string() {
            i++; // opening quote
            StringBuilder b = new StringBuilder();
            while (true) {
                if (i >= s.length()) {
                    throw error("unterminated string");
                }
                char c = s.charAt(i++);
                if (c == '"') {
                    return b.toString();
                }
                if (c < 0x20) {
                    i--;
                    throw error("control character in a string");
                }
                if (c != '\\') {
                    b.append(c);
                    continue;
                }
                if (i >= s.length()) {
                    throw error("unterminated escape");
                }
                char e = s.charAt(i++);
                switch (e) {
                    case '"': b.append('"'); break;
                    case '\\': b.append('\\'); break;
                    case '/': b.append('/'); break;
                    case 'b': b.append('\b'); break;
                    case 'f': b.append('\f'); break;
                    case 'n': b.append('\n'); break;
                    case 'r': b.append('\r'); break;
                    case 't': b.append('\t'); break;
                    case 'u':
                        if (i + 4 > s.length()) {
                            throw error("short \\u escape");
                        }
                        try {
                            b.append((char) Integer.parseInt(s.substring(i, i + 4), 16));
                        } catch (NumberFormatException ex) {
                            throw error("bad \\u escape");
                        }
                        i += 4;
                        break;
                    default:
                        i--;
                        throw error("bad escape '\\" + e + "'");
                }
            }
        }

        Object number() {
            int start = i;
            if (s.charAt(i) == '-') {
                i++;
            }
            int digits = i;
            while (i < s.length() && Character.isDigit(s.charAt(i))) {
                i++;
            }
            if (i == digits) {
                throw error("expected digits");
            }
            if (s.charAt(digits) == '0' && i - digits > 1) {
                throw error("leading zero in a number");
            }
            boolean integral = true;
            if (i < s.length() && s.charAt(i) == '.') {
                integral = false;
                i++;
                int f = i;
                while (i < s.length() && Character.isDigit(s.charAt(i))) {
                    i++;
                }
                if (i == f) {
                    throw error("expected digits after '.'");
                }
            }
            if (i < s.length() && (s.charAt(i) == 'e' || s.charAt(i) == 'E')) {
                integral = false;
                i++;
                if (i < s.length() && (s.charAt(i) == '+' || s.charAt(i) == '-')) {
                    i++;
                }
                int f = i;
                while (i < s.length() && Character.isDigit(s.charAt(i))) {
                    i++;
                }
                if (i == f) {
                    throw error("expected digits in the exponent");
                }
            }
            String t = s.substring(start, i);
            if (integral) {
                BigInteger big = new BigInteger(t);
                return big.bitLength() < 64 ? (Object) big.longValue() : big;
            }
            return Double.parseDouble(t);
        }
    }

    // ---- writing ----

    /** Compact JSON. */
    public static String write(Object v) {
        StringBuilder b = new StringBuilder();
        write(b, v, -1, 0);
        return b.toString();
    }

    /** JSON indented by two spaces per level, with a trailing newline (what Python's json.dumps(indent=2) + "\n" gives). */
    public static String pretty(Object v) {
        StringBuilder b = new StringBuilder();
        write(b, v, 2, 0);
        return b.append('\n').toString();
    }

    private static void newline(StringBuilder b, int indent, int level) {
        if (indent < 0) {
            return;
        }
        b.append('\n');
        for (int k = 0; k < indent * level; k++) {
            b.append(' ');
        }
    }

    private static void write(StringBuilder b, Object v, int indent, int level) {
        if (v == null) {
            b.append("null");
        } else if (v instanceof String) {
            quote(b, (String) v);
        } else if (v instanceof Boolean) {
            b.append(v.toString());
        } else if (v instanceof Double || v instanceof Float) {
            double d = ((Number) v).doubleValue();
            if (Double.isNaN(d) || Double.isInfinite(d)) {
                b.append("null");
            } else if (d == Math.rint(d) && Math.abs(d) < 1e15) {
                b.append((long) d).append(".0"); // keep it a float on the reading side
            } else {
                b.append(Double.toString(d));
            }
        } else if (v instanceof Number) {
            b.append(v.toString()); // Long, Integer, Short, Byte, BigInteger
        } else if (v instanceof Map) {
            Map<?, ?> m = (Map<?, ?>) v;
            if (m.isEmpty()) {
                b.append("{}");
                return;
            }
            b.append('{');
            Iterator<? extends Map.Entry<?, ?>> it = m.entrySet().iterator();
            while (it.hasNext()) {
                Map.Entry<?, ?> e = it.next();
                newline(b, indent, level + 1);
                if (!(e.getKey() instanceof String)) {
                    throw new IllegalArgumentException("JSON object keys must be strings, got " + e.getKey());
                }
                quote(b, (String) e.getKey());
                b.append(indent < 0 ? ":" : ": ");
                write(b, e.getValue(), indent, level + 1);
                if (it.hasNext()) {
                    b.append(',');
                }
            }
            newline(b, indent, level);
            b.append('}');
        } else if (v instanceof Iterable || v instanceof long[] || v instanceof int[] || v instanceof double[]
                || v instanceof Object[]) {
            List<Object> items = asList(v);
            if (items.isEmpty()) {
                b.append("[]");
                return;
            }
            b.append('[');
            for (int k = 0; k < items.size(); k++) {
                newline(b, indent, level + 1);
                write(b, items.get(k), indent, level + 1);
                if (k + 1 < items.size()) {
                    b.append(',');
                }
            }
            newline(b, indent, level);
            b.append(']');
        } else {
            throw new IllegalArgumentException("cannot write " + v.getClass().getName() + " as JSON");
        }
    }

    private static List<Object> asList(Object v) {
        List<Object> out = new ArrayList<>();
        if (v instanceof long[]) {
            for (long x : (long[]) v) {
                out.add(x);
            }
        } else if (v instanceof int[]) {
            for (int x : (int[]) v) {
                out.add(x);
            }
        } else if (v instanceof double[]) {
            for (double x : (double[]) v) {
                out.add(x);
            }
        } else if (v instanceof Object[]) {
            for (Object x : (Object[]) v) {
                out.add(x);
            }
        } else {
            for (Object x : (Iterable<?>) v) {
                out.add(x);
            }
        }
        return out;
    }

    private static void quote(StringBuilder b, String s) {
        quote(b, s, false);
    }

    /**
     * A JSON string: ensureAscii false escapes only what JSON requires (quote, backslash, controls); true also every
     * character outside space..~, as Python's json.dumps writes it by default (ensure_ascii).
     */
    static void quote(StringBuilder b, String s, boolean ensureAscii) {
        b.append('"');
        for (int k = 0; k < s.length(); k++) {
            char c = s.charAt(k);
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                case '\b': b.append("\\b"); break;
                case '\f': b.append("\\f"); break;
                default:
                    if (c < 0x20 || (ensureAscii && c > 0x7e)) {
                        b.append(String.format("\\u%04x", (int) c));
                    } else {
                        b.append(c);
                    }
            }
        }
        b.append('"');
    }

    // ---- typed access for readers of parsed documents ----

    /** Navigates a parsed document with a path for error messages ("state.tensors[3].bytes"). */
    public static final class Node {
        public final Object value;
        public final String path;
        private final String where;

        public Node(Object value, String path, String where) {
            this.value = value;
            this.path = path;
            this.where = where;
        }

        public String where() {
            return where;
        }

        public static Node root(Object value, String where) {
            return new Node(value, "", where);
        }

        private EdgekvException bad(String expected) {
            String got = value == null ? "null" : value instanceof Map ? "an object" : value instanceof List
                    ? "an array" : value instanceof String ? "a string" : value instanceof Boolean ? "a boolean"
                    : "a number (" + value + ")";
            return new EdgekvException(where + ": " + (path.isEmpty() ? "(top level)" : path) + ": expected "
                    + expected + ", got " + got);
        }

        public EdgekvException error(String message) {
            return new EdgekvException(where + ": " + (path.isEmpty() ? "(top level)" : path) + ": " + message);
        }

        public boolean isNull() {
            return value == null;
        }

        public boolean has(String key) {
            return value instanceof Map && ((Map<?, ?>) value).containsKey(key);
        }

        @SuppressWarnings("unchecked")
        public Map<String, Object> map() {
            if (!(value instanceof Map)) {
                throw bad("an object");
            }
            return (Map<String, Object>) value;
        }

        @SuppressWarnings("unchecked")
        public List<Object> list() {
            if (!(value instanceof List)) {
                throw bad("an array");
            }
            return (List<Object>) value;
        }

        /** A required key. */
        public Node get(String key) {
            Map<String, Object> m = map();
            String p = path.isEmpty() ? key : path + "." + key;
            if (!m.containsKey(key)) {
                throw new EdgekvException(where + ": " + p + ": missing");
            }
            return new Node(m.get(key), p, where);
        }

        /** An optional key: a Node holding null when absent. */
        public Node opt(String key) {
            Map<String, Object> m = map();
            return new Node(m.get(key), path.isEmpty() ? key : path + "." + key, where);
        }

        public Node at(int index) {
            List<Object> l = list();
            return new Node(l.get(index), path + "[" + index + "]", where);
        }

        public int size() {
            return value instanceof Map ? map().size() : list().size();
        }

        public String str() {
            if (!(value instanceof String)) {
                throw bad("a string");
            }
            return (String) value;
        }

        public boolean bool() {
            if (!(value instanceof Boolean)) {
                throw bad("a boolean");
            }
            return (Boolean) value;
        }

        public long integer() {
            if (value instanceof Long) {
                return (Long) value;
            }
            if (value instanceof Double && ((Double) value) == Math.rint((Double) value)
                    && Math.abs((Double) value) < 9.0e15) {
                return (long) (double) (Double) value; // 2.0 is an integer to JSON Schema as well
            }
            throw bad("an integer");
        }

        public double number() {
            if (value instanceof Number && !(value instanceof BigInteger)) {
                return ((Number) value).doubleValue();
            }
            throw bad("a number");
        }

        public boolean isInteger() {
            return value instanceof Long || value instanceof BigInteger;
        }

        public boolean isString() {
            return value instanceof String;
        }
    }
}
