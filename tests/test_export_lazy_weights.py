"""The streamed ONNX export lowers its graph over placeholders of the weights (edgekv.export.lazy_weights): what it
holds while lowering is the weights' exact bf16 copies, not the fp32 module, and what it writes is the checkpoint's own
values.

References: the safetensors file itself (its bf16 tensors widened to fp32, q/k/v stacked in the order the swapped
attention stacks them) for every weight written; the kernel's resident size of a child process (VmRSS, /proc) for the
memory.
"""
import sys

import numpy as np
import pytest

from conftest import ROOT, child_json, random_llama

CHILD = """
import gc, json, re, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from edgekv.export import manifest as mf
from edgekv.export.targets import OnnxTarget
from edgekv.export.to_onnx import lower_onnx, save_onnx
from edgekv.export.trace import trace
from edgekv.strategies import parse_strategy
from edgekv.export.wquant import trim
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
class X:  # the export in progress, as far as OnnxTarget.trace reads it
    class opts:
        weights, formats, runners, max_ctx = "int4", ["onnx"], [], 64
    stash, eps = None, {}
import edgekv.export.narrow_route as narrow_route
narrow_route.fp32_reference = lambda x, release=True: None  # verify-quant's fp32 side: not this test's
# the exporter's imports before the baseline: a two-layer model traced and lowered once
warm = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
lower_onnx(torch.export.export(warm, (torch.zeros(1, 8),)), {"inputs": [], "outputs": []}, fold_weights=False)
gc.collect(); trim()
base = status("VmRSS")
x = X()
x.loaded, x.stash = narrow_route.narrow_load(sys.argv[2], parse_strategy("kv"), 64)  # as the export loads it
x.module = x.loaded.module
fp32 = sum(p.numel() * 4 for p in x.module.parameters())
OnnxTarget.trace(x, trace)
entry = mf.entry_point("forward", "seq", x.loaded.layout, x.loaded.args.vocab)
model = lower_onnx(x.eps.pop("onnx:forward"), entry, fold_weights=False, stash=x.stash)
gc.collect(); trim()
held = status("VmRSS") - base
save_onnx(model, Path(sys.argv[3]) / "model.onnx")
print(json.dumps({"held": held, "fp32": fp32}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's VmRSS (/proc/self/status)")
def test_lowering_holds_the_narrow_weights_and_writes_the_checkpoints(tmp_path):
    """A bf16 HF folder of ~44M parameters (scripts/make_random_model.py, 4 layers of 512), loaded as the export
    loads it (narrow_route.narrow_load: the large weights kept bf16 from the start; k/v too small, stacked with q): after
    the ONNX target's trace and lower-onnx, the process holds less than 0.75x the module's fp32 weights above its baseline (their bf16
    copies, half, and the graph), where a lowering over the fp32 module holds all of them and more; and every weight
    in model.onnx.data is the checkpoint's bf16 value, bit for bit."""

    import onnx
    from onnx import numpy_helper
    from safetensors.torch import load_file as load_torch

    cfg = {"num_hidden_layers": 4, "vocab_size": 64000}
    random_llama(tmp_path, **cfg)
    (tmp_path / "out").mkdir()
    r = child_json(CHILD, ROOT, tmp_path / "m", tmp_path / "out")
    assert r["fp32"] > 150e6 and r["held"] < 0.75 * r["fp32"], r

    import torch
    ref = {k: v.to(torch.float32).numpy() for k, v in load_torch(str(tmp_path / "m" / "model.safetensors")).items()}
    for i in range(cfg["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn."
        ref[a + "qkv_proj.weight"] = np.concatenate([ref[a + f"{n}_proj.weight"] for n in "qkv"])
    m = onnx.load(str(tmp_path / "out" / "model.onnx"))
    big = [t for t in m.graph.initializer if np.prod(t.dims) >= 1 << 18]
    assert len(big) == 1 + 5 * cfg["num_hidden_layers"]  # the table, and each layer's qkv, o, gate, up and down
    for t in big:
        np.testing.assert_array_equal(numpy_helper.to_array(t), ref[t.name], err_msg=t.name)
