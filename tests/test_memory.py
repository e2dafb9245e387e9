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


# Runtime load terms and workspace, by hand from SmolLM2-135M's published config (30 layers, hidden 576, 9 query /
# 3 KV heads of 64, intermediate 1536, vocab 49152, tied embeddings) and the measured constants documented in
# edgekv/memory.py (ORT session 17 MB, ExecuTorch session 10 MB, 3 ORT score copies, 2 ORT state copies).
SMOL = catalog_arch("smollm2-135m")
SMOL_EMB = 49152 * 576 * 4  # fp32 table: 113,246,208 B
SMOL_LINEAR = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) * 4  # q,o + k,v + gate,up,down: 424,673,280 B


def test_ort_load_is_its_session_and_a_tied_head_peaks_while_it_loads():
    from edgekv.memory import runtime_load_bytes, workspace_bytes
    # the packed head is the weights' own bytes; the table the gather reads costs the rows it reads
    assert runtime_load_bytes(SMOL, "fp32", "onnxruntime").value == 17_000_000
    assert runtime_load_bytes(LLAMA, "fp32", "vllm").value == 0  # datacenter overheads live in the device profile
    # loading packs the head from the table's mapped pages before the state exists: a decode step's own workspace
    # (a row of activations and logits, one layer's K and V in fp32, 2 more copies of the kv-int8 state) is less
    s = parse_strategy("kv-int8")
    lay = build_layout(SMOL, s, 1024)
    step = (4 * 576 + (9 + 2 * 3) * 64 + 3 * 1536) * 4 + 2 * 9 * 1024 * 4 + 2 * 1024 * 4 + 49152 * 4 \
        + 2 * 3 * 1024 * 64 * 4 + 2 * lay.nbytes
    assert step < SMOL_EMB - lay.nbytes
    assert workspace_bytes(SMOL, lay, s, "onnxruntime", 1).value == SMOL_EMB - lay.nbytes
    # at 8k slots the state outweighs the table: the step is the peak
    big = build_layout(SMOL, s, 8192)
    assert workspace_bytes(SMOL, big, s, "onnxruntime", 1).value > SMOL_EMB - big.nbytes


def test_executorch_packs_the_delegated_weights_once_per_method():
    from edgekv.memory import runtime_load_bytes
    one = runtime_load_bytes(SMOL, "fp32", "executorch", methods=1).value
    two = runtime_load_bytes(SMOL, "fp32", "executorch", methods=2).value
    assert one == 10_000_000  # the packed lm_head is the weights' own bytes; the gather reads rows of the mapped table
    assert two - one == SMOL_LINEAR + SMOL_EMB  # linear layers + the delegate's own lm_head table, packed again


def test_ort_workspace_counts_score_copies_state_copies_and_the_load_transient():
    from edgekv.memory import workspace_bytes
    s = parse_strategy("kv-int8")  # a quantized cache: the explicit graph (no GroupQueryAttention)
    lay = build_layout(SMOL, s, 8192)
    state = 2 * 30 * 3 * (64 + 2) * 8192  # int8 codes + a fp16 scale per head_dim group
    assert lay.nbytes == state
    chunk = 512
    act = chunk * (4 * 576 + (9 + 2 * 3) * 64 + 3 * 1536) * 4
    # the graph writes the chunk into the 8192 slots first, then attends over all of them: 2 live fp32 score tensors
    # [9 heads, chunk, 8192] per layer + 2 fp32 [chunk, 8192] masks shared by the layers (measured: memory.MEASURED)
    scores = 2 * 9 * chunk * 8192 * 4 + 2 * chunk * 8192 * 4
    # + one row of logits (the call asks for its last row: edgekv.models.head; ORT allocates what a call returns)
    # + fp32 K,V of one layer + 2 more state copies (ORT's outputs and the numpy copies run() returns)
    step = act + scores + 49152 * 4 + 2 * 3 * 8192 * 64 * 4 + 2 * state
    assert workspace_bytes(SMOL, lay, s, "onnxruntime", chunk).value == step


