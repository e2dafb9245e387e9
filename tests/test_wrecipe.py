"""--weights int4-mix (edgekv.export.wrecipe): the bits each tensor gets, each block's search, and the export's blocks.

References: llama.cpp's llama_tensor_get_type for Q4_K_M worked by hand for published layer counts (and what its own
quantizer chose on the same weights: benchmarks/results/weight_recipe.json's tensor types); ONNX Runtime's own
MatMulNBitsQuantizer kernel (qbits_block_quant: the min/max blocks, packed, bit for bit) and its MatMulNBits kernel
running the exported tensors against numpy's x W^T.
"""
import re

import numpy as np
import pytest

from conftest import ROOT, traced_for_onnx

TINY = ROOT / "fixtures" / "tiny" / "llama"


def test_mix_bits_follow_llama_cpps_q4_k_m_rule_by_hand():
    """use_more_bits(i, n) = i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2 in C integer arithmetic, by hand:
    SmolLM2-135M (30 layers): n/8 = 3, 7n/8 = 26 -> 0-2, 26-29 and 5, 8, ..., 23: 14 layers, the 14 Q6_K ffn_down
    and 14 Q8_0 attn_v (Q6_K on a 576 width) llama.cpp's quantizer chose; Gemma-3-270M (18): n/8 = 2, 7n/8 = 15 ->
    0, 1, 15-17 and 4, 7, 10, 13: 9 layers (9 and 9 in its file)."""
    from edgekv.export.wrecipe import mix_bits
    for n, more in ((30, {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}), (18, {0, 1, 4, 7, 10, 13, 15, 16, 17}),
                    (4, {2, 3})):
        for role in ("attn_v", "ffn_down"):
            assert {i for i in range(n) if mix_bits(role, i, n) == 8} == more, (n, role)
        for role in ("q", "k", "o", "gate", "up"):
            assert all(mix_bits(role, i, n) == 4 for i in range(n))
        assert mix_bits("head", None, n) == 8


def _err(w, q, s, z, wt=None, block=32):
    from edgekv.export.wrecipe import dequantize
    d = (w - dequantize(q, s, z, block)).reshape(w.shape[0], -1, block) ** 2
    return (d if wt is None else d * wt.reshape(1, -1, block)).sum(-1)


@pytest.mark.parametrize("bits", [4, 8])
def test_search_never_loses_to_min_max_on_any_block(bits):
    """Gaussian, heavy-tailed, one-sided, constant and zero blocks, uniform and importance-weighted: every block's
    (weighted) squared error at most min/max's, and less in total."""
    from edgekv.export.wrecipe import minmax_blocks, search_blocks
    rng = np.random.default_rng(0)
    w = np.concatenate([rng.standard_normal((8, 256)), rng.standard_t(2, (8, 256)), np.abs(rng.standard_normal((4, 256))),
                        np.full((2, 256), 0.3), np.zeros((2, 256))]).astype(np.float32)
    for imp in (None, rng.gamma(0.5, 1.0, 256).astype(np.float32)):
        got, base = _err(w, *search_blocks(w, bits, importance=imp), wt=imp), _err(w, *minmax_blocks(w, bits), wt=imp)
        assert (got <= base * (1 + 1e-6) + 1e-12).all()
        assert got.sum() < 0.97 * base.sum()


@pytest.mark.parametrize("bits", [4, 8])
def test_min_max_blocks_packed_are_ort_quantizers_own(bits):
    """minmax_blocks + pack_matmul against ONNX Runtime's asymmetric kernel (MatMulNBitsQuantizer's
    qbits_block_quant) on the same weights, bit for bit: codes, scales and zero points, an odd block count too."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, \
        DefaultWeightOnlyQuantizer

    from edgekv.export.wrecipe import minmax_blocks, pack_matmul
    w = np.random.default_rng(1).standard_normal((24, 96)).astype(np.float32)  # [N, K], K/32 = 3 blocks
    q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, bits=bits))
    want = q.qbits_block_quant(np.ascontiguousarray(w.T))
    got = pack_matmul(*minmax_blocks(w, bits), bits)
    for g, x in zip(got, want):
        assert np.array_equal(g.reshape(-1), np.asarray(x).reshape(-1))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The tiny llama's graph as the streamed export lowers it, quantized with int4-mix."""
    from edgekv.export import wquant
    from edgekv.export.to_onnx import lower_onnx, save_onnx

    ep, entry = traced_for_onnx(TINY)
    root = tmp_path_factory.mktemp("mix")
    (root / "fp32").mkdir()
    (root / "q").mkdir()
    save_onnx(lower_onnx(ep, entry, fold_weights=False), root / "fp32" / "model.onnx")
    rec = wquant.quantize_onnx(root / "fp32" / "model.onnx", root / "q" / "model.onnx", "int4-mix", entry)
    return root, rec


