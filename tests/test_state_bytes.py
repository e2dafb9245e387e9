"""KV / state bytes of published configs against hand arithmetic, and against numbers other tools print."""

from edgekv.arch import catalog_arch, read_gguf
from edgekv.strategies import build_layout, build_ring_layout, parse_strategy

MiB = 2**20


def state(model, spec, ctx):
    return build_layout(catalog_arch(model), parse_strategy(spec), ctx).nbytes


def test_llama_3_2_1b_kv_fp16():
    # config.json: 16 layers, 8 KV heads, head_dim 64 -> 2 x 16 x 8 x 64 x 2 B = 32,768 B per token
    assert state("llama-3.2-1b", "kv", 32768) == 2 * 16 * 8 * 64 * 2 * 32768 == 2**30


def test_llama_3_70b_matches_the_published_per_token_kv():
    # 80 layers x 8 KV heads x 128: 163,840 B/token at 1 B (anchors.md), 327,680 at fp16
    assert state("llama-3-70b", "kv:dtype=fp8", 1) == 163_840
    assert state("llama-3-70b", "kv", 128_000) == 327_680 * 128_000


def test_qwen2_5_0_5b_kv_fp16():
    # 24 layers, 2 KV heads, head_dim 64 (896 / 14 heads)
    assert state("qwen2.5-0.5b", "kv", 8192) == 2 * 24 * 2 * 64 * 2 * 8192


def test_gemma_3_1b_sliding_layers_cap_at_the_window():
    # 26 layers, 1 KV head, head_dim 256, window 512, every 6th layer global -> 4 global + 22 local
    ctx = 32768
    expected = 4 * 2 * 256 * ctx * 2 + 22 * 2 * 256 * 512 * 2
    assert state("gemma-3-1b", "kv", ctx) == expected


def test_deepseek_v2_lite_caches_the_latent():
    # 27 layers, kv_lora_rank 512 + qk_rope_head_dim 64, fp16
    assert state("deepseek-v2-lite", "mla", 4096) == 27 * (512 + 64) * 2 * 4096


def test_mamba_130m_state_is_flat_in_context():
    # 24 layers, d_inner 1536 (2 x 768), d_state 16, conv kernel 4 -> fp32 SSM state + 3-column conv state
    expected = 24 * (1536 * 16 * 4 + 1536 * 3 * 4)
    assert state("mamba-130m", "ssm", 1024) == state("mamba-130m", "ssm", 1 << 20) == expected


def test_mamba2_1_3b_state():
    # 48 layers, d_inner 4096 = 64 heads x 64, d_state 128, 1 group, conv over 4096 + 2 x 128 channels
    expected = 48 * (64 * 64 * 128 * 4 + (4096 + 256) * 3 * 4)
    assert state("mamba2-1.3b", "ssm", 32768) == expected


def test_jamba_keeps_kv_in_one_layer_of_eight():
    # Jamba-v0.1: 32 layers, attention at i % 8 == 4 (4 layers), 8 KV heads x 128; the Jamba paper's "4GB" KV at 256K
    arch = catalog_arch("jamba-v0.1")
    layout = build_layout(arch, parse_strategy("hybrid"), 262144)
    kv = sum(t.nbytes for t in layout.tensors if t.role in ("key", "value"))
    assert kv == 2 * 4 * 8 * 128 * 2 * 262144
    assert 4.0e9 < kv < 4.5e9


def test_smollm2_matches_what_llama_cpp_prints(gguf_path):
    # stack.md: llama.cpp prints f16 KV 45.00 MiB at ctx 2048 and 180.00 MiB at 8192, q8_0 23.91 MiB at 2048
    # (q8_0 = 32 int8 values + one fp16 scale = 34 B per 32 values, i.e. kv-int8 with group 32)
    arch = read_gguf(gguf_path)
    assert build_layout(arch, parse_strategy("kv"), 2048).nbytes == 45 * MiB
    assert build_layout(arch, parse_strategy("kv"), 8192).nbytes == 180 * MiB
    q8 = build_layout(arch, parse_strategy("kv-int8:group=32"), 2048).nbytes / MiB
    assert round(q8, 2) == 23.91


