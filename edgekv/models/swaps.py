"""Runtime-specific attention as module swaps, as ExecuTorch's examples/models/llama/source_transformation/ does
(replace_sdpa_with_custom_op and friends): for_runtime(model, runtime) returns a copy of the model, sharing its
weights, in which each attention layer a runtime's fused op can serve is replaced by a module that calls that op; the
other layers keep the eager Attention (edgekv.models.attention). The eager model is left as it was, so it can still
serve as the reference a trace is verified against.

  onnxruntime   GQAAttention: ONNX Runtime's com.microsoft::GroupQueryAttention (the op ONNX Runtime GenAI's models
                use), on a float cache, or a static-scale int8 one (kv-int8c), with one slot per position or a
                native sliding window (below). Every RMSNorm becomes OnnxRMSNorm, the form ORT fuses into
                SimplifiedLayerNormalization.
  executorch    SdpaAttention: ExecuTorch's llama::custom_sdpa, or llama::custom_quantized_sdpa on int8 codes (its LLM
                custom ops, as ExecuTorch's own Llama export), on a float or quantized cache with one slot per
                position.

A native sliding-window layer (Gemma 3's local layers, Mistral's) whose cache is exactly its window goes to
GroupQueryAttention too on ONNX Runtime, with the op's window-sized cache (sliding_window_cache, ONNX Runtime 1.32's
contract): the op keeps the newest positions contiguously at rows [0, L) and evicts itself, so that layer's state
rows are in the op's order, not the eager ring's (slot = position mod W); the logits are the same. A layer under the
window strategy (sinks, a window narrower than the model's) and every rolling layer on ExecuTorch keep the eager
path. The state is written in place (the manifest's state_in_place) only when every layer is swapped: an eager
layer's outputs are computed from its inputs and must not be bound to the same buffers.

Adding a runtime's attention: a subclass of Attention with its forward (same signature), and a Swap in SWAPS[runtime]
(when it applies to a layer, how to make it from the eager layer and the per-model constants); the first Swap whose
rule takes a layer wins.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..errors import EdgekvError
from ..quant import dequantize, dequantize_planar, planar_order
from ..strategies.storage import EDGEKV_PACKED_BITS
from .attention import Attention, Call
from .layers import RMSNorm


def _share(module: nn.Module, cls: type) -> nn.Module:
    """A module of class cls holding the same submodules, parameters and buffers as module (no copy of a weight); its
    own dicts, so registering on it leaves module unchanged."""
    new = cls.__new__(cls)
    new.__dict__ = dict(module.__dict__)
    for name in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        setattr(new, name, type(getattr(module, name))(getattr(module, name)))
    return new


class OnnxRMSNorm(RMSNorm):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim: the pattern ONNX Runtime fuses into
    (Skip)SimplifiedLayerNormalization (one node with the residual add, instead of eight)."""

    def forward(self, x):
        x32 = x.float()
        w = self.weight + self.offset if self.offset else self.weight
        return w * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Constants(nn.Module):
    """Constant tensors the swapped layers of one model share (one copy in the traced program)."""

    def __init__(self, **tensors):
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)


class GQAAttention(Attention):
    """The same step as Attention on a plain float cache with one slot per position, as one ONNX Runtime
    GroupQueryAttention node (com.microsoft). For the ONNX trace only: eager torch has no such op.

    The node writes the C new keys/values at slots pos..pos+C-1 and attends causally over slots 0..pos+C-1 only,
    not over all T: the cost of a step grows with the position, not with max_ctx. Its present outputs have the past
    inputs' shape; when the caller binds each present to its past's buffer ORT writes the C rows in place
    (past_present_share_buffer), otherwise it copies the past into the present first. q, k and v come from one
    matmul (qkv_proj: their weights stacked). q/k/v go in as the cache dtype (the op takes one dtype), so a fp16 cache
    also rounds q and the attention output to fp16. rope: None, or Constants with cos, sin [max_ctx, D/2], with
    which the op rotates q and k itself (do_rotary). window: None, or a native sliding window W whose layer keeps a
    cache of exactly W slots: the op attends to the last W positions (local_window_size W: a query sees itself and
    the W - 1 before it, as q - k < W in transformers) and manages the W rows itself (sliding_window_cache 1)."""

    window = None

    def forward(self, x, cos, sin, k_state, v_state, call: Call):
        import torch.onnx.ops  # noqa: F401 (torch.onnx loads its submodules lazily)

        c = x.shape[1]
        lens = call.once("gqa_lens", lambda: ((call.pos + c - 1).to(torch.int32),
                                              (call.pos + c).to(torch.int32).reshape(())))
        k_cache, v_cache = k_state[0], v_state[0]
        qkv = self.qkv_proj(x)
        dt = k_cache.dtype
        static = dt == torch.int8  # kv-int8c: the op quantizes the new rows with the layer's scales and reads codes
        io = torch.float32 if static else dt  # q, k, v and the output
        attrs = {"num_heads": self.h, "kv_num_heads": self.hkv, "scale": self.scale}
        if self.rope is not None:  # the packed q/k/v go in as they are; the op rotates at positions pos..pos+C-1
            inputs = [qkv, None, None, k_cache, v_cache, *lens, self.rope.cos, self.rope.sin]
            attrs["do_rotary"] = 1
        else:  # rotate in fp32 here, then round q, k, v to the cache dtype
            parts = qkv.split([self.h * self.dh, self.hkv * self.dh, self.hkv * self.dh], dim=-1)
            q, k, v = self._rotated(*parts, cos, sin)
            inputs = [*(t.reshape(1, c, -1).to(io) for t in (q, k, v)), k_cache, v_cache, *lens]
        if self.window is not None:
            attrs.update(local_window_size=self.window, sliding_window_cache=1)
        if static:  # inputs 12, 13: k_scale, v_scale [1, Hkv, 1, D], after cos/sin, position_ids, bias, head_sink
            inputs += [None] * (12 - len(inputs))
            inputs += [self.kv_scale[0].reshape(1, self.hkv, 1, self.dh), self.kv_scale[1].reshape(1, self.hkv, 1, self.dh)]
            attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
        out, nk, nv = torch.onnx.ops.symbolic_multi_out(
            "com.microsoft::GroupQueryAttention", inputs, attrs,
            dtypes=[io, dt, dt], shapes=[[1, c, self.h * self.dh], list(k_cache.shape), list(v_cache.shape)],
            version=1)
        return self.o_proj(out.float()), (nk,), (nv,)


