"""Where an export's peak memory above the runtime's baseline falls: at load, or while it runs (issue 39, target 1's
memory). Loads the export the way benchmarks/filled_context.py's child does (the runtime imported, the baseline
read, then the stepper, which packs the weights and warms up), then prefills N tokens and decodes a few steps,
printing VmHWM and VmRSS above the baseline after each phase.

    python experiments/pte_load_peak.py FOLDER pte|onnx [--tokens 2048] [--out JSON]

The token ids are fixed numbers (no tokenizer in the process: Gemma's 262k-entry tokenizer is hundreds of MiB).
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import decode_speed as ds  # noqa: E402

MIB = 2 ** 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("fmt", choices=["pte", "onnx"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.fmt == "pte":
        import torch  # noqa: F401  (the ExecuTorch Python runtime; part of its baseline)
        from executorch.extension.pybindings import portable_lib  # noqa: F401

        from edgekv.export.pte_stepper import PteStepper as Stepper
    else:
        import onnxruntime  # noqa: F401

        from edgekv.export.runtime import OrtStepper as Stepper
    from edgekv.export.manifest import load_export

    base = ds._status_bytes("VmRSS")
    phases = []

    def mark(name):
        phases.append({"after": name, "hwm_above_baseline": ds._status_bytes("VmHWM") - base,
                       "rss_above_baseline": ds._status_bytes("VmRSS") - base})
        print(f"{a.fmt} after {name}: peak {phases[-1]['hwm_above_baseline'] / MIB:.1f} MiB, resident "
              f"{phases[-1]['rss_above_baseline'] / MIB:.1f} MiB above the baseline", flush=True)

    folder = Path(a.folder)
    st = Stepper(load_export(folder, check_hashes=False), folder, 1)
    mark("load (weights packed, one warm-up call)")
    ids = [(i * 7919) % 50000 + 100 for i in range(a.tokens)]
    st.prefill(ids, last=True)
    mark(f"prefill of {a.tokens} tokens")
    for i in range(8):
        st.step([ids[i]], a.tokens + i)
    mark("8 decode steps")
    if a.out:
        Path(a.out).write_text(json.dumps({"folder": str(folder), "format": a.fmt, "baseline_rss_bytes": base,
                                           "load": list(os.getloadavg()), "phases": phases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
