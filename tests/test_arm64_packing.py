"""The planner's phone memory uses the arm64 packing measured by `edgekv profile --arch arm64`
(edgekv/costs/arm64_packing.json, made by experiments/arm64_packing.py from benchmarks/results/arm64_vs_x86_smollm2.json):
a phone's plan moves by the measured fraction of its stored weights, an x86 host's and a datacenter GPU's do not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgekv import memory as M
from edgekv.arch import catalog_arch
from edgekv.devices import load_device
from edgekv.plan import plan_one
from edgekv.strategies import parse_strategy

DATA = Path(M.__file__).resolve().parent.parent / "costs" / "arm64_packing.json"  # edgekv/costs
RUNTIME_OF = {"onnxruntime": "onnxruntime", "executorch": "edgekv-pte", "executorch-llama": "executorch"}


def _load(device: str, runtime: str | None, weights: str) -> int:
    row = plan_one(catalog_arch("smollm2-135m"), parse_strategy("kv"), load_device(device), 4096, weights, runtime)
    return row.deployment.bytes["load"]


def test_every_entry_is_a_measured_fact_with_its_source():
    doc = json.loads(DATA.read_text())
    for cost, by_precision in doc.items():
        if cost.startswith("_"):
            continue
        assert cost in M.RUNTIMES
        for precision, fact in by_precision.items():
            assert precision in ("fp32", "fp16", "int8", "int4")
            assert set(fact) == {"value", "source"} and isinstance(fact["value"], float)
            assert "arm64_vs_x86" in fact["source"] and "arm64" in fact["source"]


@pytest.mark.parametrize("cost,precision", [(c, p) for c, v in M.ARM64_PACKING.items() for p in v] or
                         [pytest.param(None, None, marks=pytest.mark.skip(reason="no arm64 packing differs"))])
def test_a_phone_plan_moves_by_the_measured_packing_and_x86_does_not(cost, precision, monkeypatch):
    runtime = RUNTIME_OF[cost]
    with_it = {d: _load(d, runtime if d == "pixel8" else None, precision) for d in ("pixel8", "host", "h100")}
    weights = plan_one(catalog_arch("smollm2-135m"), parse_strategy("kv"), load_device("pixel8"), 4096, precision,
                       runtime).deployment.weights["total"]
    monkeypatch.setattr(M, "ARM64_PACKING", {})
    without = {d: _load(d, runtime if d == "pixel8" else None, precision) for d in ("pixel8", "host", "h100")}
    want = json.loads(DATA.read_text())[cost][precision]["value"] * weights
    assert with_it["pixel8"] - without["pixel8"] == pytest.approx(want, abs=1)
    assert with_it["host"] == without["host"] and with_it["h100"] == without["h100"]


def test_the_hook_applies_any_entry_to_phones_only(monkeypatch):
    """The mechanism, whatever the data file holds: a 10 % entry for ONNX Runtime int4."""
    monkeypatch.setattr(M, "ARM64_PACKING", {})
    base = {d: _load(d, "onnxruntime", "int4") for d in ("pixel8", "host")}
    fp32 = _load("pixel8", "onnxruntime", "fp32")
    monkeypatch.setattr(M, "ARM64_PACKING", {"onnxruntime": {"int4": {"value": 0.1, "source": "test"}}})
    row = plan_one(catalog_arch("smollm2-135m"), parse_strategy("kv"), load_device("pixel8"), 4096, "int4",
                   "onnxruntime")
    assert row.deployment.bytes["load"] - base["pixel8"] == pytest.approx(0.1 * row.deployment.weights["total"], abs=1)
    assert "arm64 packing +0.1000" in row.deployment.explain["load"]
    assert _load("host", "onnxruntime", "int4") == base["host"]
    assert _load("pixel8", "onnxruntime", "fp32") == fp32  # no fp32 entry: unchanged
