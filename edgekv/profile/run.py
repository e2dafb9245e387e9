"""`edgekv profile`: measured peak memory and speed of an export, next to what the planner predicted.

Each (ctx) run is a fresh process (edgekv/profile/child.py) so its peak memory is its own. The parent measures this
host's memory bandwidth in the same run (a torch reduction over a large fp32 tensor, best of 3; stack.md: np.sum is
compute-bound here and must not be the roofline) and turns bytes-read-per-token into a roofline tokens/s.

Report (edgekv/profile/report.schema.json; the Android app writes the same):
  {"artifact", "runtime", "host": {...}, "runs": [{"ctx", "predicted_bytes", "measured_bytes",
   "runtime_baseline_bytes", "tokens_per_s", "roofline_tokens_per_s", "latency_ms": {"p50", "p90"}, "fits", ...}]}
measured_bytes = peak (VmHWM) - the runtime's own baseline (RSS after importing it, before loading the artifact).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..children import child_setup
from ..errors import EdgekvError
from .child import TRIM_RULE

SCHEMA = Path(__file__).resolve().parent / "report.schema.json"


def host_info() -> dict:
    ram = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"kind": f"{platform.system().lower()}-{platform.machine()}", "device": "host", "ram_bytes": ram,
            "cores": os.cpu_count(), "malloc": {**{k: v for k, v in child_env().items() if k in MALLOC_ENV},
                                                "trim": TRIM_RULE}}


def measure_bandwidth(mib: int = 512, threads: int | None = None) -> float:
    """Read bandwidth in bytes/s: best of 3 torch.sum over a fresh fp32 tensor of `mib` MiB."""
    import time

    import torch
    if threads:
        torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(4):
        t = time.perf_counter()
        float(x.sum())
        best = max(best, x.numel() * 4 / (time.perf_counter() - t))
    return best


def prompt_tokens(folder: Path, manifest: dict, n: int) -> list[int]:
    """Real text (the stdlib docs) through the export's own tokenizer, repeated to n tokens."""
    from ..analyze.run import default_text
    tok = manifest.get("tokenizer")
    text = default_text()
    if tok and tok.get("file") and (folder / tok["file"]).is_file():
        from ..export.generate import load_tokenizer
        ids = load_tokenizer(folder / tok["file"], manifest["model"]["vocab"]).encode(text[:400_000]).ids
    else:
        ids = [b % manifest["model"]["vocab"] for b in text.encode()]
    reps = n // max(len(ids), 1) + 1
    return (ids * reps)[:n]


# --runtime -> the planner's runtime; genai and executorch-runner run the same artifacts through the runtimes' LLM APIs
RUNTIME_NAMES = {"ort": "onnxruntime", "executorch": "executorch", "genai": "onnxruntime",
                 "executorch-runner": "executorch"}
FORMAT = {"ort": "onnx", "executorch": "pte", "genai": "onnx", "executorch-runner": "pte"}


def prefill_chunk(manifest: dict, runtime: str) -> int:
    """Tokens per prefill call the child really makes: the .pte's most tokens per call (its `forward` method's
    max_tokens, or its `prefill` method's fixed length), or the call size the export recorded for ORT (OrtStepper
    uses it; an older manifest without one: Stepper.max_chunk)."""
    from ..export.pte_stepper import pte_calls
    from ..export.stepper import Stepper, entry, recorded_chunk
    if runtime == "executorch":
        return pte_calls(manifest)[3]
    if runtime == "executorch-runner":  # calls of up to get_max_seq_len tokens, as the runner prefills
        return int(entry(manifest, "pte")["entry_points"][0]["max_tokens"])
    if runtime == "genai":  # GenAI appends the whole prompt in one call
        return int(manifest["max_ctx"])
    return recorded_chunk(manifest, "onnx") or min(Stepper.max_chunk, int(manifest["max_ctx"]))


