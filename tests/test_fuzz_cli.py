"""Property: whatever bad value a user gives an option or puts in a file edgekv reads, the command ends in one line
on stderr starting `edgekv: error:`, exit code 2, no traceback, and nothing is written (issue 21).

Hypothesis generates the bad values: for each command, one option (or one input file) is replaced by a value that
cannot be valid (a context of 0 or in Arabic-Indic digits, a strategy parameter of '²', a device fact of NaN, a
config.json size of 1e9 or of the wrong type, a manifest field changed under its hash...), the others are valid.
The commands run in this process through click's CliRunner, each in a fresh empty working folder whose contents are
compared before and after. Examples are derandomized so `make test` is repeatable; EDGEKV_FUZZ_EXAMPLES=N (and
EDGEKV_FUZZ_RANDOM=1) explore further.
"""
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT

TINY_LLAMA = ROOT / "fixtures" / "tiny" / "llama"
SCALE = int(os.environ.get("EDGEKV_FUZZ_EXAMPLES", "0"))


def fuzz(n: int):
    return settings(max_examples=SCALE or n, deadline=None, database=None, derandomize=not os.environ.get(
        "EDGEKV_FUZZ_RANDOM"), suppress_health_check=list(HealthCheck), print_blob=True)


def invoke(args, cwd: Path):
    from edgekv.cli import main
    old = Path.cwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(main, [str(a) for a in args])
    finally:
        os.chdir(old)
    return r


def listing(folder: Path) -> list:
    return sorted((p.relative_to(folder).as_posix(), p.stat().st_size if p.is_file() else -1)
                  for p in folder.rglob("*"))


def check_refused(args, files: dict | None = None, watch: Path | None = None):
    """Run args in a fresh folder holding `files` ({name: bytes}); assert one line, exit 2, nothing written there
    (nor in `watch`)."""
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for name, data in (files or {}).items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)
        before, watched = listing(d), listing(watch) if watch else None
        r = invoke(args, d)
        err = r.stderr
        lines = err.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("edgekv: error: "), (
            f"edgekv {' '.join(map(str, args))!s:.300}\nexit {r.exit_code}\nstderr: {err[-2000:]}\n"
            f"exception: {r.exception!r}")
        assert "Traceback" not in err
        assert listing(d) == before, "wrote into the working folder"
        if watch:
            assert listing(watch) == watched, f"wrote into {watch}"


# ---- bad values, each guaranteed invalid for its option ----

OTHER_DIGITS = st.sampled_from(["٣", "²", "३", "３", "𝟑", "⁴", "½", "Ⅳ"])
CTX_BAD = st.one_of(
    st.integers(max_value=0).map(str),
    st.integers(min_value=16 * 2**20 + 1, max_value=10**30).map(str),
    st.builds(lambda d, s: d + s, OTHER_DIGITS, st.sampled_from(["", "k", "m"])),
    st.sampled_from(["", " ", "4kk", "1.5k", "1e9", "nan", "inf", "-inf", "0x10", "4 k k", "k", "32kb", "٣٢k",
                     "4\x00k", "99999999999999999999999999m"]),
    st.text(alphabet=st.characters(blacklist_categories=("Nd",)), min_size=1, max_size=12).filter(
        lambda s: s.strip() and not re.fullmatch(r"\s*[kKmM]?\s*", s)),
)
STRATEGY_BAD = st.one_of(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=10).filter(
        lambda s: s not in ("kv", "kv-int8", "kv-int4", "kv-int2", "window", "mla", "ssm", "linear", "hybrid",
                            "ring")),
    st.builds(lambda n, k, v: f"{n}:{k}={v}", st.sampled_from(["kv-int4", "kv-int8", "window", "ring"]),
              st.sampled_from(["group", "w", "sinks", "n"]).filter(lambda k: True),
              st.one_of(OTHER_DIGITS, st.sampled_from(["-1", "x", "", "1.5", "1e3", " 3 4", "nan"]))),
    st.builds(lambda n, v: f"{n}:dtype={v}", st.sampled_from(["kv", "ssm", "hybrid"]),
              st.sampled_from(["fp4", "int3", "", "FP16x", "float"])),
    st.builds(lambda v: f"mla:ratio={v}", st.sampled_from(["0", "-0.5", "2", "nan", "inf", "x", "٠.٥"])),
    st.builds(lambda n, p: f"{n}:{p}", st.sampled_from(["kv", "window", "mla"]),
              st.sampled_from(["bogus=1", "group", "=", ",,=,", "w==4"])),
)
BYTES_BAD = st.one_of(st.sampled_from(["0", "0MB", "-1GB", "1TB", "GB", "", "nan", "inf", "1e9", "٣GB", "3 G B"]),
                      st.integers(max_value=0).map(str))
