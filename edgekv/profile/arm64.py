"""`edgekv profile FOLDER --arch arm64`: the artifact on the phone's instruction set, against this host's run of it.

A phone runs the arm64 kernels of the same runtimes (ONNX Runtime's arm64 MLAS/KleidiAI, XNNPACK's NEON paths) and
packs weights for them; those can differ from the x86 kernels in results, in what they support and in memory. Here
the artifact runs in an arm64 Debian root (`make arm64-env`: scripts/arm64_env.sh) under qemu-user, through the same
Stepper code as on the host, and the two runs are compared:
  - greedy tokens: the arm64 run is fed the host's greedy tokens (teacher-forced, as verify does, so one near-tie
    cannot make the two sequences diverge and hide what follows); its own argmax must equal the host's at every
    position;
  - logits: max |difference| over the logit scale (max |host logit|), against the limit the export's own
    verification held the artifact to against eager torch (manifest verification.<fmt>.tolerance, set by
    edgekv/export/verify.py's REL_TOL for the state's dtype);
  - the state after the prompt and N decode steps: max |difference| over the host state's scale for float
    tensors, against the same limit; for integer codes (int8, packed int4) the fraction of bytes that differ;
  - memory above the runtime baseline (RSS after importing the runtime, before loading the artifact), as the arm64
    process sees it, beside the planner's prediction and the host's measurement.
No speed: under emulation a step's time is qemu's, not a phone's (tokens/s stays a phone-only figure: --adb).
The emulated CPU is qemu's `max` model (every feature qemu emulates: ARMv8.2+ FP16 arithmetic, dot product, i8mm, SVE,
as recent phone cores have), or the model named by QEMU_CPU (e.g. cortex-a57: ARMv8.0, none of them), which the
runtimes' kernel selection follows (they read the features from the auxiliary vector's HWCAP bits).

How the arm64 memory is measured: edgekv.profile.qemu_rss (the guest's mappings split out of qemu's RSS).

The child (`python -m edgekv.profile.arm64_child`, run by both sides) needs only numpy, the runtime, and edgekv's own
light modules (edgekv.export.runtime and what it imports: no torch model code, no jsonschema): the parent binds the
edgekv package read-only into the root at /opt/edgekv/edgekv, the artifact folder read-only at /mnt/artifact and a
fresh output folder at /mnt/out, in a private mount namespace (unshare) that vanishes with the child, so nothing is
left mounted. The host's /sys is not bound (ONNX Runtime's cpuinfo crashes at import on the x86 host's /sys); the
root's own /sys holds the CPU list cpuinfo needs (scripts/arm64_env.sh), without which XNNPACK refuses to start.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..errors import EdgekvError
from .qemu_rss import split_rss

ARCHES = ("host", "arm64")
# under emulation a run is 10-50x slower than on the host: a short prompt and few steps by default
DEFAULT_CTX, DEFAULT_STEPS = 40, 8
VENV_PY = "/opt/venv/bin/python"  # inside the root (scripts/arm64_env.sh)
IN_ROOT = {"pkg": "/opt/edgekv/edgekv", "artifact": "/mnt/artifact", "out": "/mnt/out"}
PKG_DIR = Path(__file__).resolve().parents[1]  # the edgekv package the child imports
REPO = PKG_DIR.parent


def arm64_dir() -> Path:
    return Path(os.environ.get("EDGEKV_ARM64_DIR") or REPO / ".arm64")


def check_arch(arch: str) -> str:
    a = arch.strip().lower()
    a = {"aarch64": "arm64", "x86_64": "host", "native": "host"}.get(a, a)
    if a not in ARCHES:
        raise EdgekvError(f"--arch {arch!r} is not supported: host (this machine) or arm64 (emulated; make arm64-env)")
    return a


def check_env(root: Path | None = None) -> Path:
    """The arm64 root, ready to run; else one line saying what is missing."""
    root = root or arm64_dir() / "root"
    if platform.system() != "Linux":
        raise EdgekvError("--arch arm64 needs Linux (qemu-user through binfmt_misc, a chroot)")
    if not (root / VENV_PY.lstrip("/")).exists() or not (root / "opt/venv/.installed").exists():
        raise EdgekvError(f"no arm64 environment at {root}: run `make arm64-env` as root first (or set "
                          "EDGEKV_ARM64_DIR to the folder holding its root/)")
    if os.geteuid() != 0:
        raise EdgekvError("--arch arm64 runs the artifact in a chroot with its own mounts: run it as root")
    if platform.machine() != "aarch64" and not Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists():
        raise EdgekvError("binfmt_misc has no qemu-aarch64 entry (after a reboot?): run `make arm64-env` again")
    return root


# ---- the child: one run of the artifact, on either side ----


def _pythonpath() -> str:
    return os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


def _run(cmd: list[str], env: dict, args: dict, timeout: float, root: Path | None) -> dict:
    """Start the child, answer its marks (reading the host's smaps of it when root is given), return its JSON."""
    err = tempfile.TemporaryFile()
    from ..children import child_setup
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                         preexec_fn=child_setup())
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    marks, result = {}, None
    try:
        p.stdin.write(json.dumps(args) + "\n")
        p.stdin.flush()
        for line in p.stdout:
            if line.startswith("MARK "):
                m = json.loads(line[5:])
                text = Path(f"/proc/{p.pid}/smaps").read_text()
                st = Path(f"/proc/{p.pid}/status").read_text()
                from .procmem import status_bytes
                marks[m["name"]] = {**split_rss(text, m["maps"], root), "hwm": status_bytes(st)["VmHWM"]}
                p.stdin.write("\n")
                p.stdin.flush()
            elif line.startswith("{"):
                result = json.loads(line)
        p.wait()
    finally:
        timer.cancel()
        if p.poll() is None:  # left by an error or SIGTERM (edgekv.children): the child goes with us
            p.kill()
            p.wait()
    if result is None:
        err.seek(0)
        lines = [ln for ln in err.read().decode(errors="replace").splitlines() if ln.strip()]
        why = "killed after %.0f s" % timeout if p.returncode in (-9,) else (lines[-1] if lines else "no output")
        if p.returncode == -4:  # SIGILL: the build runs an instruction the emulated core does not have
            why += (f"; the runtime's aarch64 build needs a feature qemu's {os.environ.get('QEMU_CPU') or 'max'} core "
                    "lacks (ExecuTorch 1.5.1's LLM kernels, custom_sdpa, need ARMv8.2: benchmarks/README.md, arm64)")
        return {"status": f"failed (exit {p.returncode}): {why}"}
    result["status"] = "ok"
    if marks:
        result["marks"] = marks
    return result