def _unpack(b, zp, bits, n, k, block=32):
    kb = k // block
    if bits == 4:
        codes = np.stack([b & 15, b >> 4], -1).reshape(n, k)
        zeros = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :kb]
    else:
        codes, zeros = b.reshape(n, k), zp.reshape(n, kb)
    return codes, zeros


def test_int4_mix_export_bits_blocks_and_kernel(mixed):
    """Every MatMulNBits of the tiny llama (4 layers; q/k/v fused into one matrix on the ONNX route, so qkv and
    ffn_down of layers 2 and 3 at 8 bits, the head at 8, the rest 4) as the manifest's per-tensor record says; ONNX Runtime running each node's tensors (fp32
    activations) equals numpy's x W_q^T with W_q decoded from them; each block's error against the fp32 weight at
    most ORT's own min/max block's."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, \
        DefaultWeightOnlyQuantizer

    from edgekv.export.onnx_stream import _stream_weights

    root, rec = mixed
    per = rec["per_tensor"]
    fp32 = onnx.load(str(root / "fp32" / "model.onnx"), load_external_data=False)
    base = str(root / "fp32")
    weights = {w.name: (numpy_helper.to_array(w, base) if tr else numpy_helper.to_array(w, base).T)
               for w, tr, _, _ in _stream_weights(fp32).values()}  # each as rows [N, K]
    m = onnx.load(str(root / "q" / "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    nodes = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 4 * 5 + 1 and not any(n.op_type == "MatMul" and n.input[1] in inits for n in m.graph.node)
    rng = np.random.default_rng(2)
    for node in nodes:
        a = {x.name: x.i for x in node.attribute}
        name = next(k for k, v in per.items() if node.name == f"{v.get('node')}_Q{a['bits']}")
        tensor = np.ascontiguousarray(weights[name], dtype=np.float32)
        head = per[name]["role"] == "head"
        assert a["bits"] == per[name]["bits"] == (8 if head or re.search(r"layers\.[23]\..*(qkv|down)_proj", name) else 4), name
        n, k = a["N"], a["K"]
        codes, zeros = _unpack(inits[node.input[1]], inits[node.input[3]], a["bits"], n, k)
        scales = inits[node.input[2]].reshape(n, k // 32)
        deq = ((codes.reshape(n, -1, 32).astype(np.float32) - zeros[..., None]) * scales[..., None]).reshape(n, k)
        x = rng.standard_normal((3, k)).astype(np.float32)
        g = helper.make_graph([helper.make_node("MatMulNBits", ["x", "B", "s", "z"], ["y"], domain="com.microsoft",
                                                K=k, N=n, bits=a["bits"], block_size=32, accuracy_level=0)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
                              [numpy_helper.from_array(inits[node.input[i]], nm)
                               for i, nm in ((1, "B"), (2, "s"), (3, "z"))])
        sess = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21),
                                                                        helper.make_opsetid("com.microsoft", 1)])
                                    .SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], x @ deq.T, rtol=1e-4, atol=1e-4)
        # ORT's min/max quantizer on the same fp32 weight: the export's blocks never do worse
        ortq = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False,
                                                                        bits=a["bits"]))
        ob, os_, oz = ortq.qbits_block_quant(np.ascontiguousarray(tensor.T))
        oc, ozz = _unpack(np.asarray(ob), np.asarray(oz), a["bits"], n, k)
        odeq = ((oc.reshape(n, -1, 32).astype(np.float32) - ozz[..., None])
                * np.asarray(os_).reshape(n, -1)[..., None]).reshape(n, k)
        mine = ((tensor - deq).reshape(n, -1, 32) ** 2).sum(-1)
        theirs = ((tensor - odeq).reshape(n, -1, 32) ** 2).sum(-1)
        assert (mine <= theirs * (1 + 1e-5) + 1e-12).all(), name


def test_plan_prices_int4_mix_by_hand():
    """SmolLM2-135M (576 wide, 1536 MLP, 192-wide v): int4-mix holds v (192 x 576) and down (576 x 1536) of 14
    layers at int8's bytes (n + 2 B per row) instead of int4's (n / 2 + 2 B per 32): 7n/16 + 2 rows more each, so
    14 x (48,384 + 384 + 387,072 + 1,152) = 6,117,888 B over int4; the table is priced at int8 either way."""
    from edgekv.arch.catalog import load_arch
    from edgekv.memory.weights import weight_bytes
    a = load_arch("smollm2-135m")
    assert weight_bytes(a, "int4-mix")["total"] - weight_bytes(a, "int4")["total"] == 6_117_888


def test_int4_mix_for_the_pte_is_refused_in_one_line(tmp_path):
    """int4-mix is MatMulNBits blocks: a .pte export is refused before anything is loaded, exit 2, one line."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "edgekv.cli", "export", "-m", str(TINY), "--weights", "int4-mix",
                        "--format", "pte", "-c", "512", "-o", str(tmp_path / "out")], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "int4-mix" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
