"""The non-GQA export modules (Mamba-1/2, DeepSeek-V2 MLA, converted MLA, RWKV-4, Jamba, decayed linear attention)
against independent references: transformers' own models, and for the linear-attention mixer (which transformers
lacks) the O(T^2) masked-attention formula written out below.

Every comparison runs our module the way an exported program runs it: a prefill, then one-token decode steps with the
state tensors fed back, against transformers' full-sequence forward over the same tokens.
"""
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import greedy_with_state, tiny_models  # noqa: E402
from conftest import tiny_hf as conftest_tiny_hf  # noqa: E402
from edgekv.arch import Arch, arch_from_config, read_config_json  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models.jamba import load_jamba  # noqa: E402
from edgekv.models.mamba import load_mamba  # noqa: E402
from edgekv.models.converted_mla import factorisation_errors, load_converted_mla  # noqa: E402
from edgekv.models.mla import load_deepseek  # noqa: E402
from edgekv.models.recurrent import LinearAttention, LinearArgs, LinearLM, linear_arch, load_rwkv, phi  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402
from tiny_families import hf_logits  # noqa: E402

PROMPT = [3, 17, 42, 5, 8, 60, 11]

MOE = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
           moe_intermediate_size=16)
DSV2 = dict(cls="DeepseekV2Config", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            initializer_range=0.3, max_position_embeddings=256, **MOE)
TINY = {
    "mamba": (dict(cls="MambaConfig", vocab_size=100, hidden_size=32, num_hidden_layers=3, state_size=8,
                   initializer_range=0.5), load_mamba, "ssm:dtype=fp32"),
    "mamba2": (dict(cls="Mamba2Config", vocab_size=100, hidden_size=32, num_hidden_layers=2, state_size=8,
                    num_heads=8, head_dim=8, n_groups=2, chunk_size=8, initializer_range=0.5),
               load_mamba, "ssm:dtype=fp32"),
    "deepseek_v2": (dict(DSV2, q_lora_rank=None), load_deepseek, "mla:dtype=fp32"),
    "deepseek_v2-qlora-yarn-grouped": (
        dict(DSV2, q_lora_rank=24, topk_method="group_limited_greedy", n_group=2, topk_group=1,
             routed_scaling_factor=1.5, max_position_embeddings=64,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 0.707}),
        load_deepseek, "mla:dtype=fp32"),
    "jamba": (dict(cls="JambaConfig", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                   attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
                   mamba_d_state=8, mamba_dt_rank=4, initializer_range=0.3), load_jamba, "hybrid:dtype=fp32"),
    "rwkv": (dict(cls="RwkvConfig", vocab_size=100, hidden_size=32, num_hidden_layers=3, rescale_every=1),
             load_rwkv, "linear"),
    "llama-as-mla": (dict(cls="LlamaConfig", vocab_size=97, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False),
                     load_converted_mla, "mla:rank=64,dtype=fp32"),  # full rank: 2 x Hkv x D = 64
    "qwen2-as-mla": (dict(cls="Qwen2Config", vocab_size=101, hidden_size=48, intermediate_size=80,
                          num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.2,
                          rope_theta=1e6), load_converted_mla, "mla:rank=32,dtype=fp32"),  # k/v biases, tied head
}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_hf(kind: str, folder):
    """A random transformers model of that family, saved as an HF folder (config.json + model.safetensors)."""
    return conftest_tiny_hf(TINY[kind][0], folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (transformers model, folder); each tiny model is built once per test module."""
    return tiny_models(tmp_path_factory, {k: v[0] for k, v in TINY.items()})


def load(kind, folder, max_ctx=64, strategy=None):
    _, loader, spec = TINY[kind]
    return loader(str(folder), parse_strategy(strategy or spec), max_ctx)



# ---- parity with transformers ----


@pytest.mark.parametrize("kind", list(TINY))
def test_matches_transformers_over_prefill_and_32_decode_steps(kind, saved):
    ref, folder = saved(kind)
    module = load(kind, folder).module
    tokens, logits, _ = greedy_with_state(module, PROMPT, steps=32)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    assert scale > 1.0  # random weights large enough that every part of the model matters
    diff = (logits - want).abs().max().item()
    print(f"\n{kind}: max abs diff {diff:.3g} at logit scale {scale:.3g}")
    assert diff <= 2e-5 * scale, f"{kind}: max abs diff {diff:.3g} (logit scale {scale:.3g})"
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", ["mamba2", "deepseek_v2", "jamba", "rwkv"])
def test_chunked_prefill_equals_one_shot_prefill(kind, saved):
    _, folder = saved(kind)
    module = load(kind, folder).module
    prompt = [4, 9, 33, 2, 71, 15, 60, 8, 1, 99, 23]
    _, one, _ = greedy_with_state(module, prompt, steps=6)
    _, chunked, _ = greedy_with_state(module, prompt, steps=6, chunk=4)
    assert (one - chunked).abs().max().item() <= 1e-5 * one.abs().max().item()


def test_rwkv_state_is_transformers_state(saved):
    """Not just the logits: the five vectors per layer are the ones RwkvModel returns (ffn shift, att shift, num,
    den, max), so a state could be handed over between the two."""
    ref, folder = saved("rwkv")
    module = load("rwkv", folder).module
    tokens, _, state = greedy_with_state(module, PROMPT, steps=5)
    with torch.no_grad():
        hf_state = ref(torch.tensor([tokens]), use_cache=True).state  # 5 x [1, d, layers]
    for i, s in enumerate(state):
        want = torch.stack([hf_state[k][0, :, i] for k in range(5)])
        assert torch.allclose(s[0], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_fp16_caches_stay_close_to_the_fp32_reference(saved):
    for kind, spec in (("jamba", "hybrid"), ("deepseek_v2", "mla")):  # both default to fp16 KV / latent
        ref, folder = saved(kind)
        module = load(kind, folder, strategy=spec).module
        assert torch.float16 in {s.dtype for s in module.empty_state()}
        tokens, logits, _ = greedy_with_state(module, PROMPT, steps=32)
        want = hf_logits(ref, tokens)
        assert (logits - want).abs().max().item() <= 5e-3 * want.abs().max().item()


# ---- the state is the StateLayout ----


@pytest.mark.parametrize("kind", list(TINY))
def test_state_is_exactly_the_strategy_layout(kind, saved):
    ref, folder = saved(kind)
    loaded = load(kind, folder, max_ctx=48)
    strategy = parse_strategy(TINY[kind][2])
    layout = build_layout(arch_from_config(ref.config.to_dict(), kind, "test"), strategy, 48)
    assert [(t.name, t.shape, t.dtype) for t in loaded.layout.tensors] == \
        [(t.name, t.shape, t.dtype) for t in layout.tensors]
    state = loaded.module.empty_state()
    assert [tuple(s.shape) for s in state] == [t.shape for t in layout.tensors]
    out = loaded.module(torch.tensor([[1, 2, 3]]), torch.tensor([0]), *state)
    assert out[0].shape == (1, 3, ref.config.vocab_size)
    assert [(tuple(s.shape), str(s.dtype)[6:]) for s in out[1:]] == [(t.shape, t.dtype) for t in layout.tensors]


def test_ssm_and_recurrent_state_is_flat_in_context(saved):
    for kind in ("mamba", "mamba2", "rwkv"):
        _, folder = saved(kind)
        short, long = load(kind, folder, max_ctx=64), load(kind, folder, max_ctx=1024)
        assert short.layout.nbytes == long.layout.nbytes
        assert [s.shape for s in short.module.empty_state()] == [s.shape for s in long.module.empty_state()]
    _, folder = saved("mamba")
    shapes = {t.name: t.shape for t in load("mamba", folder).layout.tensors}
    assert shapes["past_conv.0"] == (1, 64, 3) and shapes["past_ssm.0"] == (1, 64, 8)  # [1, Di, K-1], [1, Di, N]
    _, folder = saved("mamba2")
    shapes = {t.name: t.shape for t in load("mamba2", folder).layout.tensors}
    assert shapes["past_conv.0"] == (1, 64 + 2 * 2 * 8, 3) and shapes["past_ssm.0"] == (1, 8, 8, 8)


def test_hybrid_state_grows_only_in_its_attention_layers(saved):
    _, folder = saved("jamba")
    a, b = load("jamba", folder, max_ctx=32), load("jamba", folder, max_ctx=64)
    for ta, tb in zip(a.layout.tensors, b.layout.tensors):
        assert (ta.shape == tb.shape) == (ta.role in ("conv", "ssm"))


# ---- converted MLA ----


def test_converted_mla_below_full_rank_equals_llama_with_low_rank_kv(saved):
    """At rank r the module must compute exactly a Llama whose W_k, W_v are replaced by W_up W_down: the cache and
    the attention lose nothing beyond the factorisation itself."""
    ref, folder = saved("llama-as-mla")
    loaded = load("llama-as-mla", folder, strategy="mla:rank=24,dtype=fp32")
    assert [t.shape for t in loaded.layout.tensors] == [(1, 64, 24)] * 2
    lowrank = transformers.LlamaForCausalLM(ref.config).eval()
    lowrank.load_state_dict(ref.state_dict())
    kvd = 2 * 16
    with torch.no_grad():
        for i, layer in enumerate(lowrank.model.layers):
            attn = loaded.module.model.layers[i].self_attn
            w = attn.kv_up @ attn.kv_down
            layer.self_attn.k_proj.weight.copy_(w[:kvd])
            layer.self_attn.v_proj.weight.copy_(w[kvd:])
    tokens, logits, _ = greedy_with_state(loaded.module, PROMPT, steps=32)
    want = hf_logits(lowrank, tokens)
    assert (logits - want).abs().max().item() <= 2e-5 * want.abs().max().item()
    assert (logits - hf_logits(ref, tokens)).abs().max().item() > 1e-2  # rank 24 of 64 really is an approximation


def test_factorisation_error_follows_the_singular_values(saved):
    """Eckart-Young: the best rank-r error is sqrt(sum of the dropped squared singular values) / ||W||."""
    ref, folder = saved("llama-as-mla")
    attn = ref.model.layers[1].self_attn
    s = torch.linalg.svdvals(torch.cat([attn.k_proj.weight, attn.v_proj.weight]).double())
    errs = {r: factorisation_errors(str(folder), r) for r in (8, 32, 64)}
    for r, e in errs.items():
        want = math.sqrt((s[r:] ** 2).sum().item() / (s ** 2).sum().item())
        assert e[1] == pytest.approx(want, abs=1e-9)
    assert errs[8][0] > errs[32][0] > errs[64][0] and errs[64][0] < 1e-12
    assert load("llama-as-mla", folder, strategy="mla:rank=32,dtype=fp32").module.errors == pytest.approx(errs[32])


# ---- decayed linear attention: no transformers model, so the O(T^2) formula ----


def quadratic_linear_attention(m: LinearAttention, x):
    """o_t = sum_{s<=t} a^(t-s) (phi(q_t) . phi(k_s)) v_s / sum_{s<=t} a^(t-s) (phi(q_t) . phi(k_s)), per head,
    then o_proj. x [1, T, d] -> [1, T, d]."""
    t, h, dk, dv = x.shape[1], m.h, m.dk, m.dv
    q = phi(m.q_proj(x).view(t, h, dk)).transpose(0, 1)  # [H, T, Dk]
    k = phi(m.k_proj(x).view(t, h, dk)).transpose(0, 1)
    v = m.v_proj(x).view(t, h, dv).transpose(0, 1)  # [H, T, Dv]
    a = torch.sigmoid(m.decay.detach()).double()
    idx = torch.arange(t)
    age = (idx[:, None] - idx[None, :]).double()  # t - s
    causal = idx[:, None] >= idx[None, :]
    decay = torch.where(causal, a[:, None, None] ** age.clamp(min=0), 0.0)  # [H, T, T]
    w = decay * (q.double() @ k.double().transpose(1, 2))
    o = (w @ v.double()) / w.sum(-1, keepdim=True)  # [H, T, Dv]
    return m.o_proj(o.transpose(0, 1).reshape(1, t, h * dv).float())


def test_linear_attention_recurrence_equals_the_quadratic_formula():
    torch.manual_seed(0)
    m = LinearAttention(d=32, n_heads=4, d_k=8, d_v=6)
    with torch.no_grad():
        m.decay.copy_(torch.tensor([-2.0, 0.0, 1.5, 4.0]))  # a from 0.12 to 0.98
    x = torch.randn(1, 40, 32)
    want = quadratic_linear_attention(m, x)
    state = torch.zeros(1, 4, 8, 7)
    outs = []
    with torch.no_grad():
        for s, e in [(0, 5), (5, 8)] + [(i, i + 1) for i in range(8, 40)]:  # two prefill chunks, then decode steps
            o, state = m(x[:, s:e], state)
            outs.append(o)
    got = torch.cat(outs, dim=1)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_linear_lm_state_is_its_layout_and_flat_in_context():
    a = LinearArgs(vocab=100, hidden=32, n_layers=2, n_heads=4, d_k=8, d_v=8, intermediate=64)
    arch = linear_arch(a)
    assert isinstance(arch, Arch) and arch.family == "linear"
    assert arch.n_params == sum(p.numel() for p in LinearLM(a, build_layout(arch, parse_strategy("linear"), 8))
                                .parameters())
    small, big = (build_layout(arch, parse_strategy("linear"), n) for n in (64, 4096))
    assert small.nbytes == big.nbytes == 2 * 4 * 8 * 9 * 4  # layers x H x Dk x (Dv + 1) x fp32
    torch.manual_seed(0)
    lm = LinearLM(a, small).eval()
    _, one, _ = greedy_with_state(lm, PROMPT, steps=8)
    _, stepped, state = greedy_with_state(lm, PROMPT, steps=8, chunk=1)
    assert (one - stepped).abs().max().item() <= 1e-5 * one.abs().max().item()
    assert [tuple(s.shape) for s in state] == [(1, 4, 8, 9)] * 2


# ---- export ----


def _linear_lm():
    a = LinearArgs(vocab=100, hidden=32, n_layers=2, n_heads=4, d_k=8, d_v=8, intermediate=64)
    torch.manual_seed(0)
    return LinearLM(a, build_layout(linear_arch(a), parse_strategy("linear"), 32)).eval()


@pytest.mark.parametrize("kind", ["mamba", "mamba2", "deepseek_v2", "jamba", "rwkv", "llama-as-mla", "linear"])
def test_decode_step_exports_with_torch_export(kind, saved):
    module = _linear_lm() if kind == "linear" else load(kind, saved(kind)[1], max_ctx=32).module
    state = [torch.randn_like(s) * 0.1 if kind != "rwkv" else s for s in module.empty_state()]
    example = (torch.tensor([[5]]), torch.tensor([3]), *state)
    program = torch.export.export(module, example)
    for want, got in zip(module(*example), program.module()(*example)):
        assert torch.allclose(want, got, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mamba", "mamba2", "deepseek_v2", "jamba", "rwkv", "llama-as-mla", "linear"])
def test_decode_step_lowers_to_executorch_and_onnx(kind, saved, tmp_path):
    """~20 s each on 2 cores: ExecuTorch with XNNPACK and ONNX Runtime run the exported step like eager torch."""
    import onnxruntime as ort
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    module = _linear_lm() if kind == "linear" else load(kind, saved(kind)[1], max_ctx=32).module
    example = (torch.tensor([[5]]), torch.tensor([3]), *module.empty_state())
    want = module(*example)
    prog = to_edge_transform_and_lower(torch.export.export(module, example),
                                       partitioner=[XnnpackPartitioner()]).to_executorch()
    (tmp_path / "m.pte").write_bytes(prog.buffer)
    got = Runtime.get().load_program(str(tmp_path / "m.pte")).load_method("forward").execute(list(example))
    assert max((w - g).abs().max().item() for w, g in zip(want, got)) < 1e-4
    torch.onnx.export(module, example, str(tmp_path / "m.onnx"), dynamo=True, external_data=False)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"))
    got = sess.run(None, {i.name: x.numpy() for i, x in zip(sess.get_inputs(), example)})
    assert max((w - torch.from_numpy(g)).abs().max().item() for w, g in zip(want, got)) < 1e-4


# ---- errors a user can cause ----


def test_wrong_strategy_or_model_is_one_clear_error(saved):
    _, mamba = saved("mamba")
    _, llama = saved("llama-as-mla")
    with pytest.raises(EdgekvError, match="does not apply"):
        load_mamba(str(mamba), parse_strategy("kv"), 64)
    with pytest.raises(EdgekvError, match="not a mamba model"):
        load_mamba(str(llama), parse_strategy("kv"), 64)
    with pytest.raises(EdgekvError, match="rank must be between"):
        load_converted_mla(str(llama), parse_strategy("mla:rank=65"), 64)
    with pytest.raises(EdgekvError, match="exceeds the model's trained context"):
        load_converted_mla(str(llama), parse_strategy("mla:rank=8"), 512)
    assert read_config_json(llama).family == "transformer"
