"""The runtimes' own LLM APIs on edgekv exports: ONNX Runtime GenAI (og.Model / og.Generator, with its own tokenizer
and greedy loop) and ExecuTorch's LLM runner (TextLLMRunner, the Python binding of the runner LlmModule wraps) each
generate from an export made with --runner, and agree with `edgekv run` on the explicit-state artifact of the same
model and strategy. A folder a runner cannot load fails in one line naming what is missing."""
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("executorch")
pytest.importorskip("onnxruntime_genai")

from conftest import ROOT, run_cli  # noqa: E402

from edgekv.export.manifest import load_export  # noqa: E402
from edgekv.export.pipeline import export_model  # noqa: E402
from edgekv.export.options import ExportOptions  # noqa: E402

TINY = ROOT / "fixtures/tiny/llama"
MAX_CTX, CHUNK = 128, 16
# longer than CHUNK bytes (the byte-level fixture: one token per byte), so ExecuTorch's runner prefills in 2 calls
PROMPT = "import os\nimport sys\ndef "


def _export(out, formats, runners=(), strategy="kv:dtype=fp32", model=str(TINY), max_ctx=MAX_CTX, chunk=CHUNK):
    return export_model(ExportOptions(model=model, strategy=strategy, formats=formats, max_ctx=max_ctx, out=out,
                                      prefill_chunk=chunk, verify_steps=8, threads=1, runners=runners),
                        echo=lambda s: None)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The tiny trained Llama: one export for the runners (--runner genai,executorch), one explicit-state .pte."""
    root = tmp_path_factory.mktemp("runners")
    runner = _export(root / "runner", ("onnx", "pte"), ("genai", "executorch"))
    explicit = _export(root / "explicit", ("pte",))
    return root / "runner", runner, root / "explicit", explicit


def run_json(folder, runtime, prompt=PROMPT, n=24):
    p = run_cli("run", folder, "--prompt", prompt, "--max-new-tokens", n, "--runtime", runtime, "--json",
                "--threads", 1, check=True)
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def explicit_run(exports):
    """`edgekv run --runtime executorch` on the explicit-state .pte: the reference both runners are held to, run
    once."""
    return run_json(exports[2], "executorch")


def test_genai_generates_what_edgekv_run_generates_on_the_explicit_state_pte(exports, explicit_run):
    """GenAI's own tokenizer and greedy loop vs edgekv's loop on the explicit-state .pte and on the same graph."""
    runner = exports[0]
    genai = run_json(runner, "genai")
    ref = explicit_run
    ort = run_json(runner, "ort")  # edgekv's OrtStepper on the GenAI graph: one artifact serves both
    assert genai["runtime"] == "genai" and genai["new_tokens"] == 24
    assert genai["prompt_tokens"] == ref["prompt_tokens"] == len(PROMPT.encode())
    assert genai["tokens"] == ref["tokens"] == ort["tokens"]
    assert genai["text"] == ref["text"]
    assert len(set(ref["tokens"])) > 3, ref  # a continuation worth comparing, not one repeated byte


def test_executorch_runner_generates_what_edgekv_run_generates_on_the_explicit_state_pte(exports, explicit_run):
    """`edgekv run --runtime executorch-runner` (edgekv's loop over the runner .pte, called as the runner calls it:
    chunked prefill, last-token logits) vs edgekv's loop on the explicit-state .pte: the same token ids; and
    TextLLMRunner itself (its HF tokenizer over tokenizer.json, its chunked prefill, its decode loop, as an app runs
    it) generates the same text."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (llama::custom_sdpa, as the README says)
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    runner, manifest, _, _ = exports
    et = run_json(runner, "executorch-runner")
    ref = explicit_run
    assert et["runtime"] == "executorch-runner" and et["prompt_tokens"] == ref["prompt_tokens"]
    assert et["new_tokens"] == ref["new_tokens"] == 24
    assert et["tokens"] == ref["tokens"] and et["text"] == ref["text"]
    pieces = []
    TextLLMRunner(str(runner / "model.pte"), str(runner / manifest["tokenizer"]["file"])).generate(
        PROMPT, GenerationConfig(echo=False, max_new_tokens=24, temperature=0.0, num_bos=0, num_eos=0,
                                 seq_len=MAX_CTX), token_callback=pieces.append)
    assert len(pieces) == 24 and "".join(pieces) == ref["text"]


