"""The strategy registry (edgekv.strategies): every registered class parses its defaults and builds the layout whose
bytes hand arithmetic gives on a catalog model; a class added to the registry is planned without other edits."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from edgekv.arch import catalog_arch
from edgekv.cli import main
from edgekv.strategies import KV_DTYPES, REGISTRY, Kv, NotApplicable, build_layout, parse_strategy, register
from edgekv.strategies.layout import StateTensor, _kv_pair

CTX = 1024
# smollm2-135m: 30 layers x 3 KV heads x head_dim 64; mamba-130m: 24 Mamba-1 layers, d_inner 1536, d_state 16,
# d_conv 4; rwkv-4-169m-pile: 12 layers x 5 fp32 vectors of 768; jamba-v0.1: 4 attention layers of 32 (8 KV heads x
# 128) and 28 Mamba-1 layers (d_inner 8192, d_state 16, d_conv 4). Bytes at CTX tokens, by hand:
HAND = {
    "kv": ("smollm2-135m", 2 * 30 * 3 * CTX * 64 * 2),  # K and V, fp16
    "kv-int8": ("smollm2-135m", 2 * 30 * 3 * CTX * (64 * 1 + 1 * 2)),  # int8 codes + one fp16 scale per token, head
    "kv-int4": ("smollm2-135m", 2 * 30 * 3 * CTX * (64 // 2 + 2 * (64 // 32) * 2)),  # packed + fp16 scale, zero / 32
    "kv-int2": ("smollm2-135m", 2 * 30 * 3 * CTX * (64 // 4 + 2 * (64 // 32) * 2)),
    "kv-int8c": ("smollm2-135m", 2 * 30 * 3 * CTX * 64),  # int8 codes alone: the static scales are the graph's
    "kv-fp8": ("smollm2-135m", 2 * 30 * 3 * CTX * (64 * 1 + 1 * 2)),  # e4m3 codes + one fp16 scale per token, head
    "window": ("smollm2-135m", 2 * 30 * 3 * min(CTX, 4096 + 4) * 64 * 2),  # W + sinks cover 1024: every token
    "mla": ("smollm2-135m", 30 * CTX * (3 * 64) * 2),  # converted: a latent of rank Hkv x D = 192, fp16
    "ssm": ("mamba-130m", 24 * (1536 * 3 * 4 + 1536 * 16 * 4)),  # conv state (K - 1 taps) + SSM state, fp32
    "linear": ("rwkv-4-169m-pile", 12 * 5 * 768 * 4),
    "hybrid": ("jamba-v0.1", 4 * 2 * 8 * CTX * 128 * 2 + 28 * (8192 * 3 * 4 + 8192 * 16 * 4)),
    "ring": ("smollm2-135m", 2 * 30 * 3 * (CTX // 8) * 64 * 2),  # one of 8 GPUs: 1/8 of the tokens' KV
}


def test_every_registered_strategy_has_hand_arithmetic_here():
    """A new strategy class is not done until its bytes are checked below."""
    assert list(HAND) == list(REGISTRY)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_registered_strategy_parses_its_defaults_and_builds_the_hand_computed_layout(name):
    cls = REGISTRY[name]
    s = parse_strategy(name)
    assert type(s) is cls and s.name == name and s.params == cls.defaults
    assert parse_strategy(s.label) == s  # the label is a spec that parses back to the same strategy
    model, nbytes = HAND[name]
    layout = s.layout(catalog_arch(model), CTX)
    assert layout.nbytes == nbytes
    assert layout.strategy == s.label and layout.ctx == CTX


def test_parameters_change_the_layout_as_the_arithmetic_says():
    a = catalog_arch("smollm2-135m")
    assert build_layout(a, parse_strategy("window:w=256,sinks=4"), CTX).nbytes == 2 * 30 * 3 * 260 * 64 * 2
    assert build_layout(a, parse_strategy("kv:dtype=fp32"), CTX).nbytes == 2 * 30 * 3 * CTX * 64 * 4
    assert build_layout(a, parse_strategy("mla:rank=64"), CTX).nbytes == 30 * CTX * 64 * 2
    assert build_layout(a, parse_strategy("kv-int4:group=16"), CTX).nbytes == 2 * 30 * 3 * CTX * (32 + 2 * 4 * 2)
    assert parse_strategy("ring:n=4").layout(a, CTX).nbytes == 2 * 30 * 3 * 256 * 64 * 2


def test_traits_are_the_strategies_own():
    """What the planner asks instead of comparing names."""
    assert [parse_strategy(n).kv_bits for n in ("kv", "kv-int8", "kv-int4", "kv-int2")] == [None, 8, 4, 2]
    assert parse_strategy("window:w=100,sinks=2").window_tokens == 102 and parse_strategy("kv").window_tokens is None
    w = parse_strategy("window:w=100,sinks=2")
    assert (w.recent_tokens, w.sink_tokens) == (100, 2) and parse_strategy("kv").recent_tokens is None
    assert [n for n, c in REGISTRY.items() if c.kv_cache] == ["kv", "kv-int8", "kv-int4", "kv-int2", "kv-int8c",
                                                              "kv-fp8", "window"]
    assert parse_strategy("ring:n=4").n_gpus == 4 and parse_strategy("kv").n_gpus == 1
    assert [n for n, c in REGISTRY.items() if not c.exportable] == ["ring"]
    assert [n for n, c in REGISTRY.items() if c.converts_to_latent] == ["mla"]
    with pytest.raises(NotApplicable, match="datacenter"):
        parse_strategy("ring").check_device(datacenter=False)
    with pytest.raises(NotApplicable, match="pure ssm"):
        parse_strategy("ssm").layout(catalog_arch("smollm2-135m"), CTX)
    assert parse_strategy("kv").fused_attention("onnxruntime") and not parse_strategy("kv-int8").fused_attention(
        "onnxruntime")
    # kv-int8c: GroupQueryAttention reads its codes, and the .pte's custom_quantized_sdpa (scales folded around it)
    c = parse_strategy("kv-int8c")
    assert c.kv_bits == 8 and c.static_scales and c.fused_attention("onnxruntime") and c.fused_attention(
        "executorch")
    assert [n for n, c in REGISTRY.items() if c.static_scales] == ["kv-int8c"]
    # kv-fp8: no fused op reads e4m3 codes with per-group scales; the eager graph decodes them on every runtime
    f = parse_strategy("kv-fp8")
    assert f.kv_bits == 8 and not f.fused_attention("onnxruntime") and not f.fused_attention("executorch")


class KvHalf(Kv):
    """A made-up strategy for the test: keeps the newest half of the context, fp16."""
    name = "kv-half"
    help = "kv-half"
    exportable = False
    evidence = {"kv-half": ("high", "made up for a test: half the tokens are dropped", "test")}

    def attention_state(self, arch, i, m, ctx):
        return _kv_pair(i, m.n_kv_heads, ctx // 2, m.head_dim, Kv({"dtype": "fp16"}))

    def quality_key(self, ctx, converted):
        return "kv-half"


@pytest.fixture
def kv_half(monkeypatch):
    """KvHalf registered for one test (what @register does), removed after it."""
    monkeypatch.setitem(REGISTRY, "kv-half", KvHalf)
    yield KvHalf


def test_a_class_added_to_the_registry_is_planned_without_other_edits(kv_half):
    """`edgekv plan` lists the new strategy by default, parses it as a spec, and its state is its layout's."""
    r = CliRunner().invoke(main, ["plan", "--device", "pixel8", "--ctx", "4k", "--model", "smollm2-135m", "--json"])
    assert r.exit_code == 0, r.output
    rows = {o["strategy"]: o for o in json.loads(r.output)["options"]}
    assert rows["kv-half"]["bytes"]["state"] == rows["kv"]["bytes"]["state"] // 2 == 2 * 30 * 3 * 2048 * 64 * 2
    assert rows["kv-half"]["quality"]["cite"].startswith("test") and rows["kv-half"]["exportable"] is False
    r = CliRunner().invoke(main, ["plan", "--device", "pixel8", "--ctx", "4k", "--model", "smollm2-135m", "--json",
                                  "--strategy", "kv-half"])
    assert [o["strategy"] for o in json.loads(r.output)["options"]] == ["kv-half"]