def run_host(folder: Path, out: Path, runtime: str, prompt, steps, threads, force=None, timeout=1800) -> dict:
    from .run import child_env
    env = {**child_env(), "PYTHONPATH": _pythonpath()}
    args = {"artifact": str(folder.resolve()), "out": str(out), "runtime": runtime, "prompt": prompt,
            "steps": steps, "threads": threads, "force": force, "sync": False}
    return _run([sys.executable, "-m", "edgekv.profile.arm64_child"], env, args, timeout, None)


def run_arm64(root: Path, folder: Path, out: Path, runtime: str, prompt, steps, threads, force=None,
              timeout=None) -> dict:
    """timeout: seconds, default EDGEKV_ARM64_TIMEOUT or 3600 (a loaded host emulates slowly)."""
    timeout = timeout or float(os.environ.get("EDGEKV_ARM64_TIMEOUT") or 3600)
    from .run import MALLOC_ENV
    for d in IN_ROOT.values():
        (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
    script = ('set -e; R=$0; mount --bind /proc "$R/proc"; mount --rbind /dev "$R/dev"; '
              'mount --bind "$1" "$R' + IN_ROOT["pkg"] + '"; mount -o remount,bind,ro "$R' + IN_ROOT["pkg"] + '"; '
              'mount --bind "$2" "$R' + IN_ROOT["artifact"] + '"; mount -o remount,bind,ro "$R' + IN_ROOT["artifact"]
              + '"; mount --bind "$3" "$R' + IN_ROOT["out"] + '"; exec chroot "$R" ' + VENV_PY
              + ' -m edgekv.profile.arm64_child')
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(root), str(PKG_DIR),
           str(folder.resolve()), str(out)]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "PYTHONPATH": str(Path(IN_ROOT["pkg"]).parent), "PYTHONDONTWRITEBYTECODE": "1", **MALLOC_ENV,
           **{k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
           # the core is named, not left to the qemu build's default: `max` has ARMv8.2's FP16 arithmetic and dot
           # product, as phones do, which ExecuTorch's aarch64 LLM kernels need (SIGILL on an ARMv8.0 core)
           "QEMU_CPU": os.environ.get("QEMU_CPU") or "max"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    args = {"artifact": IN_ROOT["artifact"], "out": IN_ROOT["out"], "runtime": runtime, "prompt": prompt,
            "steps": steps, "threads": threads, "force": force, "sync": True}
    return _run(cmd, env, args, timeout, root)


def arm64_memory(r: dict) -> dict:
    """The guest's bytes from the marks (module docstring): baseline, peak above it, qemu's own at each mark."""
    m = r["marks"]
    base = m["baseline"]["guest"]
    peak = max(m["end"]["hwm"] - m["end"]["qemu"], m["end"]["guest"])
    return {"runtime_baseline_bytes": base, "peak_bytes": peak, "measured_bytes": peak - base,
            "qemu_own_bytes": {k: v["qemu"] for k, v in m.items()},
            "process_rss_bytes": {k: v["total"] for k, v in m.items()}}


def limit_for(manifest: dict, fmt: str) -> dict:
    """The logits limit: the one the export's own verification held this artifact to against eager torch; an
    artifact without one (ONNX with quantized weights: export checks it against fp32 over real text, top-1 and KL,
    not against a parity limit) gets verify.py's limit for quantized weights, the one a quantized .pte is held to."""
    v = (manifest.get("verification") or {}).get(fmt)
    if v and "tolerance" in v:
        return {"max_abs_diff_over_logit_scale": float(v["tolerance"]["max_abs_diff_over_logit_scale"]),
                "source": f"manifest verification.{fmt}.tolerance"}
    from ..export.verify import REL_TOL
    return {"max_abs_diff_over_logit_scale": REL_TOL["quantized-weights"],
            "source": "edgekv/export/verify.py REL_TOL['quantized-weights'] (the export has no parity limit for it)"}


def compare(host: dict, arm: dict, host_npz, arm_npz, tol: dict) -> dict:
    import numpy as np
    lh, la = host_npz["logits"], arm_npz["logits"]
    scale = float(np.abs(lh).max())
    diff = float(np.abs(lh - la).max())
    ht, at = host["tokens"], arm["tokens"]
    first = next((i for i, (a, b) in enumerate(zip(ht, at)) if a != b), None)
    rel = float(tol["max_abs_diff_over_logit_scale"])
    states = []
    for k in sorted((k for k in host_npz.keys() if k.startswith("state")), key=lambda s: int(s[5:])):
        x, y = host_npz[k], arm_npz[k]
        if x.dtype.kind == "f":
            d = float(np.abs(x.astype(np.float32) - y.astype(np.float32)).max()) if x.size else 0.0
            s = float(np.abs(x.astype(np.float32)).max()) if x.size else 0.0
            states.append({"kind": "float", "max_abs_diff": d, "scale": s})
        else:
            states.append({"kind": "codes", "differ_fraction": float((x != y).mean()) if x.size else 0.0})
    fl = [s for s in states if s["kind"] == "float"]
    codes = [s for s in states if s["kind"] == "codes"]
    st_rel = max((s["max_abs_diff"] / max(s["scale"], 1e-30) for s in fl), default=0.0)
    st_codes = max((s["differ_fraction"] for s in codes), default=0.0)
    return {"positions": len(ht), "tokens_equal": ht == at, "first_token_difference": first,
            "top1_agreement": float(np.mean([a == b for a, b in zip(ht, at)])),
            "max_abs_diff": diff, "logit_scale": scale, "max_abs_diff_over_logit_scale": diff / max(scale, 1.0),
            "tolerance": {"max_abs_diff_over_logit_scale": rel,
                          "source": tol.get("source", "manifest verification tolerance")},
            "logits_within_tolerance": diff <= rel * max(scale, 1.0),
            "state": {"float_max_abs_diff_over_scale": st_rel, "codes_differ_fraction": st_codes,
                      "float_within_tolerance": st_rel <= rel, "tensors": len(states)}}


def interpreter_check(root: Path) -> dict:
    """The interpreter alone, on both sides: how the split of qemu's process into guest and qemu's own holds up
    (the guest's RSS beside the host python's own)."""
    with tempfile.TemporaryDirectory() as d:
        a = run_arm64(root, REPO, Path(d), "none", [], 0, None, timeout=600)
        h = run_host(REPO, Path(d), "none", [], 0, None, timeout=120)
    if a.get("status") != "ok" or h.get("status") != "ok":
        return {"status": a.get("status") if a.get("status") != "ok" else h.get("status")}
    m = a["marks"]["interpreter"]
    return {"host_python_bytes": h["python_bytes"], "arm64_guest_bytes": m["guest"], "arm64_qemu_own_bytes": m["qemu"],
            "arm64_process_bytes": m["total"]}


def profile_arch(folder: str, arch: str, ctx: int | None, steps: int | None, runtime: str | None,
                 threads: int | None, progress=None) -> dict:
    """Both formats (or --runtime's) on the host and in the arm64 root; see the module docstring."""
    from ..export.manifest import check_files, load_export, loaded_files, private_copy
    arch = check_arch(arch)
    if arch != "arm64":
        raise EdgekvError("--arch host is the plain `edgekv profile` (no --arch)")
    root = check_env()
    folder = Path(folder)
    manifest = load_export(folder, check_hashes=False)  # hashed below: in place, and the loaded files as copied
    ctx, steps = ctx or DEFAULT_CTX, steps if steps is not None else DEFAULT_STEPS
    if ctx <= steps:
        raise EdgekvError(f"ctx {ctx} must be larger than --steps {steps} (a run is ctx - steps prompt tokens, "
                          "then steps decoded)")
    if ctx > int(manifest["max_ctx"]):
        raise EdgekvError(f"ctx {ctx} exceeds this export's max_ctx {manifest['max_ctx']}")
    formats = [a["format"] for a in manifest["artifacts"]]
    runtimes = [runtime] if runtime else [r for r, f in (("ort", "onnx"), ("executorch", "pte")) if f in formats]
    names = list(dict.fromkeys(n for rt in runtimes for n in loaded_files(manifest, rt)))
    check_files(folder, manifest, skip=names)
    # both sides load a private copy, hashed as it was copied (edgekv.export.manifest.private_copy)
    with private_copy(folder, manifest, names) as copy:
        return _profile_arch(folder, copy, manifest, root, ctx, steps, runtimes, formats, threads, progress)


def _profile_arch(folder: Path, copy: Path, manifest: dict, root: Path, ctx: int, steps: int, runtimes, formats,
                  threads, progress) -> dict:
    import numpy as np

    from .run import predicted, prompt_tokens
    prompt = prompt_tokens(copy, manifest, ctx - steps)
    say = progress or (lambda s: None)
    say("arm64: the interpreter alone, for qemu's own memory ...")
    rep = {"artifact": str(folder), "model": manifest["model"]["name"], "strategy": manifest["strategy"]["label"],
           "weights": manifest["weights"]["dtype"], "weights_bytes": int(manifest["weights"]["bytes"]),
           "max_ctx": int(manifest["max_ctx"]), "prompt_tokens": len(prompt),
           "steps": steps, "threads": threads, "host_machine": platform.machine(),
           "qemu_cpu": os.environ.get("QEMU_CPU") or "max",
           "interpreter": interpreter_check(root), "runs": []}
    for rt in runtimes:
        fmt = "onnx" if rt == "ort" else "pte"
        if fmt not in formats:
            raise EdgekvError(f"this export has no {fmt} artifact (it has: {', '.join(formats)})")
        tol = limit_for(manifest, fmt)
        pred = predicted(manifest, rt)
        pred.pop("explain", None)
        run = {"runtime": rt, "format": fmt, "predicted_bytes": int(sum(pred.values())), "status": "ok"}
        if rt == "executorch" and not (root / "opt/venv/.installed-executorch").exists():
            run["status"] = "not run: the arm64 root has no ExecuTorch runtime (make arm64-env's second stage)"
            rep["runs"].append(run)
            continue
        with tempfile.TemporaryDirectory() as hd, tempfile.TemporaryDirectory() as ad:
            say(f"arm64: {fmt} on this host ({platform.machine()}) ...")
            h = run_host(copy, Path(hd), rt, prompt, steps, threads)
            if h["status"] != "ok":
                run["status"] = f"host run {h['status']}"
                rep["runs"].append(run)
                continue
            say(f"arm64: {fmt} in the arm64 root under qemu (slow) ...")
            a = run_arm64(root, copy, Path(ad), rt, prompt, steps, threads, force=h["tokens"][:steps])
            if a["status"] != "ok":
                run["status"] = f"arm64 run {a['status']}"
                rep["runs"].append(run)
                continue
            with np.load(Path(hd) / "result.npz") as hn, np.load(Path(ad) / "result.npz") as an:
                run.update(compare(h, a, hn, an, tol))
        run["runtime_version"] = {"host": h.get("runtime_version"), "arm64": a.get("runtime_version")}
        run["machine"] = {"host": h["machine"], "arm64": a["machine"]}
        run["host"] = {"runtime_baseline_bytes": h["runtime_baseline_bytes"], "peak_bytes": h["peak_bytes"],
                       "measured_bytes": h["peak_bytes"] - h["runtime_baseline_bytes"]}
        run["arm64"] = arm64_memory(a)
        # the export's own verification holds an artifact to tokens and logits (its state difference is reported,
        # not limited): so does this comparison; the state's agreement is its own column
        run["agrees"] = bool(run["tokens_equal"] and run["logits_within_tolerance"])
        rep["runs"].append(run)
    return rep


def print_table(rep: dict) -> None:
    from rich.table import Table

    from ..termtext import console
    from ..units import fmt_bytes
    t = Table(title=f"edgekv profile --arch arm64 — {rep['artifact']} ({rep['strategy']}, weights {rep['weights']}): "
                    f"{rep['prompt_tokens']} prompt tokens + {rep['steps']} steps, arm64 (qemu cpu {rep['qemu_cpu']}) vs "
                    f"{rep['host_machine']}", title_justify="left")
    for col in ("format", "tokens", "max |Δlogit| / scale", "limit", "state Δ / scale", "codes differ",
                "predicted", f"{rep['host_machine']} measured", "arm64 measured", "agrees"):
        t.add_column(col, justify="left" if col in ("format", "tokens", "agrees") else "right")
    for r in rep["runs"]:
        if r["status"] != "ok":
            t.add_row(r["format"], r["status"], *["-"] * 7, "[red]no[/]")
            continue
        t.add_row(r["format"], "equal" if r["tokens_equal"] else f"differ at {r['first_token_difference']}",
                  f"{r['max_abs_diff_over_logit_scale']:.2e}", f"{r['tolerance']['max_abs_diff_over_logit_scale']:.0e}",
                  f"{r['state']['float_max_abs_diff_over_scale']:.2e}", f"{r['state']['codes_differ_fraction']:.2%}",
                  fmt_bytes(r["predicted_bytes"], "MB", 1), fmt_bytes(r["host"]["measured_bytes"], "MB", 1),
                  fmt_bytes(r["arm64"]["measured_bytes"], "MB", 1), "[green]yes[/]" if r["agrees"] else "[red]no[/]")
    c = console()
    c.print(t)
    i = rep.get("interpreter") or {}
    c.print("MB = 1e6 bytes. measured = peak RSS above the runtime's baseline. arm64: the guest's own pages, qemu's "
            "translated code, heap and binary taken out (host smaps of the qemu process split by the guest's "
            "mappings)" + (f"; the interpreter alone: guest {fmt_bytes(i['arm64_guest_bytes'], 'MB', 1)} (+ qemu "
                           f"{fmt_bytes(i['arm64_qemu_own_bytes'], 'MB', 1)}) vs {fmt_bytes(i['host_python_bytes'], 'MB', 1)}"
                           f" on the host" if "arm64_guest_bytes" in i else "")
            + ". No speed: under emulation a step's time is qemu's, not a phone's.")


def arch_command(cctx, export_dir, arch, ctxs, steps, runtime, threads, as_json, out, force=False) -> None:
    """`edgekv profile --arch arm64`: refuses the options that do not apply, runs profile_arch, prints, writes."""
    from click.core import ParameterSource
    given = {p: cctx.get_parameter_source(p) not in (ParameterSource.DEFAULT, None) for p in cctx.params}
    for name, flag in (("limit_text", "--limit"), ("device_name", "--device"), ("repeats", "--repeats"),
                       ("use_adb", "--adb"), ("serial", "--serial")):
        if given.get(name):
            raise EdgekvError(f"{flag} does not apply with --arch {arch} (it compares tokens, logits, state and "
                              "memory above the baseline; no budget, no speed)")
    if given.get("ctx_text") and len(ctxs) != 1:
        raise EdgekvError("--arch arm64 runs one context: give one --ctx")
    err = sys.stderr
    rep = profile_arch(export_dir, arch, ctxs[0] if given.get("ctx_text") else None,
                       steps, runtime, threads,
                       progress=lambda s: (err.write(s + "\n"), err.flush()))
    if out:
        from ..outputs import marked, write_atomic
        write_atomic(out, json.dumps(marked(rep), indent=2) + "\n", option="--out", force=force)
    if as_json:
        sys.stdout.write(json.dumps(rep, indent=2) + "\n")
    else:
        print_table(rep)