class SdpaAttention(Attention):
    """The same step as Attention on a plain or quantized cache with one slot per position, attended by ExecuTorch's
    llama::custom_sdpa or llama::custom_quantized_sdpa (executorch/extension/llm/custom_ops). For the .pte trace;
    eager torch runs it too once the ops' AOT library is loaded.

    Each state tensor gets the call's C rows with an index_put at slots pos..pos+C-1 (the graph stays functional;
    edgekv.export.to_pte turns it into index_put_ on the past.* input when every layer is swapped, so the .pte writes
    the caller's state in place). The ops want [B, T, heads, D]: a [1, Hkv, T, D] cache is exactly a contiguous
    [Hkv, T, 1, D] tensor, i.e. a batch of Hkv one-head caches, and a query [Hkv, C, G, D] attends each KV head with
    its G query heads (repeat_kv's order). Both ops attend causally over slots 0..pos+C-1 only.

    How each cache is read (the storage's pte_read, edgekv.strategies.storage):
      "in place"   a fp32 cache: custom_sdpa on a view of it (zero copy).
      "int8 codes" int8 codes, read in place by custom_quantized_sdpa, which multiplies int8 by int8: the query is
                   quantized to int8 per (token, head) as ExecuTorch's own QuantizedSDPA does it
                   (quantized_decomposed::choose_qparams_per_token_asymmetric, quantize_per_token), and the op takes
                   fp32 scales and int8 zero points shaped as the whole cache [Hkv, T, 1, 1]. kv-int8 (one scale per
                   token and head): its fp16 scales cast to fp32 (1/D of the codes' values), the zero points a
                   constant 0 (symmetric codes). kv-int8c (static per-channel scales s_k, s_v [Hkv, D]): q.k =
                   (q * s_k).codes_k, so the key scales are folded into the query before it is quantized, and
                   sum_t p_t v_t = s_v * sum_t p_t codes_v, so the value scales multiply the output; the op reads the
                   codes with a constant unit scale. The query's own int8 rounding is the one error this adds over
                   the eager layer (benchmarks/results/pte_quant_attention.json: about 0.5 % of the attention output).
                   With int8_kernel "edgekv" (export --pte-kernel edgekv) edgekv's own edgekv::int8_sdpa
                   reads them instead: the fp32 query, the codes and their scales as stored, no rounding.
      "fp32 rows"  rows 0..pos+C-1 read back as fp32 and attended by custom_sdpa, as Attention does: a fp16 cache
                   cast (custom_sdpa on fp16 rows runs an fp16 GEMM without a fast path on the host's CPU), an int8
                   cache with group scales by edgekv.quant.dequantize, a packed int4/int2 cache by
                   edgekv.quant.dequantize_planar in planar channel order, with q permuted into the same order (q.k is
                   invariant to one permutation of both) and the output permuted back before o_proj. With
                   int8_kernel "edgekv" neither is read back: edgekv::fp16_sdpa reads a fp16 cache and
                   edgekv::packed_sdpa packed codes in place (_edgekv_reads, _edgekv_float_read).
    rotate_half is a matmul by a constant signed permutation (exact, and XNNPACK takes it with a dynamic token count,
    where the two slices of rotate_half would each leave XNNPACK). consts: Constants with rope_rot [D, D], planar
    [D, D] for a packed cache, and for an int8-codes read the op's constant zero points (and unit scales)."""

    def _half(self, x):
        return (x.reshape(-1, self.dh) @ self.consts.rope_rot).reshape(-1, x.shape[1], self.dh)

    def forward(self, x, cos, sin, k_state, v_state, call: Call):
        fmt = self.fmt
        c, t, g = x.shape[1], k_state[0].shape[2], self.h // self.hkv

        def checked_start():
            start = call.pos[0].item()
            torch._check(start >= 0)
            torch._check(start + c <= t)
            return start

        start = call.once("start", checked_start)
        positions = call.positions
        perm = getattr(self.consts, "planar", None)
        q, k, v = self._qkv(x, cos, sin)  # [C, H, D], [C, Hkv, D], [C, Hkv, D]
        static = self.kv_scale if fmt.static else (None, None)

        def put(state, rows):  # rows [C, Hkv, X] -> the state tensor with them at slots positions
            return torch.ops.aten.index_put(state, [None, None, positions], rows.permute(1, 0, 2)[None])

        if fmt.bits:
            k_state, v_state = (tuple(put(s, r) for s, r in zip(st, fmt.store(z, sc)))
                                for st, z, sc in ((k_state, k, static[0]), (v_state, v, static[1])))
        else:
            dt = k_state[0].dtype
            k_state, v_state = (put(k_state[0], k.to(dt)),), (put(v_state[0], v.to(dt)),)
        read = fmt.storage.pte_read(self.dh)
        if read == "int8 codes" or (getattr(self.consts, "int8_kernel", "executorch") == "edgekv"
                                    and _edgekv_reads(self)):
            if read == "int8 codes":
                out = self._int8_codes(q, k_state, v_state, start, t)
            else:  # edgekv's own kernels on the cache in place: fp16 values, or packed codes with their groups
                qg = q.view(-1, self.hkv, g, self.dh).permute(1, 0, 2, 3).contiguous()
                out = _edgekv_float_read(fmt, qg, k_state, v_state, start, self.scale, self.dh)
            return self.o_proj(out.permute(1, 0, 2, 3).reshape(1, -1, self.h * self.dh)), k_state, v_state
        if read == "in place":
            kc, vc = (st[0].view(self.hkv, t, 1, self.dh) for st in (k_state, v_state))
        else:  # "fp32 rows": the written rows read back in fp32
            n = start + c

            def rows(st):
                part = [s[:, :, :n] for s in st]
                if not fmt.bits:
                    r = part[0].float()
                elif perm is not None:
                    r = dequantize_planar(*part, fmt.bits, fmt.group)
                else:
                    r = dequantize(part[0], part[1], part[2] if fmt.bits < 8 else None, fmt.bits, fmt.group)
                return r.view(self.hkv, n, 1, self.dh)

            kc, vc = rows(k_state), rows(v_state)
        if perm is not None:
            q = (q.reshape(-1, self.dh) @ perm).reshape(-1, self.h, self.dh)
        qg = q.view(-1, self.hkv, g, self.dh).permute(1, 0, 2, 3)  # [Hkv, C, G, D]
        out = self._custom_sdpa(qg, kc, vc, start, c, call.pos, rows_ok=read == "in place")
        if perm is not None:
            out = (out.reshape(-1, self.dh) @ perm.t()).reshape(out.shape)
        out = out.permute(1, 0, 2, 3).reshape(1, -1, self.h * self.dh)
        return self.o_proj(out), k_state, v_state

    def _custom_sdpa(self, qg, kc, vc, start, c, pos, rows_ok: bool = True):
        """custom_sdpa of qg [Hkv, C, G, D] over the caches -> [Hkv, C, G, D].

        One token (C = 1) with G > 1 query heads a KV head: the G heads go in as G query rows of one head
        ([Hkv, G, 1, D]), not causal, at start - (G - 1), so every row attends the same slots 0..start (the op reads
        start_pos + rows keys). The op runs one attention per (batch, head) and each reads the whole cache: per head
        a decode step reads each KV head's keys and values G times, over a one-row product; as rows of one head it
        reads them once, in a G-row product. The same sums in the same order per row: Gemma-3-270M's global layer at
        16k slots (G = 4, D = 256), 14-15 ms against 4.6-4.9 ms of CPU per call, max |diff| 2e-8
        (experiments/sdpa_fold.py). A call of several tokens (prefill) keeps the causal per-head call: its rows
        need each their own last slot. torch.cond picks at run time (the .pte's one method takes 1..max tokens).
        rows_ok=False (rows read back into a tensor of start + C slots, "fp32 rows"): per head only, since the
        branch's start, read again inside torch.cond, is a new unbacked size the op's shape check cannot equate with
        the rows' length."""
        g = qg.shape[2]
        if g == 1 or not rows_ok:
            return torch.ops.llama.custom_sdpa(qg, kc, vc, start, None, 0.0, True, self.scale)

        def causal(qg, kc, vc, pos):
            return torch.ops.llama.custom_sdpa(qg, kc, vc, self._start(pos, kc), None, 0.0, True, self.scale)

        def rows(qg, kc, vc, pos):
            # -1: C x G rows (torch.cond traces both branches for any C; this one runs with C = 1)
            out = torch.ops.llama.custom_sdpa(qg.reshape(self.hkv, -1, 1, self.dh), kc, vc,
                                              self._start(pos, kc) - (g - 1), None, 0.0, False, self.scale)
            return out.reshape(self.hkv, -1, g, self.dh)

        if isinstance(c, int):  # eager: the branch itself
            return (rows if c == 1 else causal)(qg, kc, vc, pos)
        # the start position goes in as the tensor it is (torch.cond takes no unbacked size as an input)
        return torch.cond(c == 1, rows, causal, (qg, kc, vc, pos))

    @staticmethod
    def _start(pos, kc):
        start = pos[0].item()
        torch._check(start >= 0)
        torch._check(start < kc.shape[1])
        return start

    def _int8_codes(self, q, k_state, v_state, start, t):
        """custom_quantized_sdpa (or edgekv's own int8_sdpa) over the int8 codes in place -> out [Hkv, C, G, D] fp32
        (see the class docstring)."""
        g = self.h // self.hkv
        if getattr(self.consts, "int8_kernel", "executorch") == "edgekv":
            # edgekv::int8_sdpa (edgekv/native): the fp32 query against the codes and their scales as stored (fp16
            # per token and head, or the static [Hkv, D] ones), GQA's G heads of a token together, causal
            qg = q.view(-1, self.hkv, g, self.dh).permute(1, 0, 2, 3).contiguous()
            if self.fmt.static:
                ks, vs = self.kv_scale[0], self.kv_scale[1]
            else:
                ks, vs = k_state[1], v_state[1]
            return torch.ops.edgekv.int8_sdpa(qg, k_state[0], v_state[0], ks, vs, start, self.scale,
                                              bool(self.fmt.static))
        zero = getattr(self.consts, _op_const("zero", self.hkv, t))
        if self.fmt.static:  # fold the key scales into the query: head kv*G + j takes KV head kv's [D] scales
            ks, vs = self.kv_scale[0], self.kv_scale[1]
            q = q * ks.repeat_interleave(g, 0)[None]
            unit = getattr(self.consts, _op_const("unit", self.hkv, t))
            k_scale = v_scale = unit
        else:  # one fp16 scale per (token, head): [1, Hkv, T] -> [Hkv, T, 1, 1] fp32
            k_scale, v_scale = (st[1].float().view(self.hkv, t, 1, 1) for st in (k_state, v_state))
        qg = q.view(-1, self.hkv, g, self.dh).permute(1, 0, 2, 3)  # [Hkv, C, G, D]
        qs, qz = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric(qg, torch.int8)
        qq = torch.ops.quantized_decomposed.quantize_per_token(qg, qs, qz, -128, 127, torch.int8)
        kc, vc = (st[0].view(self.hkv, t, 1, self.dh) for st in (k_state, v_state))
        out = torch.ops.llama.custom_quantized_sdpa(qq, kc, vc, start, None, 0.0, True, self.scale,
                                                    qz.to(torch.int8), qs.to(torch.float32), zero, k_scale, zero,
                                                    v_scale)
        if self.fmt.static:
            out = out * vs.view(self.hkv, 1, 1, self.dh)
        return out


