"""`edgekv export --format pte --pte-kernel edgekv`: a kv-int8 / kv-int8c .pte whose attention reads the int8
codes with edgekv's own ExecuTorch kernel (edgekv::int8_sdpa, edgekv/native) instead of custom_quantized_sdpa, and an
fp16-cache (`kv`) .pte whose attention reads the fp16 cache in place (edgekv::fp16_sdpa) instead of casting the rows
written so far to fp32 every call.

The tiny llama of tests/test_pte_cache_kinds.py (2 layers, 4 query heads on 2 KV heads), its .pte run in ExecuTorch's
runtime over 26 positions (calls of 4 tokens, then one a call) against the plain eager module: edgekv's eager layer
dequantizes the codes and attends in fp32, with no query rounding (the kernel rounds none either), so the two agree to
fp32 summation order, well inside what custom_quantized_sdpa's int8 query moves (QUERY_ROUNDING there, 1.3-2.4 %)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("executorch")

from edgekv import native  # noqa: E402
from edgekv.export.options import ExportOptions  # noqa: E402
from edgekv.export.pipeline import export_model  # noqa: E402

if native.compiler() is None:
    pytest.skip("no C++ compiler to build edgekv's int8 kernel", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread")

CTX, CHUNK = 32, 4
STREAM = [int(t) for t in np.random.default_rng(7).integers(3, 60, 26)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from test_export_kv import tiny_llama_folder

    src = tmp_path_factory.mktemp("pte-int8-kernel") / "tiny"
    tiny_llama_folder(src)
    return src


def export(src, out, strategy, kernel="edgekv"):
    return export_model(ExportOptions(model=str(src), strategy=strategy, formats=("pte",), max_ctx=CTX, out=out,
                                      prefill_chunk=CHUNK, verify_steps=1, threads=1, pte_int8_kernel=kernel),
                        echo=lambda s: None)


OP = {"kv-int8": "edgekv.int8_sdpa", "kv-int8c": "edgekv.int8_sdpa", "kv": "edgekv.fp16_sdpa",  # the op each reads by
      "kv-int4": "edgekv.packed_sdpa"}


# kv-int8c's export is as long as kv-int8's (about 30 s each on 2 cores): the default suite exports kv-int8 only (the
# fp16 kernel's default-suite export is the Gemma 3 one below, which takes it through both layer kinds)
@pytest.mark.parametrize("strategy", ["kv-int8", pytest.param("kv-int8c", marks=pytest.mark.slow),
                                      pytest.param("kv", marks=pytest.mark.slow),
                                      pytest.param("kv-int4:group=16", marks=pytest.mark.slow)])
def test_edgekv_kernel_pte_decodes_what_the_plain_eager_module_does(llama, tmp_path, strategy):
    from test_pte_cache_kinds import ROWS_COMPARED, eager_module, eager_rows, pte_rows

    out = tmp_path / "pte"
    m = export(llama, out, strategy)
    assert m["verification"]["pte"]["passed"], m["verification"]["pte"]
    art = m["artifacts"][0]
    op = OP[strategy.split(":")[0]]
    assert art["custom_ops"]["ops"] == [op.replace(".", "::") + ".out"]
    ops = art["delegation"]["forward"]["portable_ops"]
    assert ops.get(op) == 2 and "llama.custom_quantized_sdpa" not in ops, ops  # one call per layer
    assert "llama.custom_sdpa" not in ops and "aten._to_copy.default" not in ops, ops  # no fp16 cache cast
    assert art.get("state_in_place") is True
    got = pte_rows(out, STREAM)
    want = eager_rows(eager_module(llama, strategy, "fp32", m), STREAM)[ROWS_COMPARED]  # no query rounding
    scale = np.abs(want).max()
    assert scale > 1.0
    assert np.abs(got - want).max() <= 1e-4 * scale, (np.abs(got - want).max(), scale)
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.slow  # two exports and a child process (over a minute); the library's own refusals run in test_native_int8_sdpa
def test_default_pte_names_no_custom_op_and_a_damaged_or_missing_library_is_one_line(llama, tmp_path, monkeypatch):
    """The default (executorch) .pte needs nothing of edgekv's. An edgekv-kernel export ships no library (nothing in
    an export folder is executed: SECURITY.md); `edgekv run` loads edgekv's own build. A build that is damaged is one
    line, exit 2, and so is `--pte-int8-kernel edgekv` where no compiler can build a missing one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from click.testing import CliRunner

    from edgekv.cli import main

    m = export(llama, tmp_path / "stock", "kv-int8", kernel="executorch")
    assert "custom_ops" not in m["artifacts"][0]
    out = tmp_path / "pte"
    m = export(llama, out, "kv-int8")
    assert m["artifacts"][0]["custom_ops"]["sources_sha256"] == native.source_digest()
    assert not any(p.suffix == ".so" for p in out.iterdir())
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "EDGEKV_NATIVE_DIR": str(tmp_path / "builds"),
           "OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("EDGEKV_NATIVE_DIR", str(tmp_path / "builds"))
    lib = native.library_path()
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF" + b"\0" * 64)  # a damaged build where edgekv looks for its own
    run = [sys.executable, "-m", "edgekv.cli", "run", str(out), "-p", "a b", "-n", "1", "--runtime", "executorch"]
    p = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and native.LIB_NAME in p.stderr, p.stderr[-2000:]
    lib.unlink()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # missing, and nothing to build it with
    r = CliRunner().invoke(main, ["export", "-m", str(llama), "--strategy", "kv-int8", "--format", "pte", "--max-ctx",
                                  "32", "--prefill-chunk", "4", "--out", str(tmp_path / "nocc"), "--pte-int8-kernel",
                                  "edgekv"])
    assert r.exit_code == 2, r.output
    last = r.output.strip().splitlines()[-1]
    assert "C++ compiler" in last and "--pte-kernel executorch" in last, r.output