def test_ort_workspace_of_a_fused_float_cache_is_one_probability_buffer_and_no_state_copy():
    from edgekv.memory import fused_gqa, workspace_bytes
    s = parse_strategy("kv")  # fp16 cache: GroupQueryAttention, present bound to past
    lay = build_layout(SMOL, s, 8192)
    assert fused_gqa(SMOL, lay, s, "onnxruntime") and not fused_gqa(SMOL, lay, s, "llama.cpp")
    chunk = 512
    act = chunk * (4 * 576 + (9 + 2 * 3) * 64 + 3 * 1536) * 4
    # one fp32 [9 heads, chunk, 8192 slots] probability buffer, a row of logits, one head's K (or V) in fp32
    step = act + 9 * chunk * 8192 * 4 + 49152 * 4 + 2 * (8192 + chunk) * 64 * 4
    assert workspace_bytes(SMOL, lay, s, "onnxruntime", chunk).value == step
    win = parse_strategy("window:w=256,sinks=4")
    assert not fused_gqa(SMOL, build_layout(SMOL, win, 8192), win, "onnxruntime")
    small = build_layout(SMOL, s, 256)  # a short context: packing the tied head from its table while loading
    assert workspace_bytes(SMOL, small, s, "onnxruntime", 32).value == SMOL_EMB - small.nbytes


SMOL_ACT = lambda chunk: chunk * (4 * 576 + (9 + 2 * 3) * 64 + 3 * 1536) * 4  # noqa: E731


def test_ort_workspace_of_a_rolling_window_is_the_larger_of_its_attention_and_the_written_copies():
    from edgekv.memory import workspace_bytes
    s = parse_strategy("window:w=4096,sinks=4")  # fp16 ring of 4100 slots at a 32k context
    lay = build_layout(SMOL, s, 32768)
    state = 2 * 30 * 3 * 4100 * 64 * 2
    assert lay.nbytes == state
    chunk, seen = 128, 4100 + 128  # a rolling layer attends over its old slots + this call's tokens
    attend = (SMOL_ACT(chunk) + 2 * 9 * chunk * seen * 4 + 2 * chunk * seen * 4 + 49152 * 4
              + 2 * 3 * 4100 * 64 * 4)  # + one layer's K,V cast to fp32
    copies = 2 * state + 49152 * 4  # ORT's outputs + the numpy copies, at the end of the call
    assert workspace_bytes(SMOL, lay, s, "onnxruntime", chunk).value == max(attend, copies)
    assert workspace_bytes(SMOL, lay, s, "onnxruntime", 512).value == max(  # long chunks: the attention wins
        SMOL_ACT(512) + 2 * 9 * 512 * 4612 * 4 + 2 * 512 * 4612 * 4 + 49152 * 4 + 2 * 3 * 4100 * 64 * 4, copies)


def test_ort_workspace_counts_the_rebuilt_keys_of_converted_mla_and_the_planes_of_an_int4_cache():
    from edgekv.memory import workspace_bytes
    # the measured counts documented in edgekv/memory.py: the fp32 latent + 8 key-sized tensors while converted MLA
    # rebuilds its keys (decode at 8192 slots: 9.0 x 6.29 MB), 2.6 unpacking planes beside an int4 cache's K and V
    rebuild, planes = 8, 2.6
    chunk, t = 128, 8192
    base = SMOL_ACT(chunk) + 2 * 9 * chunk * t * 4 + 2 * chunk * t * 4 + 49152 * 4
    s = parse_strategy("mla:rank=96")
    lay = build_layout(SMOL, s, t)
    assert lay.nbytes == 30 * t * 96 * 2  # one fp16 latent of width 96 per layer
    key = t * 3 * 64 * 4  # one layer's keys for every slot, fp32
    assert workspace_bytes(SMOL, lay, s, "onnxruntime", chunk).value == \
        base + t * 96 * 4 + rebuild * key + 2 * lay.nbytes
    s = parse_strategy("kv-int4")
    lay = build_layout(SMOL, s, t)
    assert workspace_bytes(SMOL, lay, s, "onnxruntime", chunk).value == \
        base + (2 + planes) * key + 2 * lay.nbytes


