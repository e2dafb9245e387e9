"""edgekv run --save-state / --resume (edgekv/export/statefile.py): prefill a prompt once, keep the explicit state.

The property: with a byte-level tokenizer (the trained fixtures in fixtures/tiny/ are byte-level: token id = byte),
`run F --prompt P --save-state S` then `run F --resume S --prompt Q` generates exactly what `run F --prompt PQ` does,
in ONNX Runtime and in ExecuTorch, for a KV cache (fp32 and int8) and a recurrent state (Mamba ssm). The reference
is the artifact's own uninterrupted run; the fixtures are exported here into tmp_path at a small max_ctx.
Then bad files: each is one line on stderr, exit code 2, and nothing is replaced that edgekv did not write.
"""
import json
import struct

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("executorch")

from click.testing import CliRunner  # noqa: E402

from edgekv.export.cli import cli  # noqa: E402
from edgekv.export.pipeline import export_model  # noqa: E402
from edgekv.export.options import ExportOptions  # noqa: E402

P, Q = "foo_bar_baz = 1\nfoo_", "bar"  # Q's continuation depends on P: a zeroed state gives another
MAX_CTX = 64


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    made = {}

    def get(model, strategy):
        if (model, strategy) not in made:
            out = tmp_path_factory.mktemp("state") / strategy
            export_model(ExportOptions(model=f"fixtures/tiny/{model}", strategy=strategy, formats=("onnx", "pte"),
                                       max_ctx=MAX_CTX, out=out, prefill_chunk=8, verify_steps=1),
                         echo=lambda s: None)
            made[model, strategy] = out
        return made[model, strategy]
    return get


def run(*args):
    r = CliRunner().invoke(cli, ["run", *map(str, args)])
    return r


def tokens(*args):
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


