"""The Android core's state-file fixture (android_demo/core/src/test/resources/tiny-llama-kv-int4-state, read and
rewritten byte for byte by StateFileTest in Java) is what this edgekv's own reader and writer
(edgekv/export/statefile.py) read and write: a change to the Python format fails here, not only on a phone."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekv.errors import EdgekvError
from edgekv.export import statefile
from edgekv.export.stepper import NP_DTYPES

FIXTURE = Path(__file__).resolve().parents[1] / "android_demo/core/src/test/resources/tiny-llama-kv-int4-state"


class Book:
    """The stepper side statefile needs: state buffers in the manifest's order, a runtime, reset."""

    def __init__(self, manifest: dict, runtime: str = "ort"):
        self.runtime = runtime
        self.arrays = [np.zeros(t["shape"], NP_DTYPES[t["dtype"]]) for t in manifest["state"]["tensors"]]

    def state_arrays(self):
        return self.arrays

    def reset(self):
        for a in self.arrays:
            a[...] = 0


def test_python_reads_the_android_fixture_and_writes_its_bytes(tmp_path):
    manifest = json.loads((FIXTURE / "manifest.json").read_text())
    book = Book(manifest)
    got = statefile.load(FIXTURE / "state.safetensors", manifest, book)
    assert got["position"] == 14 and bytes(got["tokens"]) == b"The cat sat th" and got["pending"] == ord("e")
    k0 = book.arrays[0]  # past_key_values.0.key [1, 4, 32, 24] uint8: codes at the 14 consumed positions only
    assert k0.any(-1)[0].sum(-1).tolist() == [14, 14, 14, 14]
    out = tmp_path / "again.safetensors"
    statefile.save(out, manifest, book, got["position"], got["tokens"], got["pending"])
    assert out.read_bytes() == (FIXTURE / "state.safetensors").read_bytes()
    with pytest.raises(EdgekvError, match="pte"):  # an ONNX-only export: no .pte to resume in
        statefile.load(FIXTURE / "state.safetensors", manifest, Book(manifest, "executorch"))
