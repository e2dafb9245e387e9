"""What every exported family must do, one table of cases against transformers as the independent reference.

1. edgekv's eager module (load_any) follows transformers' full-sequence forward over a chunked prefill and greedy
   decode steps with its state carried between calls, within fp32 rounding (or an int8 cache's error).
2. `edgekv export` to ONNX and .pte: the artifact driven by ONNX Runtime / the ExecuTorch runtime alone (calls of 8
   and 3 tokens, then single-token steps) follows transformers step by step.
3. Where the family has a word-level tokenizer: `edgekv run` on the export generates transformers' greedy
   continuation, and `edgekv profile` writes a report.
The tiny models are tests/tiny_families.py's; what is particular to one family is in tests/test_family_<name>.py.
Exports take about a minute each on 2 cores: all but Gemma 3's (sliding windows that roll, in both formats) are
`make test-all` (slow).
"""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import greedy_rows, greedy_with_state, run_cli  # noqa: E402
from tiny_families import WINDOW, hf_logits, tiny  # noqa: E402
from edgekv.models import load_any  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

FP32, HYBRID = "kv:dtype=fp32", "hybrid:dtype=fp32"
QWEN3_5 = "hybrid:dtype=fp32,state_dtype=fp32"
PROMPT = [3, 17, 42, 5, 8, 60, 11, 30, 2, 77, 9]  # longer than the tiny Gemma's window and every conv kernel

# ---- 1. eager module ----

# kind, strategy, relative tolerance, config overrides, max_ctx, decode steps, prefill chunk
EAGER = [
    *[(k, FP32, 2e-5, {}, 64, 3 * WINDOW, 4) for k in ("gemma3", "qwen3", "smollm3")],
    ("phi4mini", FP32, 2e-5, {}, 32, 19, 4),  # short factors: the whole run within the original 40 positions
    ("phi4mini", FP32, 2e-5, {}, 96, 59, 4),  # long factors: the run passes 40, as transformers' does
    ("phi3mini", FP32, 2e-5, {}, 32, 19, 4),  # the window of 8 rolls
    ("lfm2", HYBRID, 2e-5, {}, 64, 20, 4),
    ("lfm2", "hybrid:dtype=int8", 0.05, {}, 64, 20, 4),  # int8 attention caches, the conv state exact
    ("granite", HYBRID, 2e-5, {}, 64, 16, 4),
    ("granite", HYBRID, 2e-5, {"position_embedding_type": "rope"}, 64, 16, 4),
    ("granite", "hybrid:dtype=int8", 0.05, {}, 64, 16, 4),
    ("falcon_h1", HYBRID, 2e-5, {}, 64, 16, 4),  # Falcon-H1-0.5B's form: y * silu(z), no norm
    ("falcon_h1", HYBRID, 2e-5, {"mamba_rms_norm": True, "mamba_norm_before_gate": False}, 64, 16, 4),  # 1.5B, 7B
    ("falcon_h1", HYBRID, 2e-5, {"mamba_rms_norm": True, "mamba_norm_before_gate": True}, 64, 16, 4),  # default
    ("falcon_h1", "hybrid:dtype=int8", 0.05, {}, 64, 16, 4),
    ("zamba2", HYBRID, 2e-5, {}, 64, 16, 4),
    ("zamba2", HYBRID, 2e-5, {"use_mem_rope": False, "use_shared_attention_adapter": False, "num_mem_blocks": 1,
                              "num_key_value_heads": 2, "hidden_act": "silu"}, 64, 16, 4),  # NoPE, GQA 3, no LoRA
    ("zamba2", "hybrid:dtype=int8", 0.05, {}, 64, 16, 4),
    ("olmo2", FP32, 2e-5, {}, 48, 20, None),  # post-sublayer norms, qk-norm over the whole projection
    ("olmo2", FP32, 2e-5, {}, 48, 20, 4),
    ("qwen3_5", QWEN3_5, 2e-5, {}, 64, 12, 1),  # the conv state and the delta rule one token at a time
    ("qwen3_5", QWEN3_5, 2e-5, {}, 64, 12, 5),  # and in chunks that straddle the conv kernel
]


def _eager_id(case):
    kind, strategy, _, over, ctx, _, chunk = case
    return "-".join([kind, strategy.split(":")[-1], f"ctx{ctx}", f"chunk{chunk or 'all'}",
                     *(f"{k}={v}" for k, v in sorted(over.items()))])


@pytest.mark.parametrize("kind,strategy,tol,over,ctx,steps,chunk", EAGER, ids=[_eager_id(c) for c in EAGER])
def test_module_matches_transformers_over_prefill_and_decode(kind, strategy, tol, over, ctx, steps, chunk, tmp_path):
    ref = tiny(kind, tmp_path, **over)
    loaded = load_any(str(tmp_path), parse_strategy(strategy), ctx)
    tokens, logits, _ = greedy_with_state(loaded.module, PROMPT, steps=steps, chunk=chunk)
    want = hf_logits(ref, tokens)
    scale = want.abs().max().item()
    assert scale > 1.0
    diff = (logits - want).abs().max().item()
    assert diff <= tol * scale, f"{kind} {strategy} {over}: max abs diff {diff:.3g} (logit scale {scale:.3g})"


# ---- 2. exported, run by the runtimes alone ----

