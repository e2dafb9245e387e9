package org.edgekv.core;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;

/**
 * A small JSON Schema checker for the keywords edgekv/profile/report.schema.json uses (type, required, properties,
 * additionalProperties, items, minItems, minLength, minimum, const, enum, $ref to #/$defs). No JSON Schema library
 * is available to plain javac here; the Python side validates the same file with jsonschema. An unsupported
 * validation keyword is an error, so the schema cannot grow a rule this checker silently skips.
 */
final class MiniSchema {
    private static final Set<String> ANNOTATIONS = new HashSet<>(Arrays.asList(
            "$schema", "$id", "title", "description", "$defs", "examples", "default", "$comment"));
    private static final Set<String> SUPPORTED = new HashSet<>(Arrays.asList(
            "type", "required", "properties", "additionalProperties", "items", "minItems", "minLength", "minimum",
            "const", "enum", "$ref"));

    private final Map<String, Object> root;

    @SuppressWarnings("unchecked")
    MiniSchema(Object schema) {
        this.root = (Map<String, Object>) schema;
    }

    /** Every violation, as "path: message"; empty when the document follows the schema. */
    List<String> check(Object doc) {
        List<String> errors = new ArrayList<>();
        check(root, doc, "$", errors);
        return errors;
    }

    @SuppressWarnings("unchecked")
    private void check(Map<String, Object> schema, Object v, String path, List<String> errors) {
        for (String k : schema.keySet()) {
            if (!ANNOTATIONS.contains(k) && !SUPPORTED.contains(k)) {
                throw new IllegalStateException("MiniSchema does not support keyword '" + k + "' (at " + path
                        + "); extend the checker");
            }
        }
        if (schema.containsKey("$ref")) {
            String ref = (String) schema.get("$ref");
            if (!ref.startsWith("#/$defs/")) {
                throw new IllegalStateException("unsupported $ref " + ref);
            }
            Map<String, Object> defs = (Map<String, Object>) root.get("$defs");
            Map<String, Object> target = (Map<String, Object>) defs.get(ref.substring("#/$defs/".length()));
            if (target == null) {
                throw new IllegalStateException("dangling $ref " + ref);
            }
            check(target, v, path, errors);
        }
        if (schema.containsKey("type")) {
            Object t = schema.get("type");
            List<Object> types = t instanceof List ? (List<Object>) t : Arrays.asList(t);
            boolean ok = false;
            for (Object ty : types) {
                ok |= isType(v, (String) ty);
            }
            if (!ok) {
                errors.add(path + ": expected " + types + ", got " + describe(v));
                return; // the other keywords assume the type
            }
        }
        if (schema.containsKey("const") && !jsonEquals(schema.get("const"), v)) {
            errors.add(path + ": must be " + schema.get("const") + ", got " + describe(v));
        }
        if (schema.containsKey("enum")) {
            boolean found = false;
            for (Object e : (List<Object>) schema.get("enum")) {
                found |= jsonEquals(e, v);
            }
            if (!found) {
                errors.add(path + ": must be one of " + schema.get("enum") + ", got " + describe(v));
            }
        }
        if (schema.containsKey("minimum") && v instanceof Number) {
            double min = ((Number) schema.get("minimum")).doubleValue();
            if (((Number) v).doubleValue() < min) {
                errors.add(path + ": " + v + " is below the minimum " + schema.get("minimum"));
            }
        }
        if (schema.containsKey("minLength") && v instanceof String
                && ((String) v).length() < ((Number) schema.get("minLength")).intValue()) {
            errors.add(path + ": shorter than " + schema.get("minLength"));
        }
        if (v instanceof Map) {
            Map<String, Object> obj = (Map<String, Object>) v;
            if (schema.containsKey("required")) {
                for (Object req : (List<Object>) schema.get("required")) {
                    if (!obj.containsKey(req)) {
                        errors.add(path + ": missing required key '" + req + "'");
                    }
                }
            }
            Map<String, Object> props = schema.containsKey("properties")
                    ? (Map<String, Object>) schema.get("properties") : null;
            for (Map.Entry<String, Object> e : obj.entrySet()) {
                String p = path + "." + e.getKey();
                if (props != null && props.containsKey(e.getKey())) {
                    check((Map<String, Object>) props.get(e.getKey()), e.getValue(), p, errors);
                } else if (schema.containsKey("additionalProperties")) {
                    Object ap = schema.get("additionalProperties");
                    if (Boolean.FALSE.equals(ap)) {
                        errors.add(p + ": not allowed here");
                    } else if (ap instanceof Map) {
                        check((Map<String, Object>) ap, e.getValue(), p, errors);
                    }
                }
            }
        }
        if (v instanceof List) {
            List<Object> arr = (List<Object>) v;
            if (schema.containsKey("minItems") && arr.size() < ((Number) schema.get("minItems")).intValue()) {
                errors.add(path + ": fewer than " + schema.get("minItems") + " items");
            }
            if (schema.containsKey("items")) {
                for (int i = 0; i < arr.size(); i++) {
                    check((Map<String, Object>) schema.get("items"), arr.get(i), path + "[" + i + "]", errors);
                }
            }
        }
    }

    static boolean isType(Object v, String type) {
        switch (type) {
            case "null": return v == null;
            case "object": return v instanceof Map;
            case "array": return v instanceof List;
            case "string": return v instanceof String;
            case "boolean": return v instanceof Boolean;
            case "number": return v instanceof Number;
            case "integer":
                return v instanceof Long || v instanceof Integer || v instanceof BigInteger
                        || (v instanceof Double && ((Double) v) == Math.rint((Double) v)
                        && !((Double) v).isInfinite());
            default: throw new IllegalStateException("unknown type " + type);
        }
    }

    private static boolean jsonEquals(Object a, Object b) {
        if (a instanceof Number && b instanceof Number) {
            return ((Number) a).doubleValue() == ((Number) b).doubleValue();
        }
        return a == null ? b == null : a.equals(b);
    }

    private static String describe(Object v) {
        return v == null ? "null" : v.getClass().getSimpleName() + " " + v;
    }
}