def test_register_refuses_a_name_twice():
    with pytest.raises(ValueError, match="twice"):
        register(type("Again", (Kv,), {"name": "kv"}))


def test_state_tensor_bytes_follow_dtype():
    assert StateTensor("a", "b", (1, 2, 3, 4), "float16", 0, "key").nbytes == 48


@pytest.mark.parametrize("runtime", ["executorch", "edgekv-pte", "onnxruntime", "llama.cpp"])
def test_every_cache_dtype_a_spec_accepts_is_planned_on_every_phone_runtime(runtime):
    """Each dtype parse_strategy accepts for a cache (fp32, fp16, bf16, fp8) is planned, or refused in one line, on
    every phone runtime: `plan --strategy kv:dtype=fp8 --runtime edgekv-pte` once ended in a KeyError."""
    for dtype in KV_DTYPES:
        for spec in (f"kv:dtype={dtype}", f"window:w=512,dtype={dtype}"):
            r = CliRunner().invoke(main, ["plan", "--device", "pixel8", "--ctx", "4k", "--model", "smollm2-135m",
                                          "--strategy", spec, "--runtime", runtime, "--json"])
            assert r.exit_code in (0, 3), (spec, r.output[-300:])
            opt = json.loads(r.output)["options"][0]
            assert opt["bytes"]["total"] > opt["bytes"]["state"] > 0, (spec, opt["bytes"])