def weight_precision(manifest: dict) -> str:
    """The planner's name (fp32, fp16, int8, int4) for the weights the export stored (manifest weights.dtype)."""
    from ..export.options import WEIGHT_DTYPES
    stored = manifest["weights"]["dtype"]
    return next((k for k, v in WEIGHT_DTYPES.items() if v == stored), "fp32")


def int8_kernel(manifest: dict, runtime: str) -> str:
    """What reads the .pte's int8, fp16 or packed cache: "edgekv" where the artifact calls edgekv's own kernels (its
    custom_ops, as export --pte-kernel edgekv writes them: native.OUT_OPS), else "executorch" (a custom_ops that is
    not an object with a list of names counts as none)."""
    from ..export.stepper import entry
    from ..native import OUT_OPS
    if FORMAT.get(runtime) != "pte":
        return "executorch"
    try:
        ops = entry(manifest, "pte").get("custom_ops") or {}
    except (EdgekvError, KeyError, TypeError):
        return "executorch"
    names = ops.get("ops") if isinstance(ops, dict) else None
    return "edgekv" if isinstance(names, list) and any(op in OUT_OPS for op in names) else "executorch"


def predicted(manifest: dict, runtime: str | None = None, filled: int | None = None) -> dict:
    """The planner's bytes for this artifact on this runtime, comparable to peak - runtime baseline: weights + state +
    workspace (at the chunk the run really uses) + the runtime's load-time copies. Rebuilt with edgekv.plan from the
    model the export came from when it is still there, with the weights in the runtime's own layout where
    runtimes.json gives one (what `edgekv plan` prices for edgekv's artifacts: --runtime ort, MatMulNBits' fp32
    scales; --runtime executorch, the .pte's own int4 layout with its untied output layer), and the .pte's int8
    kernel the export built (the manifest's custom_ops: edgekv's own); else the manifest's recorded Deployment (the export's chunk and ORT's terms), else weights + state. filled: the
    positions the run fills (its ctx) where fewer than max_ctx, for the terms that follow them."""
    from ..arch import load_arch
    from ..plan import deployment, runtime_cost
    from ..strategies import parse_strategy
    rt = runtime or "ort"
    src = manifest["model"].get("source")
    try:
        arch = load_arch(src)
        n_methods = len(entry_points(manifest, rt))
        precision = weight_precision(manifest)
        # edgekv's ONNX on ONNX Runtime (GenAI runs the same graph), edgekv's .pte on ExecuTorch (`plan --runtime
        # executorch`); ExecuTorch's LLM runner runs the runner .pte, whose weights the planner's own layout prices
        scheme = runtime_cost("onnxruntime" if rt in ("ort", "genai") else "edgekv-pte", arch, precision)[1] \
            if rt in ("ort", "genai", "executorch") else None
        max_ctx = int(manifest["max_ctx"])
        d = deployment(arch, parse_strategy(manifest["strategy"]["label"]), max_ctx, precision, RUNTIME_NAMES[rt],
                       0, prefill_chunk(manifest, rt), methods=n_methods, scheme=scheme,
                       filled=filled if filled and filled < max_ctx else None, int8_kernel=int8_kernel(manifest, rt))
        b = d.bytes
        # the calls' own peak (weights + state + a call's workspace + the session), beside the load-time transient
        # the workspace is the larger of: what calls_peak_bytes measures (edgekv.profile.child)
        calls = b["weights"] + b["state"] + int(d.workspace.parts.get("step", b["workspace"])) + b["load"]
        return {"weights": b["weights"], "state": b["state"], "workspace": b["workspace"], "load": b["load"],
                "explain": {**{k: d.explain[k] for k in ("workspace", "load")}, "calls_bytes": calls}}
    except (EdgekvError, OSError, ValueError, KeyError, TypeError):
        pass
    dep = manifest.get("deployment") or {}
    dep = dep.get("formats", {}).get(FORMAT[rt], dep)  # older manifests: one (ORT) plan
    if "bytes" in dep:
        b = dep["bytes"]
        return {"weights": int(b["weights"]), "state": int(b["state"]), "workspace": int(b.get("workspace", 0)),
                "load": int(b.get("load", 0))}
    return {"weights": int(manifest["weights"]["bytes"]), "state": int(manifest["state"]["bytes"]), "workspace": 0}


