"""kv-fp8: fp8 e4m3 codes with an fp16 scale per group, added as one storage class (edgekv.strategies.storage
Fp8GroupStorage) and one strategy class (edgekv.strategies.kv KvFp8). Its codes are torch's own float8_e4m3fn bit
patterns; the plan counts codes and scales as the config says by hand; the export to ONNX verifies against the eager
module and stays close to transformers' fp32 forward."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from edgekv.cli import main

torch = pytest.importorskip("torch")


def test_codes_are_torch_float8_e4m3fn_bit_patterns_and_read_back_as_its_values():
    """The graph's arithmetic encoder against torch's own float8_e4m3fn cast (round to nearest even), over values
    that span every binade and the subnormals within a group; the read-back is the fp8 value times the scale."""
    from edgekv.strategies import parse_strategy

    st = parse_strategy("kv-fp8:group=16").kv_storage
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2, 64, generator=gen) * torch.logspace(-5, 3, 64)
    x[0, 0, :16] = torch.tensor([1.0, -1.0, 0.5, 448.0, 2.0 ** -9, 3 * 2.0 ** -9, -2.0 ** -7, 1.0625, 1.1875,
                                 17.0, 19.0, 2.0 ** -6, 0.0078, 300.0, -96.0, 1e-6])  # ties, subnormals, the max
    codes, scale = st.store(x)
    assert codes.dtype == torch.uint8 and scale.dtype == torch.float16 and scale.shape == (7, 2, 4)
    y = (x.reshape(7, 2, 4, 16) / scale.float()[..., None]).reshape(x.shape)
    want = y.to(torch.float8_e4m3fn)
    assert torch.equal(codes, want.view(torch.uint8))
    back = st.read((codes, scale))
    assert torch.equal(back, (want.float().reshape(7, 2, 4, 16) * scale.float()[..., None]).reshape(x.shape))


def plan_json(*args):
    r = CliRunner().invoke(main, ["plan", "--device", "pixel8", "--json", *args])
    return r.exit_code, r.output


def test_plan_counts_the_codes_and_their_scales_as_the_config_says():
    """SmolLM2-135M (config: 30 layers, 3 KV heads, head_dim 576 / 9 = 64): per layer K and V of 3 x 4096 rows,
    each 64 one-byte codes + one fp16 scale per group."""
    code, out = plan_json("--model", "smollm2-135m", "--ctx", "4k", "--strategy", "kv-fp8",
                          "--strategy", "kv-fp8:group=16")
    assert code == 0, out
    rows = {o["strategy"] + json.dumps(o.get("params"), sort_keys=True): o for o in json.loads(out)["options"]}
    per_token_head = next(o for o in rows.values() if o["params"].get("group") == 0)
    group16 = next(o for o in rows.values() if o["params"].get("group") == 16)
    assert per_token_head["bytes"]["state"] == 30 * 2 * 3 * 4096 * (64 + 2)
    assert group16["bytes"]["state"] == 30 * 2 * 3 * 4096 * (64 + 2 * 4)


def test_a_group_that_does_not_divide_head_dim_is_one_line_and_exit_2():
    r = CliRunner().invoke(main, ["plan", "--device", "pixel8", "--model", "smollm2-135m", "--ctx", "4k",
                                  "--strategy", "kv-fp8:group=24"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == ["edgekv: error: kv-fp8:group=24: head_dim 64 is not a multiple of group 24"]


MODEL = dict(cls="LlamaConfig", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             initializer_range=0.2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import tiny_hf
    folder = tmp_path_factory.mktemp("llama")
    return tiny_hf(MODEL, folder), folder


def fp8_transformers(ref, monkeypatch, tokens):
    """transformers' fp32 forward with its post-RoPE keys and values rounded as a kv-fp8 cache stores them, by torch's
    own float8_e4m3fn cast: one fp16 scale amax / 448 per (token, head)."""
    import transformers.models.llama.modeling_llama as llama

    original = llama.eager_attention_forward

    def fp8(x):  # [B, Hkv, T, D]
        s = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-8).half().float()
        return (x / s).to(torch.float8_e4m3fn).float() * s

    def rounded(module, query, key, value, *args, **kwargs):
        return original(module, query, fp8(key), fp8(value), *args, **kwargs)

    monkeypatch.setattr(llama, "eager_attention_forward", rounded)
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].numpy()


def greedy(call, prompt, steps):
    """Teacher-forced greedy over a prompt and `steps` decode calls: (logits of every position, tokens)."""
    rows, tokens = [call(prompt, 0)], list(prompt)
    for _ in range(steps):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(call([tokens[-1]], len(tokens) - 1))
    return np.concatenate(rows), tokens


@pytest.mark.usefixtures("one_thread")
def test_the_eager_module_is_transformers_with_its_kv_rounded_to_fp8(tiny, monkeypatch):
    """edgekv's Llama module with a kv-fp8 cache (its codes written and read back every call) against transformers
    whose attention sees the same keys and values rounded by torch's float8 cast: the same numbers up to fp32
    arithmetic, and far from transformers' unrounded forward."""
    from edgekv.models import load_any
    from edgekv.models.base import empty_state
    from edgekv.strategies import parse_strategy

    ref, folder = tiny
    loaded = load_any(str(folder), parse_strategy("kv-fp8"), 64)
    state = empty_state(loaded.layout)

    def call(tokens, pos):
        nonlocal state
        with torch.no_grad():
            out = loaded.module(torch.tensor([tokens]), torch.tensor([pos]), *state,
                                rows=torch.arange(len(tokens)))
        state = list(out[1:])
        return out[0][0].float().numpy()

    ours, tokens = greedy(call, np.random.default_rng(1).integers(0, 96, 15).tolist(), 6)
    with torch.no_grad():
        plain = ref(torch.tensor([tokens])).logits[0].numpy()
    want = fp8_transformers(ref, monkeypatch, tokens)
    scale = np.abs(want).max()
    assert np.abs(ours - want).max() <= 1e-4 * scale
    assert np.abs(ours - plain).max() > 1e-3 * scale  # the rounding is there: fp8 is not a float cache


