"""edgekv plan marks an ExecuTorch row that edgekv export cannot build (issue 39): not only a whole family it has no
module for, but one (model type, weights, cache kind, context) whose export failed. The reference is the failed run
itself: the benchmark JSON each runtimes.json cannot_build entry cites holds that row with its export error."""
import json

from click.testing import CliRunner

from conftest import ROOT
from edgekv.cli import main
from edgekv.memory import PLAN_RUNTIMES


def plan_options(*args) -> list[dict]:
    r = CliRunner().invoke(main, ["plan", "--device", "pixel8", "--model", "gemma-3-270m", *args, "--json"],
                           env={"COLUMNS": "2000"})
    assert r.exit_code in (0, 3), r.stderr
    return json.loads(r.stdout)["options"]


# plan runtime -> its rows' family in the filled-context benchmark
ROW_FAMILY = {"edgekv-pte": "edgekv-pte:", "onnxruntime": "edgekv-ort:"}


def row_strategy(name: str) -> str:
    """A filled-context row's strategy name: 'edgekv-ort:mla/int4' -> 'mla', 'edgekv-pte:kv:dtype=fp32/int4' -> 'kv'."""
    return name.split(":", 1)[1].rsplit("/", 1)[0].split(":")[0]


def test_each_cannot_build_entry_is_a_run_that_failed():
    entries = [(rt, e) for rt in ROW_FAMILY for e in PLAN_RUNTIMES[rt].get("cannot_build", {}).get("value", [])]
    assert any(rt == "onnxruntime" for rt, _ in entries)
    for rt, e in entries:
        rows = json.loads((ROOT / e["evidence"]).read_text())["rows"]
        failed = [r for r in rows if r["name"].startswith(ROW_FAMILY[rt]) and "error" in r
                  and r["name"].endswith(tuple(f"/{w}" for w in e["weights"]))
                  and row_strategy(r["name"]) in e.get("strategies", [row_strategy(r["name"])])]
        assert failed, e
        assert all("export failed" in r["error"] for r in failed), failed


def test_smollm2_mla_int4_onnx_is_marked_and_its_kv_fp16_row_is_not():
    """An entry naming strategies (mla: its latent cache has kv's cache kind, fp16, full) marks that strategy's row
    only: SmolLM2's mla row with int4 weights for ONNX Runtime and for the .pte, whose exports the verify-quant gate
    refused, not its kv fp16 row, and not the mla row with int8 weights."""
    def row(*args, model="smollm2-135m"):
        r = CliRunner().invoke(main, ["plan", "--device", "host-xeon", "--model", model, "--ctx", "8k",
                                      *args, "--json"], env={"COLUMNS": "2000"})
        assert r.exit_code in (0, 3), r.stderr
        (o,) = json.loads(r.stdout)["options"]
        return o

    for rt in ("ort", "executorch"):  # each refused by its own format's gate (verify-quant-onnx, verify-quant-pte)
        mla = row("--runtime", rt, "--strategy", "mla", "--weights", "int4")
        assert mla["exportable"] is False and "verify-quant" in mla["exportable_reason"], rt
        assert row("--runtime", rt, "--strategy", "kv", "--weights", "int4")["exportable"] is True
        assert row("--runtime", rt, "--strategy", "mla", "--weights", "int8")["exportable"] is True
        # the refusal was measured on SmolLM2 only: another Llama-type model's mla row stays buildable
        assert row("--runtime", rt, "--strategy", "mla", "--weights", "int4", model="llama-3.2-1b")["exportable"]


def test_plan_marks_a_row_an_entry_names_and_only_that_row(monkeypatch):
    """The mechanism, on the entry Gemma-3's 16k run once needed (benchmarks/results/filled_context_gemma3_16384_rows.json:
    its 8da4w .pte with a full fp32 cache failed verification at max_ctx 16384): the row it names is marked, rows it
    does not name (int8 weights, a window, another runtime, a shorter context) are not."""
    entry = {"model_types": ["gemma3_text"], "weights": ["int4"], "caches": ["fp32"], "full_cache": True,
             "min_ctx": 16384, "reason": "a failed verification", "evidence": "benchmarks/results/filled_context_gemma3_16384_rows.json"}
    monkeypatch.setitem(PLAN_RUNTIMES["edgekv-pte"], "cannot_build", {"value": [entry], "source": "test"})
    (row,) = plan_options("--ctx", "16k", "--strategy", "kv:dtype=fp32", "--weights", "int4")
    assert row["params"]["runtime"] == "executorch"  # pixel8's runtime, built as edgekv's own .pte
    assert row["exportable"] is False
    assert "a failed verification" in row["exportable_reason"] and "filled_context_gemma3_16384_rows.json" in \
        row["exportable_reason"]
    for args in (("--ctx", "16k", "--strategy", "kv:dtype=fp32", "--weights", "int8"),
                 ("--ctx", "16k", "--strategy", "window:w=512,sinks=4", "--weights", "int4"),
                 ("--ctx", "8k", "--strategy", "kv:dtype=fp32", "--weights", "int4"),
                 ("--ctx", "16k", "--strategy", "kv:dtype=fp32", "--weights", "int4", "--runtime", "ort")):
        (row,) = plan_options(*args)
        assert row["exportable"] is True, (args, row["exportable_reason"])


def test_gemma3_int4_full_fp32_cache_pte_is_buildable_at_16k_and_32k():
    """That entry is gone because the export now builds, verifies and decodes those rows (6 of Gemma's 18 layers
    int8): the runs that measured them hold the row's decode and no error."""
    for ctx, run in (("16k", "filled_context_gemma3_16384_pte_fast_r2.json"), ("32k", "pte32k_filled_gemma3_32768_fp32.json")):
        rows = json.loads((ROOT / "benchmarks/results" / run).read_text())["rows"]
        (built,) = [r for r in rows if r["name"] == "edgekv-pte:kv:dtype=fp32/int4"]
        assert "error" not in built and built["decode_tok_per_cpu_s"] > 0
        (row,) = plan_options("--ctx", ctx, "--strategy", "kv:dtype=fp32", "--weights", "int4")
        assert row["exportable"] is True, (ctx, row["exportable_reason"])
