"""RWKV-4's int8 recurrent state (linear:dtype=int8) on the trained fixture (fixtures/tiny/rwkv, real weights).

The layout's bytes against hand arithmetic from the fixture's config.json; the fp32 path against transformers'
RwkvForCausalLM; the int8 state against the fp32 one over real stdlib text; the int8 state through an ONNX export.
"""
import json
import sysconfig
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import greedy_with_state  # noqa: E402
from edgekv.arch import read_config_json  # noqa: E402
from edgekv.errors import EdgekvError  # noqa: E402
from edgekv.models.recurrent import load_rwkv  # noqa: E402
from edgekv.strategies import build_layout, parse_strategy  # noqa: E402

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "tiny" / "rwkv"


pytestmark = pytest.mark.usefixtures("one_thread")


def stdlib_bytes(n: int) -> list[int]:
    """n bytes of real text the fixture never trained on as a whole file: textwrap.py from a line start."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes()
    start = src.index(b"\n", 3000) + 1
    return list(src[start:start + n])


def test_int8_layout_bytes_by_hand():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    d, layers = cfg["hidden_size"], cfg["num_hidden_layers"]  # 192, 4
    arch = read_config_json(FIXTURE)
    fp32 = build_layout(arch, parse_strategy("linear"), 4096)
    int8 = build_layout(arch, parse_strategy("linear:dtype=int8"), 4096)
    assert fp32.nbytes == layers * 5 * d * 4  # five fp32 rows per block
    # per block: 4 int8 rows (ffn shift, att shift, num, den), 4 fp32 row scales, the max row in fp32
    assert int8.nbytes == layers * (4 * d * 1 + 4 * 4 + d * 4) == 6208
    assert [(t.name, t.shape, t.dtype) for t in int8.tensors[:3]] == [
        ("past_recurrent.0", (1, 4, d), "int8"), ("past_recurrent.0.scale", (1, 4, 1), "float32"),
        ("past_recurrent.0.max", (1, 1, d), "float32")]
    assert int8.bytes_by_role() == {"recurrent": layers * 4 * d, "recurrent.scale": layers * 16,
                                    "recurrent.max": layers * 4 * d}
    assert build_layout(arch, parse_strategy("linear"), 64).nbytes == fp32.nbytes  # flat in context
    # state_dtype= is the same spec as dtype= (the recurrent state is the only state)
    assert parse_strategy("linear:state_dtype=int8") == parse_strategy("linear:dtype=int8")


def test_fp32_path_still_equals_transformers():
    transformers = pytest.importorskip("transformers")
    ref = transformers.RwkvForCausalLM.from_pretrained(FIXTURE).eval()
    module = load_rwkv(str(FIXTURE), parse_strategy("linear"), 256).module
    tokens, logits, state = greedy_with_state(module, stdlib_bytes(40), steps=16, chunk=16)
    with torch.no_grad():
        out = ref(torch.tensor([tokens]), use_cache=True)
    want = out.logits[0]
    assert (logits - want).abs().max().item() <= 2e-5 * want.abs().max().item()
    for i, s in enumerate(state):  # the five rows per block are RwkvModel's state
        hf = torch.stack([out.state[k][0, :, i] for k in range(5)])
        assert torch.allclose(s[0], hf, rtol=1e-5, atol=1e-5 * hf.abs().max().item())


def test_int8_state_stays_close_to_fp32_over_real_text():
    """Teacher-forced over 256 bytes of stdlib source, one token per call (as decode stores the state every token).
    Measured: top-1 agreement 0.980, mean KL 5.5e-4 nats, state relative error 0.088 (worst block)."""
    ref = load_rwkv(str(FIXTURE), parse_strategy("linear"), 256).module
    q = load_rwkv(str(FIXTURE), parse_strategy("linear:dtype=int8"), 256).module
    text = stdlib_bytes(256)
    sr, sq = ref.empty_state(), q.empty_state()
    agree, kl, state_err = 0, 0.0, []
    with torch.no_grad():
        for t, b in enumerate(text):
            lr, *sr = ref(torch.tensor([[b]]), torch.tensor([t]), *sr)
            lq, *sq = q(torch.tensor([[b]]), torch.tensor([t]), *sq)
            pr, pq = lr[0, -1].log_softmax(-1), lq[0, -1].log_softmax(-1)
            agree += int(pr.argmax() == pq.argmax())
            kl += float((pr.exp() * (pr - pq)).sum())
    for i in range(ref.args.n_layers):  # the stored int8 state is the fp32 one, rounded
        codes, scale, mx = sq[3 * i:3 * i + 3]
        assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127  # each row's largest entry sets its scale
        deq = torch.cat((codes.float() * scale, mx), dim=1)
        state_err.append(float((deq - sr[i]).norm() / sr[i].norm()))
    print(f"\nint8 vs fp32 over {len(text)} bytes: top-1 {agree / len(text):.3f}, mean KL {kl / len(text):.2e}, "
          f"state rel err {max(state_err):.3f}")
    assert agree / len(text) >= 0.95
    assert kl / len(text) < 0.01
    assert 0 < max(state_err) < 0.2  # rounded and drifted, but the same state
    assert agree < len(text) or kl > 0  # the variant really differs from the reference


def test_int8_state_with_stochastic_rounding_uses_its_generator():
    a = load_rwkv(str(FIXTURE), parse_strategy("linear:dtype=int8"), 64).module
    b = load_rwkv(str(FIXTURE), parse_strategy("linear:dtype=int8"), 64).module
    prompt = stdlib_bytes(24)
    _, nearest, _ = greedy_with_state(a, prompt, steps=0, chunk=1)
    runs = []
    for seed in (1, 1, 2):
        b.rounding, b.generator = "stochastic", torch.Generator().manual_seed(seed)
        runs.append(greedy_with_state(b, prompt, steps=0, chunk=1)[1])
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0], nearest)


def test_the_module_refuses_a_layout_it_does_not_keep():
    from edgekv.models.recurrent import Rwkv4, rwkv_args
    from edgekv.strategies import StateLayout, StateTensor

    args = rwkv_args(json.loads((FIXTURE / "config.json").read_text()))
    bad = StateLayout("linear:dtype=int8", 64, tuple(
        StateTensor(f"past_recurrent.{i}", f"present_recurrent.{i}", (1, 5, args.hidden), "int8", i, "recurrent")
        for i in range(args.n_layers)))
    with pytest.raises(EdgekvError, match="RWKV-4 module keeps"):
        Rwkv4(args, bad)


@pytest.mark.parametrize("fmt", ["onnx", pytest.param("pte", marks=pytest.mark.slow)])  # pte: ~4 min on 2 cores
def test_int8_state_round_trips_through_the_export(fmt, tmp_path):
    """The exported program reads and writes the int8 state; verify steps it against the eager module (ONNX
    measured: logit diff 1.2e-5 at scale 14.9, state diff 3e-6; pte: 1.0e-2)."""
    pytest.importorskip("onnxruntime" if fmt == "onnx" else "executorch")
    import numpy as np
    from click.testing import CliRunner
    from edgekv.export.cli import cli
    from edgekv.export.runtime import EagerStepper, open_stepper, state_as_numpy
    from edgekv.export.verify import verify
    from edgekv.models import load_any

    out = tmp_path / "rwkv-int8"
    r = CliRunner().invoke(cli, ["export", "--model", str(FIXTURE), "--strategy", "linear:state_dtype=int8",
                                 "--format", fmt, "--max-ctx", "256", "--threads", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    # by hand (test_int8_layout_bytes_by_hand): 4 blocks x (4 int8 rows of 192 + 4 fp32 scales + a fp32 max row)
    assert m["state"]["bytes"] == 4 * (4 * 192 + 4 * 4 + 192 * 4) == 6208
    assert [(t["shape"], t["dtype"]) for t in m["state"]["tensors"][:3]] == [
        ([1, 4, 192], "int8"), ([1, 4, 1], "float32"), ([1, 1, 192], "float32")]
    v = m["verification"][fmt]
    assert v["passed"], v
    assert v["top1_agreement"] >= 0.95

    # the int8 codes the runtime wrote are the eager module's, value by value. Not all of them, bit for bit: the
    # state is rounded again at every call, so where the eager value lies within a runtime's last bit of a rounding
    # boundary the two round apart, and a channel that hardly decays (den, an integrator) keeps that step and may
    # gain another later. Measured on a Sapphire Rapids host (XNNPACK): layer 3's den channel 70 read 79.49992
    # steps in eager after the 4th 32-token call, the .pte rounded it to 80, eager to 79, 22 token calls later 71
    # against 69: 1 code of 3,072 off, by 2 steps (ONNX: none). A wrong write (scale, rounding rule, row order)
    # moves most codes by many steps.
    art = open_stepper(out, m, "ort" if fmt == "onnx" else "executorch", threads=1)
    ref = EagerStepper(m, load_any(str(FIXTURE), parse_strategy("linear:dtype=int8"), 256).module,
                       chunk=art.chunk, tail=art.tail, max_chunk=art.max_chunk)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 100, 150)]
    verify(art, ref, prompt, 40, "int8", fmt)  # drives both: the prompt, then 40 steps teacher-forced by eager
    codes, off = 0, []
    for spec, x, y in zip(m["state"]["tensors"], state_as_numpy(art), state_as_numpy(ref)):
        x, y = x.astype(np.float32), y.astype(np.float32)
        if spec["dtype"] == "int8":
            codes += x.size
            off += list(np.abs(x - y)[x != y])
        else:  # the scales and the fp32 max row
            np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4, err_msg=spec["input"])
    assert len(off) <= codes // 100 and max(off, default=0) <= 4, (len(off), codes, off)
