package org.edgekv.core;

import java.util.ArrayList;
import java.util.List;

/**
 * Which entry point each call uses and how many tokens it carries, the way edgekv/export/runtime.py calls an
 * artifact: ONNX has one graph with a dynamic token axis (a prompt goes in calls of at most maxChunk tokens); a .pte
 * of a state made of caches (plain, quantized, windowed or MLA) has one {@code forward} method with a dynamic token
 * axis of at most max_tokens per call; a .pte of a recurrent state (ssm, linear, hybrid) has a fixed-size
 * {@code prefill} method (the last chunk is padded with token 0: the padded slots lie past the prompt, stay masked,
 * and are overwritten by the decode steps, or, for a tail "decode", runs token by token) and a one-token
 * {@code decode} method.
 */
public final class StepPlan {
    private StepPlan() {}

    public static final class Call {
        public final Manifest.EntryPoint entry;
        /** Position of the first token of this call. */
        public final int pos;
        /** Real tokens in this call. */
        public final int n;
        /** Tokens passed (n plus padding for a fixed-size entry point). */
        public final int padded;

        Call(Manifest.EntryPoint entry, int pos, int n, int padded) {
            this.entry = entry;
            this.pos = pos;
            this.n = n;
            this.padded = padded;
        }

        /** The {@code rows} input of this call when it wants its last real token's logits only: {n - 1}. */
        public long[] lastRow() {
            return new long[] {n - 1};
        }

        /** Where that token's logits are in the returned logits: row 0 of [1, 1, vocab] when the entry point takes
         * rows, else row n - 1 of [1, padded, vocab]. */
        public int lastRowIndex() {
            return entry.takesRows ? 0 : n - 1;
        }

        @Override
        public String toString() {
            return entry.name + "@" + pos + "+" + n + (padded != n ? " (padded to " + padded + ")" : "");
        }
    }

    /** The entry point that takes n tokens in one call, or null if none does. */
    public static Manifest.EntryPoint entryFor(Manifest.Artifact a, int n) {
        Manifest.EntryPoint best = null;
        for (Manifest.EntryPoint e : a.entryPoints) {
            if (e.isDynamic()) {
                best = e; // no padding needed (unless a fixed size fits exactly)
            } else if (e.fixedTokens == n) {
                return e; // exact fit (decode for n = 1)
            } else if (e.fixedTokens > n && (best == null || (!best.isDynamic() && e.fixedTokens < best.fixedTokens))) {
                best = e; // padded
            }
        }
        return best;
    }

    /** The most tokens one call can take: the largest fixed size, or for a dynamic axis maxChunk, capped by the
     * axis's max_tokens. */
    public static int maxTokensPerCall(Manifest.Artifact a, int maxChunk) {
        int most = 0;
        for (Manifest.EntryPoint e : a.entryPoints) {
            int n = e.isDynamic() ? maxChunk : (int) (long) e.fixedTokens;
            if (e.isDynamic() && e.maxTokens != null) {
                n = (int) Math.min(n, e.maxTokens);
            }
            most = Math.max(most, n);
        }
        return most;
    }

    /** The calls that feed a prompt of promptLen tokens starting at position start. */
    public static List<Call> prefill(Manifest.Artifact a, int start, int promptLen, int maxChunk, int maxCtx) {
        if (promptLen < 1) {
            throw new EdgekvException("a prompt needs at least one token");
        }
        if (start + promptLen > maxCtx) {
            throw new EdgekvException((start + promptLen) + " tokens exceed this export's max_ctx " + maxCtx);
        }
        int per = maxTokensPerCall(a, Math.max(1, maxChunk));
        List<Call> calls = new ArrayList<>();
        for (int s = 0; s < promptLen; s += per) {
            int n = Math.min(per, promptLen - s);
            Manifest.EntryPoint e = entryFor(a, n);
            if (e == null) {
                throw new EdgekvException("artifact " + a.file + " has no entry point that takes " + n + " tokens");
            }
            if (!e.isDynamic() && n < e.fixedTokens && "decode".equals(e.tail)) {
                for (int k = 0; k < n; k++) { // padding would corrupt a recurrent state or a rolling window
                    calls.add(decode(a, start + s + k, maxCtx));
                }
                continue;
            }
            calls.add(new Call(e, start + s, n, e.isDynamic() ? n : (int) (long) e.fixedTokens));
        }
        return calls;
    }

    /** One decode step at position pos. */
    public static Call decode(Manifest.Artifact a, int pos, int maxCtx) {
        if (pos >= maxCtx) {
            throw new EdgekvException("position " + pos + " is outside this export's max_ctx " + maxCtx);
        }
        Manifest.EntryPoint e = entryFor(a, 1);
        if (e == null) {
            throw new EdgekvException("artifact " + a.file + " has no entry point that takes 1 token");
        }
        return new Call(e, pos, 1, e.isDynamic() ? 1 : (int) (long) e.fixedTokens);
    }
}