class RingSdpaAttention(Attention):
    """A native sliding-window layer (Gemma 3's local layers; _native_window) in a .pte whose other layers take
    custom_sdpa: the eager layer's arithmetic on its ring of W slots (slot = position mod W), with the state written
    by an index_put of this call's rows instead of the blend, so that with this swap every layer of such a model
    writes its state in place (edgekv.export.to_pte.write_state_in_place) and no call copies the whole state in and
    out of the method's planned buffers (at a filled 16k on Gemma-3-270M, 3 global layers' 16k slots each).

    Attention reads the ring as it was before the call, then the call's own rows (RollingCache.plan's mask over
    T + C keys, as Attention computes it), because a call of C > 1 tokens overwrites keys that its earlier tokens
    still see. The write must therefore run after those reads: the rows written take + 0 * one value of the
    layer's output, a data dependency that orders every read of the old ring before the in-place write in any
    schedule (write_state_in_place checks that each other reader of the state is an ancestor of its write). A call
    writes at most W rows (C <= W), so the slots of one index_put are distinct."""

    kernel = None  # "edgekv": a one-token call's ring attended by edgekv::int8_sdpa on the codes, or edgekv::fp16_sdpa
    # on an fp16 ring, in place (_kernel_forward)

    def forward(self, x, cos, sin, k_state, v_state, call: Call):
        cache, fmt = self.cache, self.fmt
        c, t, g = x.shape[1], cache.slots, self.h // self.hkv
        torch._check(c <= t)
        if self.kernel == "edgekv":
            return self._kernel_forward(x, cos, sin, k_state, v_state, call)
        plan = call.once(cache, lambda: cache.plan(call.pos, call.positions, g, fmt.dtype or torch.float32))
        news = {}

        def read(new, st, which):  # -> (state, fp32 [Hkv, T + C, D]: the ring before this call, then its rows)
            scale = self.kv_scale[which] if fmt.static else None
            news[which] = new
            old = fmt.read(tuple(s[0] for s in st), scale)
            rows = fmt.storage.as_stored(new, fmt.store(new, scale), scale)
            return st, torch.cat((old, rows.permute(1, 0, 2)), 1)

        out, _, _ = self._attend(x, cos, sin, plan[2], k_state, v_state, read)
        slots = call.once(("ring", t), lambda: call.positions % t)  # sinks == 0: slot = position mod W
        after = out.reshape(-1)[:1] * 0  # [1], 0: makes the write depend on this layer's reads

        def put(state, which):  # this call's rows, stored as the cache stores them, at their ring slots
            scale = self.kv_scale[which] if fmt.static else None
            # the dependency before the quantizer: its ops then reach the index_put only through the quantizer's
            # own ops, which the .pte's partitioner keeps beside the write (to_pte._feeds_state_write)
            parts = fmt.store(news[which] + after, scale)
            # a float storage stores the rows as they come and is cast where it is written (FloatStorage.store)
            return tuple(torch.ops.aten.index_put(s, [None, None, slots], r.permute(1, 0, 2)[None].to(s.dtype))
                         for s, r in zip(state, parts))

        return out, put(k_state, 0), put(v_state, 1)

    def _kernel_forward(self, x, cos, sin, k_state, v_state, call: Call):
        """The ring of int8 codes (kv-int8, kv-int8c) or fp16 values with --pte-kernel edgekv: this call's rows are
        written first, then a one-token call attends the whole ring with edgekv::int8_sdpa on the codes (or
        edgekv::fp16_sdpa on the fp16 values) in place (no fp32 copy of the ring a step). Slot order does not matter
        to attention, and after the write the ring holds
        exactly the positions the token sees (the last W, q - k < W): slots 0..min(pos, W - 1), written in order
        until the ring is full. A call of several tokens needs the keys its rows overwrite (its earlier tokens still
        see them): the C old rows at its slots are gathered before the write (the write depends on them, so every
        read of the old ring precedes it), and its branch puts them back into a copy of the ring and attends as the
        eager layer does, over [the ring before the call, this call's rows as stored] with RollingCache.plan's
        mask. torch.cond picks at run time, as SdpaAttention._custom_sdpa does."""
        cache, fmt = self.cache, self.fmt
        c, t, g = x.shape[1], cache.slots, self.h // self.hkv
        plan = call.once(cache, lambda: cache.plan(call.pos, call.positions, g, fmt.dtype or torch.float32))
        slots = call.once(("ring", t), lambda: call.positions % t)  # sinks == 0: slot = position mod W
        q, k, v = self._qkv(x, cos, sin)  # [C, H, D], [C, Hkv, D], [C, Hkv, D]
        ks, vs = (self.kv_scale[0], self.kv_scale[1]) if fmt.static else (None, None)
        nk = len(k_state)
        old = [s[:, :, slots] for s in (*k_state, *v_state)]  # the C rows this call overwrites, before the write
        after = sum(o.reshape(-1)[:1].float() for o in old) * 0  # [1], 0: orders those reads before the write

        def put(state, rows, scale):
            return tuple(torch.ops.aten.index_put(s, [None, None, slots], r.permute(1, 0, 2)[None].to(s.dtype))
                         for s, r in zip(state, fmt.store(rows + after, scale)))

        k_state, v_state = put(k_state, k, ks), put(v_state, v, vs)
        hkv, h, dh, scale, static = self.hkv, self.h, self.dh, self.scale, bool(fmt.static)

        # the static scales [2, Hkv, D] go in as one operand (a branch closing over the module's buffers does not
        # trace, and two views of one tensor are inputs that alias)
        scales = (self.kv_scale,) if static else ()
        ns = len(scales)

        def one(q, pos, mask, slots, *parts):  # a one-token call: the kernel over the ring as written
            ks, vs = (parts[0][0], parts[0][1]) if static else (None, None)
            kn, vn = parts[ns:ns + nk], parts[ns + nk:ns + 2 * nk]
            start = torch.clamp(pos, max=t - 1)[0].item()
            torch._check(start >= 0)
            torch._check(start < t)
            qg = q[:1].reshape(1, hkv, g, dh).permute(1, 0, 2, 3).contiguous()  # [Hkv, 1, G, D]
            if nk == 1:  # an fp16 ring: its values, no scales
                out = _edgekv_float_read(fmt, qg, kn, vn, start, scale, dh)
            else:
                out = torch.ops.edgekv.int8_sdpa(qg, kn[0], vn[0], ks if static else kn[1], vs if static else vn[1],
                                                 start, scale, static)
            # [1, 1, H*D], repeated to the call's C (= 1 here; torch.cond traces both branches for any C)
            return out.permute(1, 0, 2, 3).reshape(1, 1, h * dh).repeat(1, q.shape[0], 1)

        def several(q, pos, mask, slots, *parts):  # the eager layer's attention over the ring before the call
            n = q.shape[0]
            sc = (parts[0][0], parts[0][1]) if static else (None, None)
            new, olds = parts[ns:ns + 2 * nk], parts[ns + 2 * nk:]
            f = []
            for i in (0, 1):
                st, od = new[i * nk:(i + 1) * nk], olds[i * nk:(i + 1) * nk]
                ring = tuple(torch.ops.aten.index_put(s, [None, None, slots], o) for s, o in zip(st, od))
                rows = tuple(s[:, :, slots] for s in st)
                f.append(torch.cat((fmt.read(tuple(r[0] for r in ring), sc[i]),
                                    fmt.read(tuple(r[0] for r in rows), sc[i])), 1))
            qg = q.view(n, hkv, g, dh).permute(1, 2, 0, 3).reshape(hkv, g * n, dh)
            scores = torch.bmm(qg, f[0].transpose(1, 2)) * scale + mask  # [Hkv, G*C, T + C]
            out = torch.bmm(torch.softmax(scores, dim=-1), f[1])  # [Hkv, G*C, D]
            return out.view(hkv, g, n, dh).permute(2, 0, 1, 3).reshape(1, n, h * dh)

        operands = (q, call.pos, plan[2], slots, *scales, *k_state, *v_state, *old)
        if isinstance(c, int):  # eager: the branch itself
            out = (one if c == 1 else several)(*operands)
        else:
            out = torch.cond(c == 1, one, several, operands)
        return self.o_proj(out), k_state, v_state


