"""What a user types: the demo command, bad input (one line, exit 2), no torch on the planner's path."""
import json
import sys

import pytest

from conftest import run_cli


def test_demo_command_prints_the_pixel8_table():
    p = run_cli("plan", "--device", "pixel8", "--ctx", "32k", check=True)
    assert "Pixel 8" in p.stdout and "32,768 tokens" in p.stdout and "tok/s" in p.stdout


@pytest.mark.parametrize("args,needle", [
    (["plan", "--device", "nokia3310", "--ctx", "32k"], "unknown device"),
    (["plan", "--device", "pixel8", "--ctx", "32kk"], "not a token count"),
    (["plan", "--device", "pixel8", "--ctx", "0"], "at least 1 token"),
    (["plan", "--device", "pixel8", "--ctx", "-5"], "not a token count"),
    (["plan", "--device", "pixel8", "--ctx", "1e9"], "not a token count"),
    (["plan", "--device", "pixel8", "--ctx", "4k", "--model", "gpt-5"], "unknown model"),
    (["plan", "--device", "pixel8", "--ctx", "4k", "--model", "./my-model/"], "./my-model/: no such file or folder"),
    (["plan", "--device", "pixel8", "--ctx", "4k", "--model", "HuggingFaceTB/SmolLM2-135M"], "nothing is downloaded"),
    (["plan", "--device", "pixel8", "--ctx", "4k", "--strategy", "magic"], "unknown strategy"),
    (["plan", "--device", "pixel8", "--ctx", "4k", "--strategy", "window:w=x"], "must be a non-negative integer"),
    (["baseline", "--device", "pixel8"], "not a datacenter GPU"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    p = run_cli(*args)
    assert p.returncode == 2
    assert needle in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_broken_config_json_and_truncated_gguf(tmp_path, gguf_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "hidden_size": ')
    p = run_cli("plan", "--device", "pixel8", "--ctx", "4k", "--model", cfg)
    assert p.returncode == 2 and "not valid JSON" in p.stderr and "Traceback" not in p.stderr
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:3_000_000])
    p = run_cli("plan", "--device", "pixel8", "--ctx", "4k", "--model", cut)
    assert p.returncode == 2 and "GGUF" in p.stderr and "Traceback" not in p.stderr


def test_plan_never_imports_torch_or_a_runtime():
    code = ("import sys, runpy; sys.argv=['edgekv','plan','--device','pixel8','--ctx','32k','--json'];\n"
            "import io, contextlib\n"
            "f = io.StringIO()\n"
            "with contextlib.redirect_stdout(f):\n"
            "    try:\n        runpy.run_module('edgekv.cli', run_name='__main__')\n"
            "    except SystemExit: pass\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch','executorch','onnxruntime','transformers','onnx'))\n"
            "print(heavy)")
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:] + out.stderr[-2000:]


def test_plot_is_written(tmp_path):
    out = tmp_path / "mem.png"
    run_cli("plan", "--device", "pixel8", "--ctx", "32k", "--model", "llama-3.2-1b", "--plot", out, check=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp*"))


def test_devices_models_and_version():
    assert "pixel8" in run_cli("devices", check=True).stdout
    models = json.loads(run_cli("models", "--json", check=True).stdout)
    assert any(m["name"] == "smollm2-135m" for m in models)
    assert run_cli("--version", check=True).stdout.startswith("edgekv, version")


def test_explain_shows_formulas_and_sources():
    p = run_cli("plan", "--device", "pixel8", "--ctx", "32k", "--model", "qwen2.5-0.5b", "--strategy", "kv",
                "--explain", check=True)
    # the terminal: a short derivation with the device facts and their sources; --json --explain: every formula
    assert "vs budget" in p.stdout and "FLOP" in p.stdout and "overhead" in p.stdout and "estimate:" in p.stdout
    p = run_cli("plan", "--device", "pixel8", "--ctx", "32k", "--model", "qwen2.5-0.5b", "--strategy", "kv",
                "--explain", "--json", check=True)
    ex = json.loads(p.stdout)["options"][0]["explain"]
    assert "state tensors" in ex["state"] and "FLOP" in ex["prefill_seconds"] and "overhead" in ex["runtime"]


def test_every_command_takes_json_and_help():
    """The README: every command takes --json and --help (the options click registered, not the help text)."""
    from edgekv.cli import main

    assert set(main.commands) >= {"plan", "baseline", "devices", "models", "export", "run", "analyze", "profile",
                                  "report", "ring"}
    for name, cmd in main.commands.items():
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        assert "--json" in opts, name
    p = run_cli("report", "--help", check=True)
    assert "--json" in p.stdout
