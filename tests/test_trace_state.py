"""The ONNX graph is traced with an uninitialised example state (edgekv.export.trace, lazy_state): an ExportedProgram
keeps its example inputs for as long as it lives (through lowering), and a zeroed state would be resident all that
time for no reader. Reference: the state's size by hand from the fixture's config, the kernel's resident size."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytest.importorskip("torch")

CHILD = """
import gc, json, re, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from edgekv.export.trace import trace
from edgekv.models import load_model
from edgekv.strategies import parse_strategy
torch.set_num_threads(1)
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
m = load_model(sys.argv[2], parse_strategy("kv:dtype=fp32"), 8192).module
trace(m, {"f": None}, lazy_state=True)  # the exporter's one-time costs (imports, caches) paid here
gc.collect()
out, keep = {}, []
for lazy in (True, False):
    before = rss()
    keep.append(trace(m, {"f": None}, lazy_state=lazy)["f"])
    gc.collect()
    out[str(lazy)] = rss() - before
shapes = [list(t.shape) for t in keep[0].example_inputs[0][2:]]
print(json.dumps({"rise": out, "shapes": shapes}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's VmRSS (/proc/self/status)")
def test_the_traced_graphs_example_state_is_not_resident():
    cfg = json.loads((ROOT / "fixtures" / "tiny" / "llama" / "config.json").read_text())
    hkv, d, layers = cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]
    state = layers * 2 * hkv * 8192 * d * 4  # K and V, fp32, 8192 slots: 50.3 MB
    p = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(ROOT / "fixtures" / "tiny" / "llama")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["shapes"] == [[1, hkv, 8192, d]] * (2 * layers)
    assert r["rise"]["False"] > 0.9 * state, r  # a zeroed example state is resident while the program lives
    assert r["rise"]["True"] < 0.25 * state, r