def test_int4_cache_counts_packed_codes_scales_and_zeros():
    # Llama-3.2-1B at 1 token: codes 64/2 B, per group of 32 an fp16 scale and an fp16 zero, for K and V
    per_token = 2 * 16 * 8 * (64 // 2 + (64 // 32) * 2 * 2)
    assert state("llama-3.2-1b", "kv-int4", 1) == per_token


def test_window_keeps_w_plus_sinks():
    assert state("llama-3.2-1b", "window:w=1000,sinks=4", 32768) == 2 * 16 * 8 * 64 * 2 * 1004
    assert state("llama-3.2-1b", "window:w=1000,sinks=4", 500) == 2 * 16 * 8 * 64 * 2 * 500


def test_converted_mla_default_rank_halves_the_cache():
    assert state("llama-3.2-1b", "mla", 4096) * 2 == state("llama-3.2-1b", "kv", 4096)
    assert state("llama-3.2-1b", "mla:rank=64", 1) == 16 * 64 * 2


def test_ring_holds_one_nth_per_gpu():
    arch = catalog_arch("llama-3-70b")
    assert build_ring_layout(arch, parse_strategy("ring:n=8"), 128000).nbytes == 327_680 * 16000


def test_state_names_follow_the_onnx_genai_convention():
    names = [t.name for t in build_layout(catalog_arch("llama-3.2-1b"), parse_strategy("kv-int4"), 8).tensors[:3]]
    assert names == ["past_key_values.0.key", "past_key_values.0.key.scale", "past_key_values.0.key.zero"]
    outs = [t.output for t in build_layout(catalog_arch("mamba-130m"), parse_strategy("ssm"), 8).tensors[:2]]
    assert outs == ["present_conv.0", "present_ssm.0"]


def test_rwkv_4_state_fp32_and_int8_by_hand():
    # RWKV-4 169M: 12 layers of 5 rows of 768 (ffn shift, att shift, num, den, max); fp16 has no path: fp32.
    # int8: 4 int8 rows + a fp32 scale per row + the fp32 max row
    assert state("rwkv-4-169m-pile", "linear", 4096) == 12 * 5 * 768 * 4
    assert state("rwkv-4-169m-pile", "linear:dtype=fp16", 4096) == 12 * 5 * 768 * 4
    arch = catalog_arch("rwkv-4-169m-pile")
    int8 = build_layout(arch, parse_strategy("linear:dtype=int8"), 64)
    assert int8.nbytes == 12 * (4 * 768 + 4 * 4 + 768 * 4)
    assert [t.shape for t in int8.tensors[:3]] == [(1, 4, 768), (1, 4, 1), (1, 1, 768)]


def test_int8_ssm_state_by_hand():
    # mamba-130m: int8 codes [1536, 16] + a fp32 scale per channel, beside the fp32 conv state; mamba2-1.3b per head
    assert state("mamba-130m", "ssm:dtype=int8", 1) == 24 * (1536 * 16 + 1536 * 4 + 1536 * 3 * 4)
    assert state("mamba2-1.3b", "ssm:dtype=int8", 1) == 48 * (64 * 64 * 128 + 64 * 64 * 4 + (4096 + 256) * 3 * 4)
    assert state("mamba2-1.3b", "ssm:dtype=fp16", 1) == 48 * (64 * 64 * 128 * 2 + (4096 + 256) * 3 * 4)


def test_converted_mla_rank_from_a_ratio_and_its_limits():
    # Llama-3.2-1B: K and V rows per layer 2 x 8 x 64 = 1024; ratio 0.25 keeps 256
    assert state("llama-3.2-1b", "mla:ratio=0.25", 1) == 16 * 256 * 2
    assert state("llama-3.2-1b", "mla:rank=1024", 1) == 16 * 1024 * 2
    import pytest

    from edgekv.errors import EdgekvError
    with pytest.raises(EdgekvError, match="between 1 and 1024"):
        state("llama-3.2-1b", "mla:rank=1025", 1)


def test_int8_cache_per_group_scales_and_the_fused_rule():
    from edgekv.strategies import per_token_int8
    # Llama-3.2-1B int8 in groups of 32: 64 codes + 2 fp16 scales per token, head and K/V; no zero points at 8 bits
    assert state("llama-3.2-1b", "kv-int8:group=32", 1) == 2 * 16 * 8 * (64 + 2 * 2)
    assert state("llama-3.2-1b", "kv-int2", 1) == 2 * 16 * 8 * (64 // 4 + 2 * 2 * 2)  # int2: 4 per byte
    lay = build_layout(catalog_arch("llama-3.2-1b"), parse_strategy("kv-int8"), 1)
    assert [(t.role, t.dtype, t.shape) for t in lay.tensors[:2]] == [("key", "int8", (1, 8, 1, 64)),
                                                                      ("key.scale", "float16", (1, 8, 1, 1))]
    assert per_token_int8(8, 0, 64) and per_token_int8(8, 64, 64)
    assert not per_token_int8(8, 32, 64) and not per_token_int8(4, 0, 64)


def test_hybrid_keeps_its_attention_in_the_strategy_dtype():
    # Jamba-v0.1 at fp32: 4 attention layers of 8 KV heads x 128, 28 Mamba layers (d_inner 8192, d_state 16)
    arch = catalog_arch("jamba-v0.1")
    lay = build_layout(arch, parse_strategy("hybrid:dtype=fp32"), 1000)
    kv = sum(t.nbytes for t in lay.tensors if t.role in ("key", "value"))
    assert kv == 2 * 4 * 8 * 128 * 4 * 1000
    assert lay.nbytes == kv + 28 * (8192 * 16 * 4 + 8192 * 3 * 4)


def test_strategies_that_do_not_fit_the_model_say_so():
    import pytest

    from edgekv.strategies import NotApplicable
    for model, spec in (("llama-3.2-1b", "ssm"), ("mamba-130m", "kv"), ("jamba-v0.1", "ssm"),
                        ("llama-3.2-1b", "hybrid"), ("deepseek-v2-lite", "kv"), ("jamba-v0.1", "linear")):
        with pytest.raises(NotApplicable):
            state(model, spec, 8)
