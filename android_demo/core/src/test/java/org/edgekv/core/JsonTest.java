package org.edgekv.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.math.BigInteger;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.junit.Test;

public class JsonTest {
    @Test
    public void parsesEveryKindOfValue() {
        Object v = Json.parse(" {\"a\": [1, -2.5, 3e2, true, false, null], \"s\": \"x\\n\\u00e9\\\"\", "
                + "\"big\": 123456789012345678901234567890, \"o\": {}} ");
        @SuppressWarnings("unchecked")
        Map<String, Object> m = (Map<String, Object>) v;
        assertEquals(Arrays.asList(1L, -2.5, 300.0, true, false, null), m.get("a"));
        assertEquals("x\n\u00e9\"", m.get("s"));
        assertEquals(new BigInteger("123456789012345678901234567890"), m.get("big"));
        assertEquals(new LinkedHashMap<String, Object>(), m.get("o"));
        assertEquals(Arrays.asList("a", "s", "big", "o"), new java.util.ArrayList<>(m.keySet())); // order kept
    }

    @Test
    public void integersStayIntegers() {
        assertEquals(538060032L, Json.parse("538060032"));
        assertEquals(Long.MAX_VALUE, Json.parse(Long.toString(Long.MAX_VALUE)));
        assertEquals(2.0, Json.parse("2.0"));
    }

    @Test
    public void rejectsMalformedInputWithAPosition() {
        String[] bad = {"{", "[1,]", "{\"a\" 1}", "01", "\"abc", "tru", "{\"a\":1,\"a\":2}", "1 2", "[1.]", "-"};
        for (String b : bad) {
            try {
                Json.parse(b);
                fail("accepted " + b);
            } catch (Json.ParseException e) {
                assertTrue(e.getMessage(), e.getMessage().startsWith("invalid JSON at line 1, column "));
            }
        }
    }

    @Test
    public void quotesAsPythonsJsonDumpsWithEnsureAsciiAndOnlyWhatJsonNeedsWithout() {
        String s = "\u00e9\"\n\u0001\ud83d\ude00~ \u007f";
        StringBuilder ascii = new StringBuilder();
        Json.quote(ascii, s, true);
        // python3 -c 'import json; print(json.dumps("\u00e9\"\n\u0001\U0001F600~ \x7f"))'
        assertEquals("\"\\u00e9\\\"\\n\\u0001\\ud83d\\ude00~ \\u007f\"", ascii.toString());
        StringBuilder plain = new StringBuilder();
        Json.quote(plain, s, false);
        assertEquals("\"\u00e9\\\"\\n\\u0001\ud83d\ude00~ \u007f\"", plain.toString());
    }

    @Test
    public void writesAndReadsBack() {
        Map<String, Object> m = new LinkedHashMap<>();
        m.put("int", 42L);
        m.put("neg", -7);
        m.put("float", 1.5);
        m.put("whole_float", 3.0);
        m.put("nan", Double.NaN);
        m.put("null", null);
        m.put("list", Arrays.asList(1L, "two", false));
        m.put("arr", new long[] {1, 2});
        m.put("text", "tab\tquote\"back\\slash\u0001");
        m.put("empty", new LinkedHashMap<String, Object>());
        for (String text : new String[] {Json.write(m), Json.pretty(m)}) {
            @SuppressWarnings("unchecked")
            Map<String, Object> back = (Map<String, Object>) Json.parse(text);
            assertEquals(42L, back.get("int"));
            assertEquals(-7L, back.get("neg"));
            assertEquals(1.5, back.get("float"));
            assertEquals(3.0, back.get("whole_float")); // written as 3.0: a float stays a float
            assertNull(back.get("nan"));
            assertTrue(back.containsKey("null"));
            assertEquals(Arrays.asList(1L, "two", false), back.get("list"));
            assertEquals(Arrays.asList(1L, 2L), back.get("arr"));
            assertEquals("tab\tquote\"back\\slash\u0001", back.get("text"));
        }
        assertTrue(Json.pretty(m).endsWith("}\n"));
        assertTrue(Json.pretty(m).contains("\n  \"int\": 42,\n"));
    }

    @Test
    public void nodeErrorsNameThePath() {
        Json.Node root = Json.Node.root(Json.parse("{\"state\": {\"tensors\": [{\"bytes\": \"x\"}]}}"), "m.json");
        try {
            root.get("state").get("tensors").at(0).get("bytes").integer();
            fail();
        } catch (EdgekvException e) {
            assertEquals("m.json: state.tensors[0].bytes: expected an integer, got a string", e.getMessage());
        }
        try {
            root.get("state").get("ctx");
            fail();
        } catch (EdgekvException e) {
            assertEquals("m.json: state.ctx: missing", e.getMessage());
        }
        List<Object> l = root.get("state").get("tensors").list();
        assertEquals(1, l.size());
    }
}
