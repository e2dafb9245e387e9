"""A careless or hostile user, round two (issue 37): inputs that grew memory without end or ended in a traceback
now end in one line on stderr and exit code 2."""
import hashlib
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from conftest import EDGEKV, ROOT, cli, one_line_exit_2


def bounded(args, seconds=60, mem_mb=600, env=None, cwd=ROOT):
    """edgekv as a child with its address space capped (a runaway fails fast instead of filling the host)."""
    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
    e = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **(env or {})}  # no per-thread arenas
    p = subprocess.run(EDGEKV + [str(a) for a in args], capture_output=True, cwd=cwd, env=e, timeout=seconds,
                       preexec_fn=limit)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


# ---- 1. a GGUF whose counts claim more than the file holds ----


def _gguf(path, n_scores=8000):
    """A small valid llama GGUF written by gguf-py's own writer (the reference for the layout)."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_array("tokenizer.ggml.tokens", ["a"] * 8)
    w.add_array("tokenizer.ggml.scores", [0.5] * n_scores)
    w.add_key_value("tokenizer.ggml.token_type", [1] * 8, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8)
    w.add_tensor("token_embd.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _patch(path, old: bytes, new: bytes):
    b = path.read_bytes()
    assert b.count(old) == 1
    path.write_bytes(b.replace(old, new))


GGUF_ARRAY, GGUF_UINT8, GGUF_FLOAT32 = 9, 0, 6


@pytest.mark.parametrize("key,itype,n", [(b"tokenizer.ggml.token_type", GGUF_UINT8, 8),
                                         (b"tokenizer.ggml.scores", GGUF_FLOAT32, 8000)])
def test_a_gguf_array_claiming_2_62_items_is_one_line(tmp_path, key, itype, n):
    """gguf-py's reader reads one-byte items past the end of the file as empty arrays and goes on appending them:
    before the header check, this 66 KB file grew plan's memory without end (here: into the address-space cap)."""
    f = _gguf(tmp_path / "huge.gguf")
    _patch(f, key + struct.pack("<IIQ", GGUF_ARRAY, itype, n), key + struct.pack("<IIQ", GGUF_ARRAY, itype, 2**62))
    assert f.stat().st_size < 70_000
    code, _, err = bounded(["plan", "--device", "pixel8", "--ctx", "4k", "-m", f])
    one_line_exit_2(code, err, "item count")


def test_a_gguf_tensor_count_of_2_62_is_one_line(tmp_path):
    f = _gguf(tmp_path / "tensors.gguf")
    head = f.read_bytes()[:24]
    assert struct.unpack("<4sIQQ", head)[2] == 1  # one tensor, as written
    _patch(f, head, head[:8] + struct.pack("<Q", 2**62) + head[16:])
    code, _, err = bounded(["plan", "--device", "pixel8", "--ctx", "4k", "-m", f])
    one_line_exit_2(code, err, "tensor count")


def test_a_gguf_string_longer_than_the_file_is_one_line(tmp_path):
    f = _gguf(tmp_path / "string.gguf")
    token = struct.pack("<Q", 1) + b"a"  # the vocabulary: 8 one-byte strings; the first now claims 2**62 bytes
    _patch(f, token * 8, struct.pack("<Q", 2**62) + b"a" + token * 7)
    code, _, err = bounded(["plan", "--device", "pixel8", "--ctx", "4k", "-m", f])
    one_line_exit_2(code, err, "past the end of the file")


def test_the_gguf_header_check_passes_a_real_gguf(gguf_path):
    from edgekv.arch.gguf import check_gguf_header
    check_gguf_header(gguf_path)  # SmolLM2's 49,152-token vocabulary and its merges, as llama.cpp wrote them


# ---- 4. digits that str.isdigit() accepts and int() refuses ----