PACKED_BITS = EDGEKV_PACKED_BITS  # the packed caches edgekv::packed_sdpa reads (kv-int4, kv-int2)


def _edgekv_reads(at: Attention) -> bool:
    """Whether edgekv's own kernels (--pte-kernel edgekv, edgekv/native) read this layer's cache in place: int8 codes
    (edgekv::int8_sdpa), an fp16 cache (edgekv::fp16_sdpa) or packed int4 / int2 codes (edgekv::packed_sdpa), where
    the default reads the rows written so far back into fp32 every call."""
    return at.fmt.storage.edgekv_kernel_reads(at.dh)


def _edgekv_float_read(fmt, qg, k_state, v_state, start, scale: float, d: int):
    """edgekv::fp16_sdpa on an fp16 cache, or edgekv::packed_sdpa on packed codes (their scales and zeros, the
    storage's group), qg [Hkv, C, G, D] -> [Hkv, C, G, D] fp32."""
    if fmt.bits in PACKED_BITS:
        return torch.ops.edgekv.packed_sdpa(qg, k_state[0], v_state[0], k_state[1], k_state[2], v_state[1],
                                            v_state[2], start, scale, fmt.bits, fmt.group or d)
    return torch.ops.edgekv.fp16_sdpa(qg, k_state[0], v_state[0], start, scale)


