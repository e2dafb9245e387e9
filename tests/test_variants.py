"""Each Llama-family variant declared in edgekv.arch.variants carries its transformers config class's defaults: the
value a config.json that leaves the field out gets (tied head, RMSNorm eps, RoPE bases, activation, score scale,
window). The reference is the config class itself (AutoConfig.for_model), not edgekv's declaration."""
import pytest

transformers = pytest.importorskip("transformers")

from edgekv.arch.variants import VARIANTS  # noqa: E402

DECLARED = sorted(mt for mt, v in VARIANTS.items() if not v.text_model)  # a wrapper's defaults are its text model's


def _theta(rope: dict) -> float:
    return float(rope["rope_theta"])


@pytest.mark.parametrize("mt", DECLARED)
def test_the_declared_defaults_are_the_config_classes(mt):
    v = VARIANTS[mt]
    c = transformers.AutoConfig.for_model(mt)
    assert v.tied == c.tie_word_embeddings
    assert v.rms_eps == c.rms_norm_eps
    assert v.act == getattr(c, v.act_field)
    rope = c.rope_parameters
    if v.local_rope_theta is not None:  # per layer type (transformers >= 5)
        assert (v.rope_theta, v.local_rope_theta) == (_theta(rope["full_attention"]), _theta(rope["sliding_attention"]))
    else:
        assert v.rope_theta == _theta(rope)
    assert v.query_pre_attn_scalar == getattr(c, "query_pre_attn_scalar", None)
    if v.window_default is not None:
        assert v.window_default == c.sliding_window
    assert hasattr(c, "no_rope_layers") == v.nope_layers


def test_wrappers_name_a_declared_text_model():
    for v in VARIANTS.values():
        if v.text_model:
            assert v.text_model in VARIANTS and VARIANTS[v.text_model].exported


# a tiny config of each model type; the ids inside the vocabulary (the classes' defaults name Llama-3's)
TINY = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _norm_offset(norm) -> float:
    """c in y = (c + w) * x / rms(x), read off transformers' own RMSNorm: its output with w = 0 and with w = 1."""
    torch = pytest.importorskip("torch")
    x = torch.arange(1.0, 1.0 + norm.weight.numel()).reshape(1, -1)
    with torch.no_grad():
        norm.weight.fill_(0.0)
        y0 = norm(x)[0, 0].item()
        norm.weight.fill_(1.0)
        y1 = norm(x)[0, 0].item()
    return y0 / (y1 - y0)


@pytest.mark.parametrize("mt", DECLARED)
def test_the_declared_layer_is_the_transformers_modules(mt):
    """Biases, norm layout and offset, qk-norm and the scaled embedding as transformers' own modules have them, for
    the config class's attention_bias and (where the class has the field) for attention_bias=True."""
    pytest.importorskip("torch")
    v = VARIANTS[mt]
    c = transformers.AutoConfig.for_model(mt, **TINY)
    for bias in [c.attention_bias, True] if hasattr(c, "attention_bias") else [False]:
        c = transformers.AutoConfig.for_model(mt, **TINY, **({"attention_bias": bias} if bias else {}))
        m = transformers.AutoModelForCausalLM.from_config(c)
        layer, att = m.model.layers[0], m.model.layers[0].self_attn
        q = getattr(att, "q_proj", None) or att.qkv_proj  # Phi-3's fused projection
        assert (q.bias is not None, att.o_proj.bias is not None) == v.biases(bool(bias)), bias
    norms = {n: ch for n, ch in layer.named_children() if "Norm" in type(ch).__name__}
    assert set(norms) == set(v.norm_names().values())
    assert _norm_offset(next(iter(norms.values()))) == pytest.approx(v.norm_offset, abs=1e-4)
    shape = {"head": (c.head_dim,), "proj": (c.num_attention_heads * c.head_dim,), None: None}[v.qk_norm]
    assert (tuple(att.q_norm.weight.shape) if hasattr(att, "q_norm") else None) == shape
    assert ("Scaled" in type(m.model.embed_tokens).__name__) == v.embed_scale


