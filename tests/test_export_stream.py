"""The streamed ONNX int8 / int4 export (edgekv.export.onnx_quant.quantize_onnx on a graph lowered with its weights'
transposes unfolded) writes the blocks ONNX Runtime's own MatMulNBitsQuantizer writes for the whole model, and it
never holds the fp32 weights in memory.

References: ONNX Runtime's MatMulNBitsQuantizer run here on the whole fp32 graph, its head untied with numpy (the
blocks, scales and zero points must be identical, bit for bit); the kernel's peak resident size of a child process
(VmHWM, reset after its imports) for the memory.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, child_json, random_llama, traced_for_onnx

TINY = ROOT / "fixtures" / "tiny" / "llama"


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """The tiny llama's fp32 graph as the streamed export lowers it (W^T unfolded), and as the fp32 export does."""
    from edgekv.export.to_onnx import lower_onnx, save_onnx

    ep, entry = traced_for_onnx(TINY)
    root = tmp_path_factory.mktemp("stream")
    for fold in (False, True):
        (root / str(fold)).mkdir()
        save_onnx(lower_onnx(ep, entry, fold_weights=fold), root / str(fold) / "model.onnx")
    return root, entry


def _ort_whole(src, weights):
    """ONNX Runtime's quantizer on the whole fp32 model in memory (the head's Transpose(W) folded with numpy first:
    ORT quantizes a constant B only), as edgekv's ONNX export quantized before it streamed."""
    import onnx
    from onnx import numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from edgekv.export import wquant
    m = onnx.load(str(src))
    inits = {i.name: i for i in m.graph.initializer}
    for t in [n for n in m.graph.node if n.op_type == "Transpose" and n.input[0] in inits]:
        m.graph.initializer.append(numpy_helper.from_array(
            np.ascontiguousarray(numpy_helper.to_array(inits[t.input[0]]).T), t.output[0]))
        m.graph.node.remove(t)
    bits = wquant.BITS[weights]
    q = MatMulNBitsQuantizer(m, bits=bits, block_size=wquant.GROUP, is_symmetric=wquant.ORT_SYMMETRIC[weights],
                             accuracy_level=wquant.ORT_ACCURACY_LEVEL,
                             op_types_to_quantize=("MatMul", "Gather") if bits == 4 else ("MatMul",),
                             quant_axes=(("MatMul", 0), ("Gather", 1)))
    q.process()
    return q.model.model


def _blocks(model, base=""):
    """Every quantized node in order: (op, attributes, its constant inputs as arrays)."""
    from onnx import numpy_helper
    inits = {i.name: i for i in model.graph.initializer}
    return [(n.op_type, sorted((a.name, a.i) for a in n.attribute),
             [numpy_helper.to_array(inits[i], base) for i in n.input if i in inits])
            for n in model.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")]


@pytest.mark.parametrize("w", ["int8", "int4"])
def test_streamed_blocks_are_ort_quantizers_own_bit_for_bit(lowered, tmp_path, w, monkeypatch):
    """Chunks of 21 columns (and 20 table rows) on the tiny llama's 192-wide weights: every chunk boundary, a short
    last chunk; the blocks laid end to end must be what ORT writes for each whole matrix."""
    import onnx

    from edgekv.export import onnx_quant, onnx_stream
    root, entry = lowered
    monkeypatch.setattr(onnx_stream, "CHUNK_ELEMS", 4096)
    out = tmp_path / "model.onnx"
    rec = onnx_quant.quantize_onnx(root / "False" / "model.onnx", out, w, entry)
    got = _blocks(onnx.load(str(out), load_external_data=False), str(tmp_path))
    want = _blocks(_ort_whole(root / "True" / "model.onnx", w))
    assert [g[:2] for g in got] == [x[:2] for x in want] and len(got) == 21 + (w == "int4")
    for (op, _, a), (_, _, b) in zip(got, want):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)), op
    assert rec["matmuls_left_float"] == 0 and rec["output_layer"] == "untied copy, quantized"
    # nothing of the fp32 weights is left in the file: the quantized bytes only (int4: 1/8, int8: 1/4, + scales)
    fp32 = (root / "False" / "model.onnx.data").stat().st_size
    assert (tmp_path / "model.onnx.data").stat().st_size < fp32 * (0.23 if w == "int4" else 0.33)


