"""edgekv/costs/arm64_packing.json from benchmarks/results/arm64_vs_x86_smollm2.json: for each runtime and weight
precision where the arm64 run of an artifact holds a different amount above the runtime baseline than the x86 run
(by more than MIN_BYTES and MIN_FRACTION of the stored weights: the runtime's arm64 kernels pack the weights
differently), the arm64 run's bytes beyond the planner's prediction for that artifact (the manifest's, made by the
same cost model), as a fraction of the artifact's stored weights (manifest weights.bytes), the mean over the exports
measured (rows with a quantized cache left out: QUANTIZED_CACHES). The planner adds value x stored weights to a phone's load bytes (edgekv.memory.arm64_load), so a phone's
plan is what the arm64 process measured; x86 plans are left as they are. Only edgekv's own .pte gets ExecuTorch's entry: ExecuTorch's
Llama export (cost model executorch-llama) is priced from the sizes and RSS its README measured on phones, which are
arm64 figures already, so adding the packing measured here would count arm64 twice. Usage: python experiments/arm64_packing.py [RESULTS_JSON] (from the repository root)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = "benchmarks/results/arm64_vs_x86_smollm2.json"
OUT = Path("edgekv/costs/arm64_packing.json")
MIN_BYTES, MIN_FRACTION = 2_000_000, 0.02
COST_MODELS = {"ort": ["onnxruntime"], "executorch": ["executorch"]}
# a quantized cache's rows are left out: their runtime holds more than the plan on x86 and arm64 alike (the
# cache path's own cost, not the weights' packing), which would leak into a phone's every plan
QUANTIZED_CACHES = ("kv-int8", "kv-int4")
PRECISION = {"float32": "fp32", "int4": "int4", "int8": "int8", "float16": "fp16"}


def main() -> None:
    src = sys.argv[1] if len(sys.argv) > 1 else RESULTS
    doc = json.loads(Path(src).read_text())
    found: dict[tuple[str, str], list] = {}
    for rep in doc["reports"]:
        # the stored weights' bytes: the report's own (edgekv profile --arch arm64 records them), else the export's
        m = Path("export") / rep["artifact"] / "manifest.json"
        if "weights_bytes" in rep:
            wbytes = rep["weights_bytes"]
        elif m.exists():
            wbytes = json.loads(m.read_text())["weights"]["bytes"]
        else:
            continue
        if rep["strategy"].split(":")[0] in QUANTIZED_CACHES:
            continue
        for run in rep["runs"]:
            if run.get("status") != "ok":
                continue
            found.setdefault((run["runtime"], PRECISION[rep["weights"]]), []).append(
                (rep["artifact"], run["predicted_bytes"], wbytes, run["arm64"]["measured_bytes"],
                 run["host"]["measured_bytes"]))
    out = {"_about": "Where a runtime's arm64 kernels hold a different amount than its x86 kernels (by more than "
                     f"{MIN_BYTES:,} B and {MIN_FRACTION:.0%} of the stored weights, measured by `edgekv profile "
                     "--arch arm64`: qemu-user, qemu's own memory taken out, against the x86 run of the same "
                     "artifact): the arm64 run's bytes above the runtime baseline beyond the planner's prediction for "
                     "that artifact, as a fraction of its stored weights (value), by planner cost model and weight "
                     "precision. The planner adds value x stored weights to the load bytes of a phone "
                     f"(edgekv.memory.arm64_load). Rows with a quantized cache (kv-int8, kv-int4) are left out: their runtime "
                     "holds more than the plan on x86 and arm64 alike, the cache path's cost, not the weights' packing. "
                     f"Made by experiments/arm64_packing.py from {src}."}
    for (rt, prec), rows in sorted(found.items()):
        diff = sum(ab - hb for _, _, _, ab, hb in rows) / len(rows)
        if abs(diff) < MIN_BYTES or abs(diff) / (sum(w for _, _, w, _, _ in rows) / len(rows)) < MIN_FRACTION:
            continue
        frac = sum((ab - p) / w for _, p, w, ab, _ in rows) / len(rows)
        cite = "; ".join(f"{a}: arm64 {ab:,} B vs x86 {hb:,} B above the baseline, planned {p:,} B, weights {w:,} B"
                         for a, p, w, ab, hb in rows)
        for cm in COST_MODELS[rt]:
            out.setdefault(cm, {})[prec] = {"value": round(frac, 4), "source": f"{src} ({rt}) {cite}"}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    write_derived(Path(src), doc)


def write_derived(path: Path, doc: dict) -> None:
    """The differences benchmarks/README.md reads off the rows, kept in the results JSON itself (`derived_mb`, MB =
    1e6 bytes) so that every figure the README prints is one the JSON holds: per artifact and runtime, x86 minus arm64
    above the baseline, and each machine's run minus the plan."""
    rows = {}
    for rep in doc["reports"]:
        for run in rep["runs"]:
            if run.get("status") != "ok":
                continue
            a, h, p = run["arm64"]["measured_bytes"], run["host"]["measured_bytes"], run["predicted_bytes"]
            rows[f"{rep['artifact']} ({run['runtime']})"] = {
                "x86_minus_arm64": round((h - a) / 1e6, 1), "x86_minus_plan": round((h - p) / 1e6, 1),
                "arm64_minus_plan": round((a - p) / 1e6, 1)}
    doc["derived_mb"] = {"how": "differences of the rows' measured_bytes (above the runtime baseline) and "
                                "predicted_bytes, in MB (1e6 bytes), written by experiments/arm64_packing.py", "rows": rows}
    path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