def entry_points(manifest: dict, runtime: str) -> list:
    from ..export.stepper import entry
    return entry(manifest, FORMAT[runtime])["entry_points"]


# glibc's malloc, as the profile child uses it: blocks of 1 MiB and more are mmapped and go back to the system when
# freed, and up to 8 MiB of free heap is kept for reuse. With glibc's defaults the mmap threshold grows to the size
# of each mmapped block freed (up to 32 MiB), so a per-call buffer of a few MB (ORT's attention probabilities) moves
# to the heap after the first call and stays resident next to the next call's: with these settings the measured
# peak is what the planner predicts (benchmarks/results/plan_accuracy.json). A larger threshold keeps the freed
# load-time buffers on the heap; a much smaller one (or glibc's 128 KiB trim threshold) mmaps every decode call's
# buffers anew, which slows decode. Phones do not run glibc (Android's scudo maps large blocks itself), so the profile measures
# what the tensors need, not what glibc's heuristics keep; a caller's own MALLOC_* variables win.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20), "MALLOC_TRIM_THRESHOLD_": str(8 * 2**20)}


def child_env() -> dict:
    """The environment a profile child runs in: this one, with MALLOC_ENV where the caller set no MALLOC_* own."""
    return {**MALLOC_ENV, **os.environ}


def child_timeout(ctx: int) -> float:
    """Seconds a profile child may run: 30 minutes per 4096 positions, at least 30 (a 32k-slot ONNX prefill of
    Gemma-3-270M in 128-token calls runs over an hour on one thread)."""
    return 1800.0 * max(1.0, ctx / 4096)


def run_child(folder: Path, runtime: str, ctx: int, steps: int, tokens: list[int], limit: int | None,
              threads: int | None, timeout: float | None = None) -> dict:
    timeout = timeout or child_timeout(ctx + steps)
    args = {"export": str(folder), "runtime": runtime, "ctx": ctx, "steps": steps, "tokens": tokens,
            "limit_bytes": limit, "threads": threads}
    env = child_env()
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        # the arguments go through stdin: 32k token ids exceed the kernel's 128 KiB limit on one argv string
        # the child dies with this process, SIGKILL included (edgekv.children); SIGTERM here kills it on the way out
        p = subprocess.run([sys.executable, "-m", "edgekv.profile.child"], input=json.dumps(args),
                           capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=child_setup())
    except subprocess.TimeoutExpired:
        return {"ctx": ctx, "status": f"failed: timed out after {timeout:.0f} s"}
    return child_result(ctx, p.returncode, p.stdout, p.stderr)


