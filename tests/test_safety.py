"""A careless or hostile user: edgekv never loses a user's files, never loads what the manifest did not vouch for,
and ends bad input in one line on stderr with exit code 2 (issue 21). Commands run in-process through click's
CliRunner where they can, as a subprocess where the old behaviour was a runaway (memory, C++ logging)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EDGEKV, ROOT, cli, one_line_exit_2

TINY_LLAMA = ROOT / "fixtures" / "tiny" / "llama"


def tree(folder: Path) -> dict:
    """Every path under folder with its bytes' sha256 (folders as None)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        out[p.relative_to(folder).as_posix()] = (hashlib.sha256(p.read_bytes()).hexdigest()
                                                 if p.is_file() and not p.is_symlink() else None)
    return out


def rehash(folder: Path, name: str) -> None:
    """Make the manifest vouch for folder/name as it now is (what an attacker who edits both would do)."""
    m = json.loads((folder / "manifest.json").read_text())
    b = (folder / name).read_bytes()
    m["files"][name] = {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)}
    (folder / "manifest.json").write_text(json.dumps(m))


def edit_manifest(folder: Path, fn) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    fn(m)
    (folder / "manifest.json").write_text(json.dumps(m))


@pytest.fixture
def export_dir(tiny_onnx_export) -> Path:
    return tiny_onnx_export


