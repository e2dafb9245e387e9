"""edgekv.export.pte_stepper.paging_out against the kernel's own accounting (VmHWM): ONNX Runtime maps a model's
external data and packs every MatMulNBits weight from the mapped pages while it loads; with paging_out around the load,
the peak is the packed weights, not the packed weights and the file's pages together, and the session computes the
same outputs."""
import sys

import pytest
from conftest import child_json

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT and /proc are Linux's")

# Gemma's tied head in small: a table of 8-bit codes (block 32) read by a GatherBlockQuantized (the embedding) and by
# a MatMulNBits (the output head, packed at load) from model.onnx.data. The gather keeps the table's mapping, so without
# paging_out the pages the packing read stay resident beside the packed copy. One process loads it with or without
# paging_out and prints its peak above the baseline, the data file's size and the logits of one token.
CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
folder, paged = Path(sys.argv[2]), sys.argv[3] == "1"
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import onnxruntime as ort
from contextlib import nullcontext
from edgekv.export.pte_stepper import paging_out
base = status("VmRSS")
o = ort.SessionOptions(); o.enable_cpu_mem_arena = False; o.intra_op_num_threads = 1
with paging_out(folder / "model.onnx.data") if paged else nullcontext():
    s = ort.InferenceSession(str(folder / "model.onnx"), o, providers=["CPUExecutionProvider"])
peak = status("VmHWM") - base
y = s.run(None, {"ids": np.array([[7]], np.int64)})[0]
print(json.dumps({"peak": peak, "data": (folder / "model.onnx.data").stat().st_size, "y": y.ravel().tolist()}))
"""

N, K = 65536, 1024  # 64 MiB of codes


def _model(folder):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nb = K // 32
    inits = [numpy_helper.from_array(rng.integers(0, 256, (N, nb, 32), dtype=np.uint8), "codes"),
             numpy_helper.from_array(rng.random((N, nb, 1), dtype=np.float32) * 1e-2, "scales3"),
             numpy_helper.from_array(rng.random(N * nb, dtype=np.float32) * 1e-2, "scales"),
             numpy_helper.from_array(np.array([1, K], np.int64), "row")]
    nodes = [helper.make_node("GatherBlockQuantized", ["codes", "ids", "scales3"], ["blocks"], domain="com.microsoft",
                              gather_axis=0, quantize_axis=2, block_size=32, bits=8),
             helper.make_node("Reshape", ["blocks", "row"], ["x"]),
             helper.make_node("MatMulNBits", ["x", "codes", "scales"], ["y"], domain="com.microsoft", K=K, N=N, bits=8,
                              block_size=32, accuracy_level=4)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    # each large tensor at a 4 KiB offset, as edgekv's exports write them: ONNX Runtime maps only aligned data (an
    # unaligned tensor is read into its own buffer)
    with open(folder / "model.onnx.data", "wb") as f:
        for t in m.graph.initializer:
            if len(t.raw_data) < 1 << 20:
                continue
            f.write(bytes(-f.tell() % 4096))
            at, raw = f.tell(), t.raw_data
            f.write(raw)
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", "model.onnx.data"), ("offset", str(at)), ("length", str(len(raw)))):
                t.external_data.add(key=k, value=v)
    onnx.save(m, str(folder / "model.onnx"))


def test_the_load_peak_is_the_packed_weights_not_the_file_beside_them(tmp_path):
    from conftest import ROOT

    _model(tmp_path)
    plain = child_json(CHILD, ROOT, tmp_path, 0)
    paged = child_json(CHILD, ROOT, tmp_path, 1)
    assert paged["y"] == plain["y"]  # the same weights: pages read again come back from the file
    data = plain["data"]
    assert data > N * K  # the codes are in the data file
    # without: the packed copy (the codes, scales and block sums: about the file) and every page of the file at once
    assert plain["peak"] > 1.9 * data
    # with: the packed copy, and what the packing read in the pager's last interval
    assert paged["peak"] < 1.5 * data
