"""What edgekv writes (SECURITY.md, "What edgekv writes, and never overwrites"; issue 37's write-side cases).

The output rule, for every command that writes a file (plan --plot, analyze --plot, profile -o, report --out,
run --save-state, profile --adb's report.android.json): a path where nothing is yet is written; a plain file edgekv
wrote is replaced with --force; nothing else ever: a user's file, a symlink, a folder, a FIFO, and no path inside an
export folder but the pages edgekv writes there. The property test draws existing files (a user's text and binary
files, JSON, edgekv's own earlier outputs made by the real commands, an export's manifest.json / model.onnx /
tokenizer.json, symlinks) and holds the check (outputs.check_writable, what every command calls before its work)
and the write (outputs.write_atomic, which checks again right before the rename) to what the draw says, worked out
here from how each file was made, not from edgekv's recognition. Then real command lines for the cases the issue
found: each refused in one line with exit code 2, before the work, leaving the file as it was.
"""
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CLI_TIMEOUT, EDGEKV, ROOT, run_cli
from edgekv.errors import EdgekvError
from edgekv.outputs import PLOT_FORMATS, check_writable, write_atomic

pytest.importorskip("onnxruntime")

AFTERWARDS = ("report.html", "report.md", "report.android.json")  # docs/export.md: what edgekv writes in an export
# every command that writes a file: (its option, the name endings it takes, None: any)
WRITERS = [("plan --plot", "--plot", PLOT_FORMATS), ("analyze --plot", "--plot", PLOT_FORMATS),
           ("profile -o", "--out", None), ("report --out", "--out", (".html", ".md")),
           ("run --save-state", "--save-state", None), ("profile --adb", "--adb", None)]