# ---- the support flags: exported, gguf_permuted, gguf_export, gguf_defaults, mla_convertible ----

def test_only_a_single_decoder_config_is_exported_itself():
    """A variant edgekv.models.llama builds is one decoder: transformers' config class for it has no sub-configs. A
    wrapper (Gemma3Config: text_config and vision_config) is exported through its text model, not as itself."""
    for mt, v in VARIANTS.items():
        subs = set(transformers.AutoConfig.for_model(mt).sub_configs)
        assert not (v.exported and subs), (mt, subs)
        assert (v.text_model is not None) == ("text_config" in subs), mt


# llama.cpp's converter writes a Mistral checkpoint as general.architecture "llama" (gguf-py has no "mistral"
# architecture; transformers' GGUF reader tells Mistral apart by the model name), so its tensors are Llama's
LLAMA_CPP_ARCH = {"mistral": "llama"}


def _llama_cpp_arch(v) -> str:
    gguf = pytest.importorskip("gguf")
    arch = LLAMA_CPP_ARCH.get(v.gguf_arch, v.gguf_arch)
    assert arch in gguf.MODEL_ARCH_NAMES.values(), arch
    assert "mistral" not in gguf.MODEL_ARCH_NAMES.values()  # else LLAMA_CPP_ARCH is stale
    return arch


GGUF_DECLARED = sorted(mt for mt, v in VARIANTS.items() if v.gguf_arch)
# exported variants whose GGUF the loader could read but whose GGUF export edgekv does not claim: a Qwen3 GGUF's
# tensors all have loader names and a random one loads as its folder, but no Qwen3 GGUF export has been checked end
# to end (its run against transformers), so gguf_export stays False
GGUF_NOT_CLAIMED = {"qwen3"}


@pytest.mark.parametrize("mt", GGUF_DECLARED)
def test_gguf_q_k_rows_are_permuted_where_transformers_gguf_reader_unpermutes_them(mt):
    """gguf_permuted against transformers' GGUF reader (modeling_gguf_pytorch_utils.TENSOR_PROCESSORS, picked by the
    file's architecture): it undoes convert_hf_to_gguf.py's q/k row permutation for the architectures llama.cpp runs
    with interleaved RoPE (llama) and leaves the NEOX-RoPE ones (qwen2, qwen3, phi3, gemma) as stored."""
    np = pytest.importorskip("numpy")
    gu = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    v = VARIANTS[mt]
    proc = gu.TENSOR_PROCESSORS.get(_llama_cpp_arch(v), gu.TensorProcessor)(
        config={"num_attention_heads": 2, "num_key_value_heads": 2})
    w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of 8 rows
    for part in ("attn_q", "attn_k"):
        out = proc.process(weights=w.copy(), name=f"blk.0.{part}.weight").weights
        assert (not np.array_equal(out, w)) == v.gguf_permuted, part


def _hf_model(mt):
    """transformers' causal LM of a tiny config of that type, on the meta device (names and shapes only)."""
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(mt, **TINY))


@pytest.mark.parametrize("mt", GGUF_DECLARED)
def test_a_gguf_is_exported_only_where_the_loader_reads_every_tensor_llama_cpp_writes(mt):
    """gguf_export against gguf-py's tensor name map (what convert_hf_to_gguf.py names each of transformers' tensors
    for the architecture): a variant exported from a GGUF is an exported variant, and the loader
    (edgekv.models.weights) has a name for every tensor llama.cpp writes for it. Phi-3's fused attn_qkv has none."""
    gguf = pytest.importorskip("gguf")
    from edgekv.models.weights import _GGUF_TOP, gguf_block_names

    v = VARIANTS[mt]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == _llama_cpp_arch(v))
    names = gguf.get_tensor_name_map(arch, TINY["num_hidden_layers"])
    written = {names.get_name(k, try_suffixes=(".weight", ".bias")) for k in _hf_model(mt).state_dict()}
    written.discard(None)  # a tied head: llama.cpp writes no output.weight
    read = set(gguf_block_names(v))
    unread = sorted(n for n in written if n not in _GGUF_TOP and n.split(".")[2] not in read)
    if v.gguf_export:
        assert v.exported and not unread, unread
    else:
        assert unread or not v.exported or mt in GGUF_NOT_CLAIMED, unread