def test_executorch_workspace_of_a_plain_cache_is_its_read_back_or_the_pack_transient():
    from edgekv.memory import fused_gqa, runtime_load_bytes, workspace_bytes
    s = parse_strategy("kv")  # fp16 cache: custom_sdpa over the written rows, state written in place
    lay = build_layout(SMOL, s, 8192)
    assert fused_gqa(SMOL, lay, s, "executorch")
    chunk = 32
    unit = 3 * 8192 * 64 * 4  # one layer's K for every slot, fp32
    logits = chunk * 49152 * 4
    # no scores, no masks, no state copy; 2.5 K-sized read-backs in the method's plan, which lays the logits (after
    # the last layer) over them: SmolLM2's .pte kv fp16 plans 15.28 MiB at 8k (2.5 x 6 MiB + activations) and
    # 6.07 MiB at 1k (the 6.0 MiB of logits), read from the .pte (non_const_buffer_sizes)
    step = SMOL_ACT(chunk) + max(logits, 2.5 * unit)
    assert step == SMOL_ACT(chunk) + 2.5 * unit and abs(2.5 * unit / 2**20 - 15.0) < 1e-9
    assert workspace_bytes(SMOL, lay, s, "executorch", chunk).value == step
    # a two-method .pte has two plans: the shared read-back twice
    assert workspace_bytes(SMOL, lay, s, "executorch", chunk, methods=2).value == SMOL_ACT(chunk) + 5 * unit
    # the tied lm_head (the 49152 x 576 fp32 embedding) unpacked while XNNPACK packs it, as the method loads, is
    # there before the state is resident: the peak where it outweighs the state and a call's workspace (1k slots)
    small = build_layout(SMOL, s, 1024)
    assert small.nbytes == 30 * 2 * 3 * 64 * 2 * 1024
    assert workspace_bytes(SMOL, small, s, "executorch", chunk).value == SMOL_EMB - small.nbytes
    # an int8 cache with one scale per token and head is written in place too, its rows read back dequantized
    # (2.3 K-sized; ONNX: the explicit graph); finer groups 3.1, packed int4 3.25 (slopes of the tiny Llama's
    # planned buffer 8k -> 32k: 2.31, 3.13, 3.25). Their kernels' code pages are part of loading, a float cache has
    # none: int8 1088 KiB, int8 groups 1160, packed 2000 (/proc/self/smaps, the same on the tiny Llama and SmolLM2)
    fp16_load = runtime_load_bytes(SMOL, "fp32", "executorch", 1, lay, s).value
    assert fp16_load == runtime_load_bytes(SMOL, "fp32", "executorch").value
    for label, copies, code in (("kv-int8", 2.3, 1088), ("kv-int8:group=32", 3.1, 1160), ("kv-int4", 3.25, 2000)):
        g = parse_strategy(label)
        glay = build_layout(SMOL, g, 8192)
        assert fused_gqa(SMOL, glay, g, "executorch") and not fused_gqa(SMOL, glay, g, "onnxruntime")
        # (or the tied head being packed, where a quantized state is smaller than the table: int8 at 8k, 97 MB)
        assert workspace_bytes(SMOL, glay, g, "executorch", chunk).value == max(SMOL_ACT(chunk) + copies * unit,
                                                                              SMOL_EMB - glay.nbytes)
        assert runtime_load_bytes(SMOL, "fp32", "executorch", 1, glay, g).value == fp16_load + code * 1024
        assert runtime_load_bytes(SMOL, "fp32", "onnxruntime", 1, glay, g).value == \
            runtime_load_bytes(SMOL, "fp32", "onnxruntime").value
    # ONNX Runtime's session: the GroupQueryAttention graph of a float cache holds 14.7 MB, the others 17 (the middle)
    assert runtime_load_bytes(SMOL, "fp32", "onnxruntime", 1, lay, s).value == 14_700_000
    assert runtime_load_bytes(SMOL, "fp32", "onnxruntime").value == 17_000_000
