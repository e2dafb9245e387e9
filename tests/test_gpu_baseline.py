"""benchmarks/gpu_baseline.py on the CPU: the modules' parameters and state tensors hold exactly the bytes the planner
counts for the same config and layout (on a GPU the same script compares torch.cuda.max_memory_allocated)."""

import pytest
import torch

from conftest import load_benchmark

gpu_baseline = load_benchmark("gpu_baseline")


def test_planner_bytes_equal_the_tensors_the_modules_allocate(tmp_path):
    out = gpu_baseline.main(["--device", "cpu", "--models", "smollm2-135m,mamba-130m", "--ctx", "64,300",
                             "--steps", "2", "--out", str(tmp_path / "b.json")])
    assert len(out["runs"]) == 4
    for r in out["runs"]:
        assert r["measured_bytes"] == r["predicted"]["compared"], r
    # and both equal what the models publish, by hand: SmolLM2-135M's 134,515,008 parameters (HF safetensors count)
    # and its fp16 cache of 30 layers x (K, V) x 3 KV heads x ctx x head_dim 64; mamba-130m's fp32 safetensors
    # (516,541,440 B) and its fp32 state of 24 layers x d_inner 1536 x (conv kernel 4 - 1 + d_state 16)
    kv = [r for r in out["runs"] if r["model"] == "smollm2-135m"]
    assert [r["param_bytes"] for r in kv] == [4 * 134_515_008] * 2
    assert [r["state_bytes"] for r in kv] == [30 * 2 * 3 * c * 64 * 2 for c in (64, 300)]
    ssm = [r for r in out["runs"] if r["model"] == "mamba-130m"]
    assert [r["param_bytes"] for r in ssm] == [516_541_440] * 2
    assert [r["state_bytes"] for r in ssm] == [24 * 1536 * (3 + 16) * 4] * 2  # flat in ctx


def test_at_half_precision_the_matrices_are_fp16_and_the_planner_still_counts_every_byte(tmp_path):
    """--dtype fp16, the CUDA default: linear and embedding weights at fp16, norms / conv / A / D / biases at fp32
    (the planner's rule), the linears run under autocast; the bytes still equal the planner's exactly."""
    out = gpu_baseline.main(["--device", "cpu", "--dtype", "fp16", "--models", "smollm2-135m,mamba-130m",
                             "--ctx", "64", "--steps", "2"])
    for r in out["runs"]:
        assert r["dtype"] == "float16"
        assert r["measured_bytes"] == r["predicted"]["compared"], r
    fp32 = gpu_baseline.main(["--device", "cpu", "--models", "smollm2-135m", "--ctx", "64", "--steps", "1"])["runs"][0]
    assert out["runs"][0]["param_bytes"] < 0.51 * fp32["param_bytes"]  # the matrices are the bulk, now halved


@pytest.mark.parametrize("model,strategy", [("smollm2-135m", None), ("smollm2-135m", "window:w=32,sinks=4"),
                                            ("smollm2-135m", "kv-int4"), ("mamba-130m", None),
                                            ("mamba2-1.3b", None)])
def test_the_modules_keep_every_tensor_on_the_device_of_their_inputs(model, strategy):
    """On a GPU every tensor a call makes must be on the GPU (a CPU arange added to a CUDA position fails). The meta
    device stands in for it here: a module and its state on `meta`, one decode call and one 8-token call."""
    from edgekv.arch import catalog_arch
    from edgekv.strategies import native_strategy, parse_strategy

    st = parse_strategy(strategy or native_strategy(catalog_arch(model)))
    with torch.device("meta"):
        module, _, _ = gpu_baseline.build_module(model, st, 128)
    state = [s.to("meta") for s in module.empty_state()]
    with torch.no_grad():
        for c in (1, 8):
            logits, *new = module(torch.ones((1, c), dtype=torch.int64, device="meta"),
                                  torch.tensor([5], device="meta"), *state)
            assert logits.device.type == "meta" and all(s.device.type == "meta" for s in new)
        if getattr(module, "fusable", lambda: False)():  # a GPU run steps a plain cache through serving_step
            assert gpu_baseline.serving_step(module, 1, 5, state).device.type == "meta"


def test_the_serving_step_writes_the_cache_in_place_and_computes_what_the_module_computes():
    """serving_step (what a GPU run uses for a plain cache) against the module's own forward (checked against
    transformers in tests/test_models_llama.py): same logits over 6 steps, the same cache, and the cache tensors
    are the ones the caller holds (written in place, no new state)."""
    from edgekv.strategies import parse_strategy

    torch.manual_seed(0)
    module, _, _ = gpu_baseline.build_module("smollm2-135m", parse_strategy("kv:dtype=fp32"), 64)
    assert module.fusable()  # the layouts run_one steps through serving_step
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.05)
        ref, mine = module.empty_state(), module.empty_state()
        ids = id(mine[0]), id(mine[-1])
        for pos, tok in enumerate([5, 17, 3, 99, 42, 7]):
            logits, *ref = module(torch.tensor([[tok]]), torch.tensor([pos]), *ref)
            got = gpu_baseline.serving_step(module, tok, pos, mine)
            torch.testing.assert_close(got, logits[0, -1], rtol=1e-4, atol=1e-4)
        assert (id(mine[0]), id(mine[-1])) == ids
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