def _op_const(name: str, hkv: int, t: int) -> str:
    """The Constants name of custom_quantized_sdpa's per-token constant for a cache of Hkv heads and T slots."""
    return f"{name}_{hkv}_{t}"


# ---- the swaps ----


@dataclass(frozen=True)
class Swap:
    """applies(layer) -> whether the runtime's op serves this eager Attention layer; make(layer, shared) -> the
    replacement (shared: what setup(model, layers) returned, once per model, for the layers it takes)."""
    applies: Callable[[Attention], bool]
    make: Callable[[Attention, object], nn.Module]
    setup: Callable[..., object] = lambda model, layers, **options: None


def _gqa_setup(model, layers, **options):
    """The op's rotary tables [max_ctx, D/2] when it can rotate q and k itself: a fp32 cache and one RoPE for every
    layer with nothing between the projection and the rotation (no qk-norm, no second RoPE base, no NoPE layer)."""
    a = model.args
    if layers and all(at.fmt.dtype == torch.float32 or at.fmt.static for at in layers) and len(layers) == a.n_layers \
            and not a.qk_norm and a.local_rope_theta is None and a.rope_layers is None:
        freqs = torch.arange(model.layout.ctx, dtype=torch.int64).float()[:, None] * model.inv_freq[None, :]
        return Constants(cos=freqs.cos(), sin=freqs.sin())
    return None