CASES = [pytest.param("llama", "kv-int8", id="llama-kv-int8"),
         pytest.param("llama", "kv:dtype=fp32", id="llama-kv-fp32", marks=pytest.mark.slow),
         pytest.param("mamba", "ssm", id="mamba-ssm", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model,strategy", CASES)
@pytest.mark.parametrize("runtime", ["ort", "executorch"])
def test_resume_generates_what_the_whole_prompt_does(exports, tmp_path, model, strategy, runtime):
    f = exports(model, strategy)
    whole = tokens(f, "--runtime", runtime, "-p", P + Q, "-n", 16)
    s = tmp_path / "p.state"
    saved = tokens(f, "--runtime", runtime, "-p", P, "-n", 0, "--save-state", s)
    assert saved["saved_state"]["position"] == len(P.encode())  # byte-level, no BOS in these fixtures
    resumed = tokens(f, "--runtime", runtime, "-p", Q, "-n", 16, "--resume", s)
    assert resumed["resumed_at"] == len(P.encode()) and resumed["prompt_tokens"] == len(Q.encode())
    assert resumed["tokens"] == whole["tokens"] and len(whole["tokens"]) == 16


def test_a_chain_of_runs_keeps_the_generated_tokens(exports, tmp_path):
    """A run that generates and saves, then a resume: the state holds P + the generated tokens (the last one
    pending), so the resumed run continues P + generated + Q."""
    f = exports("llama", "kv-int8")
    s = tmp_path / "chain.state"
    first = tokens(f, "-p", P, "-n", 5, "--save-state", s)
    assert first["saved_state"]["position"] == len(P.encode()) + 4
    resumed = tokens(f, "-p", Q, "-n", 8, "--resume", s)
    whole = tokens(f, "-p", P + bytes(first["tokens"]).decode() + Q, "-n", 8)
    assert resumed["tokens"] == whole["tokens"]


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header, data):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.fixture(scope="module")
def saved(exports, tmp_path_factory):
    f = exports("llama", "kv-int8")
    s = tmp_path_factory.mktemp("saved") / "good.state"
    r = run(f, "-p", P, "-n", 0, "--save-state", s)
    assert r.exit_code == 0, r.output
    return f, s


def _expect_refused(f, s, words, *extra):
    r = run(f, "-p", Q, "-n", 2, "--resume", s, *extra)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert words in lines[0], lines[0]


def _mutate(saved, tmp_path, edit):
    f, s = saved
    header, data = _header(s)
    header, data = edit(header, data)
    bad = tmp_path / "bad.state"
    _write(bad, header, data)
    return f, bad


def test_the_good_file_is_a_safetensors_file_with_the_manifest_state(saved):
    from safetensors.numpy import load_file

    f, s = saved
    manifest = json.loads((f / "manifest.json").read_text())
    t = load_file(str(s))
    assert [x["input"] for x in manifest["state"]["tensors"]] == [k for k in _header(s)[0] if k != "__metadata__"][:-1]
    for spec in manifest["state"]["tensors"]:
        assert list(t[spec["input"]].shape) == spec["shape"] and str(t[spec["input"]].dtype) == spec["dtype"]
    assert t["edgekv.tokens"].tolist() == list(P.encode())
    assert np.abs(t["past_key_values.0.key"][0, :, :len(P)]).max() > 0  # the prompt's rows were written
    assert not t["past_key_values.0.key"][0, :, len(P):].any()


@pytest.mark.parametrize("edit,words", [
    (lambda h, d: (h, d[:-5]), "truncated"),
    (lambda h, d: ({**h, "__metadata__": {**h["__metadata__"], "position": "nan"}}, d), "not an integer"),
    (lambda h, d: ({**h, "__metadata__": {**h["__metadata__"], "position": str(MAX_CTX)}}, d), "outside"),
    (lambda h, d: ({**h, "__metadata__": {**h["__metadata__"], "strategy": "kv:dtype=fp32"}}, d),
     "another export"),
    (lambda h, d: ({**h, "__metadata__": {**h["__metadata__"], "artifact_sha256": "{}"}}, d), "artifact sha256"),
    (lambda h, d: ({**h, "extra.0": {"dtype": "F32", "shape": [1], "data_offsets": [len(d), len(d) + 4]}},
                   d + b"\0" * 4), "extra: extra.0"),
    (lambda h, d: ({k: v for k, v in h.items() if k != "past_key_values.1.value"}, d), "missing"),
    (lambda h, d: ({**h, "past_key_values.0.key": {**h["past_key_values.0.key"], "shape": [1, 4, 2**40, 48]}}, d),
     "this export's state has"),
    (lambda h, d: ({**h, "__metadata__": {**h["__metadata__"], "format": "something"}}, d),
     "not an edgekv state file"),
])
def test_a_damaged_or_mismatched_file_is_one_line_and_exit_2(saved, tmp_path, edit, words):
    _expect_refused(*_mutate(saved, tmp_path, edit), words)


def test_hostile_header_length_and_garbage_are_refused(saved, tmp_path):
    f, _ = saved
    huge = tmp_path / "huge.state"
    huge.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    _expect_refused(f, huge, "header length")
    junk = tmp_path / "junk.state"
    junk.write_bytes(b"\x07\0\0\0\0\0\0\0not json")
    _expect_refused(f, junk, "not JSON")
    _expect_refused(f, tmp_path / "absent.state", "no such file")


def test_nan_in_the_state_is_refused(saved, tmp_path):
    def edit(h, d):
        a, _ = h["past_key_values.0.key.scale"]["data_offsets"]
        return h, d[:a] + np.float16(np.nan).tobytes() + d[a + 2:]
    _expect_refused(*_mutate(saved, tmp_path, edit), "NaN")


def test_resume_with_no_room_left_and_the_other_runtime_are_refused(saved):
    f, s = saved
    _expect_refused(f, s, "max_ctx", "-p", "x" * MAX_CTX)  # the last -p wins: a prompt past max_ctx
    _expect_refused(f, s, "another export or runtime", "--runtime", "executorch")


def test_save_never_replaces_a_file_edgekv_did_not_write(saved, tmp_path):
    f, s = saved
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    for force in ((), ("--force",)):
        r = run(f, "-p", P, "-n", 0, "--save-state", mine, *force)
        assert r.exit_code == 2 and "edgekv did not write it" in r.stderr
        assert mine.read_text() == "keep me"
        assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # no temporary file left behind
    again = tmp_path / "again.state"
    again.write_bytes(s.read_bytes())
    r = run(f, "-p", "x", "-n", 0, "--save-state", again)  # an edgekv state file is replaced with --force only
    assert r.exit_code == 2 and "--force" in r.stderr
    r = run(f, "-p", "x", "-n", 0, "--save-state", again, "--force")
    assert r.exit_code == 0, r.output
    assert json.loads(_header(again)[0]["__metadata__"]["position"]) == 1


def test_a_file_saved_by_another_export_is_refused_both_ways(saved, tmp_path):
    """Not an edited header: a real state file of another export of the same model (kv fp32 at another max_ctx,
    ONNX only), resumed in this one, and this one's file resumed in it."""
    f, s = saved
    other = tmp_path / "other"
    export_model(ExportOptions(model="fixtures/tiny/llama", strategy="kv:dtype=fp32", formats=("onnx",), max_ctx=32,
                               out=other, prefill_chunk=8, verify_steps=0), echo=lambda s: None)
    theirs = tmp_path / "theirs.state"
    r = run(other, "-p", P, "-n", 0, "--save-state", theirs)
    assert r.exit_code == 0, r.output
    _expect_refused(f, theirs, "saved for another export or runtime (strategy 'kv:dtype=fp32'")
    _expect_refused(other, s, "saved for another export or runtime (strategy 'kv-int8:")
