"""kv-int8c: int8 K/V codes with static per-channel scales calibrated at export, read in place by ONNX Runtime's
GroupQueryAttention. Checked against independent sources: ONNX Runtime's own op (what codes it writes, what it
attends to), hand arithmetic of the state's bytes from SmolLM2-135M's published config, and the fp32 cache of the
same eager model (the calibration's largest values)."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from conftest import ROOT, greedy_rows, run_cli  # noqa: E402
from edgekv.export.calibrate import CALIB_TOKENS, MARGIN, calibrate, calibration_ids  # noqa: E402
from edgekv.models import load_any  # noqa: E402
from edgekv.quant import quantize_static  # noqa: E402
from edgekv.strategies import parse_strategy  # noqa: E402

TINY = ROOT / "fixtures" / "tiny" / "llama"
H, HKV, D, T = 6, 2, 16, 96


def gqa_graph(rotary: bool) -> bytes:
    """One com.microsoft GroupQueryAttention node over an int8 PER_CHANNEL cache, C tokens per call."""
    from onnx import TensorProto as TP
    from onnx import helper

    vi = [helper.make_tensor_value_info("q", TP.FLOAT, [1, "C", H * D]),
          helper.make_tensor_value_info("k", TP.FLOAT, [1, "C", HKV * D]),
          helper.make_tensor_value_info("v", TP.FLOAT, [1, "C", HKV * D]),
          helper.make_tensor_value_info("pk", TP.INT8, [1, HKV, T, D]),
          helper.make_tensor_value_info("pv", TP.INT8, [1, HKV, T, D]),
          helper.make_tensor_value_info("seqlens", TP.INT32, [1]),
          helper.make_tensor_value_info("total", TP.INT32, [])]
    ins = ["q", "k", "v", "pk", "pv", "seqlens", "total"]
    attrs = {"num_heads": H, "kv_num_heads": HKV, "k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL",
             "kv_cache_bit_width": 8}
    if rotary:
        ins += ["cos", "sin"]
        vi += [helper.make_tensor_value_info(n, TP.FLOAT, [T, D // 2]) for n in ("cos", "sin")]
        attrs["do_rotary"] = 1
    ins += [""] * (12 - len(ins)) + ["ks", "vs"]
    vi += [helper.make_tensor_value_info(n, TP.FLOAT, [1, HKV, 1, D]) for n in ("ks", "vs")]
    node = helper.make_node("GroupQueryAttention", ins, ["o", "prk", "prv"], domain="com.microsoft", **attrs)
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in (("o", TP.FLOAT), ("prk", TP.INT8),
                                                                   ("prv", TP.INT8))]
    m = helper.make_model(helper.make_graph([node], "gqa", vi, outs),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString()


@pytest.mark.parametrize("rotary", [False, True])
def test_the_codes_edgekv_writes_are_the_codes_onnx_runtime_writes(rotary):
    """A prefill of 40 tokens then one decode token through ORT's op: its present codes equal quantize_static of the
    same (rotated) keys and values, and its output equals attention over the dequantized codes."""
    rng = np.random.default_rng(3)
    sess = ort.InferenceSession(gqa_graph(rotary), providers=["CPUExecutionProvider"])
    ks = (rng.random((1, HKV, 1, D)) * 0.04 + 0.005).astype(np.float32)
    vs = (rng.random((1, HKV, 1, D)) * 0.04 + 0.005).astype(np.float32)
    inv = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pk, pv = np.zeros((1, HKV, T, D), np.int8), np.zeros((1, HKV, T, D), np.int8)
    pos = 0
    for c in (40, 1):
        q, k, v = (rng.standard_normal((1, c, n * D)).astype(np.float32) for n in (H, HKV, HKV))
        feed = {"q": q, "k": k, "v": v, "pk": pk, "pv": pv, "seqlens": np.array([pos + c - 1], np.int32),
                "total": np.array(pos + c, np.int32), "ks": ks, "vs": vs}
        if rotary:
            feed.update(cos=cos, sin=sin)
        out, pk, pv = sess.run(None, feed)
        kk = torch.from_numpy(k.reshape(c, HKV, D))
        qq = torch.from_numpy(q.reshape(c, H, D))
        if rotary:  # rotate_half at positions pos..pos+c-1, as edgekv's Attention rotates
            cc = torch.from_numpy(np.concatenate([cos, cos], -1)[pos:pos + c])[:, None]
            ss = torch.from_numpy(np.concatenate([sin, sin], -1)[pos:pos + c])[:, None]
            half = lambda x: torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1)  # noqa: E731
            kk, qq = kk * cc + half(kk) * ss, qq * cc + half(qq) * ss
        want_k = quantize_static(kk, torch.from_numpy(ks[0, :, 0]))
        want_v = quantize_static(torch.from_numpy(v.reshape(c, HKV, D)), torch.from_numpy(vs[0, :, 0]))
        assert np.array_equal(pk[0, :, pos:pos + c], want_k.permute(1, 0, 2).numpy())
        assert np.array_equal(pv[0, :, pos:pos + c], want_v.permute(1, 0, 2).numpy())
        kd = pk[0, :, :pos + c].astype(np.float32) * ks[0]
        vd = pv[0, :, :pos + c].astype(np.float32) * vs[0]
        ref = np.zeros((c, H, D), np.float32)
        for h in range(H):
            g = h // (H // HKV)
            s = qq[:, h].numpy() @ kd[g].T / np.sqrt(D)
            s = s + np.triu(np.full((c, pos + c), -np.inf), pos + 1)
            p = np.exp(s - s.max(-1, keepdims=True))
            ref[:, h] = (p / p.sum(-1, keepdims=True)) @ vd[g]
        assert np.abs(out.reshape(c, H, D) - ref).max() < 1e-5
        pos += c


def test_the_state_is_the_codes_alone_by_hand_for_smollm2():
    """SmolLM2-135M (config.json: 30 layers, 3 KV heads, head_dim 64) at 8k: 2 x 30 x 3 x 8192 x 64 int8 bytes, no
    scale tensors; kv-int8 adds one fp16 scale per (token, head): 2 x 30 x 3 x 8192 x 2 bytes more. On ONNX Runtime
    the planner reads the codes in place (no fp32 copy in the bytes per token)."""
    out = json.loads(run_cli("plan", "--device", "pixel8", "--ctx", "8k", "--model", "smollm2-135m", "--runtime",
                             "onnxruntime", "--strategy", "kv-int8c", "--strategy", "kv-int8", "--json", "--explain",
                             check=True).stdout)
    rows = {o["strategy"]: o for o in out["options"]}
    codes = 2 * 30 * 3 * 8192 * 64
    assert rows["kv-int8c"]["bytes"]["state"] == codes
    assert rows["kv-int8"]["bytes"]["state"] == codes + 2 * 30 * 3 * 8192 * 2
    # kv-int8 is dequantized whole by the eager graph (no GroupQueryAttention), charged at that graph's rate
    # (edgekv/costs/attention_rates.json "eager int8"); kv-int8c reads the codes in place, at GroupQueryAttention's
    # measured int8 kernel rate, no copy
    assert "eager int8 eager graph" in rows["kv-int8"]["explain"]["decode_tokens_per_s"]
    int8c = rows["kv-int8c"]["explain"]["decode_tokens_per_s"]
    assert "dequant copy" not in int8c and "int8c GroupQueryAttention" in int8c


def test_calibration_sets_each_channel_from_the_fp32_cache_of_the_same_tokens():
    """The calibrated kv_scale of every layer equals MARGIN x max / 127 per (KV head, channel): of |V|, and for K of
    the norm of each RoPE pair (j, j + D/2), the maxima read from the fp32 cache the same eager model writes for the
    same tokens (another path: a kv:dtype=fp32 module's state, not the calibration mode)."""
    var = load_any(str(TINY), parse_strategy("kv-int8c"), 256)
    ref = load_any(str(TINY), parse_strategy("kv:dtype=fp32"), 256)
    ids = calibration_ids(None, var.args.vocab, 200)
    assert len(ids) == 200 and len(set(ids)) > 20  # real text's bytes
    info = calibrate(var.module, ids)
    assert info["tokens"] == 200 and info["margin"] == MARGIN
    with torch.no_grad():
        _, *state = ref.module(torch.tensor([ids]), torch.zeros(1, dtype=torch.int64), *ref.module.empty_state())
    layers = [m for m in var.module.modules() if hasattr(m, "kv_scale")]
    assert len(layers) == var.args.n_layers
    for i, m in enumerate(layers):
        k, v = state[2 * i][0, :, :200], state[2 * i + 1][0, :, :200]  # [Hkv, T, D]
        h = k.shape[-1] // 2
        pair = (k[..., :h] ** 2 + k[..., h:] ** 2).sqrt().amax(1)  # [Hkv, D/2]
        assert torch.allclose(m.kv_scale[0], MARGIN * torch.cat((pair, pair), -1) / 127, rtol=1e-5, atol=1e-9), i
        assert torch.allclose(m.kv_scale[1], MARGIN * v.abs().amax(1) / 127, rtol=1e-5, atol=1e-9), i


def test_uncalibrated_scales_would_be_wrong_so_export_calibrates(tmp_path):
    """The ONNX export of the tiny Llama with kv-int8c: codes only in the state, GroupQueryAttention over the whole
    state in place, calibration recorded; ONNX Runtime's logits follow the eager module's over a prompt and greedy
    steps (verify's own check, here again through the manifest's stepper), and the fp32 cache's within the
    quantization's error."""
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper

    out = tmp_path / "t8c"
    run_cli("export", "--model", TINY, "--strategy", "kv-int8c", "--format", "onnx", "--max-ctx", "256",
            "--out", out, "--threads", "1", check=True)
    m = load_export(out)
    assert all(t["dtype"] == "int8" and t["role"] in ("key", "value") for t in m["state"]["tensors"])
    art = m["artifacts"][0]
    assert art["attention"] == "com.microsoft.GroupQueryAttention" and art["state_in_place"] is True
    assert m["strategy"]["calibration"]["tokens"] == min(CALIB_TOKENS, 256)
    ref = load_any(str(TINY), parse_strategy("kv:dtype=fp32"), 256)
    prompt = list(b"def main(argv):\n    parser = argparse.ArgumentParser(")
    tokens, rows = greedy_rows(OrtStepper(m, out, threads=1), prompt, 8)
    with torch.no_grad():
        logits = ref.module(torch.tensor([tokens]), torch.zeros(1, dtype=torch.int64), *ref.module.empty_state())[0][0]
    want = logits.numpy()[:len(tokens)]
    scale = np.abs(want).max()
    assert np.abs(rows - want).max() / scale < 0.05  # int8 codes: a few percent of the logit scale at most
    assert (rows.argmax(-1) == want.argmax(-1)).mean() > 0.9


def test_kv_int8c_takes_no_parameters_and_refuses_a_recurrent_model():
    r = run_cli("plan", "--device", "pixel8", "--ctx", "4k", "--model", "smollm2-135m", "--strategy",
                "kv-int8c:group=32")
    assert r.returncode == 2 and "unknown parameter" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("export", "--model", ROOT / "fixtures" / "tiny" / "mamba", "--strategy", "kv-int8c", "--format",
                "onnx", "--max-ctx", "64", "--out", "/nonexistent-edgekv/x")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_gemma3_rings_and_global_layers_both_take_kv_int8c(tmp_path):
    """A tiny Gemma 3 (transformers' Gemma3TextConfig; sliding windows of 8 that roll within max_ctx 64): every layer
    attends through GroupQueryAttention's int8 cache with the same static-scale codes (calibrated in one call through
    the eager rings), the sliding ones with the op's window-sized cache; the export's own verification (ONNX Runtime
    against the eager module over a prompt and decode steps past the window) passes, and the logits stay near
    transformers' fp32 model."""
    from tiny_families import hf_logits, tiny

    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper

    ref = tiny("gemma3", tmp_path / "hf")
    out = tmp_path / "export"
    run_cli("export", "--model", tmp_path / "hf", "--strategy", "kv-int8c", "--format", "onnx", "--max-ctx", "64",
            "--prefill-chunk", "8", "--out", out, "--threads", "1", check=True)
    m = load_export(out)
    art = m["artifacts"][0]
    assert art["attention"] == "com.microsoft.GroupQueryAttention" and art["state_in_place"]
    assert art["sliding_window_cache"]
    assert m["verification"]["onnx"]["passed"] and m["verification"]["onnx"]["top1_agreement"] >= 0.95
    prompt = [5, 9, 33, 12, 40, 7, 21, 3, 18, 50, 11]
    tokens, ours = greedy_rows(OrtStepper(m, out), prompt, 30)
    want = hf_logits(ref, tokens).numpy()
    assert np.abs(ours - want).max() / np.abs(want).max() < 0.05


def test_calibration_attends_over_its_own_tokens_whatever_the_max_context():
    """A calibration call of C tokens attends over C slots, not the export's max context (a 1B at 32k held 2.1 GB of
    scores a layer, twice with softmax's), and the scales are the same as at a short max context."""
    from edgekv.models.attention import Attention
    ids = calibration_ids(None, 256, 200)
    seen = []
    real = Attention._attend

    def spy(self, x, cos, sin, mask, *rest, **kw):
        seen.append(mask.shape[-1])
        return real(self, x, cos, sin, mask, *rest, **kw)

    scales = []
    for ctx in (256, 8192):
        var = load_any(str(TINY), parse_strategy("kv-int8c"), ctx)
        seen.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Attention, "_attend", spy)
            calibrate(var.module, ids)
        assert seen and set(seen) == {200}, (ctx, set(seen))
        scales.append([m.kv_scale.clone() for m in var.module.modules() if hasattr(m, "kv_scale")])
    for a, b in zip(*scales):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)
