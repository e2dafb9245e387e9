"""One profile run, in its own process: `python -m edgekv.profile.child [JSON_ARGS]` (else the JSON on stdin).
Prints one JSON line.

Order: the interpreter alone -> import the runtime (its baseline) -> load the artifact (weights + zeroed state; its
peak is load_peak_bytes, then the peak is reset) -> prefill ctx tokens in the artifact's chunks -> decode `steps`
tokens, timing each (the peak since the load: calls_peak_bytes; peak_bytes is the larger of the two). A watchdog
thread samples VmRSS every few ms; above the runtime baseline + `limit_bytes` it reports how far the run got and
exits (status "exceeded"), so a run that does not fit is shown, not assumed, and nothing else on the machine is
pushed out.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

from .procmem import hwm, reset_hwm, rss

PROGRESS = {"phase": "start", "step": 0}


# when the profile hands glibc's free heap pages back (host.malloc records it)
TRIM_RULE = "malloc_trim(0) after a prefill call that left the resident set over 1 MiB above the last trim"


def heap_trimmer():
    """-> a function to call after each prefill call: glibc's malloc_trim(0) when the resident set grew by over
    1 MiB since the last trim (TRIM_RULE), a no-op where the C library has none (musl, macOS).

    It hands the free pages inside glibc's heap back to the system. Without it, a state of many sub-MiB tensors that
    the runtime returns anew each call (int4 codes' scales and zeros) leaves holes the next call's tensors do not
    fit, and the heap grows call after call while each call's own peak stays the same. Not between decode steps: the
    pages it returns fault back in on the next call, which the timed decode loop would then measure. Phones do not run glibc (Android's scudo releases free pages itself)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    kept = [rss()]

    def trim():
        if rss() > kept[0] + 2**20:
            fn(0)
            kept[0] = rss()
    return trim


def _exceeded(out: dict, limit: int, peak: int):
    """Report the run as over its budget, with how far it got, and end the process."""
    out.update(status="exceeded", reached=dict(PROGRESS), peak_bytes=peak, limit_bytes=limit)
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(3)


def _watchdog(limit: int, out: dict):
    """Stops a run whose resident set grows past the limit while Python code runs."""
    while True:
        r = rss()
        if r > limit:
            _exceeded(out, limit, max(r, hwm()))
        time.sleep(0.002)


def _check_peak(limit: int | None, out: dict):
    """After each runtime call: the kernel's high-water mark. A peak inside a call that holds the GIL is invisible
    to the watchdog thread (XNNPACK packing its weights while a .pte loads is one), and a run would then read "ok"
    beside fits "no"; VmHWM still records it."""
    if limit:
        peak = hwm()
        if peak > limit:
            _exceeded(out, limit, peak)


def main(args: dict) -> dict:
    out = {"ctx": args["ctx"], "steps": args["steps"], "runtime": args["runtime"], "status": "ok"}
    out["python_bytes"] = rss()
    if args.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(args["threads"])
    if args["runtime"] == "ort":
        import onnxruntime  # noqa: F401
    elif args["runtime"] == "genai":
        import onnxruntime_genai  # noqa: F401
    elif args["runtime"] == "executorch-runner":  # the runner .pte's kernels: ExecuTorch's LLM custom ops
        from executorch.runtime import Runtime  # noqa: F401
        from ..export.et_runner import _kernels
        _kernels()
    else:
        from executorch.runtime import Runtime  # noqa: F401  (imports torch)
    from pathlib import Path

    from ..export.manifest import load_export  # our own reading code counts as baseline, not as the model
    from ..export.runtime import open_stepper
    folder = Path(args["export"])
    # read (and schema-check) the manifest before the baseline: the check imports jsonschema and its dependencies
    # (megabytes), which are edgekv's own reading code, not the runtime's or the model's memory
    manifest = load_export(folder, check_hashes=False)
    prompt = args.pop("tokens")[:args["ctx"]]  # before the baseline too: the token list is ours, not the model's
    out["runtime_baseline_bytes"] = rss()
    out["hwm_reset"] = reset_hwm()
    base_hwm = hwm()
    # limit_bytes counts what the model adds above the runtime's baseline, as measured_bytes does: the process may
    # hold the baseline plus the limit
    limit = (args["limit_bytes"] + out["runtime_baseline_bytes"]) if args.get("limit_bytes") else None
    if limit:
        threading.Thread(target=_watchdog, args=(limit, out), daemon=True).start()
    PROGRESS["phase"] = "load"
    stepper = open_stepper(folder, manifest, args["runtime"], args.get("threads"))
    _check_peak(limit, out)
    out["after_load_bytes"] = rss()
    # the load's peak, then the peak of the calls alone: a runtime that packs a tied head from the table's pages
    # peaks while loading, before the state exists, so the whole run's peak can hide how the calls grow with the state
    out["load_peak_bytes"] = max(hwm(), base_hwm)
    out["hwm_reset_after_load"] = reset_hwm()
    PROGRESS["phase"] = "prefill"
    t0 = time.perf_counter()
    # keeping only the last row of logits, as an app does (Stepper.prefill's last=True)
    n = stepper.chunk or stepper.max_chunk
    trim = heap_trimmer()

    def after_call():
        _check_peak(limit, out)
        PROGRESS["step"] += 1  # prefill calls done
        trim()

    last = stepper.prefill(prompt, last=True, after_call=after_call)[-1]
    out["prefill_seconds"] = time.perf_counter() - t0
    out["after_prefill_bytes"] = rss()  # weights + the state the prompt filled + what the runtime keeps between calls
    out["prefill_chunk"] = n
    nxt = int(last.argmax())
    lat = []
    PROGRESS["phase"] = "decode"
    for i in range(args["steps"]):
        PROGRESS["step"] = i
        pos = args["ctx"] + i
        t = time.perf_counter()
        row = stepper.step([nxt], pos)
        lat.append(time.perf_counter() - t)
        _check_peak(limit, out)
        nxt = int(row[-1].argmax())
    out["latencies_s"] = lat
    if out["hwm_reset_after_load"]:
        out["calls_peak_bytes"] = hwm()
    out["peak_bytes"] = max(hwm(), out["load_peak_bytes"])
    out["rss_end_bytes"] = rss()
    return out


if __name__ == "__main__":
    res = main(json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read()))
    sys.stdout.write(json.dumps(res) + "\n")