@pytest.fixture
def copy_of(export_dir, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(export_dir, d)
    return d


# ---- the publish step: --force, atomic rename, leftovers, modes ----


@pytest.fixture
def model_copy(tmp_path) -> Path:
    d = tmp_path / "models" / "llama"
    shutil.copytree(TINY_LLAMA, d)
    return d


def test_force_never_replaces_the_model_or_a_folder_holding_it(model_copy, tmp_path):
    before = tree(tmp_path)
    for out in (model_copy, model_copy.parent, tmp_path):
        code, _, err = cli("export", "--model", model_copy, "--out", out, "--force", "--max-ctx", "64")
        one_line_exit_2(code, err, "choose a new folder")
    code, _, err = cli("export", "--model", model_copy, "--out", ".", "--force", "--max-ctx", "64", cwd=tmp_path)
    one_line_exit_2(code, err)
    assert tree(tmp_path) == before


def test_force_never_replaces_the_working_folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    code, _, err = cli("export", "--model", TINY_LLAMA, "--out", work, "--force", "--max-ctx", "64", cwd=work)
    one_line_exit_2(code, err, "working folder")
    assert (work / "notes.txt").read_text() == "mine"


def test_force_replaces_only_an_earlier_edgekv_export(export_dir, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    code, _, err = cli("export", "--model", TINY_LLAMA, "--out", user, "--force", "--max-ctx", "64")
    one_line_exit_2(code, err, "not one")
    assert (user / "thesis.tex").read_text() == "years of work"
    # an edgekv export the user added a file to is no longer only edgekv's
    mixed = tmp_path / "mixed"
    shutil.copytree(export_dir, mixed)
    (mixed / "my-notes.md").write_text("mine")
    code, _, err = cli("export", "--model", TINY_LLAMA, "--out", mixed, "--force", "--max-ctx", "64")
    one_line_exit_2(code, err, "my-notes.md")
    assert (mixed / "my-notes.md").read_text() == "mine"
    # a file is never an export
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    code, _, err = cli("export", "--model", TINY_LLAMA, "--out", f, "--force", "--max-ctx", "64")
    one_line_exit_2(code, err)
    assert f.read_bytes() == b"x" and not list(tmp_path.glob(".file.bin.*"))


def _fake_run(make_out_meanwhile):
    """pipeline._run stand-in: writes one file into the temporary folder, and meanwhile `out` appears."""
    def run(opts, strategy, st, tmp, mf, version):
        (tmp / "model.onnx").write_bytes(b"new")
        make_out_meanwhile(Path(opts.out))
        with st.stage("manifest"):
            pass
        return {"files": {}}
    return run


@pytest.mark.parametrize("who", ["user", "another export"])
def test_publish_refuses_an_out_that_appeared_meanwhile(who, export_dir, tmp_path, monkeypatch):
    from edgekv.errors import EdgekvError
    from edgekv.export import pipeline
    from edgekv.export.options import ExportOptions

    out = tmp_path / "out"

    def appear(o: Path):
        if who == "user":
            o.mkdir()
            (o / "mine.txt").write_text("mine")
        else:
            shutil.copytree(export_dir, o)
    monkeypatch.setattr(pipeline, "_run", _fake_run(appear))
    with pytest.raises(EdgekvError, match="publish"):
        pipeline.export_model(ExportOptions(model=str(TINY_LLAMA), out=out, max_ctx=64), echo=lambda s: None)
    if who == "user":
        assert (out / "mine.txt").read_text() == "mine" and sorted(os.listdir(out)) == ["mine.txt"]
    else:
        assert tree(out) == tree(export_dir)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary folder left behind


def test_leftovers_of_killed_exports_are_removed_and_nothing_else(export_dir, tmp_path, monkeypatch):
    from edgekv.export import pipeline
    from edgekv.export.options import ExportOptions

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    partial = tmp_path / f".out.tmp-{dead.pid}"
    partial.mkdir()
    (partial / ".edgekv-partial").touch()
    (partial / "model.onnx").write_bytes(b"half")
    old = tmp_path / f".out.old-{dead.pid}"
    shutil.copytree(export_dir, old)
    foreign = tmp_path / f".out.tmp-{dead.pid + 1}"  # the same name pattern, but nothing says edgekv wrote it
    foreign.mkdir()
    (foreign / "x").write_text("x")
    said = []
    monkeypatch.setattr(pipeline, "_run", _fake_run(lambda o: None))
    pipeline.export_model(ExportOptions(model=str(TINY_LLAMA), out=out, max_ctx=64), echo=said.append)
    assert not partial.exists() and not old.exists()
    assert (foreign / "x").read_text() == "x"
    assert any("removed 2 leftover" in s for s in said), said
    assert (out / "model.onnx").read_bytes() == b"new" and not (out / ".edgekv-partial").exists()


def test_every_exported_file_has_the_mode_open_gives(export_dir):
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in export_dir.iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes


def test_second_export_without_force_is_refused(export_dir):
    code, _, err = cli("export", "--model", TINY_LLAMA, "--out", export_dir, "--max-ctx", "64")
    one_line_exit_2(code, err, "already exists")


# ---- the manifest vouches for every file, every path stays inside ----


def test_an_unlisted_external_data_file_is_refused(copy_of):
    from edgekv.errors import EdgekvError
    from edgekv.export.manifest import load_export

    edit_manifest(copy_of, lambda m: m["files"].pop("model.onnx.data"))
    data = copy_of / "model.onnx.data"
    b = bytearray(data.read_bytes())
    b[-100:] = bytes(100)
    data.write_bytes(bytes(b))
    with pytest.raises(EdgekvError, match="not listed"):
        load_export(copy_of)
    code, _, err = cli("run", copy_of, "--prompt", "def ", "--max-new-tokens", "2")
    one_line_exit_2(code, err, "model.onnx.data is not listed")


def test_an_unlisted_tokenizer_is_refused(copy_of):
    edit_manifest(copy_of, lambda m: m["files"].pop("tokenizer.json"))
    code, _, err = cli("run", copy_of, "--prompt", "def ", "--max-new-tokens", "2")
    one_line_exit_2(code, err, "tokenizer.json is not listed")


def test_manifest_paths_outside_the_folder_are_refused(copy_of, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(copy_of / "tokenizer.json", outside / "tokenizer.json")
    for name in ("../outside/tokenizer.json", str(outside / "tokenizer.json")):
        d = tmp_path / f"case{len(name)}"
        shutil.copytree(copy_of, d)
        b = (outside / "tokenizer.json").read_bytes()

        def point(m, name=name, b=b):
            m["tokenizer"]["file"] = name
            m["files"][name] = {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)}
        edit_manifest(d, point)
        code, _, err = cli("run", d, "--prompt", "def ", "--max-new-tokens", "2")
        one_line_exit_2(code, err, "outside the export folder")
    # a listed name that is a symlink leading out
    d = tmp_path / "symlinked"
    shutil.copytree(copy_of, d)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    code, _, err = cli("run", d, "--prompt", "def ", "--max-new-tokens", "2")
    one_line_exit_2(code, err, "symlink leading outside")


def _resize_state(m, slots):
    m["max_ctx"] = slots
    m["state"]["ctx"] = slots
    for t in m["state"]["tensors"]:
        t["shape"][2] = slots
    for a in m["artifacts"]:
        for ep in a["entry_points"]:
            for spec in ep["inputs"] + ep["outputs"]:
                if spec["name"].startswith(("past", "present")):
                    spec["shape"][2] = slots


def test_state_shapes_that_are_not_the_graphs_are_refused_before_allocating(copy_of):
    """A manifest consistent with itself (max_ctx, state, entry points) but not with the graph: 2^30 slots would
    allocate 8 x 384 GiB."""
    from edgekv.errors import EdgekvError
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper

    edit_manifest(copy_of, lambda m: _resize_state(m, 2**30))
    m = load_export(copy_of)
    with pytest.raises(EdgekvError, match="does not describe this graph"):
        OrtStepper(m, copy_of)
    code, _, err = cli("run", copy_of, "--prompt", "def ", "--max-new-tokens", "2")
    one_line_exit_2(code, err, "does not describe this graph")


def test_state_dtype_that_is_not_the_graphs_is_refused(copy_of):
    def f32(m):
        for t in m["state"]["tensors"]:
            t["dtype"] = "float32"
        for ep in m["artifacts"][0]["entry_points"]:
            for spec in ep["inputs"] + ep["outputs"]:
                if spec["name"].startswith(("past", "present")):
                    spec["dtype"] = "float32"
    edit_manifest(copy_of, f32)
    code, _, err = cli("run", copy_of, "--prompt", "def ", "--max-new-tokens", "2")
    one_line_exit_2(code, err, "does not describe this graph")


def test_max_ctx_beyond_the_cache_is_refused(copy_of):
    """Positions past the 64 slots would fail inside the runtime after 64 tokens."""
    edit_manifest(copy_of, lambda m: m.update(max_ctx=1000))
    code, _, err = cli("run", copy_of, "--prompt", "def ", "--max-new-tokens", "2")
    one_line_exit_2(code, err, "max_ctx")


def test_a_deeply_nested_or_huge_manifest_is_one_line(copy_of):
    (copy_of / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    code, _, err = cli("run", copy_of, "--prompt", "def ", "--max-new-tokens", "2")
    one_line_exit_2(code, err, "nested")


def test_an_invalid_tokenizer_behind_a_matching_hash_is_one_line(copy_of):
    (copy_of / "tokenizer.json").write_text('{"model": 1}')
    rehash(copy_of, "tokenizer.json")
    code, _, err = cli("run", copy_of, "--prompt", "def ", "--max-new-tokens", "2")
    one_line_exit_2(code, err, "tokenizer")


def test_an_invalid_utf8_prompt_is_one_line(export_dir):
    p = subprocess.run(EDGEKV + ["run", str(export_dir), "--prompt", os.fsdecode(b"caf\xe9"), "--max-new-tokens", "2"],
                       capture_output=True, cwd=ROOT, timeout=300)
    err = p.stderr.decode(errors="replace")
    one_line_exit_2(p.returncode, err, "not valid UTF-8")


# ---- profile: a dying child is a failed run, not a traceback ----


def test_child_results_name_the_signal_or_the_error():
    from edgekv.profile.run import child_result
    assert child_result(256, -9, "", "")["status"].startswith("failed: killed by SIGKILL")
    assert "SIGSEGV" in child_result(256, -11, "", "")["status"]
    r = child_result(256, 1, "", "Traceback...\nedgekv.errors.EdgekvError: x: cannot load it\n")
    assert r["status"] == "failed: exit 1: edgekv.errors.EdgekvError: x: cannot load it"
    assert child_result(256, 0, '{"ctx": 256, "status": "ok"}\n', "")["status"] == "ok"


def test_profile_keeps_the_runs_when_children_die(copy_of, tmp_path):
    """A model corrupted behind a matching hash, still a well-formed ONNX file (an operator renamed), so the parent
    accepts it and each child's ONNX Runtime fails to load it. The report keeps every run, marked
    failed with the child's error, and the command ends in one line naming them, exit 3 (a run did not finish)."""
    b = (copy_of / "model.onnx").read_bytes()
    assert b"GroupQueryAttention" in b
    (copy_of / "model.onnx").write_bytes(b.replace(b"GroupQueryAttention", b"GroupQueryAttentioX"))
    rehash(copy_of, "model.onnx")
    out = tmp_path / "prof.json"
    code, _, err = cli("profile", copy_of, "--ctx", "48,64", "--steps", "8", "--out", out)
    assert code == 3, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("edgekv: 2 of 2 runs failed")
    rep = json.loads(out.read_text())
    assert [r["ctx"] for r in rep["runs"]] == [48, 64]
    assert all(r["status"].startswith("failed: exit 1: edgekv.errors.EdgekvError: ") and "model.onnx" in r["status"]
               and not r["fits"]
               for r in rep["runs"])


# ---- output paths are checked before the work ----


def test_output_paths_are_checked_before_the_work(export_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, _, err = cli("profile", export_dir, "--ctx", "48", "--steps", "8", "--out", blocker / "p.json")
    one_line_exit_2(code, err, "--out")
    assert "fresh process" not in err
    code, _, err = cli("report", export_dir, "--out", blocker / "r.html")
    one_line_exit_2(code, err, "--out")
    code, _, err = cli("plan", "--device", "pixel8", "--ctx", "4k", "--plot", tmp_path / "noext")
    one_line_exit_2(code, err, "must end in")
    code, _, err = cli("plan", "--device", "pixel8", "--ctx", "4k", "--plot", blocker / "x.png")
    one_line_exit_2(code, err, "--plot")
    code, _, err = cli("plan", "--device", "pixel8", "--ctx", "4k", "--plot", "/proc/edgekv.png")
    one_line_exit_2(code, err, "--plot")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_analyze_save_name_stays_in_measurements(tmp_path, monkeypatch):
    import edgekv.analyze.report as areport
    import edgekv.quality as quality

    store = tmp_path / "pkg" / "edgekv" / "measurements"
    store.mkdir(parents=True)
    monkeypatch.setattr(quality, "MEASURED_DIR", store)
    monkeypatch.setattr(areport, "MEASURED_DIR", store)
    code, _, err = cli("analyze", "--model", ROOT / "fixtures" / "tiny" / "mamba", "--strategy", "ssm", "--ctx", "64",
                       "--bits", "8", "--weight-bits", "0", "--save", "--name", "../../x")
    one_line_exit_2(code, err, "--name")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_report_refuses_a_phone_as_gpu_and_a_non_profile(export_dir):
    code, _, err = cli("report", export_dir, "--gpu", "pixel8")
    one_line_exit_2(code, err, "not a datacenter GPU")
    code, _, err = cli("report", export_dir, "--profile", export_dir / "manifest.json")
    one_line_exit_2(code, err, "report.schema.json")
    assert sorted(os.listdir(export_dir)) == ["manifest.json", "model.onnx", "model.onnx.data", "tokenizer.json"]


# ---- sizes no model has, devices no phone has ----


def _config(tmp_path, **change) -> Path:
    cfg = json.loads((TINY_LLAMA / "config.json").read_text())
    cfg.update(change)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_a_billion_layers_is_one_line_before_any_allocation(tmp_path):
    """Run under a 2 GiB address-space limit: building 1e9 layers' weight list ran out of memory (19 GB here)."""
    cfg = _config(tmp_path, num_hidden_layers=10**9)
    code = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
            "sys.argv = ['edgekv'] + sys.argv[1:]; runpy.run_module('edgekv.cli', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, "plan", "--device", "pixel8", "--ctx", "4k", "--model", str(cfg)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    one_line_exit_2(p.returncode, p.stderr, "num_hidden_layers")


@pytest.mark.parametrize("field", ["head_dim", "vocab_size", "num_attention_heads", "hidden_size",
                                   "num_hidden_layers", "intermediate_size"])
def test_zero_sizes_are_refused(field, tmp_path):
    code, _, err = cli("plan", "--device", "pixel8", "--ctx", "4k", "--model", _config(tmp_path, **{field: 0}))
    one_line_exit_2(code, err, field)


def test_a_gguf_with_zero_heads_is_one_line(tmp_path):
    import gguf
    p = tmp_path / "zero.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    for key, value in (("llama.embedding_length", 64), ("llama.block_count", 2), ("llama.attention.head_count", 0),
                       ("llama.feed_forward_length", 128), ("llama.vocab_size", 256)):
        w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, _, err = cli("plan", "--device", "pixel8", "--ctx", "4k", "--model", p)
    one_line_exit_2(code, err, "head_count")


def _device(tmp_path, **values) -> Path:
    """pixel8.toml with the `value` of the named facts replaced (TOML's nan and inf included)."""
    import re
    text = (ROOT / "device_profiles" / "pixel8.toml").read_text()
    for k, v in values.items():
        text, n = re.subn(rf"(\[{k}\]\nvalue = )[^\n]+", rf"\g<1>{v}", text)
        assert n == 1, k
    p = tmp_path / "d.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("values", [
    {"mem_bandwidth_bytes_per_s": 0}, {"mem_bandwidth_bytes_per_s": "nan"}, {"mem_bandwidth_bytes_per_s": "inf"},
    {"compute_flops": 0}, {"ram_bytes": 0}, {"app_budget_bytes": "1e15"},
])
def test_impossible_device_values_are_refused(values, tmp_path):
    p = _device(tmp_path, **values)
    code, out, err = cli("plan", "--device", p, "--ctx", "4k", "--model", "smollm2-135m", "--json")
    one_line_exit_2(code, err, next(iter(values)))
    assert "Infinity" not in out and "NaN" not in out


def test_json_output_never_holds_nan_or_infinity(capsys):
    from edgekv.termtext import print_json
    print_json({"a": float("inf"), "b": [float("nan"), 1.5], "c": {"d": -float("inf")}})
    assert json.loads(capsys.readouterr().out) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


# ---- one line for every error ----


def test_usage_errors_are_one_line():
    for args in (["plan"], ["plan", "--device", "pixel8", "--ctx", "1k", "--weights", "q3"], ["plan", "--bogus"],
                 ["nosuch"], ["export", "--model", "x"], ["profile"]):
        code, _, err = cli(*args)
        one_line_exit_2(code, err)


def test_ring_timeout_below_a_second_is_one_line():
    p = subprocess.run(EDGEKV + ["ring", "--world", "2", "--ctx", "1k", "--timeout", "0.001"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    one_line_exit_2(p.returncode, p.stderr, "--timeout")


@pytest.mark.parametrize("args,needle", [
    (["plan", "--device", "pixel8", "--ctx", "4k", "--strategy", "kv-int4:group=²"], "group"),
    (["plan", "--device", "pixel8", "--ctx", "4k", "--strategy", "kv-int4:group=٣"], "non-negative integer"),
    (["plan", "--device", "pixel8", "--ctx", "٤k"], "token count"),
    (["profile", "x", "--limit", "٣GB"], "memory size"),
])
def test_unusual_digits_are_one_line(args, needle):
    code, _, err = cli(*args)
    one_line_exit_2(code, err, needle)


def test_an_inapplicable_default_strategy_does_not_stop_the_plan():
    """The tiny Llama's head_dim 48 is no multiple of kv-int4's default group 32: that row is listed as not
    applicable, the others are planned; asked for explicitly it is still an error."""
    code, out, err = cli("plan", "--device", "pixel8", "--ctx", "4k", "--model", TINY_LLAMA, "--json")
    assert code == 0, err
    p = json.loads(out)
    planned = {o["strategy"].split(":")[0] for o in p["options"]}
    assert {"kv", "kv-int8", "mla"} <= planned and "kv-int4" not in planned
    na = [e for e in p["not_applicable"] if e["strategy"].startswith("kv-int4")]
    assert na and "head_dim 48 is not a multiple of group 32" in na[0]["reason"]
    code, _, err = cli("plan", "--device", "pixel8", "--ctx", "4k", "--model", TINY_LLAMA, "--strategy", "kv-int4")
    one_line_exit_2(code, err, "head_dim 48")


def test_external_data_the_graph_names_must_be_listed(copy_of):
    """ONNX Runtime opens what the graph names, whatever the manifest's external_data says: dropping both the
    manifest's external_data and its `files` entry must not let an unlisted (here: changed) file load."""
    def drop(m):
        m["artifacts"][0].pop("external_data")
        m["files"].pop("model.onnx.data")
    edit_manifest(copy_of, drop)
    data = copy_of / "model.onnx.data"
    b = bytearray(data.read_bytes())
    b[:64] = bytes(64)
    data.write_bytes(bytes(b))
    code, _, err = cli("run", copy_of, "--prompt", "def ", "--max-new-tokens", "2")
    one_line_exit_2(code, err, "external data model.onnx.data is not listed")


def test_an_error_a_stopping_export_meets_on_its_way_out_still_exits_143(monkeypatch, tmp_path):
    """SIGTERM's SystemExit can land inside a library's callback that turns it into its own error (a CI run: the
    safetensors reader's ValueError, then "export failed at stage load ... not a readable safetensors file", exit 2).
    Once the handler has run, an export's error exits 143, the stop's code, without a second line."""
    import signal

    from click.testing import CliRunner

    import edgekv.children as children
    import edgekv.export.pipeline as pipeline
    from edgekv.cli import main
    from edgekv.errors import EdgekvError

    def stopped_in_load(opts, echo=None, status=None):
        children.stopped(signal.SIGTERM, said=True)  # what the export's handler records before its SystemExit
        raise EdgekvError("export failed at stage load: model.safetensors: not a readable safetensors file")
    monkeypatch.setattr(children, "STOPPED_BY", [])
    monkeypatch.setattr(pipeline, "export_model", stopped_in_load)
    before = signal.getsignal(signal.SIGTERM)
    try:
        r = CliRunner().invoke(main, ["export", "--model", str(TINY_LLAMA), "--max-ctx", "64", "--out",
                                      str(tmp_path / "out")])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert r.exit_code == 143, r.output
    assert "not a readable" not in r.output


@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGKILL", marks=pytest.mark.slow)])
def test_a_killed_export_leaves_nothing_the_next_run_does_not_remove(sig, tmp_path):
    """SIGTERM unwinds (the temporary folder goes at once); SIGKILL cannot be caught, and the next export to the same
    --out removes the marked folder the dead process left."""
    import signal
    import time

    from edgekv.export.publish import clean_leftovers

    out = tmp_path / "out"
    p = subprocess.Popen(EDGEKV + ["export", "--model", str(TINY_LLAMA), "--max-ctx", "64", "--out", str(out)],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tmp = tmp_path / f".out.tmp-{p.pid}"
    deadline = time.time() + 120
    while not (tmp / ".edgekv-partial").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert (tmp / ".edgekv-partial").exists()
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    assert not out.exists()
    if sig == "SIGTERM":
        assert p.returncode == 143 and "export stopped" in err and "Traceback" not in err, err
        assert sorted(os.listdir(tmp_path)) == []
    else:
        assert tmp.exists()
        assert clean_leftovers(out) == [tmp] and sorted(os.listdir(tmp_path)) == []


def test_graph_io_check_reads_a_pte_methods_sizes_as_bounds_of_its_dynamic_axes():
    """check_graph_io on .pte-style metadata: a dynamic axis ('seq', 'rows') takes the method's upper bound, a state
    tensor must match exactly, a dtype must match."""
    from edgekv.errors import EdgekvError
    from edgekv.export.stepper import check_graph_io

    state = [{"input": "past.0", "output": "present.0", "shape": [1, 2, 64, 8], "dtype": "float16"}]
    ep = {"name": "forward", "tokens": "seq",
          "inputs": [{"name": "tokens", "dtype": "int64", "shape": [1, "seq"]},
                     {"name": "pos", "dtype": "int64", "shape": [1]},
                     {"name": "past.0", "dtype": "float16", "shape": [1, 2, 64, 8]},
                     {"name": "rows", "dtype": "int64", "shape": ["rows"]}],
          "outputs": [{"name": "logits", "dtype": "float32", "shape": [1, "rows", 256]},
                      {"name": "present.0", "dtype": "float16", "shape": [1, 2, 64, 8]}]}
    m = {"state": {"tensors": state}, "artifacts": [{"format": "pte", "entry_points": [ep]}]}

    def graph(past=(1, 2, 64, 8), dtype="float16"):
        return {"forward": ([(None, "int64", [1, 32]), (None, "int64", [1]), (None, dtype, list(past)),
                             (None, "int64", [32])],
                            [(None, "float32", [1, 32, 256]), (None, dtype, list(past))])}
    check_graph_io(m, "pte", "model.pte", graph())
    for bad in (graph(past=(1, 2, 2**20, 8)), graph(dtype="float32"), {"prefill": graph()["forward"]}):
        with pytest.raises(EdgekvError):
            check_graph_io(m, "pte", "model.pte", bad)


def test_a_stop_wrapped_by_a_toolchain_error_still_exits_as_the_stop():
    """SIGTERM's handler calls sys.exit(143); a library catching BaseException may re-raise it as its own error. The
    stage wrapper must let that exit through (143), not report it as a failed stage (exit 2)."""
    from edgekv.errors import EdgekvError
    from edgekv.export.options import Stages

    st = Stages(names=["lower"], echo=lambda *_: None)
    with pytest.raises(SystemExit) as ex:
        with st.stage("lower"):
            try:
                raise SystemExit(143)
            except BaseException as e:
                raise RuntimeError("tracer failed") from e
    assert ex.value.code == 143
    with pytest.raises(EdgekvError, match="export failed at stage lower: RuntimeError: tracer failed"):
        with st.stage("lower"):
            raise RuntimeError("tracer failed")


def test_force_refuses_a_user_folder_even_beside_files_edgekv_also_writes(export_dir, tmp_path):
    """report.html, report.md and report.android.json are names edgekv writes into an export afterwards; a folder
    holding them and a user's file is still the user's (the ownership check is never skipped for them)."""
    for base in ("user", "export"):
        d = tmp_path / base
        if base == "export":
            shutil.copytree(export_dir, d)
        else:
            d.mkdir()
        for name in ("report.html", "report.md", "report.android.json"):
            (d / name).write_text("<html>edgekv</html>" if name.endswith("html") else "{}")
        (d / "thesis.tex").write_text("years of work")
        code, _, err = cli("export", "--model", TINY_LLAMA, "--out", d, "--force", "--max-ctx", "64")
        one_line_exit_2(code, err, "thesis.tex" if base == "export" else "not one")
        assert (d / "thesis.tex").read_text() == "years of work"
        assert (d / "report.html").is_file()


def test_a_dotdot_in_a_manifest_path_is_refused_even_when_it_stays_inside(copy_of):
    """`sub/../tokenizer.json` resolves inside the folder, so only the no-`..` rule refuses it (the symlink rule,
    which shares the words 'outside the export folder', cannot)."""
    from edgekv.errors import EdgekvError
    from edgekv.export.manifest import member

    (copy_of / "sub").mkdir()
    assert member(copy_of, "tokenizer.json", "tokenizer") == copy_of / "tokenizer.json"
    for name in ("sub/../tokenizer.json", "./sub/../tokenizer.json", ".."):
        with pytest.raises(EdgekvError, match="points outside the export folder"):
            member(copy_of, name, "tokenizer")
