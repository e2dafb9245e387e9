"""The README as a new user follows it (issue 42): every `edgekv ...` line the README shows is one the CLI parser
accepts, the worked example's steps are found and run on a fresh clone (slow), and `-n` means new tokens only.
References: the README's own text, click's parser, the report a real profile run writes."""
import json
import re
import shlex
import subprocess
import sys

import click
import pytest

from conftest import EDGEKV, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import walkthrough  # noqa: E402

README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    """Every `edgekv ...` command in the README's code blocks: `$ edgekv` lines and the Commands block's lines, with
    a trailing comment cut, continuation lines joined, `[optional]` parts dropped and `a ; b` split."""
    out = []
    for block in re.findall(r"```\n(.*?)```", README, re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        prompted = any(ln.startswith("$ ") for ln in text.splitlines())  # then the other lines are output
        for line in text.splitlines():
            if prompted and not line.startswith("$ "):
                continue
            line = line.removeprefix("$ ").strip()
            if line.startswith("make ") and "&&" in line:
                line = line.split("&&", 1)[1].strip()
            if not line.startswith("edgekv "):
                continue
            line = re.sub(r"\s+#.*$", "", line)
            line = re.sub(r"\[[^\]]*\]", "", line)  # `[--runtime executorch]`: an optional part
            out += [part.strip() for part in line.split(" ; ")]
    return out


def parse(command: str) -> None:
    """click's own parsing of the command line, as `edgekv` would before running it: the subcommand exists, every
    option is known, every value converts (choices, numbers, required options); nothing runs."""
    from edgekv.cli import main
    args = shlex.split(command)[1:]
    name = args[0]
    cmd = main.commands.get(name)
    assert cmd is not None, f"README: `{command}`: no command {name!r}"
    with cmd.make_context(f"edgekv {name}", args[1:], resilient_parsing=False) as ctx:
        assert ctx.params is not None


def test_the_readme_has_the_commands_a_user_copies():
    cmds = readme_commands()
    # the worked example's five steps, and the Commands section's lines
    assert len(cmds) >= 30, cmds
    assert {c.split()[1] for c in cmds} >= {"plan", "export", "run", "profile", "report", "analyze", "baseline",
                                            "devices", "models", "ring"}


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_is_accepted_by_the_cli_parser(command, tmp_path, monkeypatch):
    # options that name an existing file (report --profile) are given one in an empty folder
    monkeypatch.chdir(tmp_path)
    for arg in shlex.split(command):
        if arg.endswith(".json") and not arg.startswith("-"):
            (tmp_path / arg).write_text("{}")
    try:
        parse(command)
    except click.UsageError as e:
        pytest.fail(f"README: `{command}` is refused by the parser: {e.format_message()}")
    except click.BadParameter as e:
        pytest.fail(f"README: `{command}`: {e.format_message()}")


def test_a_readme_command_the_parser_refuses_is_caught():
    """The check above fails on a flag that does not exist or a value that does not convert (the check's own
    sensitivity: a README typo must not pass)."""
    for bad in ("edgekv plan --device pixel8 --ctx 32k --runtim ort", "edgekv run F -p x -n many",
                "edgekv profile F --steps 0", "edgekv exprot -m smollm2-135m -o x"):
        with pytest.raises((click.UsageError, click.BadParameter, AssertionError)):
            parse(bad)


def test_the_walkthrough_reads_each_step_of_the_worked_example_from_the_readme():
    steps = walkthrough.steps(README)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    # each command is the README's own text, the first token `edgekv`, then plan -> export -> run -> profile -> report
    assert [s["command"].split()[1] for s in steps] == ["plan", "export", "run", "profile", "report"]
    for s in steps:
        assert s["command"] in README
    # steps 1-4 show output; step 5 gives its command inline in the paragraph
    assert all(s["shown"] for s in steps[:4]) and steps[4]["shown"] == []


def test_the_walkthrough_compares_words_not_numbers():
    shown = ["wrote export/x: model.pte (0.190 GB), tokenizer.json (0.00352 GB)", "...", "1 of 1 options fit. GB ..."]
    real = ["progress line", "wrote export/x: model.pte (0.191 GB), tokenizer.json (0.00353 GB)", "more",
            "1 of 1 options fit. GB = 1e9 bytes"]
    assert walkthrough.differs(shown, real) == []
    # a word changed, a line missing, or lines out of order are differences
    assert walkthrough.differs(["wrote export/x: model.onnx (0.190 GB)"], real) == \
        ["wrote export/x: model.onnx (0.190 GB)"]
    assert walkthrough.differs(["1 of 1 options fit. GB ...", "wrote export/x: model.pte (1 GB), tokenizer.json "
                                "(2 GB)"], real) == ["wrote export/x: model.pte (1 GB), tokenizer.json (2 GB)"]


def test_profile_steps_are_spelled_steps_and_n_is_new_tokens(tiny_onnx_export):
    """`-n` is new tokens in `run` (as in llama.cpp and ONNX Runtime GenAI); profile's decode steps are --steps, and
    its old `-n` still works with one line saying so. Reference: the report the run writes (runs[].steps)."""
    from edgekv.export.cli import run_cmd
    from edgekv.profile.cli import profile
    run_help = {o: p.help for p in run_cmd.params for o in p.opts}
    assert "new tokens" in run_help["-n"]
    visible = {o for p in profile.params if not getattr(p, "hidden", False) for o in p.opts}
    assert "--steps" in visible and "-n" not in visible
    base = EDGEKV + ["profile", str(tiny_onnx_export), "-c", "32", "--threads", "1", "--json"]
    p = subprocess.run(base + ["-n", "3"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert [r["steps"] for r in json.loads(p.stdout)["runs"]] == [3]
    notes = [ln for ln in p.stderr.splitlines() if "deprecated" in ln]
    assert notes == ["edgekv: profile -n is deprecated: use --steps 3 (decode steps per run; -n is new tokens in "
                     "edgekv run)"]
    p = subprocess.run(base + ["-n", "3", "--steps", "4"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("edgekv: error: -n 3 and --steps 4")
    # the README says the same
    assert "`-n` new\ntokens (`run`; `profile` counts decode steps, `--steps`" in README


@pytest.mark.slow
def test_the_readme_walkthrough_on_a_fresh_clone(tmp_path):
    """README steps 1-5 (plan, export, run, profile, report) on a fresh clone, every command as the README gives it;
    each exits 0 and prints every line the README shows (numbers aside). Minutes on a quiet host; past an hour at
    load average 11 on 2 cores (the .pte export: XNNPACK lowering, then int4 against fp32 over 256 tokens)."""
    out = tmp_path / "walkthrough.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "walkthrough.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=6 * 3600)
    summary = json.loads(out.read_text())
    assert [s["exit_code"] for s in summary["steps"]] == [0] * 5, p.stderr
    assert {s["step"]: s["differs"] for s in summary["steps"]} == {i: [] for i in range(1, 6)}, p.stderr
    assert p.returncode == 0, p.stderr


def test_what_a_new_user_mistypes_is_named_in_one_line(tmp_path):
    """A mistyped export folder given to report is named as not an export (it was named as the folder --out would be
    written in); a runner whose format is missing reads as English."""
    from conftest import cli, one_line_exit_2
    code, _, err = cli("report", tmp_path / "exprot/smollm2-pixel8")
    one_line_exit_2(code, err, "exprot/smollm2-pixel8: no manifest.json there (not an edgekv export?)")
    code, _, err = cli("export", "-m", "smollm2-135m", "-o", tmp_path / "o", "--runner", "genai", "--format", "pte")
    one_line_exit_2(code, err, "--runner genai writes an onnx artifact: add onnx to --format")
    assert not (tmp_path / "o").exists()
    # run / profile's runner names given to plan: answered with the runtime whose costs they run on
    for name, plan_as in (("genai", "ort"), ("executorch-runner", "executorch")):
        code, _, err = cli("plan", "-d", "pixel8", "-c", "2k", "-m", "smollm2-135m", "--runtime", name)
        one_line_exit_2(code, err, f"plan with --runtime {plan_as}")
        assert "is not one of" not in err