# model types make_random_model.py writes a GGUF of (tests/test_random_model.py holds those files to transformers'
# GGUF reader) whose GGUF export edgekv claims (README.md, the families table): llama, mistral, qwen2, gemma3
GGUF_EXPORTED = ("llama", "mistral", "qwen2", "gemma3_text")


def _tiny_gguf(mt, tmp_path) -> dict:
    """A tiny GGUF f16 of model type mt written by scripts/make_random_model.py from an HF folder, and its folder."""
    import json

    from conftest import make_random_model
    mrm = make_random_model()
    # a vocabulary past the writer's 256 byte tokens
    cfg = transformers.AutoConfig.for_model(mt, **{**TINY, "vocab_size": 300}, tie_word_embeddings=False).to_dict()
    cfg.update(torch_dtype="float32", architectures=[type(_hf_model(mt)).__name__])
    (tmp_path / "e.json").write_text(json.dumps({"name": f"tiny-{mt}", "config": cfg}))
    return mrm.make(str(tmp_path / "e.json"), tmp_path / "m", std=0.2, echo=lambda s: None)  # logits of order 10


@pytest.mark.parametrize("mt", GGUF_EXPORTED)
def test_a_random_gguf_of_each_exported_architecture_loads_as_its_folder(mt, tmp_path):
    """edgekv.models.weights.load_gguf gives the folder's weights (to f16 rounding; Gemma's norms back from 1 + w):
    the tensor names, the q/k row order (un-permuted) and the layout the GGUF writer used."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from edgekv.models.weights import load_gguf
    made = _tiny_gguf(mt, tmp_path)
    _, sd, _, _ = load_gguf(made["gguf"])
    want = load_file(made["folder"] + "/model.safetensors")
    assert set(sd) == set(want)
    for k, w in want.items():
        torch.testing.assert_close(sd[k].float(), w.float(), rtol=1e-3, atol=1e-3 * w.abs().max().item(), msg=k)


@pytest.mark.slow  # needs llama-cpp-python, which `make bench-deps` compiles (make test-all runs it)
@pytest.mark.parametrize("mt", GGUF_EXPORTED)
def test_the_export_module_from_a_random_gguf_gives_llama_cpps_logits(mt, tmp_path):
    """The export module edgekv builds from the tiny GGUF gives llama.cpp's logits for the same file
    (llama-cpp-python): the header's reading, what it does not carry (gguf_defaults, Gemma 3's score scale
    1/sqrt(head_dim), here 16 and not the config class's 256) and the q/k row order."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    llama_cpp = pytest.importorskip("llama_cpp")
    from conftest import greedy_with_state

    from edgekv.models import load_any
    from edgekv.strategies import parse_strategy
    made = _tiny_gguf(mt, tmp_path)
    prompt = [5, 17, 3, 40, 22, 9, 31, 2, 60, 11]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module = load_any(made["gguf"], parse_strategy("kv:dtype=fp32"), 64).module
        _, got, _ = greedy_with_state(module, prompt, steps=0)
    finally:
        torch.set_num_threads(before)
    llm = llama_cpp.Llama(made["gguf"], n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(prompt)
    ref = np.asarray(llm.scores[:len(prompt)])
    # llama.cpp's f16 matmuls: 5e-4 of the largest logit measured; a wrong score scale or row order moves it 30 %
    assert np.abs(got.detach().numpy() - ref).max() <= 3e-3 * np.abs(ref).max()


def _transformers_default(c, key: str):
    """A gguf_defaults key as transformers' config class holds its default (transformers >= 5 keeps the sliding
    layers' RoPE base under rope_parameters and the pattern as layer_types)."""
    if key == "rope_local_base_freq":
        return float(c.rope_parameters["sliding_attention"]["rope_theta"])
    if key == "sliding_window_pattern":  # every n-th layer global: the first global layer is n - 1
        return c.layer_types.index("full_attention") + 1
    return getattr(c, key)


@pytest.mark.parametrize("mt", [mt for mt in GGUF_DECLARED if VARIANTS[mt].gguf_defaults])
def test_gguf_defaults_are_what_transformers_gguf_reader_ends_up_with(mt):
    """What a GGUF header does not carry: none of gguf_defaults is a field transformers' GGUF reader maps from the
    header (integrations.ggml.GGUF_CONFIG_MAPPING), and each is the config class's default, which that reader
    leaves in place (and which llama.cpp's loader hard-codes for the architecture)."""
    ggml = pytest.importorskip("transformers.integrations.ggml")
    v = VARIANTS[mt]
    mapped = set(ggml.GGUF_CONFIG_MAPPING[_llama_cpp_arch(v)].values())
    c = transformers.AutoConfig.for_model(mt)
    for key, value in v.gguf_defaults.items():
        assert key not in mapped, key
        assert value == _transformers_default(c, key), key


# a tiny transformers model of each llama-family model type, with what sets the type apart from Llama switched on:
# tests/tiny_families.py's (Phi-3 as Phi-4-mini: partial rotary and longrope; Gemma 3 with sliding layers)
MLA_TINY = {"llama": None, "mistral": None, "qwen2": None, "qwen3": "qwen3", "phi3": "phi4mini",
            "smollm3": "smollm3", "gemma3_text": "gemma3", "olmo2": "olmo2"}


def test_every_exported_variant_is_probed_for_the_mla_conversion():
    assert set(MLA_TINY) == {mt for mt, v in VARIANTS.items() if v.exported}


@pytest.mark.parametrize("mt", sorted(MLA_TINY))
def test_mla_convertible_where_the_full_rank_conversion_gives_transformers_logits(mt, tmp_path, monkeypatch):
    """mla_convertible against transformers: at full rank (2 x Hkv x D) the GQA -> latent factorisation is exact, so
    edgekv.models.converted_mla reproduces a model of that type exactly where its attention is the one the converted
    module implements. The registry's guard is lifted for the probe; a type whose weights or layout the module
    refuses (qk-norm, sliding layers) or whose logits differ (partial rotary, NoPE layers) is not convertible."""
    torch = pytest.importorskip("torch")
    import tiny_families as tf
    from conftest import greedy_with_state

    import edgekv.models.converted_mla as cm
    from edgekv.errors import EdgekvError
    from edgekv.strategies import parse_strategy

    monkeypatch.setattr(cm, "CONVERTIBLE_TYPES", tuple(VARIANTS))
    kind = MLA_TINY[mt]
    if kind is None:  # Llama's shape, under the type's own config class
        cls = type(transformers.AutoConfig.for_model(mt)).__name__
        monkeypatch.setitem(tf.TINY, mt, dict(cls=cls, vocab_size=97, hidden_size=48, intermediate_size=80,
                                              num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                              max_position_embeddings=256, initializer_range=0.2, rope_theta=1e5,
                                              tie_word_embeddings=False))
        kind = mt
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = tf.tiny(kind, tmp_path)
        c = ref.config
        assert c.model_type == mt
        rank = 2 * c.num_key_value_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        prompt = [5, 17, 3, 40, 22, 9, 31, 2, 60, 11, 7, 19]  # longer than tiny Gemma 3's window
        try:
            module = cm.load_converted_mla(str(tmp_path), parse_strategy(f"mla:rank={rank},dtype=fp32"), 64).module
            _, got, _ = greedy_with_state(module, prompt, steps=0)
            want = tf.hf_logits(ref, prompt)
            same = (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
        except EdgekvError:
            same = False
    finally:
        torch.set_num_threads(before)
    assert same == VARIANTS[mt].mla_convertible
