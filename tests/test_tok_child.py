"""A large GGUF's tokenizer stage runs in a child from the start of the export (edgekv.export.tok_child): the same
tokenizer.json bytes and manifest entry as the in-process stage, the same one-line error for a vocabulary the
converter refuses, and the child gone whenever the export is (stopped before the stage, or SIGKILLed).

References: write_tokenizer run in this process (the sequential stage) for the bytes and the error; the kernel's
process table (/proc) for the child's life. Seconds (each child imports transformers' GGUF converter)."""
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


def _vocab_gguf(path: Path, model: str = "gpt2") -> Path:
    """A GGUF holding a gpt2-style vocabulary (the 256 byte symbols and one merged token: the GPT-2 converter runs)."""
    from edgekv.export.tokenizer import byte_symbols

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("default")
    tokens = byte_symbols() + ["ĠĠ"]
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(256)
    w.add_add_bos_token(True)
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _export(tmp_path: Path, src: Path):
    from edgekv.export import manifest as mf
    from edgekv.export import pipeline
    from edgekv.export.options import ExportOptions, Stages
    from edgekv.strategies import parse_strategy

    out = tmp_path / "out"
    out.mkdir()
    opts = ExportOptions(model=str(src), formats=("pte",), max_ctx=64)
    return pipeline.Export(opts, parse_strategy("kv"), Stages(["tokenizer"], echo=lambda s: None), out, mf)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.fixture
def every_gguf(monkeypatch):
    from edgekv.export import tok_child
    monkeypatch.setattr(tok_child, "MIN_BYTES", 0)  # the fixtures are tiny; real models are over the threshold


def test_the_child_writes_the_bytes_and_entry_of_the_in_process_stage(tmp_path, every_gguf):
    from edgekv.export import pipeline
    from edgekv.export.tokenizer import write_tokenizer

    src = _vocab_gguf(tmp_path / "m.gguf")
    x = _export(tmp_path, src)
    pipeline._start_tokenizer(x)
    assert x.tok_child is not None and x.tok_child.proc.pid != os.getpid()
    x.loaded = SimpleNamespace(source=src, args=SimpleNamespace(vocab=257))
    pipeline._tokenizer(x)
    (tmp_path / "seq").mkdir()
    entry = write_tokenizer(src, tmp_path / "seq")
    digest = [hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest() for d in (x.tmp, tmp_path / "seq")]
    assert digest[0] == digest[1] and x.tok_entry == entry and entry["bos_token_id"] == 256
    assert x.tokenizer.encode("a  ").ids == [ord("a"), 256] and x.tok_child is None


def test_a_vocabulary_the_converter_refuses_is_the_same_one_line_error(tmp_path, every_gguf):
    from edgekv.errors import EdgekvError
    from edgekv.export import pipeline
    from edgekv.export.tokenizer import write_tokenizer

    src = _vocab_gguf(tmp_path / "m.gguf", model="no-such-model")
    with pytest.raises(EdgekvError) as seq:
        write_tokenizer(src, tmp_path)
    x = _export(tmp_path, src)
    pipeline._start_tokenizer(x)
    x.loaded = SimpleNamespace(source=src, args=SimpleNamespace(vocab=257))
    with pytest.raises(EdgekvError) as child:
        pipeline._tokenizer(x)
    assert str(child.value) == f"export failed at stage tokenizer: {seq.value}" and "\n" not in str(child.value)


def test_an_export_that_stops_before_the_stage_stops_the_child(tmp_path, every_gguf, monkeypatch):
    from edgekv.errors import EdgekvError
    from edgekv.export import pipeline

    x = _export(tmp_path, _vocab_gguf(tmp_path / "m.gguf"))
    seen = []

    def load_fails(x, opts, st, version):
        seen.append(x.tok_child.proc.pid)
        assert not _gone(seen[0])  # started before load, still importing
        raise EdgekvError("load: not a model")
    monkeypatch.setattr(pipeline, "_stages", load_fails)
    with pytest.raises(EdgekvError):
        pipeline._run(x.opts, x.strategy, x.st, x.tmp, x.mf, "0")
    assert seen and _gone(seen[0])


PARENT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from edgekv.export.tok_child import TokenizerChild
c = TokenizerChild(Path(sys.argv[2]), Path(sys.argv[3]))
print(c.proc.pid, flush=True)
time.sleep(60)
"""


def test_the_child_dies_with_a_sigkilled_export(tmp_path):
    src = _vocab_gguf(tmp_path / "m.gguf")
    p = subprocess.Popen([sys.executable, "-c", PARENT, str(ROOT), str(src), str(tmp_path)], stdout=subprocess.PIPE,
                         text=True)
    try:
        child = int(p.stdout.readline())
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        for _ in range(100):
            if _gone(child):
                break
            time.sleep(0.05)
        assert _gone(child)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
