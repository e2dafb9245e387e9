"""torchao's eager quantized linear, the same numbers with a fifth of the dequantization's cost: what verify's eager
reference of a weight-quantized .pte runs through (EagerStepper).

torchao's F.linear over an IntxUnpackedToInt8Tensor (the 8da4w / 8da8w recipes of edgekv.export.wquant) quantizes the
input per token, dequantizes the whole weight to fp32 and calls F.linear: `dequantize_affine` makes three new fp32
tensors of the weight's size (codes to fp32, minus the zero point, times the scale) on every call. On Llama-3.2-1B that
is most of verify-pte's CPU: 22 calls of the reference and 22 of its noise floor, each widening all 1.24B weights
(benchmarks/README.md, "What an export costs"; experiments/verify_pte_cost.py measures it).

Here the weight is dequantized into one reused fp32 buffer in blocks of rows (each block's three steps run while it is
in cache), with the same three operations in the same order: codes to fp32 (exact: int8 values), minus the zero point
(exact: small integers; skipped where every zero point is 0, as in the symmetric recipes), times the scale widened to
fp32 (one rounding, IEEE's, whatever the loop). So the dequantized
weight is torchao's bit for bit, and F.linear is then called on it with the same input (torchao's own per-token
activation quantization) and shapes: the same logits, bit for bit (tests/test_eager_linear.py). Any other weight layout
takes torchao's own path.

What it saves on the random Llama-3.2-1B's int4 module, and what is left of a decode call:
experiments/verify_pte_cost.py, benchmarks/results/verify_pte_cost_llama_3.2_1b_random{,_skipzero}.json
(benchmarks/README.md, "What an export costs").
"""
from __future__ import annotations

import contextlib

ROW_BLOCK = 64  # rows dequantized at a time: 64 x 2048 fp32 is 0.5 MiB, inside a core's L2 (the fastest of 16..256
# rows timed on a [8192, 2048] int4 weight, one x86 core)

_depth = 0  # nesting of fast_quantized_linear (the patch is made by the outermost)
_buffer = None  # the reused fp32 buffer, sized by the largest weight seen inside the outermost context


def _weight_class():
    """torchao's IntxUnpackedToInt8Tensor, or None where torchao is not imported yet: then no weight of the process is
    one, and importing it here would only add its modules to the caller's memory (an fp32 module's reference pass)."""
    import sys
    if "torchao" not in sys.modules:
        return None
    try:
        from torchao.quantization import IntxUnpackedToInt8Tensor
    except ImportError:  # no torchao: nothing is quantized by it
        return None
    return IntxUnpackedToInt8Tensor


def dequantized(w):
    """w (an IntxUnpackedToInt8Tensor, 2-D, block size (1, group)) -> its fp32 values, in the shared buffer (valid until
    the next call), or None where its layout is not the one handled here (the caller takes torchao's path)."""
    import torch

    global _buffer
    q, s, z = w.qdata, w.scale, w.zero_point
    if (w.dtype != torch.float32 or q.dim() != 2 or q.dtype != torch.int8 or not q.is_contiguous()
            or len(w.block_size) != 2 or w.block_size[0] != 1 or q.shape[1] % w.block_size[1]):
        return None
    o, i = q.shape
    g = w.block_size[1]
    if tuple(s.shape) != (o, i // g) or (z is not None and tuple(z.shape) != (o, i // g)):
        return None
    if _buffer is None or _buffer.numel() < o * i:
        _buffer = None
        _buffer = torch.empty(o * i, dtype=torch.float32)
    out = _buffer[:o * i].view(o, i // g, g)
    codes = q.view(o, i // g, g)
    if z is not None and not bool(z.any()):  # symmetric codes (the int4 and int8 recipes): q - 0 is q, exactly
        z = None
    for a in range(0, o, ROW_BLOCK):
        d = out[a:a + ROW_BLOCK]
        d.copy_(codes[a:a + ROW_BLOCK])
        if z is not None:
            d.sub_(z[a:a + ROW_BLOCK].unsqueeze(-1))
        d.mul_(s[a:a + ROW_BLOCK].unsqueeze(-1))
    return out.view(o, i)


def _linear(original):
    def linear(func, types, args, kwargs):
        import torch
        from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
            IntxUnpackedToInt8TensorActivationQuantization as Act, _apply_int8_act_asym_per_token_quant_dequant)

        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
        cls = _weight_class()
        if not isinstance(w, cls) or isinstance(x, cls) or w.activation_quantization not in (None, Act.INT8_ASYM_PER_TOKEN):
            return original(func, types, args, kwargs)
        wide = dequantized(w)
        if wide is None:
            return original(func, types, args, kwargs)
        if w.activation_quantization is not None:
            x = _apply_int8_act_asym_per_token_quant_dequant(x)
        return torch.nn.functional.linear(x, wide, bias)
    return linear


@contextlib.contextmanager
def fast_quantized_linear():
    """Inside: F.linear over torchao's IntxUnpackedToInt8Tensor weights dequantizes through `dequantized` (the same
    values, a reused buffer). Outside, torchao's own path; the buffer is freed on leaving the outermost context. Not
    for tracing (torch.export goes through aten.linear, which this leaves alone) nor for threads sharing a module."""
    global _depth, _buffer
    cls = _weight_class()
    if cls is None:
        yield
        return
    import torch

    table = cls._TORCH_FN_TABLE[cls]
    fn = torch.nn.functional.linear
    original = table.get(fn)
    if _depth == 0 and original is not None:
        table[fn] = _linear(original)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            if original is not None:
                table[fn] = original
            _buffer = None