def test_every_layout_of_every_catalog_model_names_its_state_as_the_manifest_schema_says():
    """Each state kind (KV, latent, SSM, conv, recurrent, their quantization parameters) has its input/output name
    pattern and role in edgekv/export/manifest.schema.json: the layout of every catalog model under every strategy
    that applies (quantized forms included) validates against the schema's state object."""
    import re
    from pathlib import Path

    import jsonschema

    from edgekv.arch import catalog_names
    schema = json.loads((Path(__file__).resolve().parents[1] / "edgekv/export/manifest.schema.json").read_text())
    state_schema = schema["properties"]["state"]
    validator = jsonschema.validators.validator_for(schema)(state_schema)
    specs = [*REGISTRY, "kv-int4", "kv-int2", "ssm:dtype=int8", "linear:dtype=int8", "hybrid:dtype=int8",
             "hybrid:dtype=int4"]
    kinds, seen = set(), set()
    for model in catalog_names():
        arch = catalog_arch(model)
        for spec in specs:
            try:
                layout = build_layout(arch, parse_strategy(spec), 64)
            except (NotApplicable, ValueError):
                continue
            js, new = layout.to_json(), []
            for t in js["tensors"]:  # each kind once (its name with the layer index blanked): validation is slow
                kind = (re.sub("[0-9]+", "#", t["input"]), t["role"])
                if kind not in seen:
                    seen.add(kind)
                    new.append(t)
            if new:
                validator.validate({**js, "tensors": new})
            kinds |= {t.role for t in layout.tensors}
    assert {"key", "value", "key.scale", "latent", "ssm", "ssm.scale", "conv", "recurrent", "recurrent.scale",
            "recurrent.max"} <= kinds, kinds
    bad = build_layout(catalog_arch("smollm2-135m"), parse_strategy("kv"), 64).to_json()
    bad["tensors"][0]["input"] = "past_cache.0"
    with pytest.raises(jsonschema.ValidationError, match="past_cache.0"):
        validator.validate(bad)


def test_every_kv_cache_declares_its_storage_and_the_layout_is_what_the_storage_says():
    """A KV cache strategy names its storage (edgekv.strategies.storage): its bits and static scales are the
    storage's, and the layout's K/V tensors of a layer are the storage's parts (role suffix, dtype, width) for
    SmolLM2's head_dim 64, with the bytes per row the storage counts."""
    arch = catalog_arch("smollm2-135m")
    for name, cls in REGISTRY.items():
        if not cls.kv_cache:
            assert parse_strategy(name).kv_storage is None or name in ("hybrid", "ring"), name
            continue
        st = parse_strategy(name)
        storage = st.kv_storage
        assert (st.kv_bits, st.static_scales) == (storage.bits, storage.static_scales), name
        layer0 = [t for t in build_layout(arch, st, 128).tensors if t.layer == 0]
        assert [(t.role, t.dtype, t.shape[-1]) for t in layer0] == [
            (r + p.suffix, p.dtype, p.width(64)) for r in ("key", "value") for p in storage.parts(64)], name
        assert sum(t.nbytes for t in layer0) == 2 * 3 * 128 * storage.row_bytes(64), name


def test_every_exportable_storage_dtype_is_one_the_manifest_and_the_steppers_know():
    """A storage whose parts use a tensor dtype the manifest schema, the ONNX reader or the numpy steppers do not
    know would export a manifest that fails validation: the dtypes of every exportable KV cache are in all three."""
    from edgekv.export.manifest import schema
    from edgekv.export.stepper import NP_DTYPES
    from edgekv.export.to_onnx import ONNX_DTYPES

    allowed = set(schema()["$defs"]["tensors"]["items"]["properties"]["dtype"]["enum"])  # entry points' tensors
    used = {p.dtype for name, cls in REGISTRY.items() if cls.kv_cache and cls.exportable
            for st in [parse_strategy(name)] + [Kv({"dtype": d}) for d in ("fp32", "fp16")]
            if st.kv_storage.exportable for p in st.kv_storage.parts(64)}
    assert used == {"float32", "float16", "int8", "uint8"}
    assert used <= allowed and used <= set(NP_DTYPES) and used <= set(ONNX_DTYPES.values())
