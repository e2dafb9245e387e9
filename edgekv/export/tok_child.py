"""The tokenizer stage of a GGUF export on the second core: write_tokenizer in a child process started before load.

Building tokenizer.json from a GGUF's vocabulary (Gemma 3's 262k tokens and merges through transformers' converter)
takes seconds of one core that nothing before the tokenizer stage needs, while load / trace / lowering run on one
thread (--threads 1 is what the plan measures). So the export starts this child first and collects it where the
stage is: same function, same file in the export's temporary folder (published with the rest, never half-done at
--out), same manifest entry. The child dies with the export (edgekv.children: SIGKILL included); an export that
stops before the stage kills it before its temporary folder is removed. A small GGUF (a fixture) or an HF folder
(a file copy) keeps the sequential stage: a second interpreter would cost more than it saves.

    python -m edgekv.export.tok_child SOURCE OUT_DIR   -> one JSON line (the entry) on stdout; exit 2 with one line
                                                          on stderr for an EdgekvError
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..errors import EdgekvError

MIN_BYTES = 64 << 20  # GGUFs at least this large get the child (every real model; test fixtures are smaller)


def worth_it(spec: str) -> Path | None:
    """The GGUF of spec when its tokenizer is worth a child (a .gguf file, a folder of one, or a packaged / already
    assembled name; nothing written to find it), else None."""
    from ..models.weights import known_gguf
    p = Path(spec)
    try:
        if p.is_dir():
            ggufs = [] if (p / "config.json").is_file() else sorted(p.glob("*.gguf"))
            p = ggufs[0] if len(ggufs) == 1 else None
        elif not (p.is_file() and p.suffix.lower() == ".gguf"):
            p = known_gguf(spec)
        return p if p is not None and p.stat().st_size >= MIN_BYTES else None
    except OSError:
        return None


class TokenizerChild:
    """write_tokenizer(source, out_dir) running in a child; result() waits for its entry, stop() kills it."""

    def __init__(self, source: Path, out_dir: Path):
        from ..children import child_setup
        self.source = Path(source)
        root = str(Path(__file__).resolve().parents[2])  # the edgekv this process runs, whatever the child's cwd
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen([sys.executable, "-m", "edgekv.export.tok_child", str(source), str(out_dir)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=child_setup())

    def result(self) -> dict | None:
        out, err = self.proc.communicate()
        if self.proc.returncode == 0:
            return json.loads(out)
        last = next((ln for ln in reversed(err.splitlines()) if ln.strip()), "")
        if self.proc.returncode == 2:  # an EdgekvError: the user's file, said in one line as the sequential stage does
            raise EdgekvError(last.removeprefix("error: "))
        raise RuntimeError(f"the tokenizer child exited {self.proc.returncode}: {last}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def main(argv: list[str]) -> int:
    from .tokenizer import write_tokenizer
    try:
        entry = write_tokenizer(Path(argv[0]), Path(argv[1]))
    except EdgekvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
