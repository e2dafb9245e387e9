"""README.md's `$ edgekv plan ...` examples from real runs: each block's shown lines are replaced by what the command
prints at the width of the block's rule line (a line ending in '...' keeps that cut; a lone '...' ends what is
shown). `python scripts/readme_examples.py` says which blocks differ; `--write` rewrites them.
tests/test_first_plan.py::test_the_readme_shows_the_plans_real_output checks the same blocks."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from edgekv.children import child_setup  # a child dies with this process

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```\n(\$ edgekv plan [^\n]*)\n(.*?)```", re.S)


def real(cmd: str, shown: list[str]) -> list[str]:
    rule = next((ln for ln in shown if ln and set(ln) == {"─"}), "─" * 80)
    env = {**os.environ, "COLUMNS": str(len(rule)), "PYTHONPATH": str(ROOT)}
    env.pop("LINES", None)
    out = subprocess.run([sys.executable, "-m", "edgekv.cli", *cmd.split()[2:]], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300, preexec_fn=child_setup()).stdout.splitlines()
    new = []
    for i, want in enumerate(shown):
        if want == "..." or i >= len(out):
            new += shown[i:] if want == "..." else []
            break
        new.append(out[i][:len(want) - 3].rstrip() + " ..." if want.endswith("...") else out[i])
    return new


def main(write: bool) -> int:
    path = ROOT / "README.md"
    text = path.read_text()
    changed = []

    def fix(m):
        cmd, body = m.group(1), m.group(2).rstrip("\n").split("\n")
        new = real(cmd, body)
        if new != body:
            changed.append(cmd)
        return "```\n" + cmd + "\n" + "\n".join(new) + "\n```"
    out = BLOCK.sub(fix, text)
    for c in changed:
        print(f"differs: {c}")
    if write and changed:
        path.write_text(out)
    return 1 if changed and not write else 0


if __name__ == "__main__":
    sys.exit(main("--write" in sys.argv[1:]))
