"""benchmarks/profile_ort.py: an ONNX decode step taken apart by ONNX Runtime's own profiler, on a real export."""
import json
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from conftest import load_benchmark, run_cli

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "fixtures" / "tiny" / "llama"
po = load_benchmark("profile_ort")


def test_kernel_time_is_summed_per_op_type_over_the_last_runs_by_hand():
    ev = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 900},  # warm-up, left out
          {"cat": "Node", "name": "a_kernel_time", "ts": 10, "dur": 800, "args": {"op_name": "MatMul"}},
          {"cat": "Session", "name": "model_run", "ts": 1000, "dur": 1000},
          {"cat": "Node", "name": "q_kernel_time", "ts": 1010, "dur": 600, "args": {"op_name": "MatMul"}},
          {"cat": "Node", "name": "q_fence_before", "ts": 1011, "dur": 50, "args": {"op_name": "MatMul"}},
          {"cat": "Node", "name": "g_kernel_time", "ts": 1700, "dur": 200, "args": {"op_name": "GroupQueryAttention"}},
          {"cat": "Session", "name": "model_run", "ts": 2000, "dur": 2000},
          {"cat": "Node", "name": "q_kernel_time", "ts": 2010, "dur": 1000, "args": {"op_name": "MatMul"}}]
    r = po.kernel_ms_by_op(ev, steps=2)
    assert r["model_run"] == pytest.approx(1.5)  # (1000 + 2000) us / 2
    assert r["ops"] == {"MatMul": pytest.approx(0.8), "GroupQueryAttention": pytest.approx(0.1)}
    assert list(r["ops"]) == ["MatMul", "GroupQueryAttention"] and r["kernels"] == pytest.approx(0.9)
    # node by node: q ran in both counted runs ((600 + 1000) us / 2), g in one (200 us / 2)
    assert [(n["node"], n["op"]) for n in r["nodes"]] == [("q", "MatMul"), ("g", "GroupQueryAttention")]
    assert [n["ms"] for n in r["nodes"]] == [pytest.approx(0.8), pytest.approx(0.1)]
    assert r["node_counts"] == {"GroupQueryAttention": 1, "MatMul": 1}
    assert po.attention_slope([(0, 1.0), (100, 3.0), (200, 5.0)]) == pytest.approx(0.02)


def test_a_tiny_export_is_profiled_op_by_op_and_its_cache_cost_per_token_is_the_configs(tmp_path):
    out = tmp_path / "tiny"
    run_cli("export", "--model", TINY, "--strategy", "kv:dtype=fp32", "--format", "onnx", "--max-ctx", "256",
            "--verify-steps", "0", "--out", out, check=True)
    r = po.main([str(out), "--threads", "1", "--repeats", "2", "--steps", "12", "--position", "30",
                 "--positions", "8,120,230", "--out", str(tmp_path / "p.json")])
    assert json.loads((tmp_path / "p.json").read_text())["rows"] == r["rows"]
    (row,) = r["rows"]
    assert row["name"] == "edgekv graph" and len(row["runs_ms"]) == 2 and row["ms_per_step"] > 0
    (prof,) = r["profiles"]
    # the profiled op types are the nodes of the graph ONNX Runtime optimised (read back from its own file)
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(out / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    graph_ops = {n.op_type for n in onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False).graph.node}
    assert "GroupQueryAttention" in prof["ops_ms"] and set(prof["ops_ms"]) <= graph_ops
    assert 0 < prof["kernels_ms"] <= prof["model_run_ms"]
    assert sum(prof["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    cfg = json.loads((TINY / "config.json").read_text())  # fp32 key + value per layer, kv head, head_dim
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    (pos,) = r["positions"]
    assert pos["state_bytes_per_token"] == per_token and [p for p, _ in pos["points"]] == [8, 120, 230]
    # --compare: a second export in the same rounds, its own row and profile; each step's CPU ms beside its wall ms
    r2 = po.main([str(out), "--compare", str(out), "--threads", "1", "--repeats", "1", "--steps", "6", "--position",
                  "30", "--positions", ""])
    assert [x["name"] for x in r2["rows"]] == ["edgekv graph", "edgekv graph 2"]
    assert all(x["export"] == str(out.resolve()) and len(x["runs_cpu_ms"]) == 1 and x["cpu_ms_per_step"] > 0
               for x in r2["rows"])
    assert [p["name"] for p in r2["profiles"]] == ["edgekv graph", "edgekv graph 2"]
