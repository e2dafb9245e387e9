"""Properties of the arithmetic (hypothesis) and the memory components."""
from hypothesis import given, settings, strategies as st

from edgekv.arch import catalog_arch
from edgekv.memory import weight_bytes
from edgekv.strategies import build_layout, parse_strategy

LLAMA = catalog_arch("llama-3.2-1b")
MAMBA = catalog_arch("mamba-370m")
ctxs = st.integers(min_value=1, max_value=1 << 20)


def nbytes(arch, spec, ctx):
    return build_layout(arch, parse_strategy(spec), ctx).nbytes


@settings(max_examples=60, deadline=None)
@given(a=ctxs, b=ctxs, spec=st.sampled_from(["kv", "kv-int8", "kv-int4", "window", "mla", "mla:rank=32"]))
def test_memory_is_monotone_in_context_for_caches(a, b, spec):
    lo, hi = sorted((a, b))
    assert nbytes(LLAMA, spec, lo) <= nbytes(LLAMA, spec, hi)


@settings(max_examples=40, deadline=None)
@given(a=ctxs, b=ctxs)
def test_recurrent_state_is_flat_in_context(a, b):
    assert nbytes(MAMBA, "ssm", a) == nbytes(MAMBA, "ssm", b)


@settings(max_examples=40, deadline=None)
@given(ctx=ctxs, w=st.integers(1, 8192), s=st.integers(0, 16))
def test_window_caps_at_w_plus_sinks(ctx, w, s):
    per_token = nbytes(LLAMA, "kv", 1)
    assert nbytes(LLAMA, f"window:w={w},sinks={s}", ctx) == per_token * min(ctx, w + s)


@settings(max_examples=40, deadline=None)
@given(ctx=ctxs)
def test_int4_below_int8_below_fp16(ctx):
    assert nbytes(LLAMA, "kv-int4", ctx) < nbytes(LLAMA, "kv-int8", ctx) < nbytes(LLAMA, "kv", ctx)


def test_weight_precisions_order_and_int4_group_scales():
    b = {p: weight_bytes(LLAMA, p)["total"] for p in ("fp32", "fp16", "int8", "int4")}
    assert b["int4"] < b["int8"] < b["fp16"] < b["fp32"]
    # int4 linear layers: 0.5 B + an fp16 scale per 32 weights = 0.5625 B per weight
    lin = sum(w.numel for w in LLAMA.weights if w.cls == "linear")
    assert weight_bytes(LLAMA, "int4")["linear"] == lin * 0.5625