def test_manifest_says_which_runners_load_each_artifact(exports):
    runner, m, explicit, m2 = exports
    by = {a["format"]: a for a in m["artifacts"]}
    assert by["onnx"]["runners"] == ["edgekv", "onnxruntime-genai"]
    assert by["pte"]["runners"] == ["executorch-llm-runner"] and by["pte"]["state_location"] == "mutable_buffers"
    for a in m["artifacts"]:  # every file a runner opens is listed with its hash
        for f in [a["file"], *a["runner_files"]]:
            assert f in m["files"] and (runner / f).is_file()
    assert m["runners_unsupported"] == {}
    assert m["verification"]["genai"]["passed"] and m["verification"]["pte"]["passed"]
    assert "state_max_abs_diff" not in m["verification"]["genai"]  # GenAI keeps its cache to itself
    assert m2["artifacts"][0]["runners"] == ["edgekv"]
    assert set(m2["runners_unsupported"]) == {"onnxruntime-genai", "executorch-llm-runner"}
    assert "--runner executorch" in m2["runners_unsupported"]["executorch-llm-runner"]


def test_genai_config_describes_the_graph_and_the_fixture(exports):
    """genai_config.json against the fixture's config.json (the published numbers) and the graph's own I/O."""
    import onnx

    runner, m, _, _ = exports
    cfg = json.loads((TINY / "config.json").read_text())
    g = json.loads((runner / "genai_config.json").read_text())
    d = g["model"]["decoder"]
    assert (d["num_hidden_layers"], d["num_attention_heads"], d["num_key_value_heads"], d["head_size"],
            d["hidden_size"]) == (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                  cfg["head_dim"], cfg["hidden_size"])
    assert g["model"]["vocab_size"] == cfg["vocab_size"] and g["model"]["eos_token_id"] == cfg["eos_token_id"]
    assert g["model"]["context_length"] == g["search"]["max_length"] == MAX_CTX
    assert g["search"]["past_present_share_buffer"] is True and g["search"]["do_sample"] is False
    graph = onnx.load(str(runner / d["filename"]), load_external_data=False).graph
    ins, outs = [i.name for i in graph.input], [o.name for o in graph.output]
    n = cfg["num_hidden_layers"]
    assert ins == ["input_ids", "attention_mask"] + [f"past_key_values.{i}.{kv}" for i in range(n)
                                                      for kv in ("key", "value")]
    assert outs == ["logits"] + [f"present.{i}.{kv}" for i in range(n) for kv in ("key", "value")]
    assert {d["inputs"]["past_key_names"] % 0, d["outputs"]["present_value_names"] % 1} <= set(ins + outs)
    # the graph writes the cache in place: GroupQueryAttention, whose present outputs GenAI binds to past
    assert sum(node.op_type == "GroupQueryAttention" for node in graph.node) == n


def test_runner_pte_carries_the_metadata_the_runner_reads(exports):
    from executorch.extension.pybindings import portable_lib

    from edgekv.export.et_runner import _kernels

    runner, m, _, _ = exports
    cfg = json.loads((TINY / "config.json").read_text())
    _kernels()
    prog = portable_lib._load_program(str(runner / "model.pte"))
    names = {prog.get_method_name(i) for i in range(prog.num_methods())}
    want = {"get_max_seq_len": CHUNK, "get_max_context_len": MAX_CTX, "get_vocab_size": cfg["vocab_size"],
            "get_n_layers": cfg["num_hidden_layers"], "use_kv_cache": True, "enable_dynamic_shape": True,
            "get_bos_id": cfg["bos_token_id"]}
    assert set(want) | {"forward", "get_eos_ids"} <= names
    for k, v in want.items():
        assert _run0(prog, k) == v, k
    ep = m["artifacts"][1]["entry_points"][0]
    assert [i["name"] for i in ep["inputs"]] == ["tokens", "input_pos"]  # no state in or out: it is in the program


def _run0(prog, name):
    meth = prog.load_method(name)
    meth.set_inputs([])
    meth.execute()
    out = meth.get_outputs()[0]
    return out.item() if hasattr(out, "item") else out


@pytest.mark.parametrize("runtime, folder, removes, says", [
    ("executorch-runner", "explicit", None, "explicit-state variant; .*--runner executorch"),
    ("genai", "explicit", None, "no onnx artifact"),
    ("executorch", "runner", None, "--runtime executorch-runner"),
    ("genai", "runner", "genai_config.json", "genai_config.json"),
    ("executorch-runner", "runner", "tokenizer.json", "tokenizer.json"),
])
def test_a_folder_a_runner_cannot_load_fails_in_one_line(exports, tmp_path, runtime, folder, removes, says):
    import re
    src = exports[0] if folder == "runner" else exports[2]
    d = tmp_path / "x"
    shutil.copytree(src, d)
    if removes:
        (d / removes).unlink()
    from click.testing import CliRunner

    from edgekv.export.cli import cli
    r = CliRunner().invoke(cli, ["run", str(d), "--prompt", "def ", "--max-new-tokens", "2", "--runtime", runtime])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(says, lines[0]), r.stderr


