"""benchmarks/pte_export_cost.py: each --strategy is its own cell, its export given that --strategy and its row naming
it, and each cell's verification verdict kept from the manifest (benchmarks/export_cost.py's measure). The export
itself is stubbed: what is checked is the argv each cell runs and the JSON rows written.

References: the argv and manifest the stub is handed and returns, written out below."""
import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import export_cost  # noqa: E402
import pte_export_cost  # noqa: E402


def test_one_cell_per_strategy(tmp_path, monkeypatch):
    seen = []

    def fake_measure(args):
        seen.append(args)
        return {"argv": ["edgekv", "export", *args], "returncode": 0, "wall_s": 1.0, "cpu_s": 1.0, "peak_rss": 10 ** 9,
                "stages": {}, "timings_s": {}, "files": {"model.pte": 123},
                "verification": {"pte": {"passed": True, "top1_agreement": 1.0}}}
    monkeypatch.setattr(export_cost, "measure", fake_measure)
    out = tmp_path / "cost.json"
    pte_export_cost.main(["--model", "tiny:64", "--strategy", "kv:dtype=fp32", "--strategy", "window",
                          "--out", str(out), "--", "--threads", "1"])
    assert [a[a.index("--strategy") + 1] for a in seen] == ["kv:dtype=fp32", "window"]
    assert all(a[-2:] == ["--threads", "1"] for a in seen)
    assert len({a[a.index("-o") + 1] for a in seen}) == 2  # each cell its own folder
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["max_ctx"], r["strategy"]) for r in rows] == [("tiny", 64, "kv:dtype=fp32"),
                                                                          ("tiny", 64, "window")]
    assert all(r["verification"]["pte"]["passed"] and r["pte_bytes"] == 123 for r in rows)


def test_no_strategy_one_cell(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(export_cost, "measure", lambda args: seen.append(args) or
                        {"argv": args, "returncode": 1, "wall_s": 1.0, "cpu_s": 1.0, "peak_rss": 0, "stages": {},
                         "timings_s": None, "error": "edgekv: error: x"})
    out = tmp_path / "cost.json"
    pte_export_cost.main(["--model", "tiny:64", "--out", str(out)])
    assert len(seen) == 1 and "--strategy" not in seen[0]
    assert "strategy" not in json.loads(out.read_text())["rows"][0]
