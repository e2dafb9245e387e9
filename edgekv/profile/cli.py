"""`edgekv profile` and `edgekv report`. torch and the runtimes are imported inside the commands only."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

from ..clibase import artifact_runtime, artifact_runtime_choice, threads_option
from ..errors import EdgekvError

APP = "org.edgekv.demo"
ACTIVITY = f"{APP}/.BenchmarkActivity"
REMOTE_DIR = "/data/local/tmp/edgekv"
REMOTE_REPORT = f"/sdcard/Android/data/{APP}/files/report.json"


@click.command("profile")
@click.argument("export_dir", type=click.Path(file_okay=False))
@click.option("-c", "--ctx", "ctx_text", default="256,1k", show_default=True,
              help="contexts, comma-separated: each run is ctx - steps prompt tokens, then steps decoded")
@click.option("--steps", default=None, type=click.IntRange(1, 100000),
              help="decode steps per run, after ctx - steps prompt tokens (default: 32; `run -n` counts new tokens, "
                   "the first of which comes from the prefill)")
@click.option("-n", "steps_n", default=None, type=click.IntRange(1, 100000), hidden=True,
              help="deprecated spelling of --steps (-n is new tokens in `edgekv run`; default: none)")
@click.option("--runtime", type=artifact_runtime_choice(), default=None, callback=artifact_runtime,
              help="runtime to run in (default: ort when the export has model.onnx, else executorch); genai / "
              "executorch-runner: through ONNX Runtime GenAI's Generator / the ExecuTorch runner .pte's "
              "forward(tokens, input_pos), as those APIs run it (an export made with --runner)")
@click.option("--limit", "limit_text", default=None, help="memory budget for the run with its unit (B, KB, KiB, MB, "
              "MiB, GB, GiB), e.g. 600MB, counted as the "
              "measured column counts (peak above the runtime's baseline): a run above it is stopped, reported with "
              "the step it reached, and the command exits 3 (default: no limit)")
@click.option("-d", "--device", "device_name", default=None,
              help="use this device profile's app budget less its runtime's overhead as --limit: the bytes an "
              "artifact may hold above the runtime's baseline, the basis `plan` and `report` judge fits on "
              "(default: none)")
@threads_option(help="compute threads (ONNX Runtime intra-op, ExecuTorch XNNPACK threadpool); default: the runtime's")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, 50),
              help="fresh processes per context; the run with the median memory is reported, with every run's "
                   "measured bytes (measured_bytes_runs)")
@click.option("--adb", "use_adb", is_flag=True, help="run on an attached Android phone through the demo app")
@click.option("--serial", default=None, help="adb device serial (with --adb; default: the one attached)")
@click.option("--json", "as_json", is_flag=True,
              help="print the report as JSON (the schema the Android app writes too: edgekv/profile/report.schema.json)")
@click.option("-o", "--out", type=click.Path(dir_okay=False), default=None,
              help="also write the report JSON here (default: not written)")
@click.option("--arch", default="host", show_default=True,
              help="arm64: run the export in the arm64 root under qemu (make arm64-env, as root) and compare it with "
                   "this host's run: greedy tokens, logits, state, memory above the baseline (no speed); --ctx and "
                   "--steps default to 40 and 8 there")
@click.option("--force", is_flag=True, help="replace an existing --out (and --adb's report.android.json), only if "
              "edgekv wrote it (default: refuse)")
def profile(export_dir, ctx_text, steps, steps_n, runtime, limit_text, device_name, threads, repeats, use_adb, serial,
            as_json, out, arch, force):
    """Measured peak memory (minus the runtime's baseline) and tokens/s of an export, against the plan.

    Exit codes: 0 every run finished within the budget (or no budget was given); 2 bad input; 3 a run went over
    --limit / the --device budget or did not finish."""
    steps = _steps(steps, steps_n)  # None: not given (--arch arm64 has its own default)
    from ..jsonfile import output_json
    from ..outputs import check_writable, marked, write_atomic
    from ..units import parse_bytes, parse_ctx_list

    ctxs = parse_ctx_list(ctx_text)
    if out:  # before the runs: a finished profile is not lost to an unwritable path
        check_writable(out, "--out", force=force)
    from .arm64 import check_arch
    if check_arch(arch) != "host":
        from .arm64 import arch_command
        return arch_command(click.get_current_context(), export_dir, arch, ctxs, steps, runtime, threads, as_json,
                            out, force)
    steps = DEFAULT_STEPS if steps is None else steps
    if use_adb:
        if repeats > 1:
            raise EdgekvError("--repeats is for runs on this machine; with --adb the app runs each context once")
        if runtime in ("genai", "executorch-runner"):
            raise EdgekvError(f"--adb: the Android demo runs edgekv's explicit-state artifacts (--runtime ort or "
                              f"executorch), not {runtime}; see android_demo/README.md")
        check_writable(Path(export_dir) / "report.android.json", "--adb", force=force)
        report = adb_profile(Path(export_dir), ctxs, steps, runtime or "ort", serial, force)
    else:
        from ..devices import load_device
        from .run import validate_report
        device = load_device(device_name) if device_name else None
        limit = parse_bytes(limit_text) if limit_text is not None else None
        report = profile_with_progress(export_dir, ctxs, steps, runtime, limit, threads, device, repeats,
                                       enabled=not as_json)
        validate_report(report)
    text = output_json(marked(report))
    if out:
        write_atomic(out, text + "\n", option="--out", force=force)
    if as_json:
        sys.stdout.write(text + "\n")
    else:
        profile_table(report)
    from .run import failed_runs
    failed = failed_runs(report)
    if failed:  # the other runs are reported above; one line says which did not finish and why
        click.echo(f"edgekv: {len(failed)} of {len(report['runs'])} runs failed: "
                   + "; ".join(f"ctx {r['ctx']}: {r['status']}" for r in failed), err=True)
    if not all(r.get("fits") for r in report["runs"]):  # over the budget, or did not finish
        from ..cli import EXIT_NO_FIT
        raise SystemExit(EXIT_NO_FIT)


DEFAULT_STEPS = 32


def _steps(steps: int | None, steps_n: int | None) -> int | None:
    """--steps, or the deprecated -n with one line on stderr: -n is new tokens in `edgekv run` (llama.cpp's and ONNX
    Runtime GenAI's meaning), so profile's decode steps are spelled --steps only."""
    if steps_n is None:
        return steps
    if steps is not None and steps != steps_n:
        raise EdgekvError(f"-n {steps_n} and --steps {steps} disagree: give --steps only (-n is deprecated here)")
    click.echo(f"edgekv: profile -n is deprecated: use --steps {steps_n} (decode steps per run; -n is new tokens in "
               f"edgekv run)", err=True)
    return steps_n


def profile_with_progress(export_dir, ctxs, steps, runtime, limit, threads, device, repeats, enabled=True):
    """run.profile with one line per fresh process on stderr and a bar over the processes with an estimate."""
    from ..progress import Bar
    from .run import profile as run_profile

    total = len(ctxs) * repeats
    with Bar("profile", total, enabled, "runs") as bar:
        done = [0, 0]
        tokens = sum(ctxs) * repeats  # the runs' own work: a run's time grows with its context, so the estimate of
        # the time left counts the tokens the runs done so far took, not an average per run

        def progress(c, i, n):
            bar.message(f"profile: ctx {c} in a fresh process" + (f" ({i + 1} of {n})" if n > 1 else "") + "...")
            bar.update(completed=done[0])
            if done[1]:
                bar.work(done[1], tokens)
            done[0] += 1
            done[1] += c

        report = run_profile(export_dir, ctxs, steps, runtime, limit, threads, device, progress=progress,
                             repeats=repeats)
        bar.update(completed=total)
    return report


def profile_table(report: dict) -> None:
    from ..termtext import Col, console, print_table, time_column
    from ..render import GB_NOTE
    from ..units import fmt_gb, fmt_mem
    h = report["host"]
    runs = report["runs"]
    budget = report.get("budget_bytes")
    title = (f"edgekv profile: {report['artifact']} ({report.get('strategy', '')}) on {h['kind']}, "
             f"{report['runtime']}, bandwidth {h.get('bandwidth_bytes_per_s', 0) / 1e9:.1f} GB/s"
             + (f", budget {fmt_mem(budget)} above the runtime baseline" if budget else ""))
    p50_head, p50 = time_column("p50", [r["latency_ms"].get("p50") and r["latency_ms"]["p50"] / 1e3 for r in runs])
    p90_head, p90 = time_column("p90", [r["latency_ms"].get("p90") and r["latency_ms"]["p90"] / 1e3 for r in runs])
    cols = [Col("ctx", "right", keep=True), Col("predicted\nGB", "right", give=1), Col("measured\nGB", "right"),
            Col("error", "right", give=2), Col("runtime\nbaseline GB", "right", give=5, short="base\nGB"),
            Col("decode\ntok/s", "right", give=1), Col("roofline\ntok/s", "right", give=4),
            Col(p50_head, "right", give=3), Col(p90_head, "right", give=6), Col("fits"),
            Col("status", give=1)]
    cells = []
    for r, a, b in zip(runs, p50, p90):
        m = r.get("measured_bytes")
        stopped = r.get("status") == "exceeded"  # its peak is where it was stopped: a lower bound, no error to show
        cells.append([str(r["ctx"]), fmt_gb(r["predicted_bytes"]), (">= " if stopped else "") + fmt_gb(m) if m else "-",
                      f"{r['error_pct']:+.1f}%" if r.get("error_pct") is not None and not stopped else "-",
                      fmt_gb(r["runtime_baseline_bytes"]) if r.get("runtime_baseline_bytes") else "-",
                      f"{r['tokens_per_s']:.1f}" if r.get("tokens_per_s") else "-",
                      f"{r['roofline_tokens_per_s']:.1f}" if r.get("roofline_tokens_per_s") else "-", a, b,
                      "[green]yes[/]" if r["fits"] else "[red]no[/]",
                      r.get("status", "ok") + (f" at {r.get('reached_phase')} step {r['reached_step']}"
                                               if r.get("status") == "exceeded" else "")])
    notes = []
    for r in runs:
        if r.get("measured_bytes_runs"):
            m = r["measured_bytes_runs"]
            notes.append(f"ctx {r['ctx']}: the median of {len(m)} fresh processes (measured {fmt_gb(min(m))} to "
                         f"{fmt_gb(max(m))} GB).")
        comp = r.get("measured_components") or {}
        if comp.get("calls_peak") and comp.get("load_peak", 0) > comp["calls_peak"]:
            # the load was the peak: the calls' own peak is the one that grows with the context
            notes.append(f"ctx {r['ctx']}: the peak was while loading; the calls' own peak {fmt_gb(comp['calls_peak'])}"
                         + (f" GB, planned {fmt_gb(r['predicted_calls_bytes'])} GB ({r['calls_error_pct']:+.1f}%)."
                            if r.get("calls_error_pct") is not None else " GB."))
    footer = (f"{GB_NOTE}. measured = peak RSS (VmHWM) - the runtime's baseline RSS, each run in a fresh process; "
              "predicted = the planner's weights + state + workspace of this artifact (without the runtime's "
              "overhead, which the plan's total adds); fits and --limit count the measured bytes; roofline = "
              "bandwidth / (weights + state bytes)."
              + (" >= : the run was stopped there, over its budget (the step it reached is in status)."
                 if any(r.get("status") == "exceeded" for r in runs) else "") + " " + " ".join(notes))
    print_table(console(), title, cols, cells, footer)


# ---- on a phone, through the demo app ----


def _adb(serial: str | None, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = ["adb"] + (["-s", serial] if serial else []) + list(args)
    from ..children import child_setup
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=child_setup())


def adb_profile(folder: Path, ctxs: list[int], steps: int, runtime: str, serial: str | None,
                force: bool = False) -> dict:
    if shutil.which("adb") is None:
        raise EdgekvError("--adb needs the adb tool (apt-get install adb) and a phone with USB debugging on")
    devs = [ln.split()[0] for ln in _adb(None, "devices").stdout.splitlines()[1:] if ln.strip().endswith("device")]
    if not devs:
        raise EdgekvError("no Android device attached (adb devices lists none): connect a phone with USB debugging on")
    if serial and serial not in devs:
        raise EdgekvError(f"device {serial} is not attached (attached: {', '.join(devs)})")
    if _adb(serial, "shell", "pm", "path", APP).returncode != 0:
        raise EdgekvError(f"the demo app {APP} is not installed on the phone: build android_demo/ in Android Studio "
                          "and install it (see android_demo/README.md)")
    from ..export.manifest import load_export
    load_export(folder)
    remote = f"{REMOTE_DIR}/{folder.name}"
    _adb(serial, "shell", "rm", "-rf", remote)
    p = _adb(serial, "push", str(folder), remote, timeout=1800)
    if p.returncode != 0:
        raise EdgekvError(f"adb push failed: {(p.stderr or p.stdout).strip().splitlines()[-1]}")
    _adb(serial, "logcat", "-c")
    _adb(serial, "shell", "am", "start", "-S", "-W", "-n", ACTIVITY, "--es", "export_dir", remote, "--es", "runtime",
         runtime, "--es", "ctx", ",".join(map(str, ctxs)), "--ei", "steps", str(steps))
    deadline = time.time() + 3600
    while time.time() < deadline:
        log = _adb(serial, "logcat", "-d", "-s", "edgekv").stdout
        if "EDGEKV_DONE" in log:
            if "EDGEKV_DONE error" in log:
                raise EdgekvError("the app reported: " + log.split("EDGEKV_DONE error:")[-1].strip().splitlines()[0])
            break
        time.sleep(2)
    else:
        raise EdgekvError("the app did not finish within an hour (adb logcat -s edgekv shows its progress)")
    import tempfile

    from ..jsonfile import read_json
    from ..outputs import write_atomic
    from .run import validate_report
    with tempfile.TemporaryDirectory(prefix="edgekv-adb-") as pulled:  # then written beside the export atomically
        local = Path(pulled) / "report.json"
        p = _adb(serial, "pull", REMOTE_REPORT, str(local))
        if p.returncode != 0:
            raise EdgekvError(f"could not pull {REMOTE_REPORT}: {(p.stderr or p.stdout).strip()}")
        report = read_json(local, f"the app's {REMOTE_REPORT}")
        validate_report(report)
        write_atomic(folder / "report.android.json", local.read_bytes(), option="--adb", force=force)
    return report


def planned_device(folder: Path) -> str:
    """The built-in device an export was planned for (its manifest's planned_for, from export --from-plan), else
    pixel8. A manifest that cannot be read says so later, in load_export's own words."""
    from ..devices import device_ids
    from ..jsonfile import read_json
    try:
        planned = read_json(folder / "manifest.json").get("planned_for")
    except (EdgekvError, AttributeError):
        return "pixel8"
    return planned if isinstance(planned, str) and planned in device_ids() else "pixel8"


@click.command("report")
@click.argument("export_dir", type=click.Path(file_okay=False))
@click.option("-o", "--out", type=click.Path(dir_okay=False), default=None,
              help="report.html (default: EXPORT_DIR/report.html); a .md name writes markdown")
@click.option("-d", "--device", "device_name", default=None,
              help="the phone to plan for (default: the device the export was planned for with --from-plan, else "
              "pixel8)")
@click.option("--gpu", "gpu_name", default="h100", show_default=True, help="the datacenter baseline")
@click.option("-c", "--ctx", "ctx_text", default=None,
              help="context for the plan and the baseline (default: the export's max_ctx)")
@click.option("--profile", "profile_json", type=click.Path(exists=True, dir_okay=False),
              help="an `edgekv profile --out` JSON to include (default: a quick profile now at 256 and 1k tokens, "
              "with progress on stderr; profile the full context with `edgekv profile -c CTX --out P`, then "
              "--profile P)")
@click.option("--json", "as_json", is_flag=True,
              help="also print what the page shows as one JSON object: {\"out\", \"plan\", \"profile\", \"analyzer\", "
              "\"baseline\", ...}")
@click.option("--force", is_flag=True, help="replace an existing --out, only if edgekv wrote it (default: refuse)")
def report(export_dir, out, device_name, gpu_name, ctx_text, profile_json, as_json, force):
    """One page: the plan, the measured profile, the analyzer's quality curve and the H100 baseline, side by side."""
    from ..devices import load_device
    from ..jsonfile import read_json
    from ..outputs import check_writable
    from .report import build_report
    from .run import validate_report

    # every input checked before the profile runs: its minutes are not lost to a bad flag; the folder first, so that
    # a mistyped one is named as such, not as the folder --out would be written in
    from ..export.manifest import load_export
    load_export(export_dir, check_hashes=False)
    if device_name is None:
        device_name = planned_device(Path(export_dir))
    check_writable(out or Path(export_dir) / "report.html", "--out", force=force)
    if not load_device(gpu_name).is_datacenter:
        raise EdgekvError(f"--gpu {gpu_name}: not a datacenter GPU profile (try h100, h200, a100)")
    if load_device(device_name).is_datacenter:
        raise EdgekvError(f"--device {device_name}: a datacenter GPU; --device is the phone to plan for (e.g. pixel8)")
    profile = None
    if profile_json:  # read once: --profile /dev/stdin is a pipe
        profile = read_json(profile_json, f"--profile {profile_json}")
        validate_report(profile, f"--profile {profile_json}")
    if ctx_text is not None:
        from ..units import parse_ctx
        parse_ctx(ctx_text)
    path, data = build_report(Path(export_dir), out, device_name, gpu_name, ctx_text, profile,
                              progress=not as_json, force=force)
    if as_json:
        from ..termtext import print_json
        print_json(data)
    else:
        click.echo(f"report written to {path}")