def child_result(ctx: int, returncode: int, stdout: str, stderr: str) -> dict:
    """The child's JSON line; when it has none (killed by a signal, out of memory, an error before it could
    report), a result with status "failed: ..." naming the signal or the child's last line of stderr."""
    import signal

    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("{")), None)
    if line is not None:
        try:
            r = json.loads(line)
            if isinstance(r, dict):
                return r
        except ValueError:
            pass
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = f"killed by {name}" + (" (the kernel's out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else "")
    else:
        last = (stderr.strip().splitlines() or ["no output"])[-1].strip()
        why = f"exit {returncode}: {last[:300]}"
    return {"ctx": ctx, "status": f"failed: {why}"}


def failed_runs(report: dict) -> list[dict]:
    """Runs that did not finish (not "ok", and not stopped over their budget, which is a measurement)."""
    return [r for r in report["runs"] if r.get("status", "ok") not in ("ok", "exceeded")]


def median_run(results: list[dict]) -> dict:
    """Of the results of fresh processes at one context, the one with the median peak above the baseline (the lower
    median for an even count): a real run, whose other numbers belong to it. A run that failed or went over the
    limit wins, so it is never hidden behind one that passed. The runs' measured bytes go with it."""
    bad = [r for r in results if r.get("status", "ok") != "ok" or not (r.get("peak_bytes") and
                                                                       r.get("runtime_baseline_bytes"))]
    if bad:
        return bad[0]
    ranked = sorted(results, key=lambda r: r["peak_bytes"] - r["runtime_baseline_bytes"])
    pick = dict(ranked[(len(ranked) - 1) // 2])
    if len(results) > 1:
        pick["measured_bytes_runs"] = [r["peak_bytes"] - r["runtime_baseline_bytes"] for r in results]
    return pick


BUDGET_BASIS = "measured_bytes: peak resident bytes above the runtime's baseline (the same number as measured)"
# the device profile's runtime_overhead_bytes entry each `profile --runtime` runs under (a --device budget is the app
# budget less that overhead: devices.artifact_budget, the basis plan and report use)
RUNTIME_OVERHEAD = {"ort": "onnxruntime", "genai": "onnxruntime", "executorch": "executorch",
                    "executorch-runner": "executorch"}


def device_budget(device, runtime: str):
    """devices.artifact_budget of the device profile for a profile runtime (ort, genai, executorch, ...)."""
    from ..devices import artifact_budget
    return artifact_budget(device, RUNTIME_OVERHEAD[runtime])


def profile(folder: str, ctxs: list[int], steps: int, runtime: str | None, limit: int | None,
            threads: int | None, device=None, progress=None, repeats: int = 1) -> dict:
    """repeats: fresh processes per context; the run with the median measured bytes is reported (median_run), with
    every run's measured bytes beside it. progress(ctx, i, repeats) is called before each process starts."""
    from ..export.manifest import load_export

    folder = Path(folder)
    manifest = load_export(folder, check_hashes=False)
    formats = [a["format"] for a in manifest["artifacts"]]
    runtime = runtime or ("ort" if "onnx" in formats else "executorch")
    entry_points(manifest, runtime)  # the export has an artifact for that runtime: one line now, not from a child
    max_ctx = int(manifest["max_ctx"])
    for c in ctxs:  # as the Android app does: a run of ctx positions = ctx - steps prompt tokens + steps decoded
        if c > max_ctx:
            raise EdgekvError(f"ctx {c} exceeds this export's max_ctx {max_ctx}: export with --max-ctx {c} or more, "
                              f"or profile a smaller --ctx")
        if c <= steps:
            raise EdgekvError(f"ctx {c} must be larger than --steps {steps} (a run is ctx - steps prompt tokens, "
                              f"then steps decoded)")
    with checked_copy(folder, manifest, runtime) as copy:
        report = _profile(folder, copy, manifest, ctxs, steps, runtime, limit, threads, device, progress, repeats)
    return report


def checked_copy(folder: Path, manifest: dict, runtime: str):
    """The files `runtime` loads, copied into a private folder and hashed as they are copied (private_copy), every
    other listed file hashed in place: each child loads the copy, so every run measures the bytes the manifest
    vouches for, whatever happens to the export folder meanwhile."""
    from ..export.manifest import check_files, loaded_files, private_copy
    names = loaded_files(manifest, runtime)
    check_files(folder, manifest, skip=names)
    return private_copy(folder, manifest, names)


def _profile(folder: Path, copy: Path, manifest: dict, ctxs, steps, runtime, limit, threads, device, progress,
             repeats) -> dict:
    """profile() over the private copy `copy` of the export at `folder`."""
    max_ctx = int(manifest["max_ctx"])
    basis = device_budget(device, runtime) if device is not None and limit is None else None
    budget = limit or (basis.above_baseline if basis else None)
    bw = measure_bandwidth(threads=threads)
    tokens = prompt_tokens(copy, manifest, max(ctxs))
    runs = []
    for c in ctxs:
        # per context: a run filled to fewer positions than the export's slots holds less of some terms
        pred = predicted(manifest, runtime, c)
        explain = pred.pop("explain", None)
        pred_calls = explain.pop("calls_bytes", None) if explain else None
        pred_total = sum(pred.values())
        read_per_token = pred["weights"] + pred["state"]  # every decode step reads the weights and the whole state
        results = []
        for i in range(repeats):
            if progress:
                progress(c, i, repeats)
            r = run_child(copy, runtime, c - steps, steps, tokens, budget, threads)
            if isinstance(r.get("status"), str):  # a failure names the export, not the copy
                r["status"] = r["status"].replace(str(copy), str(folder))
            results.append(r)
            if results[-1].get("status", "ok") != "ok":
                break
        r = median_run(results)
        run = {"ctx": c, "steps": steps, "prompt_tokens": c - steps, "predicted_bytes": pred_total,
               "status": r.get("status", "ok"), "predicted_components": pred,
               "roofline_tokens_per_s": bw / read_per_token}
        if "measured_bytes_runs" in r:
            run["measured_bytes_runs"] = r["measured_bytes_runs"]
        base = r.get("runtime_baseline_bytes")
        peak = r.get("peak_bytes")
        run["runtime_baseline_bytes"] = base
        run["peak_bytes"] = peak
        run["measured_bytes"] = (peak - base) if (peak and base) else None
        lat = r.get("latencies_s") or []
        if lat:
            ms = np.array(lat) * 1000
            run["latency_ms"] = {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90))}
            run["tokens_per_s"] = float(len(lat) / sum(lat))
        else:
            run["latency_ms"] = {"p50": None, "p90": None}
            run["tokens_per_s"] = None
        if r.get("prefill_seconds"):
            run["prefill_seconds"] = r["prefill_seconds"]
            run["prefill_tokens_per_s"] = (c - steps) / r["prefill_seconds"]
        if r.get("after_load_bytes") and base:
            run["measured_components"] = {"weights+state": r["after_load_bytes"] - base,
                                          "workspace": (peak - r["after_load_bytes"]) if peak else None}
            # the load's peak and the calls' peak apart (a tied head packed while loading can be the whole run's
            # peak, hiding the state), and what stays resident once the prompt is in
            for key, name in (("load_peak_bytes", "load_peak"), ("calls_peak_bytes", "calls_peak"),
                              ("after_prefill_bytes", "after_prefill")):
                if r.get(key):
                    run["measured_components"][name] = r[key] - base
        if pred_calls is not None:
            run["predicted_calls_bytes"] = pred_calls
            calls = (run.get("measured_components") or {}).get("calls_peak")
            if calls:
                run["calls_error_pct"] = 100.0 * (calls - pred_calls) / pred_calls
        if run["measured_bytes"]:
            run["error_pct"] = 100.0 * (run["measured_bytes"] - pred_total) / pred_total
        if r.get("status") == "exceeded":
            run["reached_step"] = r.get("reached", {}).get("step", 0)
            run["reached_phase"] = r.get("reached", {}).get("phase")
            run["fits"] = False
        else:
            run["fits"] = bool(run["measured_bytes"] is not None
                               and (budget is None or run["measured_bytes"] <= budget))
        runs.append(run)
    host = host_info()
    host["bandwidth_bytes_per_s"] = bw
    host["threads"] = threads
    return {"artifact": str(folder), "runtime": runtime, "host": host, "budget_bytes": budget,
            "budget_basis": BUDGET_BASIS + (f"; {basis.describe()}" if basis else ""),
            "model": manifest["model"]["name"], "strategy": manifest["strategy"]["label"], "max_ctx": max_ctx,
            "prefill_chunk": prefill_chunk(manifest, runtime), "predicted_explain": explain, "runs": runs}


def validate_report(report: dict, where: str = "the profile report") -> None:
    """report against report.schema.json; a mismatch is one EdgekvError line."""
    try:
        import jsonschema
    except ImportError:
        raise EdgekvError("checking a profile report needs jsonschema (pip install jsonschema)") from None
    try:
        jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    except jsonschema.ValidationError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise EdgekvError(f"{where}: does not follow report.schema.json at {path}: {e.message}") from None