def _invoke(*args):
    from edgekv.cli import main
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line_2(r, words=()):
    """exit code 2, one line on stderr naming words, no traceback (r: a CliRunner result or a CompletedProcess)."""
    code = r.exit_code if hasattr(r, "exit_code") else r.returncode
    err = r.stderr
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _digest(folder: Path) -> dict:
    """Every entry under folder: symlinks by target, files by sha256 (what 'unchanged' means here)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir" if p.is_dir() else "other"
    return out


@pytest.fixture(scope="module")
def own(tiny_onnx_export, tmp_path_factory):
    """edgekv's own earlier outputs, each made by the command that writes it: plots in every format, a profile
    JSON, a report page (HTML and Markdown), a state file."""
    d = tmp_path_factory.mktemp("own")
    made = {}
    for suffix in PLOT_FORMATS:
        p = d / f"plan{suffix}"
        r = _invoke("plan", "--device", "pixel8", "--ctx", "4k", "--model", "smollm2-135m", "--plot", p)
        assert r.exit_code == 0, r.output
        made[suffix] = p
    run_cli("profile", tiny_onnx_export, "--ctx", "32", "--steps", "2", "--threads", "1", "--out", d / "p.json",
            check=True)
    made[".json"] = d / "p.json"
    for suffix in (".html", ".md"):
        run_cli("report", tiny_onnx_export, "--profile", d / "p.json", "--out", d / f"r{suffix}", check=True)
        made[suffix] = d / f"r{suffix}"
    run_cli("run", tiny_onnx_export, "-p", "hello", "-n", "0", "--threads", "1", "--save-state", d / "s.state",
            check=True)
    made[".state"] = d / "s.state"
    return made


def _user_files():
    """A user's files: text, bytes that start like the formats edgekv writes (without its mark), JSON."""
    heads = st.sampled_from([b"", b"\x89PNG\r\n\x1a\n", b"%PDF-1.4\n", b"\xff\xd8\xff\xe0", b"<!doctype html>",
                             b"<?xml version='1.0'?><svg>", b"<!-- generator: ", b"{\"runs\": ",
                             b"\x10\x00\x00\x00\x00\x00\x00\x00{\"__metadata__\":{}}"])
    text = st.text(max_size=200).map(str.encode)
    return st.one_of(st.tuples(heads, st.binary(max_size=300)).map(lambda t: t[0] + t[1]), text,
                     st.dictionaries(st.text(max_size=10), st.one_of(st.integers(), st.text(max_size=20)),
                                     max_size=5).map(lambda d: json.dumps(d).encode()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(writer=st.sampled_from(WRITERS), existing=st.sampled_from(["none", "user", "own", "link-own", "link-user",
                                                                  "folder"]),
       where=st.sampled_from(["plain", "export-new", "export-own-file", "export-page"]), force=st.booleans(),
       data=st.data())
def test_the_output_rule_holds_for_every_writer(own, tiny_onnx_export, writer, existing, where, force, data):
    _, option, suffixes = writer
    suffix = data.draw(st.sampled_from(suffixes or (".json", ".txt", "", ".state", ".png")), label="suffix")
    with tempfile.TemporaryDirectory() as t:
        t = Path(t)
        folder = t / "work"
        if where == "plain":
            folder.mkdir()
            name = f"out{suffix}"
        else:  # a copy of a real export (hard links: nothing of the original can change through them unnoticed)
            shutil.copytree(tiny_onnx_export, folder, copy_function=os.link)
            if where == "export-own-file":  # what the export owns: its manifest and the files it lists
                listed = sorted(json.loads((folder / "manifest.json").read_text())["files"])
                name = data.draw(st.sampled_from(["manifest.json", *listed]), label="export file")
                existing = "export"
            elif where == "export-page":
                fits = [n for n in AFTERWARDS if suffixes is None or Path(n).suffix in suffixes]
                if not fits:
                    return
                name = data.draw(st.sampled_from(fits), label="page")
            else:
                name = f"notes{suffix}"
        target = folder / name
        mine = None
        if existing in ("own", "link-own"):  # an earlier output of a command that writes this kind of name
            kind = suffix.lower() if suffix.lower() in own else data.draw(
                st.sampled_from([".json", ".state", ".png"]), label="own kind")
            mine = own[kind]
        if existing == "own":
            shutil.copyfile(mine, target)
        elif existing == "user":
            target.write_bytes(data.draw(_user_files(), label="user file"))
        elif existing == "link-own":
            shutil.copyfile(mine, t / "elsewhere")
            target.symlink_to(t / "elsewhere")
        elif existing == "link-user":
            (t / "elsewhere").write_text("a user's file")
            target.symlink_to(t / "elsewhere")
        elif existing == "folder":
            target.mkdir()
        before = _digest(t)
        in_export = where != "plain"
        allowed = (not in_export or name in AFTERWARDS) and (existing == "none" or (existing == "own" and force))
        if allowed:
            check_writable(target, option, suffixes, force=force)
            write_atomic(target, b"new", option=option, force=force)
            assert target.read_bytes() == b"new"
            assert sorted(p.name for p in folder.iterdir()) == sorted({*before_names(before, folder, t), name})
            return
        with pytest.raises(EdgekvError) as e:
            check_writable(target, option, suffixes, force=force)
        assert "\n" not in str(e.value) and option in str(e.value)
        if existing not in ("none", "folder"):  # the second check, right before the rename, holds too
            with pytest.raises(EdgekvError):
                write_atomic(target, b"new", option=option, force=force)
        assert _digest(t) == before  # nothing changed, nothing left behind


def before_names(before: dict, folder: Path, t: Path) -> set:
    rel = folder.relative_to(t).as_posix() + "/"
    return {k[len(rel):] for k in before if k.startswith(rel) and "/" not in k[len(rel):]}


def test_a_state_file_whose_header_length_reads_as_a_brace_is_still_edgekvs(tmp_path):
    """A safetensors file starts with its header's length, little-endian: a length of 0x17b begins with "{", as JSON
    does. Built here by the safetensors layout (https://github.com/huggingface/safetensors), not by statefile."""
    import struct

    from edgekv.outputs import edgekv_wrote
    header = json.dumps({"__metadata__": {"format": "edgekv-state"}}).encode()
    header += b" " * (0x17B - len(header))
    p = tmp_path / "s.state"
    p.write_bytes(struct.pack("<Q", len(header)) + header)
    assert p.read_bytes()[:1] == b"{"
    assert edgekv_wrote(p) is None
    p.write_bytes(struct.pack("<Q", len(header)) + header.replace(b"edgekv-state", b"someone-else"))
    assert edgekv_wrote(p) is not None


# --- the command lines the issue ran ---

@pytest.fixture
def export_copy(tiny_onnx_export, tmp_path) -> Path:
    out = tmp_path / "export"
    shutil.copytree(tiny_onnx_export, out)
    return out


@pytest.mark.parametrize("args,victim", [
    (("profile", "{E}", "-c", "32", "--steps", "2", "-o", "{E}/manifest.json"), "manifest.json"),
    (("report", "{E}", "--out", "{E}/model.onnx"), "model.onnx"),
    (("profile", "{E}", "-c", "32", "--steps", "2", "-o", "{T}/thesis.txt"), "thesis.txt"),
    (("report", "{E}", "--out", "{T}/notes.html"), "notes.html"),
    (("profile", "{E}", "-c", "32", "--steps", "2", "-o", "{T}/thesis.txt", "--force"), "thesis.txt"),
])
def test_profile_and_report_never_replace_an_export_file_or_a_users_file(export_copy, tmp_path, args, victim):
    (tmp_path / "thesis.txt").write_text("chapter one")
    (tmp_path / "notes.html").write_text("<html>my notes</html>")
    before = _digest(tmp_path)
    p = run_cli(*[a.replace("{E}", str(export_copy)).replace("{T}", str(tmp_path)) for a in args])
    _one_line_2(p, [victim])
    assert _digest(tmp_path) == before
    assert run_cli("run", export_copy, "-p", "hi", "-n", "1", "--threads", "1").returncode == 0  # still loads


def test_an_earlier_output_is_replaced_with_force_only(tmp_path):
    out = tmp_path / "plan.png"
    assert _invoke("plan", "-d", "pixel8", "-c", "4k", "-m", "smollm2-135m", "--plot", out).exit_code == 0
    first = out.read_bytes()
    r = _invoke("plan", "-d", "pixel8", "-c", "8k", "-m", "smollm2-135m", "--plot", out)
    assert "--force" in _one_line_2(r, ["--plot"]) and out.read_bytes() == first
    r = _invoke("plan", "-d", "pixel8", "-c", "8k", "-m", "smollm2-135m", "--plot", out, "--force")
    assert r.exit_code == 0, r.output
    assert out.read_bytes() != first and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


LONG = "x" * 256  # file systems take names of 255 bytes at most (NAME_MAX)


@pytest.mark.parametrize("args", [("plan", "-d", "pixel8", "-c", "4k", "--plot", "{T}/" + LONG + ".png"),
                                  ("profile", "{E}", "-c", "32", "-o", "{T}/" + LONG + ".json"),
                                  ("run", "{E}", "-p", "hi", "--save-state", "{T}/" + LONG + ".state"),
                                  ("run", "{E}", "-p", "hi", "--save-state", "{T}/" + LONG[:245] + ".state"),
                                  ("run", "{E}", "-p", "hi", "--resume", "{T}/" + LONG + ".state")])
def test_a_name_too_long_for_the_file_system_is_one_line(tiny_onnx_export, tmp_path, args):
    p = run_cli(*[a.replace("{E}", str(tiny_onnx_export)).replace("{T}", str(tmp_path)) for a in args])
    _one_line_2(p)
    assert list(tmp_path.iterdir()) == []


def test_save_state_into_a_fifo_is_refused_without_reading_it(tiny_onnx_export, tmp_path):
    fifo = tmp_path / "s.state"
    os.mkfifo(fifo)
    try:  # today's code opened the FIFO to read it and waited for a writer for ever
        p = subprocess.run(EDGEKV + ["run", str(tiny_onnx_export), "-p", "hi", "-n", "1", "--save-state", str(fifo),
                                     "--force"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("run --save-state FIFO hung")
    _one_line_2(p, ["FIFO"])


def test_save_state_is_checked_before_the_run(tiny_onnx_export, tmp_path, monkeypatch):
    import edgekv.export.generate as generate

    def no_work(*a, **k):
        raise AssertionError("the export was opened before --save-state was checked")
    monkeypatch.setattr(generate, "open_export", no_work)
    from edgekv.export.cli import cli
    for target in (tmp_path / "nodir" / "x.state", tmp_path / "notes.txt"):
        (tmp_path / "notes.txt").write_text("mine")
        r = CliRunner().invoke(cli, ["run", str(tiny_onnx_export), "-p", "hi", "--save-state", str(target)])
        _one_line_2(r, ["--save-state"])
        assert (tmp_path / "notes.txt").read_text() == "mine"


def test_save_state_into_a_read_only_folder_is_one_line(tiny_onnx_export, tmp_path, monkeypatch):
    """A read-only mount, as the kernel answers in it: EROFS for every create, write and unlink there (the
    cleanup in today's handler raised again). Simulated in-process: tests do not mount file systems."""
    import builtins
    import pathlib
    ro = tmp_path / "ro"
    ro.mkdir()

    def inside(path) -> bool:
        try:
            return Path(os.fsdecode(path)).resolve().parent == ro.resolve()
        except (TypeError, ValueError):
            return False

    def refusing(fn, writes):
        def wrapped(path, *a, **k):
            mode = a[0] if a else k.get("mode", k.get("flags", "r"))
            if inside(path) and writes(mode):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return fn(path, *a, **k)
        return wrapped
    monkeypatch.setattr(builtins, "open", refusing(builtins.open, lambda m: isinstance(m, str) and set(m) & set("wax+")))
    monkeypatch.setattr(os, "open", refusing(os.open, lambda f: bool(f & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))))
    monkeypatch.setattr(os, "unlink", refusing(os.unlink, lambda m: True))
    monkeypatch.setattr(pathlib.Path, "unlink", refusing(pathlib.Path.unlink, lambda m: True))
    from edgekv.export.cli import cli
    r = CliRunner().invoke(cli, ["run", str(tiny_onnx_export), "-p", "hi", "-n", "1", "--save-state",
                                 str(ro / "s.state")])
    _one_line_2(r, ["--save-state", "Read-only file system"])


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_saves_temporary_is_removed_by_the_next_save(tiny_onnx_export, tmp_path):
    """A save killed mid-write leaves its hidden temporary; the next write to that name removes those of edgekv's
    naming whose process is gone, and nothing else."""
    dead, alive = _dead_pid(), os.getppid()
    s = tmp_path / "s.state"
    stale = [tmp_path / f".s.state.{dead}.tmp", tmp_path / f".s.state.tmp-{dead}-abcd_123.state"]
    kept = [tmp_path / f".s.state.{alive}.tmp", tmp_path / f".s.state.{dead}.tmp.mine", tmp_path / "s.state.tmp",
            tmp_path / f".other.state.{dead}.tmp"]
    for p in stale + kept:
        p.write_bytes(b"\0" * 4096)
    run_cli("run", tiny_onnx_export, "-p", "hi", "-n", "0", "--threads", "1", "--save-state", s, check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([s.name] + [p.name for p in kept])


@pytest.mark.parametrize("args", [("plan", "--device", "pixel8", "--ctx", "32k"),
                                  ("plan", "--device", "pixel8", "--ctx", "32k", "--json"), ("devices",)])
def test_stdout_on_a_full_device_is_one_line(args):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        p = subprocess.run(EDGEKV + list(args), stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           timeout=CLI_TIMEOUT)
    _one_line_2(p, ["No space left on device"])


def test_analyze_save_updates_its_own_measurement_and_nothing_else(tmp_path):
    """--save's store (analyze.report.store): its own earlier file is updated without --force; a file of that name
    that edgekv did not write is left as it was."""
    from edgekv.analyze.report import store
    fit = {"law": "power", "class": "flat", "params": {"a": 1e-4, "b": 0.01}}
    result = {"model": "m", "ctx": 64, "text": "t", "variants": [
        {"source": "state", "rounding": "nearest", "fit": fit, "strategy": "kv-int8", "kl": [1e-4], "mean_top1": 1.0}]}
    [p] = store(result, "m", tmp_path)
    first = json.loads(p.read_text())
    assert first["strategy"] == "kv-int8" and first["measured_ctx"] == 64
    result["ctx"] = 128
    assert store(result, "m", tmp_path) == [p] and json.loads(p.read_text())["measured_ctx"] == 128
    p.write_text('{"my": "numbers"}\n')
    with pytest.raises(EdgekvError, match="edgekv did not write it"):
        store(result, "m", tmp_path)
    assert p.read_text() == '{"my": "numbers"}\n' and [q.name for q in tmp_path.iterdir()] == [p.name]


def test_a_write_killed_midway_leaves_a_temporary_the_next_save_removes(tiny_onnx_export, tmp_path):
    """SIGKILL while the new file is being written (a writer that stops after 1 MiB): its hidden temporary stays,
    the old file is intact, and the next save to that name removes the temporary."""
    import signal
    s = tmp_path / "s.state"
    code = ("import sys, time\nfrom edgekv.outputs import write_atomic\n"
            "def w(tmp):\n    open(tmp, 'wb').write(b'0' * 2**20)\n    print('half', flush=True)\n    time.sleep(120)\n"
            "write_atomic(sys.argv[1], b'', writer=w)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(s)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "half"
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = [q for q in tmp_path.iterdir() if q.name.startswith(".s.state")]
    assert len(left) == 1 and left[0].stat().st_size == 2**20 and not s.exists()
    run_cli("run", tiny_onnx_export, "-p", "hi", "-n", "0", "--threads", "1", "--save-state", s, check=True)
    assert [q.name for q in tmp_path.iterdir()] == ["s.state"]