# name -> (kind, strategy, max_ctx, config overrides, decode steps or None: to the end of the context)
EXPORTS = {
    "gemma3": ("gemma3", FP32, 64, {}, None),  # windows of 8 slots roll: GroupQueryAttention's window cache / rings
    # every layer's window covers max_ctx: no ring, so the fused ops run Gemma's two RoPEs, scale and norms
    "gemma3-fused": ("gemma3", FP32, 32, {"sliding_window": 40}, None),
    "qwen3": ("qwen3", FP32, 64, {}, None),  # plain cache: GroupQueryAttention / custom_sdpa, qk-norm before both
    "smollm3": ("smollm3", FP32, 64, {}, None),  # the same fused ops, rotation skipped in its NoPE layers
    "phi4mini": ("phi4mini", FP32, 32, {}, None),
    "phi3mini": ("phi3mini", FP32, 32, {}, None),
    "lfm2": ("lfm2", HYBRID, 40, {}, None),
    "granite": ("granite", HYBRID, 32, {}, None),
    "falcon_h1": ("falcon_h1", HYBRID, 32, {"mamba_rms_norm": True, "mamba_norm_before_gate": False}, None),
    "zamba2": ("zamba2", HYBRID, 32, {}, None),
    "qwen3_5": ("qwen3_5", QWEN3_5, 32, {}, 10),
    "olmo2": ("olmo2", FP32, 32, {}, None),  # the fused ops with the whole-projection qk-norm before them
}
# minutes on 2 cores each: `make test-all`. qwen3's fused path with qk-norm before it is also the path of gemma3's
# global layer, which the default suite exports and checks
DEFAULT_EXPORTS = ("gemma3",)


def _check_artifact(name, manifest, art, fmt):
    """What one family's artifact must say of itself in its manifest (which attention ran, which state it keeps)."""
    names = [t["input"] for t in manifest["state"]["tensors"]]
    if name in ("gemma3-fused", "phi4mini", "olmo2"):  # no rolling layer: the fused ops (with their own rotary) ran in place
        assert art.get("state_in_place"), art
    if name == "gemma3":  # ONNX: GroupQueryAttention on every layer, the sliding ones with the op's window-sized
        # cache; the .pte: custom_sdpa on the global layer, each ring written by an index_put
        # (swaps.RingSdpaAttention); in place in both
        assert art.get("attention") and art.get("state_in_place"), art
        assert bool(art.get("sliding_window_cache")) == (fmt == "onnx"), art
        if fmt == "pte":  # each ring written in place by an index_put (test_pte_cache_kinds' fp16 cache: the same)
            ops = art["delegation"]["forward"]["portable_ops"]
            assert ops.get("aten.index_put_", ops.get("index_put_")), ops
            assert art["attention"] == "llama.custom_sdpa", art["attention"]
        # the export's own check compares the state where both sides keep it alike: the global layer's full cache
        # (the sliding layers' rows are in the op's order on ONNX, the ring's on the .pte and in eager torch)
        assert manifest["verification"][fmt]["state_max_abs_diff"] <= 1e-4, manifest["verification"][fmt]
    if name == "lfm2":
        assert names[:2] == ["past_conv.0", "past_key_values.1.key"]
    if name == "qwen3_5":
        assert {"past_conv.0", "past_recurrent.0", "past_key_values.1.key"} <= set(names)


@pytest.fixture(scope="module", params=[n if n in DEFAULT_EXPORTS else pytest.param(n, marks=pytest.mark.slow)
                                        for n in EXPORTS])
def exported(request, tmp_path_factory):
    from click.testing import CliRunner

    from edgekv.export.cli import cli

    pytest.importorskip("onnxruntime")
    pytest.importorskip("executorch")
    kind, strategy, ctx, over, _ = EXPORTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    ref = tiny(kind, root / "hf", **over)
    out = root / "export"
    r = CliRunner().invoke(cli, ["export", "--model", str(root / "hf"), "--strategy", strategy, "--format",
                                 "onnx,pte", "--max-ctx", str(ctx), "--prefill-chunk", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return request.param, ref, out


@pytest.mark.parametrize("fmt", ["onnx", "pte"])
def test_export_matches_transformers_step_by_step_in_the_runtime(exported, fmt):
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper
    from edgekv.export.pte_stepper import PteStepper

    name, ref, out = exported
    _, _, ctx, _, steps = EXPORTS[name]
    manifest = load_export(out)
    _check_artifact(name, manifest, next(a for a in manifest["artifacts"] if a["format"] == fmt), fmt)
    stepper = OrtStepper(manifest, out) if fmt == "onnx" else PteStepper(manifest, out)
    prompt = [5, 9, 33, 12, 40, 7, 21, 3, 18, 50, 11]  # 11 tokens: calls of 8 and 3
    tokens, ours = greedy_rows(stepper, prompt, steps or ctx - len(prompt) - 1)
    want = hf_logits(ref, tokens).numpy()
    assert np.abs(want).max() > 1.0
    diff = np.abs(ours - want).max()  # one row per position: the prefill's rows, then one per step
    assert diff <= 1e-3, f"{name} {fmt}: max abs diff {diff:.3g}"


# ---- 3. the user's commands on the export ----


def test_run_generates_what_transformers_generates_and_profile_reports(exported, tmp_path):
    from tiny_families import WORDS

    name, ref, out = exported
    if name not in WORDS:
        pytest.skip(f"{name}'s tiny model has no tokenizer")
    r = run_cli("run", str(out), "--prompt", "w5 w9 w33", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    gen = ref.generate(torch.tensor([[8, 12, 36]]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, 3:].tolist()
    assert json.loads(r.stdout)["text"].split() == [f"w{i - 3}" for i in gen]
    r = run_cli("profile", str(out), "--ctx", "24", "--steps", "4", "--json", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p.json").read_text())["runs"]
