"""Every exportable strategy through `edgekv export`, in both formats (ONNX with a dynamic token axis; .pte with one
`forward` of 1..C tokens for a plain kv cache, else a `prefill` of C tokens and a `decode` of 1), on tiny models of
each family.

For each export: the recorded verification passed (the artifact in its runtime against the eager module, state fed
back); the manifest's state pairs are the planner's StateLayout, built here from the model's config.json; and the
ONNX artifact, stepped by OrtStepper, matches transformers' own full-sequence forward (an independent reference)
where the state is fp32. Then `edgekv run` on the trained Mamba fixture prints the text transformers generates, and a
strategy that does not fit the model is one line and exit code 2.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
pytest.importorskip("executorch")

from click.testing import CliRunner  # noqa: E402
from conftest import ROOT, mapped_rss, tiny_models  # noqa: E402
from conftest import tiny_hf as conftest_tiny_hf  # noqa: E402
from edgekv.export.cli import cli  # noqa: E402
from edgekv.export.manifest import load_export  # noqa: E402
from edgekv.export.pipeline import export_model  # noqa: E402
from edgekv.export.options import EXPORTABLE, ExportOptions  # noqa: E402
from edgekv.export.runtime import OrtStepper  # noqa: E402
from edgekv.export.pte_stepper import PteStepper  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

MAX_CTX, CHUNK, STEPS = 128, 6, 8  # the 40-token verify prompt runs as 6 chunks of 6 + a tail of 4 in the .pte

# two-block random models of each family (transformers config classes and field names)
MODELS = {
    "llama": dict(cls="LlamaConfig", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  initializer_range=0.2),
    "mamba": dict(cls="MambaConfig", vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8,
                  initializer_range=0.5),
    "mamba2": dict(cls="Mamba2Config", vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8, num_heads=8,
                   head_dim=8, n_groups=2, chunk_size=8, initializer_range=0.5),
    "rwkv": dict(cls="RwkvConfig", vocab_size=96, hidden_size=32, num_hidden_layers=2, rescale_every=1),
    "jamba": dict(cls="JambaConfig", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                  attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
                  mamba_d_state=8, mamba_dt_rank=4, initializer_range=0.3),
    "deepseek_v2": dict(cls="DeepseekV2Config", vocab_size=96, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=16,
                        initializer_range=0.3, max_position_embeddings=256),
}

# (model, strategy, fp32 state: compare with transformers too); the converted MLA keeps rank 32 of a full 64
CASES = [
    ("llama", "kv:dtype=fp32", True),
    ("llama", "kv", False),
    ("llama", "kv-int8", False),
    ("llama", "kv-int4:group=16", False),  # head_dim 16
    ("llama", "mla:rank=32,dtype=fp32", False),
    ("mamba", "ssm", True),
    ("mamba", "ssm:dtype=int8", False),
    ("mamba2", "ssm", True),
    ("rwkv", "linear", True),
    ("jamba", "hybrid:dtype=fp32", True),
    ("deepseek_v2", "mla:dtype=fp32", True),
]
# state bytes at MAX_CTX = 128, by hand from the MODELS configs above (L = 2 layers each)
STATE_BYTES = {
    ("llama", "kv:dtype=fp32"): 2 * 2 * (2 * 128 * 16) * 4,  # L x (K, V) x (2 KV heads x 128 slots x head_dim 16) x 4 B
    ("llama", "kv"): 2 * 2 * (2 * 128 * 16) * 2,  # fp16
    ("llama", "kv-int8"): 2 * 2 * (2 * 128) * (16 * 1 + 2),  # int8 codes + a fp16 scale per token and head
    ("llama", "kv-int4:group=16"): 2 * 2 * (2 * 128) * (16 // 2 + 2 * 2),  # packed nibbles + fp16 scale and zero
    ("llama", "mla:rank=32,dtype=fp32"): 2 * 128 * 32 * 4,  # one rank-32 latent per layer and slot
    ("mamba", "ssm"): 2 * (64 * 3 + 64 * 8) * 4,  # d_inner 2 x 32: conv (kernel 4 - 1) + ssm (d_state 8), fp32
    ("mamba", "ssm:dtype=int8"): 2 * (64 * 3 * 4 + 64 * 8 + 64 * 4),  # fp32 conv, int8 ssm + fp32 scale per channel
    ("mamba2", "ssm"): 2 * ((64 + 2 * 2 * 8) * 3 + 8 * 8 * 8) * 4,  # conv over x, B, C (2 groups); 8 heads x 8 x 8
    ("rwkv", "linear"): 2 * 5 * 32 * 4,  # RWKV-4: 5 hidden-sized vectors per layer
    ("jamba", "hybrid:dtype=fp32"): (64 * 3 + 64 * 8) * 4 + 2 * (2 * 128 * 8) * 4,  # layer 0 Mamba, layer 1 attention
    ("deepseek_v2", "mla:dtype=fp32"): 2 * 128 * (16 + 4) * 4,  # kv_lora_rank 16 + qk_rope_head_dim 4
}
FAST = {("mamba", "ssm")}  # the rest: 1-2 minutes each on a shared 2-core machine, in the slow run


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_hf(kind, folder):
    return conftest_tiny_hf(MODELS[kind], folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory, MODELS)


def export(folder, strategy, out, formats=("onnx", "pte"), max_ctx=MAX_CTX):
    return export_model(ExportOptions(model=str(folder), strategy=strategy, formats=formats, max_ctx=max_ctx,
                                      out=out, prefill_chunk=CHUNK, verify_steps=STEPS, threads=1),
                        echo=lambda s: None)


def case_params():
    for kind, strategy, fp32 in CASES:
        marks = () if (kind, strategy) in FAST else (pytest.mark.slow,)
        yield pytest.param(kind, strategy, fp32, marks=marks, id=f"{kind}-{strategy}")


@pytest.mark.parametrize("kind,strategy,fp32", list(case_params()))
def test_strategy_exports_and_verifies_in_both_formats(kind, strategy, fp32, models, tmp_path):
    ref, folder = models(kind)
    out = tmp_path / "export"
    m = export(folder, strategy, out)

    # the state's bytes, by hand from the model's config (STATE_BYTES), and every entry point reads and writes
    # the declared pairs
    assert m["state"]["bytes"] == sum(t["bytes"] for t in m["state"]["tensors"]) == STATE_BYTES[(kind, strategy)]
    pairs = [(t["input"], t["output"]) for t in m["state"]["tensors"]]
    for art in m["artifacts"]:
        for ep in art["entry_points"]:
            assert [i["name"] for i in ep["inputs"]] == ["tokens", "pos"] + [i for i, _ in pairs] + ["rows"]
            assert [o["name"] for o in ep["outputs"]] == ["logits"] + [o for _, o in pairs]
            # the rows whose logits come back: [1] for a one-token method, else a dynamic axis (1..its tokens)
            rows = 1 if ep["tokens"] == 1 else "rows"
            assert ep["inputs"][-1]["shape"] == [rows] and ep["outputs"][0]["shape"][:2] == [1, rows]
    # only a Llama-family float cache runs as ORT's GroupQueryAttention / ExecuTorch's custom_sdpa with its state
    # updated in place, and in the .pte a quantized cache too (its written rows read back dequantized for
    # custom_sdpa); every state without a recurrence makes a .pte of one method with a dynamic token axis
    fused = kind == "llama" and (strategy == "kv" or strategy.startswith("kv:"))
    onnx_art, pte_art = (next(a for a in m["artifacts"] if a["format"] == f) for f in ("onnx", "pte"))
    assert onnx_art.get("state_in_place", False) == fused
    quantized = kind == "llama" and strategy.startswith("kv-int")
    assert pte_art.get("state_in_place", False) == (fused or quantized)
    if quantized:
        assert pte_art["attention"] == "llama.custom_sdpa"
    pte_eps = {e["name"]: e for e in pte_art["entry_points"]}
    if kind not in ("mamba", "mamba2", "rwkv", "jamba"):
        assert list(pte_eps) == ["forward"] and pte_eps["forward"]["tokens"] == "seq"
        assert pte_eps["forward"]["max_tokens"] == CHUNK
    else:  # a recurrent scan traces unrolled over a fixed number of tokens
        assert pte_eps["prefill"]["tokens"] == CHUNK and pte_eps["decode"]["tokens"] == 1
        assert pte_eps["prefill"]["tail"] == "decode"
    assert m["deployment"]["formats"]["pte"]["methods"] == len(pte_eps)

    # verify ran both runtimes against the eager module over the prompt + STEPS decode steps, and passed
    for fmt in ("onnx", "pte"):
        v = m["verification"][fmt]
        assert v["passed"], v
        assert v["decode_steps"] == STEPS and v["positions_compared"] == v["prompt_tokens"] + STEPS
        assert v["prompt_tokens"] % CHUNK > 1  # the pte prefill ran a short last call
        assert v["top1_agreement"] >= 0.95
        assert v["max_abs_diff"] <= v["tolerance"]["max_abs_diff_over_logit_scale"] * max(v["logit_scale"], 1.0)

    if fp32:  # the artifact against transformers' own forward over the same tokens (teacher-forced, greedy)
        manifest = load_export(out)
        for stepper in (OrtStepper(manifest, out, 1), PteStepper(manifest, out, 1)):
            ours, want = against_transformers(stepper, ref, MODELS[kind]["vocab_size"])
            assert np.abs(ours - want).max() <= 1e-4 * max(np.abs(want).max(), 1.0), type(stepper).__name__


def against_transformers(stepper, ref, vocab):
    """Teacher-forced greedy: the stepper's logits over a 15-token prompt and 6 decode steps, and transformers' own
    full-sequence forward over the same tokens."""
    prompt = np.random.default_rng(1).integers(0, vocab, 15).tolist()
    rows = [stepper.prefill(prompt)]
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(stepper.step([tokens[-1]], len(tokens) - 1))
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0].numpy()
    return np.concatenate(rows), want


@pytest.mark.parametrize("kind,strategy,fp32", [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in CASES
                                                if (c[0], c[1]) not in FAST])
def test_strategy_exports_to_onnx_and_verifies(kind, strategy, fp32, models, tmp_path):
    """The default suite's version of the slow two-format test above: ONNX only (the .pte lowering takes the
    minutes), the same checks: state bytes by hand, verification passed, and where the state is fp32 the artifact
    agrees with transformers."""
    ref, folder = models(kind)
    out = tmp_path / "export"
    m = export(folder, strategy, out, formats=("onnx",))
    assert m["state"]["bytes"] == sum(t["bytes"] for t in m["state"]["tensors"]) == STATE_BYTES[(kind, strategy)]
    ep = m["artifacts"][0]["entry_points"][0]
    assert [i["name"] for i in ep["inputs"]] == ["tokens", "pos"] + [t["input"] for t in m["state"]["tensors"]] + [
        "rows"]
    v = m["verification"]["onnx"]
    assert v["passed"] and v["top1_agreement"] >= 0.95, v
    assert v["decode_steps"] == STEPS and v["positions_compared"] == v["prompt_tokens"] + STEPS
    if fp32:
        ours, want = against_transformers(OrtStepper(load_export(out), out, 1), ref, MODELS[kind]["vocab_size"])
        assert np.abs(ours - want).max() <= 1e-4 * max(np.abs(want).max(), 1.0)
        assert (ours.argmax(-1) == want.argmax(-1)).all()


def test_converted_mla_records_its_factorisation_error(models, tmp_path):
    """The manifest's per-layer error is Eckart-Young's: the discarded singular values of [W_k; W_v], over all."""
    from safetensors.torch import load_file

    _, folder = models("llama")
    r = CliRunner().invoke(cli, ["export", "--model", str(folder), "--strategy", "mla:rank=20,dtype=fp32", "--format",
                                 "onnx", "--max-ctx", str(MAX_CTX), "--prefill-chunk", str(CHUNK), "--verify-steps",
                                 str(STEPS), "--threads", "1", "--out", str(tmp_path / "mla")])
    assert r.exit_code == 0, r.output
    m = load_export(tmp_path / "mla")
    sd = load_file(str(folder / "model.safetensors"))
    want = []
    for i in range(MODELS["llama"]["num_hidden_layers"]):
        w = torch.cat([sd[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "kv"]).double().numpy()
        s = np.linalg.svd(w, compute_uv=False)
        want.append(math.sqrt((s[20:] ** 2).sum() / (s ** 2).sum()))
    assert m["strategy"]["rank"] == 20
    assert np.allclose(m["strategy"]["factorisation_error"], want, rtol=1e-4)
    assert 0 < min(want) and max(want) < 1
    assert m["verification"]["onnx"]["passed"]
    hi = int(np.argmax(want))  # and the command says so
    assert f"highest {want[hi]:.3f} (layer {hi})" in r.stdout, r.stdout
    assert f"median {np.median(want):.3f}," in r.stdout, r.stdout


def test_onnx_weights_live_in_external_data_and_a_tied_head_packs_from_the_table(tmp_path):
    folder = tmp_path / "tied"
    ref = conftest_tiny_hf(dict(MODELS["llama"], tie_word_embeddings=True), folder)
    out = tmp_path / "ext"
    m = export(folder, "kv:dtype=fp32", out, formats=("onnx",))
    assert sorted(m["files"]) == ["model.onnx", "model.onnx.data"]
    assert m["artifacts"][0]["external_data"] == "model.onnx.data"
    assert m["files"]["model.onnx.data"]["bytes"] >= 0.9 * m["weights"]["bytes"]
    import onnx
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    inline = [t.name for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL and t.ByteSize() > 4096]
    assert inline == []  # model.onnx holds the graph; every weight matrix is in model.onnx.data
    # the tied output layer multiplies by the table the Gather reads, transposed by the kernel (no folded copy)
    gather = next(n for n in graph.node if n.op_type == "Gather" and n.input[1] == "tokens")
    head = [n for n in graph.node if n.op_type == "FusedMatMul"]
    assert [n.input[1] for n in head] == [gather.input[0]] and head[0].domain == "com.microsoft"
    assert onnx.helper.get_attribute_value(next(a for a in head[0].attribute if a.name == "transB")) == 1
    assert not [n for n in graph.node if n.op_type == "Transpose"]
    assert m["verification"]["onnx"]["passed"]
    manifest = load_export(out)  # hashes of both files checked
    stepper = OrtStepper(manifest, out, 1)
    ids = [3, 5, 7, 11]
    logits = stepper.prefill(ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)
    # the mapped weights the session read while packing are given back: no resident page of model.onnx.data
    # before the first call's gather reads its rows
    if Path("/proc/self/smaps").exists():
        fresh = OrtStepper(manifest, out, 1)
        assert mapped_rss(out / "model.onnx.data") == 0
        lean = OrtStepper(manifest, out, 1, lean=False)  # without it the packing's reads stay resident
        assert mapped_rss(out / "model.onnx.data") > 0
        del fresh, lean



def test_run_prints_the_mamba_fixtures_text_as_transformers_generates_it(tmp_path):
    fixture = ROOT / "fixtures" / "tiny" / "mamba"
    out = tmp_path / "mamba"
    m = export(fixture, "ssm", out, formats=("onnx",), max_ctx=256)
    assert m["tokenizer"]["kind"] == "bytes" and m["verification"]["onnx"]["passed"]
    tok = json.loads((out / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == 256 and tok["model"]["merges"] == []
    r = CliRunner().invoke(cli, ["run", str(out), "--prompt", "def ", "--max-new-tokens", "32", "--threads", "1"])
    assert r.exit_code == 0, r.output
    ref = transformers.AutoModelForCausalLM.from_pretrained(fixture, local_files_only=True).eval()
    with torch.no_grad():
        gen = ref.generate(torch.tensor([list(b"def ")]), max_new_tokens=32, do_sample=False, eos_token_id=0,
                           pad_token_id=0)[0, 4:].tolist()
    text = bytes(gen).decode("utf-8", errors="replace").rstrip("\ufffd")
    assert r.stdout == "def " + text + "\n"
    assert sum(ch.isalpha() for ch in text) >= 8  # real text, not padding or one repeated byte


@pytest.mark.parametrize("model,strategy,flags", [
    ("llama", "ssm", []),
    ("mamba", "kv", []),
    ("mamba", "hybrid", []),
    ("llama", "kv-int8", ["--rank", "16"]),
    ("llama", "ring", []),
])
def test_a_strategy_that_does_not_fit_the_model_is_one_line_and_exit_2(tmp_path, model, strategy, flags):
    folder = ROOT / "fixtures" / "tiny" / model
    r = CliRunner().invoke(cli, ["export", "--model", str(folder), "--strategy", strategy, *flags, "--out",
                                 str(tmp_path / "x"), "--max-ctx", "64"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and strategy.split(":")[0] in lines[0], lines
    if not flags and strategy != "ring":
        assert model in lines[0], lines
    assert not (tmp_path / "x").exists()


def test_rank_and_window_flags_are_strategy_shortcuts():
    from edgekv.errors import EdgekvError
    from edgekv.export.options import strategy_spec

    assert strategy_spec(None, rank=64) == "mla:rank=64"
    assert strategy_spec("mla:dtype=fp32", rank=64) == "mla:dtype=fp32,rank=64"
    assert strategy_spec(None, window=512) == "window:w=512"
    assert strategy_spec("window:sinks=0", window=512) == "window:sinks=0,w=512"
    assert parse_strategy(strategy_spec(None, rank=64)).params["rank"] == 64
    for args in (("kv", 64, None), ("mla:rank=8", 64, None), (None, 8, 64)):
        with pytest.raises(EdgekvError):
            strategy_spec(*args)


def test_export_help_lists_every_exportable_strategy():
    r = CliRunner().invoke(cli, ["export", "--help"], terminal_width=200)
    assert r.exit_code == 0
    for name in EXPORTABLE:
        assert name in r.output
    assert "--rank" in r.output and "--window" in r.output