def _gqa_make(at, rope):
    new = _share(at, GQAAttention)
    parts = (at.q_proj, at.k_proj, at.v_proj)
    from ..export.lazy_weights import fused_rows
    from .weights import no_init
    with no_init():  # its weight is assigned, never filled: one stacked copy, or a placeholder for the narrow ones
        qkv = nn.Linear(at.q_proj.in_features, sum(p.out_features for p in parts), bias=at.q_proj.bias is not None)
    with torch.no_grad():
        qkv.weight = nn.Parameter(fused_rows([p.weight for p in parts]), requires_grad=False)
        if qkv.bias is not None:
            qkv.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    new.qkv_proj = qkv
    new.rope = rope
    new.window = at.cache.size if at.cache.rolling else None
    return new


def _sdpa_setup(model, layers, int8_kernel: str = "executorch", **options):
    """Registers the ops' AOT libraries (ExecuTorch's LLM custom ops and quantized kernels: a runtime needs their
    kernels to run the .pte) and makes the constants: rope_rot, with x @ rope_rot = rotate_half(x); for a packed
    cache the permutation into edgekv.quant's planar channel order ((x @ planar)[p] = x[planar_order[p]]); for int8
    codes read in place, custom_quantized_sdpa's zero points (int8 zeros) and, for static scales, its unit scales,
    [Hkv, T, 1, 1] as the op wants them, one per cache shape shared by every layer. int8_kernel: what reads int8
    codes in place, "executorch" (llama::custom_quantized_sdpa) or "edgekv" (edgekv::int8_sdpa, edgekv/native: its
    library built and loaded here; it takes the codes and scales as stored, so no constants)."""
    if not layers:
        return None
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (registers torch.ops.llama.*)
    import executorch.kernels.quantized  # noqa: F401 (the per-token quantize kernels' out variants)
    from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401 (the ops themselves)
    d, h = model.args.head_dim, model.args.head_dim // 2
    rot = torch.zeros(d, d)
    rot[torch.arange(h, d), torch.arange(h)] = -1.0
    rot[torch.arange(h), torch.arange(h, d)] = 1.0
    consts = {"rope_rot": rot}
    fmt = layers[0].fmt
    bits = fmt.bits or 8
    if bits < 8 and (fmt.group or d) % (8 // bits) == 0:  # packed: read back in planar order
        planar = torch.zeros(d, d)
        planar[planar_order(d, bits), torch.arange(d)] = 1.0
        consts["planar"] = planar
    if int8_kernel not in INT8_KERNELS:
        raise EdgekvError(f"--pte-kernel: {int8_kernel!r} is not one of {', '.join(INT8_KERNELS)}")
    codes = [at for at in layers if at.fmt.storage.pte_read(at.dh) == "int8 codes"]
    if int8_kernel == "edgekv" and any(_edgekv_reads(at) for at in layers):
        from .. import native
        native.load()
        out = Constants(**consts)
        out.int8_kernel = "edgekv"
        return out
    for at in codes:
        consts[_op_const("zero", at.hkv, at.cache.slots)] = torch.zeros(at.hkv, at.cache.slots, 1, 1,
                                                                        dtype=torch.int8)
        if at.fmt.static:
            consts[_op_const("unit", at.hkv, at.cache.slots)] = torch.ones(at.hkv, at.cache.slots, 1, 1)
    return Constants(**consts)


def _sdpa_make(at, consts):
    new = _share(at, SdpaAttention)
    new.consts = consts
    return new


def _ring_setup(model, layers, int8_kernel: str = "executorch", **options):
    """"edgekv" when the rings hold int8 codes or fp16 values and edgekv's own kernels read them (its library built
    and loaded here), else None (the eager ring)."""
    if int8_kernel == "edgekv" and any(_edgekv_reads(at) and at.fmt.bits not in PACKED_BITS for at in layers):
        from .. import native
        native.load()
        return "edgekv"
    return None


def _ring_make(at, kernel):
    new = _share(at, RingSdpaAttention)
    # a packed ring keeps the eager ring: its several-token branch's group reshapes do not trace inside torch.cond
    # (a symbolic-size KeyError in torch.export), so only its global layers take edgekv::packed_sdpa
    if kernel == "edgekv" and _edgekv_reads(at) and at.fmt.bits not in PACKED_BITS:
        new.kernel = kernel
    return new


def _one_slot_per_position(at: Attention) -> bool:
    """A layer whose cache holds one slot per position (no rolling window). A layer without a cache of its own (the
    hybrids' attention, driven with an explicit plan by LFM2 / Granite-4.0-H / Qwen3.5) is not swapped."""
    return at.cache is not None and not at.cache.rolling


def _native_window(at: Attention) -> bool:
    """A rolling layer that is exactly the model's own sliding window: no sinks, no window strategy over it, as many
    slots as the window (edgekv.models.cache.layer_caches); GroupQueryAttention's window-sized cache serves it."""
    c = at.cache
    return c is not None and c.rolling and c.sinks == 0 and c.window is None and c.native == c.size


SWAPS: dict[str, list[Swap]] = {
    # the cache's storage says which fused ops read it (edgekv.strategies.storage: fused_runtimes)
    "onnxruntime": [Swap(lambda at: (_one_slot_per_position(at) or _native_window(at))
                         and at.fmt.storage.fused("onnxruntime"), _gqa_make, _gqa_setup)],
    "executorch": [Swap(lambda at: _one_slot_per_position(at) and at.fmt.storage.fused("executorch"), _sdpa_make,
                        _sdpa_setup),
                   # a model's own sliding layers (Gemma 3's beside its custom_sdpa layers): the eager ring, written
                   # in place, so that every layer is
                   Swap(lambda at: _native_window(at) and at.fmt.storage.fused("executorch"), _ring_make,
                        _ring_setup)],
}
INT8_KERNELS = ("executorch", "edgekv")  # --pte-kernel: what reads an int8 or fp16 cache in place in the .pte
NORM_SWAPS = {"onnxruntime": OnnxRMSNorm}  # the norms' form where any layer is swapped


def plan_swaps(model: nn.Module, runtime: str) -> list[Swap | None]:
    """Per eager Attention layer of model (in module order), the Swap that takes it for the runtime, or None."""
    rules = SWAPS.get(runtime, [])
    return [next((s for s in rules if s.applies(at)), None)
            for at in model.modules() if type(at) is Attention]


def for_runtime(model: nn.Module, runtime: str, **options) -> tuple[nn.Module, list[bool]]:
    """(a copy of model with each attention layer the runtime's op serves swapped, per attention layer whether it
    was). options go to the swaps' setup (executorch: int8_kernel). A model without eager Attention layers (mamba, rwkv, ...) comes back as it is, with []."""
    layers = [at for at in model.modules() if type(at) is Attention]
    chosen = plan_swaps(model, runtime)
    if not any(chosen):
        return model, [False] * len(layers)
    shared = {}
    for s in dict.fromkeys(s for s in chosen if s is not None):
        shared[s] = s.setup(model, [at for at, c in zip(layers, chosen) if c is s], **options)
    repl = {id(at): s.make(at, shared[s]) for at, s in zip(layers, chosen) if s is not None}
    norm = NORM_SWAPS.get(runtime)

    def swap(m):
        if id(m) in repl:
            return repl[id(m)]
        if norm is not None and type(m) is RMSNorm:
            return _share(m, norm)
        return m

    return _rebuild(model, swap), [c is not None for c in chosen]


def kernel_reference(model: nn.Module, runtime: str, int8_kernel: str = "executorch") -> nn.Module:
    """The eager reference for an artifact of the runtime: model itself, or where the runtime's op rounds the query
    (custom_quantized_sdpa on int8 codes: SdpaAttention) a copy, sharing its weights, whose eager layers round it
    the same way (Attention.query_int8) and compute everything else as before. int8_kernel "edgekv" (edgekv's own
    int8_sdpa, which never rounds the query): model itself."""
    if int8_kernel == "edgekv":
        return model
    layers = [at for at in model.modules() if type(at) is Attention]
    rounded = {id(at) for at, s in zip(layers, plan_swaps(model, runtime))
               if s is not None and s.make is _sdpa_make and at.fmt.storage.pte_read(at.dh) == "int8 codes"}
    if not rounded:
        return model

    def swap(m):
        if id(m) not in rounded:
            return m
        new = _share(m, Attention)
        new.query_int8 = True
        return new

    return _rebuild(model, swap)


def custom_ops(module: nn.Module) -> list[str]:
    """The ExecuTorch ops of edgekv's own (edgekv/native) that a module for_runtime(..., "executorch") returned calls:
    what an app running its .pte must link."""
    from .. import native
    ops = set()
    for m in module.modules():
        if (type(m) is SdpaAttention and getattr(m.consts, "int8_kernel", None) == "edgekv" and _edgekv_reads(m)) \
                or (type(m) is RingSdpaAttention and m.kernel == "edgekv"):
            ops.add((native.OP if m.fmt.storage.pte_read(m.dh) == "int8 codes" else
                     native.PACKED_OP if m.fmt.bits in PACKED_BITS else native.FP16_OP) + ".out")
    return sorted(ops)


def _rebuild(m: nn.Module, swap) -> nn.Module:
    """m with every submodule (and m itself) replaced by swap(sub) where that differs, the replacements' own
    submodules too; the modules on the way copied (_share), the rest, weights included, shared."""
    s = swap(m)
    kids = {name: _rebuild(child, swap) for name, child in s._modules.items() if child is not None}
    if all(kids[n] is s._modules[n] for n in kids):
        return s
    if s is m:
        s = _share(m, type(m))
    s._modules.update(kids)
    return s
