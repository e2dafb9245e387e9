"""The README's worked example, walked as a new user walks it: a fresh clone, then each step's command copied from
README.md ("## Worked example"), run in the clone with the toolchain already installed, and each step's output set
beside what the README shows.

    python scripts/walkthrough.py                      # clone this checkout's HEAD into a temporary folder, run steps
    python scripts/walkthrough.py --out benchmarks/results/walkthrough.json
    python scripts/walkthrough.py --list               # the commands the README gives, without running them

The commands are read from the README, never written here: a README edit that breaks the path breaks the walkthrough.
A step's command is the `$ edgekv ...` line of its code block, or, where the step shows no block, the first inline
`edgekv ...` of its paragraph. Each runs through bash in the clone's root (the README's cwd), with the `edgekv` of
the Python that runs this script (its bin folder first on PATH: no reinstall) importing the clone's package
(PYTHONPATH), output merged as a terminal shows it, COLUMNS the width of the block's rule line.

What is compared: every line the README shows for a step ("..." lines and a cut line's "..." tail mark what it leaves
out) must appear in the real output, in order, with every number masked (numbers measured on this host differ; the
words, units and columns must not). The transcript's summary (command, exit code, wall and CPU seconds, the lines
that differ) goes to --out. Exit code 0 when every step exits as the README implies (0) and no line differs, else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from edgekv.children import child_setup  # noqa: E402  (each step dies with the walkthrough)
SECTION = "## Worked example"
STEP = re.compile(r"^\*\*(\d+)\. ([^*]+?)\*\*", re.M)
BLOCK = re.compile(r"```\n(.*?)```", re.S)
INLINE = re.compile(r"`(edgekv [^`]+)`")
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:e[-+]?\d+)?%?", re.I)
STAGE_DONE = re.compile(r"^\s+\S+ done in ")  # an export stage's closing line: "      load done in 0.2 s"
# seconds per step: on a loaded shared host the .pte export (XNNPACK lowering, then its int4 weights against fp32
# over 256 tokens) runs past an hour of wall time (benchmarks/results/walkthrough.json)
STEP_TIMEOUT_S = 3 * 3600


def worked_example(readme: str) -> str:
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    return readme[start:end if end >= 0 else len(readme)]


def steps(readme: str) -> list[dict]:
    """[{"step", "title", "command", "shown"}] from the README's worked example, in order. shown: the output lines
    the README prints under the command ([] where the step gives its command inline)."""
    text = worked_example(readme)
    marks = list(STEP.finditer(text))
    out = []
    for i, m in enumerate(marks):
        body = text[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(text)]
        block = next((b for b in BLOCK.finditer(body) if b.group(1).startswith("$ edgekv ")), None)
        if block is not None:
            lines = block.group(1).rstrip("\n").split("\n")
            cmd, shown = lines[0][2:], lines[1:]
        else:
            inline = INLINE.search(body)
            if inline is None:
                raise SystemExit(f"walkthrough: README step {m.group(1)} ({m.group(2)}) names no edgekv command")
            cmd, shown = inline.group(1), []
        out.append({"step": int(m.group(1)), "title": m.group(2).strip().rstrip("."), "command": cmd,
                    "shown": shown})
    if not out:
        raise SystemExit(f"walkthrough: README.md has no numbered steps under {SECTION!r}")
    return out


def masked(line: str) -> str:
    return re.sub(r"\s+", " ", NUMBER.sub("#", line)).strip()


def differs(shown: list[str], real: list[str]) -> list[str]:
    """The README's shown lines that the real output does not have, in order, numbers masked. A line ending in "..."
    is compared up to that cut; a lone "..." stands for any number of lines."""
    want = [ln for ln in shown if ln.strip() != "..."]
    have = [masked(ln) for ln in real]
    missing, at = [], 0
    for ln in want:
        cut = ln.rstrip().endswith("...")
        key = masked(ln.rstrip()[:-3]) if cut else masked(ln)
        found = next((j for j in range(at, len(have)) if (have[j].startswith(key) if cut else have[j] == key)), None)
        if found is None:
            missing.append(ln)
        else:
            at = found + 1
    return missing


def clone(dest: Path) -> str:
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(dest)], check=True, preexec_fn=child_setup())
    return subprocess.run(["git", "-C", str(dest), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True, preexec_fn=child_setup()).stdout.strip()


def run_step(step: dict, repo: Path, bin_dir: Path, timeout: float, echo: bool = True) -> dict:
    rule = next((ln for ln in step["shown"] if ln and set(ln) == {"─"}), None)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(repo),
           "COLUMNS": str(len(rule) if rule else 100)}
    env.pop("LINES", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.Popen(["bash", "-c", step["command"]], cwd=repo, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace", preexec_fn=child_setup())
    timer = threading.Timer(timeout, p.kill)  # a step past its time is stopped and reported (exit code null)
    timer.start()
    real = []
    try:
        for line in p.stdout:  # echoed as it comes: a long export is not silent
            real.append(line.rstrip("\n"))
            if echo:
                print(f"      | {real[-1]}", file=sys.stderr, flush=True)
        p.wait()
    finally:
        timer.cancel()
    code = p.returncode if p.returncode >= 0 else None
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"step": step["step"], "title": step["title"], "command": step["command"], "exit_code": code,
            "wall_s": round(wall, 1), "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime
                                                     - before.ru_stime, 1),
            "readme_lines": len([ln for ln in step["shown"] if ln.strip() != "..."]),
            "differs": differs(step["shown"], real), "output_lines": len(real),
            "stages": [ln.strip() for ln in real if STAGE_DONE.match(ln)], "tail": real[-3:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the transcript's summary (JSON) here")
    ap.add_argument("--list", action="store_true", help="print the README's commands and exit")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    ap.add_argument("--timeout", type=float, default=STEP_TIMEOUT_S, help="seconds per step")
    ap.add_argument("--quiet", action="store_true", help="do not echo each step's output as it comes")
    args = ap.parse_args(argv)
    plan = steps((ROOT / "README.md").read_text())
    if args.list:
        for s in plan:
            print(f"{s['step']}. {s['command']}")
        return 0
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "edgekv").exists():
        raise SystemExit(f"walkthrough: {bin_dir} has no edgekv: run this with the .venv's python (make install)")
    tmp = Path(tempfile.mkdtemp(prefix="edgekv-walkthrough-"))
    results, ok = [], True
    try:
        repo = tmp / "edgekv"
        commit = clone(repo)
        print(f"walkthrough: fresh clone of {commit[:12]} in {repo}", file=sys.stderr)
        load0 = os.getloadavg()
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for s in plan:
            print(f"[{s['step']}/{len(plan)}] $ {s['command']}", file=sys.stderr, flush=True)
            r = run_step(s, repo, bin_dir, args.timeout, not args.quiet)
            results.append(r)
            print(f"      exit {r['exit_code']}, {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU; "
                  f"{r['readme_lines'] - len(r['differs'])} of {r['readme_lines']} README lines found",
                  file=sys.stderr, flush=True)
            for ln in r["differs"]:
                print(f"      README line not in the output: {ln}", file=sys.stderr)
            if r["exit_code"] != 0:
                ok = False
                print("      " + "\n      ".join(r["tail"]), file=sys.stderr)
                break  # the next step needs what this one made
            ok = ok and not r["differs"]
        summary = {"benchmark": "walkthrough", "what": "README.md's worked example, each step's command copied "
                   "from the README, run on a fresh clone with the installed toolchain (scripts/walkthrough.py)",
                   "commit": commit, "started_utc": started,
                   "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                               "loadavg_start": [round(x, 2) for x in load0],
                               "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
                   "steps": results, "ok": ok}
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    finally:
        if args.keep:
            print(f"walkthrough: clone kept at {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
