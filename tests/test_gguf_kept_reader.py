"""An export parses its GGUF's header once for the checks before any stage and the load (edgekv.arch.gguf
kept_readers): GGUFReader builds every metadata array (Gemma 3's 262k-token vocabulary: ~10 s of CPU per parse), and
check_applies, check_export and load each opened the file. A file replaced between two opens is parsed again.

References: gguf-py's GGUFReader constructions counted where they happen; the bytes written to the file. Seconds."""
import os

import numpy as np
import pytest

from conftest import smollm2_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture
def counted(monkeypatch):
    made = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, *a, **k):
            made.append(str(path))
            super().__init__(path, *a, **k)
    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    return made


def _tiny(path, value: int):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.value", value)
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_export_parses_its_gguf_once_before_the_weights_are_in_memory(tmp_path, counted, monkeypatch):
    pytest.importorskip("torch")
    from edgekv.errors import EdgekvError
    from edgekv.export import pipeline
    from edgekv.export.options import ExportOptions

    src = smollm2_gguf()
    if not src.is_file():
        pytest.skip("the SmolLM2 GGUF package is not installed")
    loaded = []

    def load_then_stop(x, opts, st, version):
        pipeline._load(x)
        loaded.append(x.loaded.source)
        raise EdgekvError("stopped after load")
    monkeypatch.setattr(pipeline, "_stages", load_then_stop)
    monkeypatch.setenv("EDGEKV_PTE_CACHE", "off")
    opts = ExportOptions(model=str(src), formats=("pte",), max_ctx=256, out=str(tmp_path / "out"), threads=1)
    with pytest.raises(EdgekvError, match="stopped after load"):
        pipeline.export_model(opts, echo=lambda s: None)
    assert loaded and counted == [str(src)]


def test_a_kept_reader_is_not_served_for_a_replaced_file(tmp_path, counted):
    from edgekv.arch.gguf import kept_readers, open_gguf, release_readers

    f = tmp_path / "m.gguf"
    _tiny(f, 1)
    with kept_readers():
        a = open_gguf(f)
        assert open_gguf(f) is a and len(counted) == 1
        _tiny(tmp_path / "new.gguf", 2)
        os.replace(tmp_path / "new.gguf", f)
        b = open_gguf(f)
        assert b is not a and b.fields["test.value"].contents() == 2
        release_readers()
        assert open_gguf(f) is not b
    assert open_gguf(f) is not open_gguf(f) and len(counted) == 5  # outside kept_readers: every open parses