# click's integer options read any Unicode decimal digits as Python's int() does ('٣' is 3): not bad values
POSITIVE_INT_BAD = st.one_of(st.integers(max_value=0), st.sampled_from(["x", "1.5", "", "²", "nan", "1e3"]))


# ---- plan and baseline ----

PLAN_OPTIONS = {
    "--ctx": CTX_BAD,
    "--strategy": STRATEGY_BAD,
    "--weights": st.text(min_size=1, max_size=6).filter(lambda s: s not in ("fp32", "fp16", "int8", "int4", "gguf")),
    "--chunk": st.one_of(st.integers(max_value=0), st.integers(min_value=65537), st.just("x")),
    "--device": st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12).filter(
        lambda s: not (ROOT / "device_profiles" / f"{s}.toml").exists()),
    "--model": st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-", min_size=1, max_size=12).filter(
        lambda s: not (ROOT / "edgekv" / "catalog" / f"{s.lower()}.json").exists() and not Path(s).exists()),
    "--plot": st.sampled_from(["plot", "plot.txt", "missing/plot.png", "plot.", ".png/x", "/proc/p.png"]),
    "--runtime": st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=10).filter(
        lambda s: s not in ("executorch", "onnxruntime", "llamacpp", "llama.cpp", "mlc", "tflite", "coreml",
                            "mlx", "vllm", "tensorrt", "tensorrt-llm", "sglang", "ort", "litert", "qnn")),
}


@fuzz(60)
@given(data=st.data())
def test_plan_with_one_bad_option(data):
    opt = data.draw(st.sampled_from(sorted(PLAN_OPTIONS)), label="option")
    value = data.draw(PLAN_OPTIONS[opt], label="value")
    args = {"--device": "pixel8", "--ctx": "4k", "--model": "smollm2-135m"}
    args[opt] = value
    flat = ["plan"] + [x for k, v in args.items() for x in (k, v)]
    if opt == "--runtime":  # a runtime the device has no overhead for
        flat += ["--json"]
    check_refused(flat)


@fuzz(30)
@given(data=st.data())
def test_baseline_with_one_bad_option(data):
    opt = data.draw(st.sampled_from(["--ctx", "--strategy", "--device", "--model"]), label="option")
    value = data.draw({"--ctx": CTX_BAD, "--strategy": STRATEGY_BAD,
                       "--device": st.sampled_from(["pixel8", "galaxy-a15", "iphone15", "nope", "host"]),
                       "--model": PLAN_OPTIONS["--model"]}[opt], label="value")
    check_refused(["baseline", opt, value, "--json"])


# ---- files: config.json, GGUF bytes, device TOML ----

CONFIG_FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "vocab_size", "max_position_embeddings", "model_type"]
BAD_FIELD_VALUE = st.one_of(
    st.sampled_from([0, -1, -(10**9), 10**9, 10**30, 1.5, 1e300, "", "64", "nan", True, False, [], {}, [64]]),
    st.integers(min_value=2**40),
)


@fuzz(50)
@given(field=st.sampled_from(CONFIG_FIELDS), value=BAD_FIELD_VALUE)
def test_plan_with_a_bad_config_json(field, value):
    cfg = json.loads((TINY_LLAMA / "config.json").read_text())
    if field == "model_type" and value in ("",):
        value = "gpt-9"
    if field == "num_key_value_heads" and value in (1.5,):
        value = 3  # 4 heads are no multiple of 3
    cfg[field] = value
    check_refused(["plan", "--device", "pixel8", "--ctx", "4k", "--model", "m/config.json"],
                  {"m/config.json": json.dumps(cfg).encode()})


@fuzz(25)
@given(data=st.binary(max_size=400), cut=st.integers(min_value=0, max_value=4000))
def test_plan_with_a_damaged_file(data, cut):
    """Random bytes as config.json, and a GGUF cut short or overwritten."""
    check_refused(["plan", "--device", "pixel8", "--ctx", "4k", "--model", "m/config.json"],
                  {"m/config.json": data})
    from conftest import smollm2_gguf
    head = smollm2_gguf().open("rb").read(4096)
    check_refused(["plan", "--device", "pixel8", "--ctx", "4k", "--model", "x.gguf"],
                  {"x.gguf": head[:cut] + data})


