"""Where a .pte's load peaks (issue 39, target 1's memory): the steps of PteStepper's load, one at a time, with the
peak (VmHWM) and resident (VmRSS) bytes above the process's baseline after each, the .pte file's own resident pages
(its mappings in /proc/self/smaps), and what the program plans: its delegates and its planned (non-constant) memory.

    python experiments/pte_load_steps.py FOLDER [FOLDER ...] [--out JSON]

Each folder is loaded in a fresh process (the runtime imported and edgekv's kernels registered before the baseline is
read, as benchmarks/filled_context.py's child does). The steps: _load_program (ExecuTorch maps and mlocks the
program's constant segment, and allocates the planned memory), edgekv's release_file_pages, load_method (XNNPACK maps
each delegate's weights, packs them, unmaps them), release_file_pages(sparse)."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2 ** 20


def child(folder: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch  # noqa: F401  (the ExecuTorch Python runtime; part of its baseline)
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.extension.pybindings import portable_lib

    import decode_speed as ds
    import executorch.kernels.quantized  # noqa: F401
    from edgekv.export.pte_stepper import release_file_pages

    pte = folder / "model.pte"
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest["artifacts"][0].get("custom_ops"):
        from edgekv import native
        native.load()
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    base = ds._status_bytes("VmRSS")

    def file_rss() -> int:
        total, on = 0, False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
            if head:
                on = head[3] == str(pte.resolve())
            elif on and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
        return total

    steps = []

    def mark(name):
        steps.append({"after": name, "hwm_above_baseline_mib": round((ds._status_bytes("VmHWM") - base) / MIB, 1),
                      "rss_above_baseline_mib": round((ds._status_bytes("VmRSS") - base) / MIB, 1),
                      "pte_file_resident_mib": round(file_rss() / MIB, 1)})

    portable_lib._unsafe_reset_threadpool(1)
    prog = portable_lib._load_program(str(pte), program_verification=portable_lib.Verification.InternalConsistency)
    mark("_load_program")
    release_file_pages(pte)
    mark("release_file_pages")
    method = prog.load_method("forward")
    mark("load_method (XNNPACK packs)")
    release_file_pages(pte, sparse=True)
    mark("release_file_pages(sparse)")
    del method
    r = deserialize_pte_binary(pte.read_bytes())  # after the steps: its copy of the program would move the peak
    plan = r.program.execution_plan[0]
    buffers = sorted(len(b) for b in r.named_data.buffers) if r.named_data else []
    program = {"delegates": len(plan.delegates), "planned_bytes": sum(plan.non_const_buffer_sizes),
               "delegate_weight_bytes": sum(buffers), "largest_delegate_weight_bytes": buffers[-1] if buffers else 0,
               "output_layer_blocks": manifest["weights"]["quantization"]["pte"].get("output_layer_blocks")}
    return {"folder": str(folder), "program": program, "steps": steps,
            "load_transient_mib": round(steps[2]["hwm_above_baseline_mib"] - steps[2]["rss_above_baseline_mib"], 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--out")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(Path(a.child))))
        return
    sys.path.insert(0, str(ROOT))
    from edgekv.children import child_setup
    runs = []
    for f in a.folders:
        p = subprocess.run([sys.executable, __file__, "x", "--child", f], capture_output=True, text=True,
                           preexec_fn=child_setup())
        if p.returncode:
            raise SystemExit(p.stderr.strip().splitlines()[-1])
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1], indent=1))
    if a.out:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
        Path(a.out).write_text(json.dumps({"experiment": "pte_load_steps", "machine": {"cpu": cpu},
                                           "load": list(os.getloadavg()), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