@pytest.mark.slow  # the trace, the ONNX export and its verification: a minute and a half on the shared host
@pytest.mark.usefixtures("one_thread")
def test_kv_fp8_exports_to_onnx_and_verifies(tiny, tmp_path, monkeypatch):
    """A two-layer Llama (2 KV heads, head_dim 16) at max_ctx 64: the manifest's state is, per layer, uint8 codes
    [1, 2, 64, 16] and fp16 scales [1, 2, 64, 1] for K and V; the recorded verification (ONNX Runtime against the
    eager module) passed; and the artifact, stepped by ONNX Runtime, agrees with transformers whose K and V are
    rounded by torch's float8 cast."""
    from edgekv.export.manifest import load_export
    from edgekv.export.pipeline import export_model
    from edgekv.export.options import ExportOptions
    from edgekv.export.runtime import OrtStepper

    ref, folder = tiny
    out = tmp_path / "export"
    m = export_model(ExportOptions(model=str(folder), strategy="kv-fp8", formats=("onnx",), max_ctx=64, out=out,
                                   prefill_chunk=6, verify_steps=6, threads=1), echo=lambda s: None)
    tensors = [(t["input"], t["dtype"], t["shape"]) for t in m["state"]["tensors"]]
    assert tensors == [(f"past_key_values.{i}.{r}{s}", dt, [1, 2, 64, w]) for i in range(2) for r in ("key", "value")
                       for s, dt, w in (("", "uint8", 16), (".scale", "float16", 1))]
    assert m["state"]["bytes"] == 2 * 2 * 2 * 64 * (16 + 2)
    v = m["verification"]["onnx"]
    assert v["passed"], v
    assert v["positions_compared"] == v["prompt_tokens"] + 6

    stepper = OrtStepper(load_export(out), out, 1)
    ours, tokens = greedy(lambda t, pos: stepper.prefill(t) if pos == 0 else stepper.step(t, pos),
                          np.random.default_rng(1).integers(0, 96, 15).tolist(), 6)
    want = fp8_transformers(ref, monkeypatch, tokens)
    assert np.abs(ours - want).max() <= 1e-3 * np.abs(want).max()
    assert (ours.argmax(-1) == want.argmax(-1)).all()