DEVICE_FACTS = ["ram_bytes", "app_budget_bytes", "mem_bandwidth_bytes_per_s", "compute_flops", "decode_efficiency",
                "prefill_efficiency"]


@fuzz(40)
@given(fact=st.sampled_from(DEVICE_FACTS),
       value=st.sampled_from(["0", "nan", "inf", "-inf", "-1", '"fast"', "true", "[]", "{}", "1e30", "2.5"]))
def test_plan_with_a_bad_device_toml(fact, value):
    if value == "2.5" and "efficiency" not in fact:
        value = "0"
    if value == "1e30" and fact in ("ram_bytes", "mem_bandwidth_bytes_per_s", "compute_flops"):
        value = "-1"
    text = (ROOT / "device_profiles" / "pixel8.toml").read_text()
    text, n = re.subn(rf"(\[{fact}\]\nvalue = )[^\n]+", rf"\g<1>{value}", text)
    assert n == 1
    check_refused(["plan", "--device", "d.toml", "--ctx", "4k", "--model", "smollm2-135m", "--json"],
                  {"d.toml": text.encode()})


# ---- ring (prediction only: no rank starts) ----


@fuzz(30)
@given(opt=st.sampled_from(["--world", "--heads", "--kv-heads", "--head-dim", "--layers", "--timeout", "--ctx",
                            "--port", "--decode-steps", "--device", "--link"]), data=st.data())
def test_ring_with_one_bad_option(opt, data):
    bad = {"--ctx": CTX_BAD, "--timeout": st.sampled_from(["0", "0.001", "-1", "nan", "inf", "1e9", "x"]),
           "--port": st.sampled_from(["-1", "65536", "99999", "x"]),
           "--decode-steps": st.sampled_from(["-1", "x"]), "--device": st.sampled_from(["nope", "x.toml"]),
           "--link": st.sampled_from(["nvlink", "warp", ""]),
           "--kv-heads": st.sampled_from(["0", "-2", "3", "x"])}.get(opt, POSITIVE_INT_BAD.map(str))
    check_refused(["ring", "--world", "2", "--ctx", "1k", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                   "--predict-only", opt, data.draw(bad, label="value")])


# ---- export, run, profile, report, analyze: fail before any work ----


@pytest.fixture
def export_dir(tiny_onnx_export) -> Path:
    return tiny_onnx_export


@fuzz(30)
@given(opt=st.sampled_from(["--max-ctx", "--format", "--strategy", "--weights", "--prefill-chunk", "--model",
                            "--rank", "--window", "--threads"]), data=st.data())
def test_export_with_one_bad_option(opt, data):
    bad = {"--max-ctx": CTX_BAD, "--strategy": STRATEGY_BAD | st.sampled_from(["ring", "ssm", "linear"]),
           "--format": st.sampled_from(["tflite", "", ",", "onnx,gguf", "PTE2"]),
           "--weights": st.sampled_from(["int3", "fp8", "", "q4_0"]),
           "--model": st.sampled_from(["gpt-9", "missing/", "x.gguf", "config.json"]),
           "--prefill-chunk": POSITIVE_INT_BAD.map(str), "--rank": POSITIVE_INT_BAD.map(str),
           "--window": POSITIVE_INT_BAD.map(str), "--threads": POSITIVE_INT_BAD.map(str)}[opt]
    args = {"--model": str(TINY_LLAMA), "--max-ctx": "64", "--out": "out"}
    args[opt] = data.draw(bad, label="value")
    check_refused(["export"] + [x for k, v in args.items() for x in (k, v)], watch=TINY_LLAMA)


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


MANIFEST_PATHS = [("max_ctx",), ("state", "ctx"), ("state", "tensors", 0, "shape"), ("state", "tensors", 0, "dtype"),
                  ("state", "tensors", 1, "shape", 2), ("artifacts", 0, "file"), ("artifacts", 0, "external_data"),
                  ("tokenizer", "file"), ("artifacts", 0, "entry_points", 0, "inputs", 2, "shape", 2),
                  ("artifacts", 0, "entry_points", 0, "inputs", 3, "dtype"), ("files", "model.onnx", "sha256"),
                  ("files", "tokenizer.json", "bytes"), ("state", "tensors"), ("artifacts",), ("files",),
                  ("artifacts", 0, "entry_points", 0, "outputs", 1, "name"), ("state", "tensors", 2, "input")]