def test_a_file_missing_from_the_manifest_too_is_named_by_the_runner(exports, tmp_path):
    """genai_config.json deleted with its `files` entry: loading refuses the runner file the manifest no longer
    vouches for; deleted from runner_files too: the runner check still names it."""
    from edgekv.errors import EdgekvError
    from edgekv.export.genai import GenaiStepper
    from edgekv.export.manifest import write_manifest

    d = tmp_path / "x"
    shutil.copytree(exports[0], d)
    m = load_export(d)
    (d / "genai_config.json").unlink()
    del m["files"]["genai_config.json"]
    write_manifest(d, m)
    with pytest.raises(EdgekvError, match="runner_files genai_config.json is not listed in `files`"):
        load_export(d)
    onnx = next(a for a in m["artifacts"] if a["format"] == "onnx")
    onnx["runner_files"].remove("genai_config.json")
    write_manifest(d, m)
    with pytest.raises(EdgekvError, match="onnxruntime-genai needs genai_config.json, which is missing"):
        GenaiStepper(load_export(d), d)


@pytest.mark.parametrize("args, says", [
    (["--model", "fixtures/tiny/mamba", "--strategy", "ssm", "--runner", "genai"],
     "GenAI's decoder feeds past key/value caches only; ssm"),
    (["--model", "fixtures/tiny/llama", "--strategy", "kv-int8", "--runner", "genai"], "quantized codes"),
    (["--model", "fixtures/tiny/llama", "--window", "32", "--runner", "genai"], "ring"),
    (["--model", "fixtures/tiny/rwkv", "--strategy", "linear", "--format", "pte", "--runner", "executorch"],
     "not exported that way"),
    (["--model", "fixtures/tiny/llama", "--format", "pte", "--runner", "genai"], "add onnx to --format"),
    (["--model", "fixtures/tiny/llama", "--runner", "tflite"], "choose from genai, executorch"),
])
def test_export_refuses_a_runner_that_cannot_carry_the_state_in_one_line(tmp_path, args, says):
    p = run_cli("export", *args, "--max-ctx", 64, "--out", tmp_path / "o")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], p.stderr
    assert not (tmp_path / "o").exists()


def test_an_export_without_runners_says_why_not_for_a_recurrent_state():
    """The manifest's runners_unsupported for a Mamba export (no torch: the rule reads the StateLayout)."""
    from edgekv.arch import read_config_json
    from edgekv.export.runners import unsupported
    from edgekv.models import layout_for
    from edgekv.strategies import parse_strategy

    layout = layout_for(read_config_json(ROOT / "fixtures/tiny/mamba"), parse_strategy("ssm"), 64)
    u = unsupported(layout, [{"format": "onnx", "runners": ["edgekv"]}])
    assert "past key/value caches only" in u["onnxruntime-genai"]
    assert "not exported that way" in u["executorch-llm-runner"]


@pytest.mark.parametrize("runtime", ["genai", pytest.param("executorch-runner", marks=pytest.mark.slow)])
def test_profile_measures_the_runner_artifacts_as_the_runtime_runs_them(exports, runtime):
    runner = exports[0]
    p = run_cli("profile", runner, "--runtime", runtime, "--ctx", 64, "--steps", 8, "--threads", 1, "--json",
                check=True)
    r = json.loads(p.stdout)
    run = r["runs"][0]
    assert run["status"] == "ok" and run["measured_bytes"] > 0 and run["tokens_per_s"] > 0, run


def _agree_on_smollm2(tmp_path, prompt="The capital of France is", n=12):
    """SmolLM2-135M kv fp32 exported twice: explicit-state (onnx, pte) and for the runners (--runner genai,executorch);
    each generated by its runtime."""
    ref_dir, run_dir = tmp_path / "explicit", tmp_path / "runner"
    _export(ref_dir, ("onnx", "pte"), (), "kv:dtype=fp32", "smollm2-135m", 512, 32)
    _export(run_dir, ("onnx", "pte"), ("genai", "executorch"), "kv:dtype=fp32", "smollm2-135m", 512, 32)
    return {rt: run_json(folder, rt, prompt, n) for folder, rt in ((ref_dir, "ort"), (ref_dir, "executorch"),
                                                                   (run_dir, "genai"), (run_dir, "executorch-runner"))}