CHILD = """
import json, re, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from edgekv.export import onnx_quant, onnx_stream
import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401 (imported before the baseline)
onnx_stream.CHUNK_ELEMS = 1 << 20  # 4 MB of fp32 per chunk: the test's weights are 32 MB each
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak resident size (VmHWM) starts again from now
base = status("VmRSS")
d = Path(sys.argv[2])
onnx_quant.quantize_onnx(d / "model.onnx", d / "q" / "model.onnx", "int4", json.loads(sys.argv[3]))
print(json.dumps({"base_kb": base, "peak_kb": status("VmHWM")}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's VmHWM (/proc/self/status)")
def test_streamed_quantization_never_holds_the_fp32_weights(tmp_path):
    """Eight 2048 x 4096 fp32 weights (256 MiB) behind Transpose, as the streamed lowering leaves them: quantizing
    them to int4 in chunks of 4 MB raises the process's peak resident size by less than a quarter of their bytes
    (a chunk and its transpose at a time, and the int4 blocks), where loading the model whole holds all of them."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    n, k, cols = 8, 2048, 4096
    inits, nodes, x = [], [], "x"
    for i in range(n):
        a, b = (k, cols) if i % 2 == 0 else (cols, k)
        w = (rng.standard_normal((b, a), dtype=np.float32) * 0.02)
        inits.append(onnx.numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Transpose", [f"w{i}"], [f"wt{i}"], perm=[1, 0], name=f"t{i}"),
                  helper.make_node("MatMul", [x, f"wt{i}"], [f"y{i}"], name=f"m{i}")]
        x = f"y{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", k])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", k])], inits)
    graph.node[-1].output[0] = "logits"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save_model(model, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
                    size_threshold=1024)
    del model, graph, inits, w
    (tmp_path / "q").mkdir()
    entry = {"inputs": [{"name": "x", "dtype": "float32", "shape": [1, "seq", k]}],
             "outputs": [{"name": "logits", "dtype": "float32", "shape": [1, "seq", k]}]}
    p = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(tmp_path), json.dumps(entry)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    weights = n * k * cols * 4
    rise = (r["peak_kb"] - r["base_kb"]) * 1024
    assert rise < weights / 4, (rise, weights)
    q = onnx.load(str(tmp_path / "q" / "model.onnx"), load_external_data=False)
    assert [nd.op_type for nd in q.graph.node] == ["MatMulNBits"] * n


LOAD_CHILD = """
import json, re, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from edgekv.models import load_any
from edgekv.strategies import parse_strategy
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak resident size (VmHWM) starts again from now
base = status("VmRSS")
m = load_any(sys.argv[2], parse_strategy("kv:dtype=fp32"), 64).module
print(json.dumps({"base_kb": base, "peak_kb": status("VmHWM"),
                  "fp32_bytes": sum(p.numel() * p.element_size() for p in m.parameters())}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's VmHWM (/proc/self/status)")
def test_loading_holds_the_fp32_weights_once(tmp_path):
    """A bf16 HF folder of ~44M parameters (scripts/make_random_model.py, 8 layers of 512): building the module and
    loading its weights raises the peak resident size by less than 1.5x the module's fp32 weights (the weights once,
    and a tensor being converted), where a randomly initialised module beside a loaded fp32 state dict is 2x."""
    # ~44M parameters: 8 layers of 512, MLP 1536, 8 KV heads, a 32000-row table
    random_llama(tmp_path, num_hidden_layers=8, intermediate_size=1536, num_key_value_heads=8, vocab_size=32000)
    r = child_json(LOAD_CHILD, ROOT, tmp_path / "m")
    rise = (r["peak_kb"] - r["base_kb"]) * 1024
    assert r["fp32_bytes"] > 150e6 and rise < 1.5 * r["fp32_bytes"], (rise, r["fp32_bytes"])
