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
    entries = PLAN_RUNTIMES["edgekv-pte"]["cannot_build"]["value"]
    assert entries
    for e in entries:
        rows = json.loads((ROOT / e["evidence"]).read_text())["rows"]
        failed = [r for r in rows if r["name"].startswith("edgekv-pte:") and "error" in r
                  and r["name"].endswith(tuple(f"/{w}" for w in e["weights"]))]
        assert failed, e
        assert all("export failed" in r["error"] for r in failed), failed


def test_plan_marks_gemma3_8da4w_full_fp32_cache_pte_at_16k_as_not_buildable():
    """benchmarks/results/filled_context_gemma3_16384_rows.json: `edgekv-pte:kv:dtype=fp32/int4` failed its
    verification at max_ctx 16384; the int8-weight row and the window row of the same run built."""
    (row,) = plan_options("--ctx", "16k", "--strategy", "kv:dtype=fp32", "--weights", "int4")
    assert row["params"]["runtime"] == "executorch"  # pixel8's runtime, built as edgekv's own .pte
    assert row["exportable"] is False
    assert "verification" in row["exportable_reason"] and "filled_context_gemma3_16384_rows.json" in \
        row["exportable_reason"]
    for args in (("--ctx", "16k", "--strategy", "kv:dtype=fp32", "--weights", "int8"),
                 ("--ctx", "16k", "--strategy", "window:w=512,sinks=4", "--weights", "int4"),
                 ("--ctx", "16k", "--strategy", "kv:dtype=fp32", "--weights", "int4", "--runtime", "ort")):
        (row,) = plan_options(*args)
        assert row["exportable"] is True, (args, row["exportable_reason"])
