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


def test_each_cannot_build_entry_is_a_run_that_failed():
    for e in PLAN_RUNTIMES["edgekv-pte"]["cannot_build"]["value"]:
        rows = json.loads((ROOT / e["evidence"]).read_text())["rows"]
        failed = [r for r in rows if r["name"].startswith("edgekv-pte:") and "error" in r
                  and r["name"].endswith(tuple(f"/{w}" for w in e["weights"]))]
        assert failed, e
        assert all("export failed" in r["error"] for r in failed), failed


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