# calls that cross the tiny Gemma 3's 8-slot rings: 4 + 2 tokens, one a call past the first full ring (positions 6-11),
# a call of 4 that overwrites keys its own earlier tokens still see (12-15), then one a call to the end (16-25)
RING_CALLS = [(0, 4), (4, 2)] + [(p, 1) for p in range(6, 12)] + [(12, 4)] + [(p, 1) for p in range(16, 26)]


@pytest.mark.parametrize("strategy", ["kv-int8", "kv", pytest.param("kv-int8c", marks=pytest.mark.slow)])
def test_gemma3_rings_decode_through_the_kernel_and_match_the_eager_module_past_full_rings(tmp_path, strategy):
    """Gemma 3's shape (sliding layers with rings of 8 slots, one global layer) with --pte-int8-kernel edgekv: the
    global layer and every one-token call of the rings attend through edgekv::int8_sdpa on the codes in place
    (RingSdpaAttention._kernel_forward: the row written first, then the whole ring), a call of several tokens through
    the eager ring arithmetic, chosen by a torch.cond; every row matches the plain eager module (dequantized codes in
    fp32, no query rounding), across three turns of each ring and a several-token call that overwrites keys its own
    earlier tokens still see."""
    from test_pte_cache_kinds import eager_module
    from tiny_families import GEMMA3_3_LAYERS, tiny, word_tokenizer

    from edgekv.export.manifest import load_export
    from edgekv.export.pte_stepper import PteStepper

    src = tmp_path / "gemma3"
    hf = tiny("gemma3", src, **GEMMA3_3_LAYERS)  # sliding, global, sliding
    word_tokenizer(src, hf.config.vocab_size)  # kv-int8c calibrates on text
    out = tmp_path / "pte"
    m = export(src, out, strategy)
    assert m["verification"]["pte"]["passed"], m["verification"]["pte"]
    art = m["artifacts"][0]
    op = OP[strategy.split(":")[0]]
    assert art["custom_ops"]["ops"] == [op.replace(".", "::") + ".out"]
    ops = art["delegation"]["forward"]["portable_ops"]
    # the global layer's call; each of the 2 sliding layers a torch.cond whose one-token branch calls the kernel
    assert ops.get(op) == 1 and ops.get("cond") == 2, ops
    assert art["delegation"]["forward"]["branch_ops"].get(op) == 2, art["delegation"]["forward"]
    assert art.get("state_in_place") is True
    stream = [t % 100 for t in STREAM]
    st = PteStepper(load_export(out), out, 1)
    got = np.concatenate([st.prefill(stream[p:p + n], p) if n > 1 else st.step([stream[p]], p)
                          for p, n in RING_CALLS])
    module = eager_module(src, strategy, "fp32", m)
    state, want = module.empty_state(), []
    with torch.no_grad():
        for p, n in RING_CALLS:
            logits, *state = module(torch.tensor([stream[p:p + n]]), torch.tensor([p]), *state)
            want.append(logits[0].numpy())
    want = np.concatenate(want)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale, (np.abs(got - want).max(), scale)
    assert (got.argmax(-1) == want.argmax(-1)).all()
