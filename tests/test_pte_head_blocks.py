"""A .pte's quantized output layer in row blocks (edgekv.export.wquant.split_head), each its own XNNPACK delegate
(edgekv.export.to_pte._head_block_partitioner), and the forward's one row of logits a call (manifest one_row).

Why: ExecuTorch maps a delegate's weights while XNNPACK packs them and unmaps them after, so a program whose head is
one delegate holds the whole head's unpacked bytes beside the packed weights while it loads (Gemma-3-270M: 84.4 MiB
above what stays resident), and a memory plan holds the most logits rows a call can return (35.4 MB at a 32-token
chunk): benchmarks/results/pte_load_steps_gemma3.json. The tiny llama's head (64 x 64, int4) is split by lowering the
block size for the test; its blocks must give the logits the whole matrix gives, in as many delegates more."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("executorch")

from edgekv.export.manifest import load_export  # noqa: E402
from edgekv.export.options import ExportOptions  # noqa: E402
from edgekv.export.pipeline import export_model  # noqa: E402
from edgekv.export.pte_stepper import PteStepper  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STREAM = [int(t) for t in np.random.default_rng(5).integers(3, 60, 12)]


def delegates(pte) -> int:
    from executorch.exir._serialize._program import deserialize_pte_binary
    return len(deserialize_pte_binary(pte.read_bytes()).program.execution_plan[0].delegates)


def rows(out):
    st = PteStepper(load_export(out), out, 1)
    got = [st.step(STREAM[:4], 0, last=True), st.prefill(STREAM[4:8], 4)]  # a chunk's last row; one token a call
    got += [st.step([t], p) for p, t in enumerate(STREAM[8:], start=8)]
    return np.concatenate(got)


def test_a_split_head_lowers_one_delegate_per_block_and_gives_the_whole_matrix_logits(tmp_path, monkeypatch):
    from test_export_kv import tiny_llama_folder

    import edgekv.arch.variants as variants

    src = tmp_path / "tiny"
    tiny_llama_folder(src)

    def export(out):
        return export_model(ExportOptions(model=str(src), strategy="kv:dtype=fp32", formats=("pte",), max_ctx=256,
                                          out=out, prefill_chunk=4, verify_steps=2, weights="int4", threads=1),
                            echo=lambda s: None)
    whole = export(tmp_path / "whole")
    assert "output_layer_blocks" not in whole["weights"]["quantization"]["pte"]
    # a row of the tiny head is 32 B of int4 codes + 2 groups' scales (bf16) and zero points: 38 B; blocks of 16 rows
    monkeypatch.setattr(variants, "PTE_HEAD_BLOCK_BYTES", 1024)
    monkeypatch.setattr(variants, "PTE_HEAD_BLOCK_ALIGN", 16)
    split = export(tmp_path / "split")
    assert split["weights"]["quantization"]["pte"]["output_layer_blocks"] == [16, 16, 16, 16]
    assert split["verification"]["pte"]["passed"]
    # each block is its own delegate (the model's partitioner had lowered the head as one, with the final norm: that
    # and the blocks' concatenation are then delegates of their own, 11 against 6 here)
    assert delegates(tmp_path / "split" / "model.pte") >= delegates(tmp_path / "whole" / "model.pte") + 3
    ep = split["artifacts"][0]["entry_points"][0]
    assert ep["inputs"][-1] == {"name": "rows", "dtype": "int64", "shape": [1]}  # one row a call
    assert ep["outputs"][0]["shape"] == [1, 1, 64]
    a, b = rows(tmp_path / "whole"), rows(tmp_path / "split")
    assert a.shape == (1 + 4 + 4, 64)
    # the same int4 codes and scales, the same per-token activation codes: each logit is the same dot product
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())


def test_the_plan_charges_one_head_block_while_xnnpack_packs():
    """The .pte's load transient in the plan: its largest packed matrix is a head block of at most
    PTE_HEAD_BLOCK_BYTES (Gemma-3-270M int4: the head is 5-10x that), not the head; an fp32 tied head (not split by
    the export: split_head takes quantized heads only) stays one matrix."""
    from edgekv.arch import catalog
    from edgekv.arch.variants import PTE_HEAD_BLOCK_ALIGN, PTE_HEAD_BLOCK_BYTES
    from edgekv.memory.weights import weight_bytes_one
    from edgekv.memory.workspace import _largest_packed

    arch = catalog.catalog_arch("gemma-3-270m")
    table = next(w for w in arch.weights if w.cls == "embedding")
    head = weight_bytes_one(table, "int4")
    assert head > 5 * PTE_HEAD_BLOCK_BYTES
    block = _largest_packed(arch, "int4")
    assert PTE_HEAD_BLOCK_BYTES - PTE_HEAD_BLOCK_ALIGN * head / arch.vocab < block <= PTE_HEAD_BLOCK_BYTES
    assert _largest_packed(arch, "fp32") == weight_bytes_one(table, "fp32")


def test_the_plan_splits_the_head_into_the_rows_the_exports_recorded():
    """The plan's head block (pte_head_row_bytes: 4-bit codes + a 2-byte scale and an int8 zero point per group, in
    the output layer's group) has the rows of the blocks two int4 exports wrote in their manifests
    (output_layer_blocks, copied by experiments/pte_load_steps.py into benchmarks/results/): the random
    Llama-3.2-1B's head in groups of 32 (2048 / 2 + 64 x 3 = 1216 B a row: 13312 rows under 16 MiB) and
    Gemma-3-270M's in groups of 64 (640 / 2 + 10 x 3 = 350 B: 47104 rows)."""
    import json
    from pathlib import Path

    from edgekv.arch import catalog
    from edgekv.arch.variants import pte_head_block_rows
    from edgekv.memory.workspace import _largest_packed, pte_head_row_bytes

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    for name, runs, per_row in (("llama-3.2-1b", "pte_load_steps_llama32_1b_random.json", 1216),
                                ("gemma-3-270m", "pte_load_steps_gemma3.json", 350)):
        arch = catalog.catalog_arch(name)
        blocks = [r["program"]["output_layer_blocks"] for r in json.loads((results / runs).read_text())["runs"]]
        recorded = next(b for b in blocks if b)
        assert pte_head_row_bytes(arch) == per_row
        rows = pte_head_block_rows(arch.vocab, per_row)
        assert rows == recorded[0] and sum(recorded) == arch.vocab
        assert _largest_packed(arch, "int4") == rows * per_row  # larger than any decoder linear of either
