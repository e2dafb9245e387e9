"""edgekv/costs/arm64_packing.json from benchmarks/results/arm64_vs_x86_smollm2.json: for each runtime and weight
precision, the bytes above the runtime baseline the arm64 run held beyond the x86 run of the same artifact, as a
fraction of the artifact's stored weights (manifest weights.bytes), the mean over the exports measured. Kept only
where arm64 and x86 differ by more than MIN_BYTES and MIN_FRACTION of the weights (run-to-run noise of the same
artifact on one host is of the order of a MB); the planner adds value x stored weights to a phone's load bytes
(edgekv.memory.arm64_load). ExecuTorch's entry covers both cost models that run XNNPACK (edgekv's .pte and
ExecuTorch's Llama export). Usage: python scripts/arm64_packing.py [RESULTS_JSON] (from the repository root)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = "benchmarks/results/arm64_vs_x86_smollm2.json"
OUT = Path("edgekv/costs/arm64_packing.json")
MIN_BYTES, MIN_FRACTION = 2_000_000, 0.02
COST_MODELS = {"ort": ["onnxruntime"], "executorch": ["executorch", "executorch-llama"]}
PRECISION = {"float32": "fp32", "int4": "int4", "int8": "int8", "float16": "fp16"}


def main() -> None:
    src = sys.argv[1] if len(sys.argv) > 1 else RESULTS
    doc = json.loads(Path(src).read_text())
    found: dict[tuple[str, str], list] = {}
    for rep in doc["reports"]:
        m = Path("export") / rep["artifact"] / "manifest.json"
        if not m.exists():
            continue
        wbytes = json.loads(m.read_text())["weights"]["bytes"]
        for run in rep["runs"]:
            if run.get("status") != "ok":
                continue
            delta = run["arm64"]["measured_bytes"] - run["host"]["measured_bytes"]
            found.setdefault((run["runtime"], PRECISION[rep["weights"]]), []).append(
                (rep["artifact"], delta, wbytes, run["arm64"]["measured_bytes"], run["host"]["measured_bytes"]))
    out = {"_about": "Bytes a runtime's arm64 kernels pack beyond its x86 kernels, as a fraction of the stored weights "
                     "(value), by planner cost model and weight precision, measured by `edgekv profile --arch arm64` "
                     "(qemu-user, qemu's own memory taken out) against the x86 run of the same artifact; only where "
                     f"they differ by more than {MIN_BYTES:,} B and {MIN_FRACTION:.0%} of the weights. The planner "
                     "adds value x stored weights to the load bytes of a phone (edgekv.memory.arm64_load). Made by "
                     f"scripts/arm64_packing.py from {src}."}
    for (rt, prec), rows in sorted(found.items()):
        mean = sum(d for _, d, _, _, _ in rows) / len(rows)
        frac = sum(d / w for _, d, w, _, _ in rows) / len(rows)
        if abs(mean) < MIN_BYTES or abs(frac) < MIN_FRACTION:
            continue
        cite = "; ".join(f"{a}: arm64 {ab:,} B vs x86 {hb:,} B above the baseline, weights {w:,} B"
                         for a, _, w, ab, hb in rows)
        for cm in COST_MODELS[rt]:
            out.setdefault(cm, {})[prec] = {"value": round(frac, 4), "source": f"{src} ({rt}) {cite}"}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
