"""edgekv's own ExecuTorch kernels edgekv::int8_sdpa and edgekv::fp16_sdpa (edgekv/native): attention over int8 KV
codes, or an fp16 cache, read in place.

Reference: torch's own scaled_dot_product_attention (its math on fp64 copies) over the codes dequantized by hand
(codes x scale), with an explicit causal mask of slots 0..start+c for token c; nothing of edgekv.native's Python
(its reference() included) is used to compute the expected values. The kernel runs through its C entry point
(ctypes) on random shapes, and once through ExecuTorch's runtime (a .pte calling the op, run by the pybindings)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("executorch")

from edgekv import native  # noqa: E402

if native.compiler() is None:
    pytest.skip("no C++ compiler to build edgekv's int8 kernel", allow_module_level=True)


def textbook(q, k, v, ks, vs, start, scale, per_channel):
    """fp64 attention of q [Hkv, C, G, D] over dequantized codes, token c attending slots 0..start+c."""
    hkv, c, g, d = q.shape
    t = k.numel() // (hkv * d)
    kd, vd = k.reshape(hkv, t, d).double(), v.reshape(hkv, t, d).double()
    if ks is None:  # an fp16 cache: its values as they are
        pass
    elif per_channel:
        kd, vd = kd * ks.reshape(hkv, 1, d).double(), vd * vs.reshape(hkv, 1, d).double()
    else:
        kd, vd = kd * ks.reshape(hkv, t, 1).double(), vd * vs.reshape(hkv, t, 1).double()
    allowed = torch.zeros(c, t, dtype=torch.bool)
    for i in range(c):
        allowed[i, : start + i + 1] = True
    out = torch.empty(hkv, c, g, d, dtype=torch.float64)
    for h in range(hkv):
        for j in range(g):
            out[h, :, j] = torch.nn.functional.scaled_dot_product_attention(
                q[h, :, j].double()[None], kd[h][None], vd[h][None], attn_mask=allowed[None], scale=scale)[0]
    return out


def random_case(hkv, c, g, d, t, per_channel, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv, c, g, d, generator=gen) * 2
    k = torch.randint(-127, 128, (1, hkv, t, d), dtype=torch.int8, generator=gen)
    v = torch.randint(-127, 128, (1, hkv, t, d), dtype=torch.int8, generator=gen)
    if per_channel:  # kv-int8c: static [Hkv, D] fp32 scales
        ks, vs = (torch.rand(hkv, d, generator=gen) * 0.05 + 0.001 for _ in range(2))
    else:  # kv-int8: one fp16 scale per token and head, as the cache stores them
        ks, vs = ((torch.rand(1, hkv, t, generator=gen) * 0.05 + 0.001).half() for _ in range(2))
    return q, k, v, ks, vs


# (Hkv, C tokens, G query heads per KV head, head size D, T slots, start position): one token and several (causal,
# across the kernel's 16-token tiles), GQA and not, D 64 and 256 (SmolLM2, Gemma 3), keys across several of the
# kernel's blocks (64 keys at D 64, 16 at D 256), the last slot of the cache reached
SHAPES = [
    (3, 1, 3, 64, 300, 250),
    (1, 1, 4, 256, 100, 99),
    (2, 37, 3, 64, 160, 90),
    (1, 20, 4, 256, 64, 40),
    (2, 5, 1, 64, 20, 0),
    (1, 17, 2, 48, 70, 53),  # a head size that is not a multiple of 16 (the SIMD loops' scalar tails)
    # the register tiles' edges: 5 query heads (a tile of 4, then 1), 3 (values: 2, then 1), head sizes 36 and 40
    # (dimensions past the 8- and 16-wide loops), an odd number of keys read in place (one token: 4 heads x 2 keys)
    (1, 1, 5, 40, 200, 186),
    (2, 1, 3, 36, 90, 84),
    (1, 18, 5, 36, 80, 61),
    (1, 1, 4, 256, 300, 290),  # one token past several of the in-place blocks (64 keys at D 256)
]


@pytest.mark.parametrize("per_channel", [False, True], ids=["kv-int8", "kv-int8c"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}_c{}_g{}_d{}_t{}_s{}".format(*s))
def test_kernel_matches_textbook_attention(shape, per_channel):
    hkv, c, g, d, t, start = shape
    q, k, v, ks, vs = random_case(hkv, c, g, d, t, per_channel, seed=sum(shape))
    scale = d ** -0.5
    got = native.c_kernel()(q, k, v, ks, vs, start, scale, per_channel).double()
    want = textbook(q, k, v, ks, vs, start, scale, per_channel)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 2e-5 * max(1.0, want.abs().max().item()), err


def fp16_case(hkv, c, g, d, t, seed):
    """An fp16 cache with values over fp16's range that matter here: normal values of either sign, a few subnormals
    (exercising the scalar conversion's renormalization in the portable build), and large keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv, c, g, d, generator=gen)
    k = (torch.randn(1, hkv, t, d, generator=gen) * 3).half()
    v = (torch.randn(1, hkv, t, d, generator=gen) * 3).half()
    k.view(-1)[::97] = 3e-6  # fp16 subnormals (below 6.1e-5)
    v.view(-1)[::89] = -2e-7
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}_c{}_g{}_d{}_t{}_s{}".format(*s))
def test_fp16_kernel_matches_textbook_attention(shape):
    hkv, c, g, d, t, start = shape
    q, k, v = fp16_case(hkv, c, g, d, t, seed=sum(shape) + 1)
    scale = d ** -0.5
    got = native.c_kernel_fp16()(q, k, v, start, scale).double()
    want = textbook(q, k, v, None, None, start, scale, False)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 2e-5 * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("bits,group", [(4, 0), (4, 16), (2, 8)], ids=["int4", "int4_g16", "int2_g8"])
