"""Ring attention: exact against plain attention written here, the cost model against hand arithmetic, and every
failure one clear EdgekvError, quickly, with no process left behind.

The multi-process runs are the slow part (each start spawns ranks that import torch); each config runs once and is
shared by the tests that read it.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from edgekv.errors import EdgekvError
from edgekv.ring import model
from edgekv.ring.attention import attend_block, merge
from edgekv.ring.config import RingConfig
from edgekv.ring.launch import make_rows, run_ring

REPO = Path(__file__).resolve().parent.parent


def plain_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Textbook softmax(q k^T / sqrt(d) + causal mask) v in float64: q [l, h, d], k, v [l, g, d] -> [l, h, d].
    GQA: query head i reads KV head i // (h // g)."""
    q, k, v = q.double(), k.double(), v.double()
    l, h, d = q.shape
    r = h // k.shape[1]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    future = torch.ones(l, l, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def reference_for(cfg: RingConfig) -> torch.Tensor:
    """Plain attention over prompt + decoded tokens: rows < ctx are the prefill, the rest the decode steps."""
    q, kv = make_rows(cfg.seed, 0, 0, cfg.ctx + cfg.decode_steps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    return plain_causal_attention(q, kv[0], kv[1])


def children_of_this_process() -> list[int]:
    """Live child processes, except multiprocessing's resource tracker (one per parent, it exits with us)."""
    me, out = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            out.append(int(stat.parent.name))
    return out


# ------------------------------------------------------------------------------------ exactness over real ranks

RUNS = {
    # odd context over 4 ranks (shards 251, 250, 250, 250), GQA 4:1, decode leaders rotate over every rank
    "world4-ctx1001-gqa": RingConfig(world=4, ctx=1001, n_heads=8, n_kv_heads=2, head_dim=32, decode_steps=6,
                                     keep_outputs=True, timeout_s=30),
    # odd context over 2 ranks (19, 18), GQA 2:1, two layers
    "world2-ctx37-gqa": RingConfig(world=2, ctx=37, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2,
                                   decode_steps=5, keep_outputs=True, timeout_s=30),
}
_results: dict = {}


def ran(name: str):
    if name not in _results:
        _results[name] = run_ring(RUNS[name], run_timeout_s=120)
    return _results[name]


@pytest.mark.parametrize("name", list(RUNS))
def test_ring_prefill_matches_plain_causal_attention(name):
    cfg, res = RUNS[name], ran(name)
    ref = reference_for(cfg)
    assert res.prefill_out[0].shape == (cfg.ctx, cfg.n_heads, cfg.head_dim)
    assert (res.prefill_out[0].double() - ref[:cfg.ctx]).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", list(RUNS))
def test_ring_decode_steps_after_prefill_match_plain_attention(name):
    cfg, res = RUNS[name], ran(name)
    ref = reference_for(cfg)
    assert res.decode_out[0].shape == (cfg.decode_steps, cfg.n_heads, cfg.head_dim)
    assert (res.decode_out[0].double() - ref[cfg.ctx:]).abs().max().item() < 1e-5


def test_every_layer_is_exact_not_only_the_first():
    cfg, res = RUNS["world2-ctx37-gqa"], ran("world2-ctx37-gqa")
    q, kv = make_rows(cfg.seed, 1, 0, cfg.ctx + cfg.decode_steps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    ref = plain_causal_attention(q, kv[0], kv[1])
    assert (res.prefill_out[1].double() - ref[:cfg.ctx]).abs().max().item() < 1e-5
    assert (res.decode_out[1].double() - ref[cfg.ctx:]).abs().max().item() < 1e-5


def test_measured_bytes_per_rank_are_what_the_model_predicts_by_hand():
    # world 2, ctx 37 -> shards 19 and 18; fp32; h=4, g=2, d=16; 2 layers
    res = ran("world2-ctx37-gqa")
    m = res.measured()
    kv_token = 2 * 2 * 16 * 4                                   # K and V, 2 heads x 16 dims, 4 bytes: 256 B
    assert m["prefill"]["bytes_per_rank"] == 2 * (19 + 18) * kv_token          # rank 0 sends 19, receives 18
    assert m["decode"]["bytes_per_rank"] == 2 * (4 * 16 * 4 + 4 * 17 * 4)      # q out, out + lse back
    for phase, ctx in (("prefill", 37), ("decode", 37)):
        p = model.predict(phase, 2, ctx, 4, 2, 16, 2, 4, link_bytes_per_s=1e9, link_latency_s=1e-5, flops=1e9,
                          mem_bandwidth=1e9)
        assert p.bytes_per_rank == m[phase]["bytes_per_rank"]


def test_measured_times_are_positive_and_comm_is_counted():
    m = ran("world4-ctx1001-gqa").measured()
    for phase in ("prefill", "decode"):
        assert m[phase]["compute_s"] > 0 and m[phase]["comm_s"] > 0 and m[phase]["wall_s"] > 0
    # shards [251, 250, 250, 250], 512 B of K/V per token (g=2, d=32, fp32). Rank 1 sends blocks 1, 0, 3 and
    # receives 0, 3, 2: 751 + 751 tokens, the most of any rank
    assert m["prefill"]["bytes_per_rank"] == (751 + 751) * 2 * 2 * 32 * 4
    # decode: the leader sends q (8 x 32 x 4 B) to 3 ranks and receives 3 partials (8 x 33 x 4 B)
    assert m["decode"]["bytes_per_rank"] == 3 * (8 * 32 * 4 + 8 * 33 * 4)


# ------------------------------------------------------------------------------------ blocks and merges in-process

@settings(max_examples=40, deadline=None)
@given(l=st.integers(1, 40), cuts=st.lists(st.integers(1, 39), max_size=5), q_cut=st.integers(0, 40),
       g=st.sampled_from([1, 2]), r=st.sampled_from([1, 3]))
def test_causal_blocks_merged_in_any_order_equal_full_attention(l, cuts, q_cut, g, r):
    """Keys split at arbitrary points, queries a suffix starting anywhere: some blocks lie wholly in some rows'
    future (lse = -inf for those rows); merging the blocks, last first, still gives plain causal attention."""
    torch.manual_seed(l)
    h, d = g * r, 8
    q, k, v = torch.randn(l, h, d), torch.randn(l, g, d), torch.randn(l, g, d)
    q0 = min(q_cut, l - 1)
    edges = sorted({0, l, *[c for c in cuts if c < l]})
    out = torch.zeros(l - q0, h, d)
    lse = torch.full((l - q0, h), float("-inf"))
    for a, b in reversed(list(zip(edges, edges[1:]))):
        o_b, lse_b = attend_block(q[q0:], torch.stack([k[a:b], v[a:b]]), q0, a, causal=True)
        out, lse = merge(out, lse, o_b, lse_b)
    ref = plain_causal_attention(q, k, v)[q0:]
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_a_block_wholly_in_the_future_contributes_nothing():
    q, kv = torch.randn(3, 2, 4), torch.randn(2, 5, 2, 4)
    out, lse = attend_block(q, kv, q_start=0, k_start=10, causal=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()


# ------------------------------------------------------------------------------------ the cost model, by hand

def test_split_sizes_cover_the_sequence_and_differ_by_at_most_one():
    assert model.split_sizes(1001, 4) == [251, 250, 250, 250]
    assert model.split_sizes(37, 2) == [19, 18]
    assert model.split_sizes(8, 4) == [2, 2, 2, 2]


def test_decode_prediction_llama70b_shape_by_hand():
    # 8 ranks, 80 layers, 64 heads, 8 KV heads, d=128, bf16; link 100 GB/s and 5 us; 3e12 B/s, 1e15 FLOP/s
    ctx, B, a, bw, F = 131072, 100e9, 5e-6, 3e12, 1e15
    p = model.predict("decode", 8, ctx, 64, 8, 128, 80, 2, link_bytes_per_s=B, link_latency_s=a, flops=F,
                      mem_bandwidth=bw)
    q_bytes, partial_bytes = 64 * 128 * 2, 64 * 128 * 4 + 64 * 4          # 16,384 and 33,024 B
    assert p.comm_s == pytest.approx(80 * (2 * a + 7 * (q_bytes + partial_bytes) / B))
    assert p.bytes_per_rank == 80 * 7 * (q_bytes + partial_bytes)
    c = 16385                                                              # ceil(131073 / 8)
    kv_bytes = 2 * 8 * 128 * c * 2
    assert p.compute_s == pytest.approx(80 * max(4 * 64 * 128 * c / F, (kv_bytes + 2 * 64 * 128 * 2) / bw))
    assert p.naive_comm_s == pytest.approx(80 * 7 * (a + kv_bytes / B))
    assert p.wall_s == pytest.approx(p.compute_s + p.comm_s)


def test_prefill_prediction_two_ranks_by_hand():
    # ctx 4 over 2 ranks: shards [2, 2]; rank 1 attends to block 0 (past) and block 1 (diagonal, full + mask)
    h, g, d, b = 2, 1, 4, 4
    F, bw, B, a = 1e9, 1e12, 1e6, 1e-3
    p = model.predict("prefill", 2, 4, h, g, d, 1, b, link_bytes_per_s=B, link_latency_s=a, flops=F,
                      mem_bandwidth=bw)
    block_flops = 4 * h * d * 2 * 2
    assert p.compute_s == pytest.approx(2 * block_flops / F)               # compute-bound at these numbers
    kv_block = b * 2 * g * d * 2
    assert p.comm_s == pytest.approx(a + kv_block / B)
    assert p.bytes_per_rank == 2 * kv_block
    # lockstep: step 0 both ranks do their diagonal while the block moves; step 1 rank 1 does the past block
    assert p.wall_s == pytest.approx(max(block_flops / F, a + kv_block / B) + block_flops / F)


def test_one_rank_moves_nothing():
    for phase in ("prefill", "decode"):
        p = model.predict(phase, 1, 100, 4, 2, 8, 1, 2, link_bytes_per_s=1e9, link_latency_s=1e-6, flops=1e12,
                          mem_bandwidth=1e11)
        assert p.comm_s == 0 and p.bytes_per_rank == 0


def test_model_rejects_impossible_shapes():
    kw = dict(link_bytes_per_s=1e9, link_latency_s=1e-6, flops=1e12, mem_bandwidth=1e11)
    with pytest.raises(ValueError):
        model.predict("decode", 4, 3, 4, 2, 8, **kw)            # fewer tokens than ranks
    with pytest.raises(ValueError):
        model.predict("decode", 2, 10, 6, 4, 8, **kw)           # 6 heads over 4 KV heads
    with pytest.raises(ValueError):
        model.predict("train", 2, 10, 4, 2, 8, **kw)


def _fake_gpu(bytes_per_s=400e9, latency_s=4e-6):
    fact = lambda v: SimpleNamespace(value=v, source="test", estimate=None)  # noqa: E731
    link = SimpleNamespace(bytes_per_s=fact(bytes_per_s), latency_s=fact(latency_s))
    return SimpleNamespace(id="gpu", device_class="datacenter", flops=1e15, bandwidth=3e12, decode_efficiency=0.5,
                           prefill_efficiency=0.5, interconnect={"fast": link})


def test_datacenter_decode_ratio_is_comm_over_compute_with_assumptions():
    r = model.datacenter_decode_ratio(_fake_gpu(), "fast", world=8, ctx=131072)
    c = 16385
    compute = 80 * (2 * 8 * 128 * c * 2 + 2 * 64 * 128 * 2) / (3e12 * 0.5)
    comm = 80 * (2 * 4e-6 + 7 * (64 * 128 * 2 + 64 * 129 * 4) / 400e9)
    assert r.ratio == pytest.approx(comm / compute)
    assert r.naive_ratio == pytest.approx(80 * 7 * (4e-6 + 2 * 8 * 128 * c * 2 / 400e9) / compute)
    assert r.naive_ratio > 10 * r.ratio                     # moving KV is the network bottleneck; q + partials is not
    text = " ".join(r.assumptions)
    assert "Llama-3-70B" in text and "80 layers" in text and "batch 1" in text


def test_datacenter_ratio_from_the_shipped_h100_profile():
    from edgekv.devices import load_device
    try:
        h100 = load_device("h100")
    except EdgekvError:
        pytest.skip("h100 profile not present")
    for link in ("nvlink", "infiniband"):
        if link in h100.interconnect:
            r = model.datacenter_decode_ratio(h100, link)
            assert 0 < r.ratio < r.naive_ratio


def _fake_host(bytes_per_s=2e9, latency_s=4e-5):
    fact = lambda v: SimpleNamespace(value=v, source=None, estimate="test")  # noqa: E731
    link = SimpleNamespace(bytes_per_s=fact(bytes_per_s), latency_s=fact(latency_s))
    return SimpleNamespace(id="cpu", device_class="host", flops=2e11, bandwidth=4e10, decode_efficiency=0.5,
                           prefill_efficiency=0.5, interconnect={"loopback": link})


def test_prediction_from_a_measured_link_by_hand():
    """The link a run measured (2 ms per message, 0.5 GB/s per rank while all ranks send) replaces the profile's
    latency and bandwidth as it is (the machine's sharing is already in it); compute is still shared 4 ways."""
    link = {"latency_s": 2e-3, "bytes_per_s": 5e8}
    h, g, d, b, w = 32, 8, 128, 4, 4
    dec = model.predict_for_device("decode", _fake_host(), "loopback", w, 2052, h, g, d, 2, b, measured_link=link)
    q_msg, partial = h * d * b, h * (d + 1) * 4                           # 16,384 B out, 16,512 B back
    assert dec.comm_s == pytest.approx(2 * (2 * 2e-3 + 3 * (q_msg + partial) / 5e8))   # 2 layers: 8.39 ms
    c = 514                                                               # ceil(2053 / 4)
    assert dec.compute_s == pytest.approx(2 * (2 * g * d * c * b + 2 * h * d * b) / (4e10 * 0.5 / 4))
    pre = model.predict_for_device("prefill", _fake_host(), "loopback", w, 2048, h, g, d, 1, b, measured_link=link)
    block = 2 * 512 * g * d * b                                           # 4 MiB of K/V per ring step
    assert pre.comm_s == pytest.approx(3 * (2e-3 + block / 5e8))          # 31.2 ms
    # without a measured link: the profile's 40 us and 2 GB/s shared by the 4 ranks
    prof = model.predict_for_device("prefill", _fake_host(), "loopback", w, 2048, h, g, d, 1, b)
    assert prof.comm_s == pytest.approx(3 * (4e-5 + block / (2e9 / 4)))
    assert any("measured in this run" in a for a in pre.assumptions)


def test_link_measured_from_the_probe_timings_by_hand():
    """RingResult.link from made-up probe timings: the latency is the median of the fan-out pings beside the decode
    steps (each step's leader's; rank 0's after the prefill only when there is no decode), the bandwidth the large
    message over the ring step's time beyond that latency."""
    from edgekv.ring.launch import RingResult
    probes = [{"small_bytes": 16384, "large_bytes": 4 << 20, "fan_s": [1e-3, 2e-3], "pair_s": 1e-4,
               "large_s": 10e-3, "step_fan_s": [9e-3, 1e-3]},
              {"small_bytes": 16384, "large_bytes": 4 << 20, "fan_s": [], "large_s": 12e-3,
               "step_fan_s": [3e-3, 2e-3, 4e-3]},
              {"small_bytes": 16384, "large_bytes": 4 << 20, "fan_s": [], "large_s": 14e-3}]
    res = RingResult(config=RingConfig(world=3, ctx=30), backend="gloo", prefill=[], prefill_probe=[], decode=[],
                     decode_probe=[], prefill_out=None, decode_out=None, link_probe=probes)
    link = res.link()
    assert link["latency_s"] == pytest.approx(3e-3)                      # median of 1, 3, 2, 9, 4 ms
    assert link["pair_latency_s"] == pytest.approx(1e-4)
    assert link["bytes_per_s"] == pytest.approx((4 << 20) / (12e-3 - 3e-3))   # median ring step 12 ms
    assert link["pings"] == 5
    for p in probes:
        p.pop("step_fan_s", None)                                         # no decode: the pings after the prefill
    assert res.link()["latency_s"] == pytest.approx(1.5e-3)
    assert res.link()["bytes_per_s"] == pytest.approx((4 << 20) / (12e-3 - 1.5e-3))


def test_planner_modules_never_import_torch():
    code = ("import sys, edgekv.ring.model, edgekv.ring.cli, edgekv.ring.config; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# ------------------------------------------------------------------------------------ the command

def _invoke(args):
    from edgekv.ring.cli import ring
    return CliRunner().invoke(ring, args)


def test_cli_check_json_one_token_shards_multi_head():
    """Shards of 2, 1, 1, 1 tokens, so every causal boundary sits at a shard edge; plain multi-head attention;
    --check compares with torch's scaled_dot_product_attention(is_causal=True) in one process."""
    res = _invoke(["--world", "4", "--ctx", "5", "--heads", "3", "--kv-heads", "3", "--head-dim", "8",
                   "--decode-steps", "4", "--check", "--json", "--timeout", "30"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["world"] == 4 and out["ctx"] == 5
    assert out["prefill_max_abs_err"] < 1e-5 and out["decode_max_abs_err"] < 1e-5
    for side in ("measured", "predicted"):
        assert set(out[side]) >= {"compute_s", "comm_s", "bytes_per_rank"}
        assert out[side]["compute_s"] > 0 and out[side]["comm_s"] > 0
    assert out["measured"]["bytes_per_rank"] == out["predicted"]["bytes_per_rank"]
    assert out["measured"]["prefill"]["bytes_per_rank"] == out["predicted"]["prefill"]["bytes_per_rank"]


def test_cli_check_json_reports_the_measured_link_and_comm_predicted_from_it():
    """--check --json carries the link the run measured and, beside the profile's prediction and the measurement,
    the comm the model predicts from that link: recomputed here by hand from the reported latency and bandwidth."""
    res = _invoke(["--world", "2", "--ctx", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                   "--decode-steps", "2", "--check", "--json", "--timeout", "30"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    link = out["link_measured"]
    assert link["latency_s"] > 0 and link["bytes_per_s"] > 0 and link["messages"] >= 200
    assert link["usable_cores"] >= 1 and link["oversubscribed"] == (2 > link["usable_cores"])
    a, B = link["latency_s"], link["bytes_per_s"]
    pred = out["predicted_from_measured_link"]
    assert pred["decode"]["comm_s"] == pytest.approx(2 * a + (4 * 16 * 4 + 4 * 17 * 4) / B)
    assert pred["prefill"]["comm_s"] == pytest.approx(a + 2 * 32 * 2 * 16 * 4 / B)      # one step, 32-token block
    for phase in ("prefill", "decode"):
        assert out["comm_measured_over_predicted"][phase] == pytest.approx(
            out["measured"][phase]["comm_s"] / pred[phase]["comm_s"])
        assert out["predicted"][phase]["comm_s"] != pred[phase]["comm_s"]   # the profile's, kept beside it


def test_check_reports_the_error_of_a_ring_that_is_wrong(monkeypatch):
    """--check against a ring whose outputs are deliberately wrong by known amounts (0.25 in one prefill value of
    layer 1, 0.5 in one decode value of layer 0): the check reports those errors, so it compares the ring with an
    independent attention, not with itself; a right ring's reported error is its distance from the float64 textbook
    attention (plain_causal_attention) to within fp32 rounding."""
    import copy

    from edgekv.ring import launch

    cfg, res = RUNS["world2-ctx37-gqa"], ran("world2-ctx37-gqa")
    good = launch.check_errors(res)
    ref = reference_for(cfg)
    assert good["prefill_max_abs_err"] == pytest.approx(
        (res.prefill_out[0].double() - ref[:cfg.ctx]).abs().max().item(), abs=2e-6)
    assert good["prefill_max_abs_err"] < 1e-5 and good["decode_max_abs_err"] < 1e-5
    bad = copy.deepcopy(res)
    bad.prefill_out[1][7, 2, 3] += 0.25
    bad.decode_out[0][2, 1, 0] -= 0.5
    errs = launch.check_errors(bad)
    assert errs["prefill_max_abs_err"] == pytest.approx(0.25, abs=1e-4)
    assert errs["decode_max_abs_err"] == pytest.approx(0.5, abs=1e-4)
    # and the command prints what check_errors finds for the ring it ran
    real = launch.run_ring

    def wrong_ring(c, *a, **k):
        out = real(c, *a, **k)
        out.decode_out[0][0, 0, 0] += 0.5
        return out

    monkeypatch.setattr(launch, "run_ring", wrong_ring)
    r = _invoke(["--world", "2", "--ctx", "6", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                 "--decode-steps", "2", "--check", "--json", "--timeout", "30"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["prefill_max_abs_err"] < 1e-5 and out["decode_max_abs_err"] == pytest.approx(0.5, abs=1e-4)


def test_cli_predict_only_for_h100_starts_no_rank():
    from edgekv.devices import load_device
    try:
        load_device("h100").interconnect["nvlink"]
    except (EdgekvError, KeyError):
        pytest.skip("h100 profile with nvlink not present")
    res = _invoke(["--device", "h100", "--link", "nvlink", "--world", "8", "--ctx", "128k", "--heads", "64",
                   "--layers", "80", "--predict-only", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["measured"] is None and out["predicted"]["comm_s"] > 0


@pytest.mark.parametrize("args, says", [
    (["--world", "0"], "--world"),
    (["--world", "4", "--ctx", "3"], "at least --world"),
    (["--heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
    (["--ctx", "12kk"], "not a token count"),
    (["--link", "carrier-pigeon"], "no interconnect"),
])
def test_cli_bad_input_is_an_edgekv_error(args, says):
    res = _invoke(args + ["--predict-only"])
    assert isinstance(res.exception, EdgekvError), res.output
    assert says in str(res.exception)


def test_edgekv_ring_bad_input_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, "-m", "edgekv.cli", "ring", "--world", "0"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    if "No such command" in p.stderr:
        pytest.skip("the main CLI does not register `ring` yet")
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "--world" in p.stderr


# ------------------------------------------------------------------------------------ failures: clear, quick, clean

def _small(**kw):
    return RingConfig(world=2, ctx=40, n_heads=2, n_kv_heads=1, head_dim=8, decode_steps=2, **kw)


def test_a_taken_port_is_one_clear_error_before_any_rank_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(EdgekvError, match=f"port {port} is already in use"):
            run_ring(_small(port=port))
    assert time.monotonic() - t0 < 5
    assert children_of_this_process() == []


def test_a_rank_that_dies_is_one_clear_error_and_no_rank_is_left():
    t0 = time.monotonic()
    with pytest.raises(EdgekvError, match="rank 1 exited with code 3"):
        run_ring(_small(fault="die:1", timeout_s=10), run_timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert children_of_this_process() == []


def test_a_rank_that_stops_answering_times_out_and_no_rank_is_left():
    t0 = time.monotonic()
    with pytest.raises(EdgekvError, match="failed within 2 s"):
        run_ring(_small(fault="hang:1", timeout_s=2), run_timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert children_of_this_process() == []


def test_bad_config_is_rejected_before_any_rank_starts():
    for cfg, says in ((RingConfig(world=0, ctx=8), "--world"), (RingConfig(world=4, ctx=2), "--ctx"),
                      (RingConfig(world=2, ctx=8, n_heads=5, n_kv_heads=2), "multiple")):
        with pytest.raises(EdgekvError, match=says):
            run_ring(cfg)