def _state_header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_a_state_file_position_of_superscript_two_is_one_line(tiny_onnx_export, tmp_path):
    s = tmp_path / "p.state"
    code, _, err = cli("run", tiny_onnx_export, "-p", "abc", "-n", "0", "--threads", "1", "--save-state", s)
    assert code == 0, err
    header, data = _state_header(s)
    assert header["__metadata__"]["position"] == "3"
    header["__metadata__"]["position"] = "\u00b2"  # '²': str.isdigit() is True, int() raises ValueError
    h = json.dumps(header).encode()
    s.write_bytes(struct.pack("<Q", len(h)) + h + data)
    code, _, err = cli("run", tiny_onnx_export, "-p", "d", "-n", "1", "--threads", "1", "--resume", s)
    one_line_exit_2(code, err, "not an integer")


@pytest.mark.parametrize("var", ["COLUMNS", "LINES"])
def test_a_terminal_size_of_superscript_two_is_ignored(var):
    """rich reads COLUMNS and LINES with str.isdigit() then int()."""
    p = subprocess.run(EDGEKV + ["devices"], capture_output=True, cwd=ROOT, timeout=120,
                       env={**os.environ, var: "\u00b2"})
    assert p.returncode == 0 and b"pixel8" in p.stdout, p.stderr


def test_columns_1_is_held_to_a_readable_width():
    """COLUMNS=1 printed the plan one character per line (10,585 lines where COLUMNS=80 prints 234)."""
    def lines(cols):
        p = subprocess.run(EDGEKV + ["plan", "-d", "pixel8", "-c", "4k"], capture_output=True, text=True, cwd=ROOT,
                           timeout=120, env={**os.environ, "COLUMNS": cols})
        assert p.returncode == 0, p.stderr
        return p.stdout.splitlines()
    narrow, normal = lines("1"), lines("80")
    assert len(narrow) < 2 * len(normal), (len(narrow), len(normal))
    rule = next(i for i, ln in enumerate(normal) if ln.startswith("─"))
    model = normal[rule + 1].split()[0]  # the first row's model, as 80 columns print it
    assert any(ln.split()[:1] == [model] for ln in narrow), model  # the model names are not cut


# ---- 5. device profiles: wrong types and sizes, control characters, a folder named like a device ----

PIXEL8 = (ROOT / "device_profiles" / "pixel8.toml").read_text()


def _device(tmp_path, old_line_start: str, new_line: str, name="d.toml"):
    lines = PIXEL8.splitlines()
    hits = [i for i, ln in enumerate(lines) if ln.startswith(old_line_start)]
    lines[hits[0]] = new_line
    f = tmp_path / name
    f.write_text("\n".join(lines) + "\n")
    return f


def _plan(device, cwd=None):
    return cli("plan", "--device", device, "--ctx", "4k", "-m", "smollm2-135m", cwd=cwd)


@pytest.mark.parametrize("old,new,needle", [
    ("value = 8_000_000_000", "value = 1" + "0" * 400, "ram_bytes.value"),     # a 401-digit integer
    ("name = ", 'name = ["Pixel", 8]', "'name' must be a string"),
    ("runtime = ", 'runtime = ["executorch"]', "'runtime' must be a string"),
    ("estimate = ", 'estimate = ["derived"]', "estimate' must be a string"),
    ("notes = ", "notes = " + "[" * 100_000 + "]" * 100_000, "nested too deep"),
])
def test_device_values_of_the_wrong_type_or_size_are_one_line(tmp_path, old, new, needle):
    code, _, err = _plan(_device(tmp_path, old, new))
    one_line_exit_2(code, err, needle)


def test_a_device_name_with_terminal_escapes_never_reaches_the_terminal_raw(tmp_path):
    code, out, err = _plan(_device(tmp_path, "name = ", r'name = "\u001b]0;owned\u0007\u001b[2JPixel"'))
    one_line_exit_2(code, err, "control characters")
    assert "\x1b" not in err + out and "\\x1b" in err


