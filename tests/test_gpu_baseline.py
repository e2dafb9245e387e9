"""benchmarks/gpu_baseline.py on the CPU: the modules' parameters and state tensors hold exactly the bytes the planner
counts for the same config and layout (on a GPU the same script compares torch.cuda.max_memory_allocated)."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("gpu_baseline", Path(__file__).parent.parent / "benchmarks" / "gpu_baseline.py")
gpu_baseline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_baseline)


def test_planner_bytes_equal_the_tensors_the_modules_allocate(tmp_path):
    out = gpu_baseline.main(["--device", "cpu", "--models", "smollm2-135m,mamba-130m", "--ctx", "64,300",
                             "--steps", "2", "--out", str(tmp_path / "b.json")])
    assert len(out["runs"]) == 4
    for r in out["runs"]:
        assert r["measured_bytes"] == r["predicted"]["compared"], r
    kv = [r for r in out["runs"] if r["model"] == "smollm2-135m"]
    assert kv[1]["state_bytes"] > kv[0]["state_bytes"]  # the cache grows with ctx
    ssm = [r for r in out["runs"] if r["model"] == "mamba-130m"]
    assert ssm[0]["state_bytes"] == ssm[1]["state_bytes"]  # the SSM state does not