@pytest.mark.parametrize("shape", SHAPES[:6], ids=lambda s: "hkv{}_c{}_g{}_d{}_t{}_s{}".format(*s))
def test_packed_kernel_matches_textbook_attention(shape, bits, group):
    """A packed int4 / int2 cache as edgekv.quant writes it (the layout's one definition: asymmetric codes, the
    lowest channel in the low bits, an fp16 scale and zero per group); the textbook attends its dequantized values."""
    from edgekv.quant import dequantize, quantize
    hkv, c, g, d, t, start = shape
    if group and d % group:
        pytest.skip("group does not divide this head size")
    gen = torch.Generator().manual_seed(sum(shape) + bits)
    q = torch.randn(hkv, c, g, d, generator=gen)
    (kc, ks, kz), (vc, vs, vz) = (quantize(torch.randn(1, hkv, t, d, generator=gen) * 2, bits, group)
                                  for _ in range(2))
    scale = d ** -0.5
    got = native.c_kernel_packed()(q, kc, vc, ks, kz, vs, vz, start, scale, bits, group or d).double()
    kd, vd = (dequantize(x, sc, z, bits, group) for x, sc, z in ((kc, ks, kz), (vc, vs, vz)))
    want = textbook(q, kd, vd, None, None, start, scale, False)
    err = (got - want).abs().max().item()
    assert err <= 2e-5 * max(1.0, want.abs().max().item()), err


def test_pte_calls_the_fp16_kernel_through_executorch():
    """A .pte calling edgekv::fp16_sdpa on an fp16 cache runs in ExecuTorch's pybindings and matches the textbook."""
    from executorch.exir import to_edge
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
    native.load()

    class M(torch.nn.Module):
        def forward(self, q, k, v, pos):
            start = pos[0].item()
            torch._check(start >= 0)
            torch._check(start + q.shape[1] <= k.shape[2])
            return torch.ops.edgekv.fp16_sdpa(q, k, v, start, 0.125)

    q, k, v = fp16_case(2, 3, 3, 64, 90, seed=8)
    ep = torch.export.export(M(), (q, k, v, torch.tensor([10])))
    assert any("edgekv.fp16_sdpa" in str(n.target) for n in ep.graph.nodes)
    buf = to_edge(ep).to_executorch().buffer
    prog = _load_for_executorch_from_buffer(buf)
    for start in (10, 87):
        got = prog.forward((q, k, v, torch.tensor([start])))[0].double()
        want = textbook(q, k, v, None, None, start, 0.125, False)
        assert (got - want).abs().max().item() <= 2e-5 * want.abs().max().item()


def test_pte_calls_the_kernel_through_executorch():
    """A .pte whose graph calls edgekv::int8_sdpa (start position read from a tensor, as the model's does) runs in
    ExecuTorch's pybindings once the library is loaded, and matches the textbook at two positions."""
    from executorch.exir import to_edge
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
    native.load()

    class M(torch.nn.Module):
        def forward(self, q, k, v, ks, vs, pos):
            start = pos[0].item()
            torch._check(start >= 0)
            torch._check(start + q.shape[1] <= k.shape[2])
            return torch.ops.edgekv.int8_sdpa(q, k, v, ks, vs, start, 0.125, False)

    q, k, v, ks, vs = random_case(2, 3, 3, 64, 90, False, seed=7)
    ep = torch.export.export(M(), (q, k, v, ks, vs, torch.tensor([10])))
    assert any("edgekv.int8_sdpa" in str(n.target) for n in ep.graph.nodes)
    buf = to_edge(ep).to_executorch().buffer  # kept alive: the runtime reads the program from it in place
    prog = _load_for_executorch_from_buffer(buf)
    for start in (10, 87):
        got = prog.forward((q, k, v, ks, vs, torch.tensor([start])))[0].double()
        want = textbook(q, k, v, ks, vs, start, 0.125, False)
        assert (got - want).abs().max().item() <= 2e-5 * want.abs().max().item()


def test_a_file_that_is_not_the_library_is_one_line(tmp_path):
    from edgekv.errors import EdgekvError
    bad = tmp_path / "libedgekv_ops.so"
    bad.write_bytes(b"\x7fELF not really")
    # in a process that has loaded the real library already (another test file first), the refusal is that it differs
    with pytest.raises(EdgekvError, match="cannot be loaded|differs from the one this process loaded"):
        native.load(bad)
    with pytest.raises(EdgekvError, match="missing"):
        native.load(tmp_path / "absent.so")