def test_tables_escape_control_characters_in_what_they_print(capsys):
    from rich.table import Table

    from edgekv import termtext
    t = Table()
    t.add_column("model")
    t.add_row("tiny\x1b]0;owned\x1b\\\x1b[2J")  # a model name as a manifest could carry it
    termtext.console().print(t)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "tiny\\x1b]0;owned" in out


def test_a_device_name_that_looks_like_markup_is_printed_as_it_is(tmp_path):
    code, out, err = _plan(_device(tmp_path, "name = ", 'name = "[/]Pixel [bold]8"'))
    assert code == 0, err
    assert out.splitlines()[0].startswith("edgekv plan: [/]Pixel [bold]8 (pixel8)")


def test_an_error_naming_a_file_escapes_its_control_characters(tmp_path):
    code, _, err = cli("plan", "--device", "x\x1b[2J.toml", "--ctx", "4k")
    one_line_exit_2(code, err, "x\\x1b[2J.toml")
    assert "\x1b" not in err


def test_a_folder_named_like_a_built_in_device_does_not_hide_it(tmp_path):
    (tmp_path / "pixel8").mkdir()
    code, out, err = _plan("pixel8", cwd=tmp_path)
    assert code == 0, err
    assert "Google Pixel 8 (pixel8)" in out.splitlines()[0]
    code, _, err = _plan("./pixel8", cwd=tmp_path)  # written as a path, it is the folder: said so
    one_line_exit_2(code, err, "is a folder, not a .toml profile")
    (tmp_path / "mine").write_text(PIXEL8.replace('name = "Google Pixel 8"', 'name = "My phone"'))
    code, out, err = _plan("mine", cwd=tmp_path)  # an existing file that is no built-in id is a profile
    assert code == 0 and "My phone (pixel8)" in out.splitlines()[0], err


# ---- 2, 3, 6: the tokenizer of an export, the folder it is in, the prompt ----


@pytest.fixture
def copy_of(tiny_onnx_export, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(tiny_onnx_export, d)
    return d


def _retokenize(folder, edit):
    """Edit folder/tokenizer.json and make the manifest vouch for it (what someone who edits both would do)."""
    t = json.loads((folder / "tokenizer.json").read_text())
    edit(t)
    b = json.dumps(t).encode()
    (folder / "tokenizer.json").write_bytes(b)
    m = json.loads((folder / "manifest.json").read_text())
    m["files"]["tokenizer.json"] = {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)}
    (folder / "manifest.json").write_text(json.dumps(m))


def test_a_tokenizer_regex_that_panics_the_rust_library_is_one_line(copy_of):
    """'(a|a)*[^a]' over 40 a's backtracks 2**40 times: Oniguruma stops at its retry limit, the tokenizers library
    unwraps that search error (a Rust panic: its message and backtrace on fd 2, a PanicException in Python)."""
    _retokenize(copy_of, lambda t: t.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a|a)*[^a]"}, "behavior": "Isolated", "invert": False},
        t["pre_tokenizer"]]}))
    p = subprocess.run(EDGEKV + ["run", str(copy_of), "-p", "a" * 40, "-n", "2", "--threads", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "RUST_BACKTRACE": "1"})
    one_line_exit_2(p.returncode, p.stderr, "panic in the tokenizers library")
    assert "retry-limit-in-match" in p.stderr


def test_a_tokenizer_whose_vocabulary_passes_the_models_is_refused_on_load(copy_of):
    def edit(t):
        vocab = t["model"]["vocab"]
        vocab[next(k for k, v in vocab.items() if v == ord("a"))] = 300  # the model's vocabulary is 256 bytes
    _retokenize(copy_of, edit)
    code, _, err = cli("run", copy_of, "-p", "abc", "-n", "2", "--threads", "1")
    one_line_exit_2(code, err, "reaches id 300, past the model's 256 tokens")


