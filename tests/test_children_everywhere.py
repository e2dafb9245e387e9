"""Every child process the project starts dies with its parent (brief: "every child process dies with its parent"):
each subprocess call in edgekv/, benchmarks/, scripts/ and experiments/ passes edgekv.children.child_setup()'s
preexec_fn (prctl PR_SET_PDEATHSIG), so a benchmark killed mid-row leaves no export running behind it. The reference
is the source itself, read by Python's own parser; tests/ is left out (a test's child is bounded by its timeout)."""
import ast
import subprocess
import sys
import textwrap

from conftest import ROOT

CALLS = {"run", "Popen", "check_output", "call", "check_call"}


def calls_without_preexec(source: str) -> list[int]:
    """Line numbers of subprocess.<call>(...) whose preexec_fn is not child_setup()."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CALLS \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "subprocess":
            pre = {k.arg: k.value for k in n.keywords}.get("preexec_fn")
            if not (isinstance(pre, ast.Call) and isinstance(pre.func, ast.Name) and pre.func.id == "child_setup"):
                out.append(n.lineno)
    return out


def test_every_subprocess_call_dies_with_its_parent():
    files = [p for d in ("edgekv", "benchmarks", "scripts", "experiments") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50
    missing = [f"{p.relative_to(ROOT)}:{line}" for p in files for line in calls_without_preexec(p.read_text())]
    assert not missing, missing


def test_the_scan_tells_a_bare_call_from_a_guarded_one():
    src = textwrap.dedent("""\
        import subprocess
        subprocess.run(["true"], check=True)
        p = subprocess.Popen(["true"], preexec_fn=child_setup())
        subprocess.run(["true"], preexec_fn=os.setsid)
        """)
    assert calls_without_preexec(src) == [2, 4]


def test_a_child_started_with_child_setup_dies_when_its_parent_is_killed(tmp_path):
    """The behaviour the scan stands for: a parent that starts `sleep` through child_setup() is SIGKILLed; the
    sleep is gone soon after (without the preexec_fn it would be re-parented and run on)."""
    pidfile = tmp_path / "pid"
    parent = textwrap.dedent(f"""\
        import subprocess, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from edgekv.children import child_setup
        p = subprocess.Popen(["sleep", "60"], preexec_fn=child_setup())
        open({str(pidfile)!r}, "w").write(str(p.pid))
        time.sleep(60)
        """)
    proc = subprocess.Popen([sys.executable, "-c", parent])
    import os
    import time
    try:
        for _ in range(200):
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.05)
        child = int(pidfile.read_text())
        proc.kill()
        proc.wait()
        for _ in range(100):
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return
            time.sleep(0.05)
        os.kill(child, 9)
        raise AssertionError("the child outlived its killed parent")
    finally:
        proc.kill()