@pytest.mark.slow
def test_smollm2_genai_and_executorch_runner_agree_with_edgekv_run(tmp_path):
    """The real model, kv fp32: GenAI's tokens equal edgekv's ORT tokens on the explicit-state graph; the runner's
    text equals edgekv's on the explicit-state .pte; all say Paris."""
    out = _agree_on_smollm2(tmp_path)
    assert out["genai"]["tokens"] == out["ort"]["tokens"]
    assert out["genai"]["prompt_tokens"] == out["ort"]["prompt_tokens"]  # GenAI's tokenizer = edgekv's
    assert out["executorch-runner"]["text"] == out["executorch"]["text"]
    assert out["executorch-runner"]["prompt_tokens"] == out["executorch"]["prompt_tokens"]
    for r in out.values():
        assert "Paris" in r["text"], out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["fixtures/tiny/llama", "smollm2-135m"])
def test_executorch_runner_with_an_int8_cache_agrees_with_edgekv_run(tmp_path, model):
    small = model.startswith("fixtures")
    ref_dir, run_dir = tmp_path / "explicit", tmp_path / "runner"
    ctx, chunk = (MAX_CTX, CHUNK) if small else (512, 32)
    _export(ref_dir, ("pte",), (), "kv-int8", str(ROOT / model) if small else model, ctx, chunk)
    m = _export(run_dir, ("pte",), ("executorch",), "kv-int8", str(ROOT / model) if small else model, ctx, chunk)
    assert m["state"]["tensors"][0]["dtype"] == "int8"
    prompt = PROMPT if small else "The capital of France is"
    a, b = run_json(ref_dir, "executorch", prompt, 16), run_json(run_dir, "executorch-runner", prompt, 16)
    assert a["text"] == b["text"] and a["new_tokens"] == b["new_tokens"]
    assert np.isfinite(m["verification"]["pte"]["max_abs_diff"])


def test_genai_config_of_a_gqa_model_carries_its_kv_heads_apart_from_its_heads(tmp_path):
    """SmolLM2-135M's published config (HuggingFaceTB/SmolLM2-135M config.json: 30 layers, 9 heads, 3 KV heads,
    hidden 576, head_dim 64, vocab 49152): every GQA model's genai_config.json must carry 3 KV heads, not 9 (the
    fixture above has as many KV heads as heads, so it cannot tell them apart)."""
    from types import SimpleNamespace

    from edgekv.export.genai import write_config
    from edgekv.export.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(TINY, tmp_path)
    args = SimpleNamespace(model_type="llama", vocab=49152, head_dim=64, hidden=576, n_heads=9, n_kv_heads=3,
                           n_layers=30)
    tok = {"file": "tokenizer.json", "eos_token_ids": [2], "bos_token_id": 1, "add_bos_token": False}
    from edgekv.arch import catalog_arch
    from edgekv.strategies import build_layout, parse_strategy
    layout = build_layout(catalog_arch("smollm2-135m"), parse_strategy("kv:dtype=fp32"), 2048)  # no sliding layer
    write_config(tmp_path, args, layout, tok, 2048, fused=True)
    d = json.loads((tmp_path / "genai_config.json").read_text())["model"]["decoder"]
    assert (d["num_hidden_layers"], d["num_attention_heads"], d["num_key_value_heads"], d["head_size"],
            d["hidden_size"]) == (30, 9, 3, 64, 576)


def test_an_int4_genai_export_is_held_to_the_same_graph_in_onnx_runtime(tmp_path):
    """With int4 weights there is no quantized torch module: GenAI runs the same model.onnx as edgekv's ONNX Runtime
    session and is held to it at the fp32 tolerance (an int4 graph held to fp32 logits fails on rounding alone); the
    graph itself is held to the fp32 model by verify-quant-onnx."""
    import jsonschema

    from edgekv.export.manifest import schema

    m = export_model(ExportOptions(model=str(TINY), strategy="kv:dtype=fp32", formats=("onnx",), max_ctx=256,
                                   out=tmp_path / "int4", prefill_chunk=CHUNK, verify_steps=8, threads=1,
                                   runners=("genai",), weights="int4"), echo=lambda s: None)
    jsonschema.validate(m, schema())
    g = m["verification"]["genai"]
    # one graph, two hosts of it: they differ by activation rounding only, far less than int4 weights from fp32
    assert g["passed"] and g["top1_agreement"] == 1.0 and g["max_abs_diff"] < 0.01 * g["logit_scale"], g
    assert "ONNX Runtime session" in g["against"]
    assert m["verification"]["onnx-quant"]["passed"]