MANIFEST_VALUES = st.one_of(
    st.sampled_from([0, -1, 1, 63, 65, 2**31, 2**62, 1e300, "", "..", "../tokenizer.json", "/etc/passwd",
                     "model.onnx/../../x", "float64", "int4", None, True, [], {}, [1, 1], [0], "0" * 64]),
    st.text(max_size=8))


@fuzz(40)
@given(path=st.sampled_from(MANIFEST_PATHS), value=MANIFEST_VALUES)
def test_run_with_a_bad_manifest_field(export_dir, path, value):
    m = json.loads((export_dir / "manifest.json").read_text())
    if path[-1] == "external_data" and not value:
        value = "../model.onnx.data"  # '' or null: no external data named by the manifest, which is allowed
    _set(m, path, value)
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "exp"
        shutil.copytree(export_dir, copy)
        (copy / "manifest.json").write_text(json.dumps(m))
        check_refused(["run", copy, "--prompt", "def ", "--max-new-tokens", "2"], watch=copy)


@fuzz(25)
@given(opt=st.sampled_from(["--ctx", "--steps", "--limit", "--device", "--out", "--threads", "--repeats",
                            "--runtime", "FOLDER"]), data=st.data())
def test_profile_with_one_bad_option(export_dir, opt, data):
    bad = {"--ctx": CTX_BAD | st.sampled_from(["65", "1k", "8", "4"]), "--steps": st.sampled_from(["0", "-1", "64"]),
           "--limit": BYTES_BAD, "--device": st.sampled_from(["nope", "x.toml"]),
           "--out": st.sampled_from(["missing/p.json", "/proc/p.json", "."]), "--threads": st.sampled_from(["0", "x"]),
           "--repeats": st.sampled_from(["0", "51"]), "--runtime": st.sampled_from(["tflite", "executorch"]),
           "FOLDER": st.sampled_from(["missing", "."])}[opt]
    value = data.draw(bad, label="value")
    args = ["profile", value if opt == "FOLDER" else export_dir, "--ctx", "48", "--steps", "8"]
    if opt != "FOLDER":
        args += [opt, value]
    check_refused(args, watch=export_dir)


@fuzz(20)
@given(opt=st.sampled_from(["--out", "--device", "--gpu", "--ctx", "--profile"]), data=st.data())
def test_report_with_one_bad_option(export_dir, opt, data):
    bad = {"--out": st.sampled_from(["missing/r.html", "/proc/r.html", "."]),
           "--device": st.sampled_from(["h100", "nope"]), "--gpu": st.sampled_from(["pixel8", "nope", "host"]),
           "--ctx": CTX_BAD, "--profile": st.sampled_from(["p.json"])}[opt]
    files = {"p.json": data.draw(st.sampled_from([b"{}", b"[]", b"nan", b'{"runs": 1}', b"\xff",
                                                  b'{"artifact": "x", "runtime": "y", "host": {}, "runs": []}']),
                                 label="profile file")}
    check_refused(["report", export_dir, opt, data.draw(bad, label="value")], files, watch=export_dir)


@fuzz(25)
@given(opt=st.sampled_from(["--ctx", "--target-ctx", "--bits", "--rounding", "--strategy", "--plot", "--name",
                            "--chunk", "--threads", "--rank", "--window"]), data=st.data())
def test_analyze_with_one_bad_option(opt, data):
    bad = {"--ctx": CTX_BAD, "--target-ctx": CTX_BAD, "--bits": st.sampled_from(["x", "٣", "-1", ",", "3", "64"]),
           "--rounding": st.sampled_from(["up", "", "nearest,down"]), "--strategy": STRATEGY_BAD,
           "--plot": st.sampled_from(["plot", "missing/p.png", "p.txt"]),
           "--name": st.sampled_from(["../../x", "/abs", "a/b", ".hidden", "", "x" * 200, "a b"]),
           "--chunk": st.sampled_from(["0", "x", "5000"]), "--threads": st.sampled_from(["0", "x"]),
           "--rank": st.sampled_from(["x", "٣"]), "--window": st.sampled_from(["x", "-1"])}[opt]
    strategy = {"--rank": "mla", "--window": "window"}.get(opt, "kv-int8")
    args = ["analyze", "--model", TINY_LLAMA, "--strategy", strategy, "--ctx", "64", "--weight-bits", "0",
            opt, data.draw(bad, label="value")]
    if opt in ("--name",):
        args += ["--save"]
    check_refused(args, watch=ROOT / "edgekv" / "measurements")