def test_a_token_id_past_the_models_vocabulary_is_refused_before_the_runtime(copy_of):
    """An added token with id 256, the first past the 256 bytes: ONNX Runtime's Gather on the embedding failed
    with its own error (exit 1)."""
    _retokenize(copy_of, lambda t: t.update(added_tokens=[
        {"id": 256, "content": "<tool>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}]))
    code, _, err = cli("run", copy_of, "-p", "x<tool>", "-n", "2", "--threads", "1")
    one_line_exit_2(code, err, "token id 256, outside the model's vocabulary of 256")
    code, _, err = cli("run", copy_of, "-p", "x", "-n", "2", "--threads", "1")
    assert code == 0, err  # the tokenizer is fine for text without that token


def test_an_export_in_a_folder_whose_name_is_not_utf8_says_so(copy_of, tmp_path):
    bad = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xff"))
    shutil.move(copy_of, bad)
    p = subprocess.run(EDGEKV + ["run", os.fsencode(bad), "-p", "ab", "-n", "2", "--threads", "1"],
                       capture_output=True, cwd=ROOT, timeout=300)
    err = p.stderr.decode(errors="replace")
    one_line_exit_2(p.returncode, err, "path is not valid UTF-8")
    assert "tokenizer" not in err and "caf\\xff" in err


def test_a_utf8_prompt_is_taken_under_the_c_locale(tiny_onnx_export):
    """LC_ALL=C outside Python's UTF-8 mode: argv's UTF-8 bytes arrive as lone surrogates; they are the prompt's
    bytes all the same. The tiny model is byte-level: 'héllo' is 6 tokens (é is 2 bytes in UTF-8)."""
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}
    p = subprocess.run(EDGEKV + ["run", str(tiny_onnx_export), "-p", "h\u00e9llo", "-n", "2", "--threads", "1"],
                       capture_output=True, cwd=ROOT, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode("utf-8").startswith("h\u00e9llo")
    assert b"[6 prompt tokens" in p.stderr
    p = subprocess.run(EDGEKV + ["run", str(tiny_onnx_export), "-p", os.fsdecode(b"caf\xe9"), "-n", "2"],
                       capture_output=True, cwd=ROOT, timeout=300, env=env)
    one_line_exit_2(p.returncode, p.stderr.decode(errors="replace"), "not valid UTF-8")  # Latin-1 bytes: refused


# ---- 6. report --profile from a pipe; matplotlib without a usable HOME ----


def test_report_reads_a_profile_from_a_pipe(tiny_onnx_export, tmp_path):
    """--profile /dev/stdin was read twice (validated, then read again for the page: empty the second time)."""
    prof = tmp_path / "profile.json"
    p = subprocess.run(EDGEKV + ["profile", str(tiny_onnx_export), "-c", "32", "--steps", "2", "--threads", "1",
                                 "-o", str(prof)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    page = tmp_path / "report.md"
    p = subprocess.run(EDGEKV + ["report", str(tiny_onnx_export), "--profile", "/dev/stdin", "--out", str(page),
                                 "--json"], input=prof.read_text(), capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    measured = [r["ctx"] for r in json.loads(prof.read_text())["runs"]]
    assert [r["ctx"] for r in json.loads(p.stdout)["profile"]["runs"]] == measured == [32]


def test_a_plot_without_a_usable_home_says_nothing_on_stderr(tmp_path):
    """matplotlib logs two warnings when its config and cache folders cannot be made (HOME a file: not even root
    can make a folder under it)."""
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    png = tmp_path / "plan.png"
    p = subprocess.run(EDGEKV + ["plan", "-d", "pixel8", "-c", "4k", "-m", "smollm2-135m", "--plot", str(png)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env={**env, "HOME": str(home)})
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_export_into_a_folder_whose_name_is_not_utf8_says_so_before_the_work(tmp_path):
    out = Path(os.fsdecode(bytes(tmp_path) + b"/out\xff")) / "tiny"
    code, _, err = cli("export", "--model", ROOT / "fixtures" / "tiny" / "llama", "--format", "onnx", "--max-ctx", "64",
                       "--out", out)
    one_line_exit_2(code, err, "--out")
    assert "path is not valid UTF-8" in err and "stage" not in err
