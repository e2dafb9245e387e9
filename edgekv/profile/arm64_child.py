"""The child of `edgekv profile FOLDER --arch arm64` (edgekv.profile.arm64), run as `python -m
edgekv.profile.arm64_child` on both sides: on this host, and inside the arm64 root under qemu-user. It loads one
artifact through the same Stepper code as `edgekv run`, runs the prompt and N greedy (or forced) steps, and reports
its memory at marks the parent reads. It imports only numpy, the runtime, and edgekv's light modules
(edgekv.export.runtime and what that imports: no torch model code, no jsonschema), so the arm64 root needs no more.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def _status() -> dict:
    from .procmem import status_bytes
    return status_bytes()


def _mark(name: str, sync: bool) -> None:
    """Tell the parent where the run is, with the guest's own mappings (qemu's emulated /proc/self/maps), and wait
    until it has read the host's view of this process."""
    if not sync:
        return
    sys.stdout.write("MARK " + json.dumps({"name": name, "maps": Path("/proc/self/maps").read_text()}) + "\n")
    sys.stdout.flush()
    sys.stdin.readline()


def _state_arrays(stepper) -> list:
    import numpy as np
    return [np.asarray(s if isinstance(s, np.ndarray) else s.contiguous().numpy()) for s in stepper.state]


def child_main() -> None:
    """Args (one JSON line on stdin): {artifact, out, runtime (ort, executorch or none: the interpreter alone),
    prompt, steps, threads, force (tokens to feed instead of its own argmax), sync}. Writes out/result.npz
    (logits of the last prompt position and of each step, the state at the end) and prints one JSON line."""
    args = json.loads(sys.stdin.readline())
    sync = bool(args.get("sync"))
    res = {"machine": platform.machine(), "python": platform.python_version(), "runtime": args["runtime"]}
    res["python_bytes"] = _status()["VmRSS"]
    _mark("interpreter", sync)
    if args["runtime"] == "none":
        res["peak_bytes"] = _status()["VmHWM"]
        sys.stdout.write(json.dumps(res) + "\n")
        return
    if args.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(args["threads"])
    if args["runtime"] == "ort":
        import onnxruntime
        res["runtime_version"] = onnxruntime.__version__
    else:
        from executorch.runtime import Runtime  # noqa: F401  (imports torch)
        from importlib.metadata import version
        res["runtime_version"] = version("executorch")
    import numpy as np

    from ..export.runtime import open_stepper
    from .procmem import reset_hwm
    folder = Path(args["artifact"])
    manifest = json.loads((folder / "manifest.json").read_text())  # the parent checked it (schema, sha256)
    res["runtime_baseline_bytes"] = _status()["VmRSS"]
    _mark("baseline", sync)
    res["hwm_reset"] = reset_hwm()
    stepper = open_stepper(folder, manifest, args["runtime"], args.get("threads"))
    res["after_load_bytes"] = _status()["VmRSS"]
    prompt, force = args["prompt"], args.get("force")
    rows = [stepper.prefill(prompt, last=True)[-1]]  # as generation does: the last row only
    own = [int(rows[-1].argmax())]
    pos = len(prompt)
    for i in range(args["steps"]):
        nxt = force[i] if force else own[-1]
        rows.append(stepper.step([nxt], pos, last=True)[-1])
        own.append(int(rows[-1].argmax()))
        pos += 1
    st = _status()
    res.update(tokens=own, peak_bytes=st["VmHWM"], rss_end_bytes=st["VmRSS"])
    _mark("end", sync)
    state = _state_arrays(stepper)
    np.savez(Path(args["out"]) / "result.npz", logits=np.stack(rows).astype(np.float32),
             **{f"state{i}": s for i, s in enumerate(state)})
    sys.stdout.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    child_main()
