"""Hostile inputs, round two (issue 37), part B: the bytes a runtime loads are the bytes the manifest vouched for,
every child process dies with the command that started it, and work a user asks for is bounded before it starts."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from click.testing import CliRunner

from conftest import ROOT
from edgekv.cli import main

LINUX = sys.platform.startswith("linux")


# ---------------------------------------------------------------------------------------------- unbounded work

@pytest.mark.parametrize("command", [["run", "EXPORT", "-p", "hi"], ["export", "-m", "MODEL", "-o", "OUT"],
                                     ["profile", "EXPORT"], ["analyze", "-m", "MODEL"]])
@pytest.mark.parametrize("threads", ["1000", "2147483648", "0"])
def test_every_command_refuses_a_thread_count_no_machine_has(tmp_path, command, threads):
    """-t is checked before anything is read: one line naming the range, exit 2 (run and export took any count)."""
    args = [a.replace("EXPORT", str(tmp_path)).replace("MODEL", str(tmp_path)).replace("OUT", str(tmp_path / "o"))
            for a in command]
    r = CliRunner().invoke(main, args + ["-t", threads])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "--threads" in line and "1<=x<=256" in line


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any ring rank would start: torch.multiprocessing's spawn context is never reached."""
    import edgekv.ring.launch as launch

    def refuse(*a, **k):
        raise AssertionError("ranks were started")
    monkeypatch.setattr(launch.mp, "get_context", refuse)


def test_ring_refuses_a_world_beyond_the_cores_before_starting_a_rank(no_ranks):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    limit = max(4, 2 * cores)  # two ranks per usable core, at least the default world of 4
    r = CliRunner().invoke(main, ["ring", "--world", str(limit + 1), "--ctx", "4k", "--heads", "2", "--kv-heads", "1",
                                  "--head-dim", "8"])
    assert r.exit_code == 2, r.output
    assert f"at most {limit} ranks" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # a prediction starts no rank: any world
    r = CliRunner().invoke(main, ["ring", "--world", "64", "--predict-only", "--json"])
    assert r.exit_code == 0, r.output and json.loads(r.stdout)["world"] == 64


def test_ring_refuses_a_context_whose_memory_is_not_there_before_starting_a_rank(no_ranks):
    """--ctx 16m: every rank keeps its K/V shard, 16,777,216 x 2 (K, V) x 8 KV heads x 128 x 4 bytes = 128 GiB in all
    at the defaults; far more than this machine has free."""
    from edgekv.ring.config import available_bytes
    r = CliRunner().invoke(main, ["ring", "--ctx", "16m"])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "available" in line
    need = float(line.split("needs about ")[1].split(" GiB")[0].replace(",", ""))
    assert need >= 16 * 2**20 * 2 * 8 * 128 * 4 / 2**30  # at least the shards, by hand
    assert available_bytes() < 128 * 2**30


def test_ring_memory_estimate_is_the_shards_by_hand_plus_the_processes():
    from edgekv.ring.config import RANK_PROCESS_BYTES, TILE_BYTES, RingConfig, memory_bytes
    cfg = RingConfig(world=2, ctx=1000, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=3, decode_steps=4)
    # shard c = 500 tokens (+ 4 // 2 + 1 decode slots) x 2 x 2 heads x 16 x 4 bytes, 3 layers; live: q 500x4x16x4,
    # K/V four times 500 x 256 bytes, fp32 out + accumulator 2 x 500x4x16x4, three score tiles
    per_rank = RANK_PROCESS_BYTES + 3 * 503 * 256 + 500 * 256 + 4 * 500 * 256 + 2 * 500 * 256 + 3 * TILE_BYTES
    assert memory_bytes(cfg) == 2 * per_rank


# ---------------------------------------------------------------------------------------------- children

def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _assert_all_gone(procs: list[psutil.Process], within: float = 5.0) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=within)
    for p in alive:  # do not leave them to the machine either way
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"still running {within} s after their parent: {[p.pid for p in alive]}"


def _start(script: str, tmp_path) -> subprocess.Popen:
    """The command in its own process, its output in files (a pipe would stay open while a child holds it)."""
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, stdout=out, stderr=err,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))


def _stop_and_check(parent: subprocess.Popen, sig: int, tmp_path) -> None:
    """Signal the command, then: every process it had started is gone within seconds (a SIGTERM'd command says
    so in one line and exits 143)."""
    kids = _descendants(parent.pid)
    assert kids
    parent.send_signal(sig)
    parent.wait(timeout=30)
    try:
        _assert_all_gone(kids)
    finally:
        if sig == signal.SIGTERM:
            err = (tmp_path / "err").read_text()
            assert parent.returncode == 143 and err.strip().splitlines()[-1] == "edgekv: terminated", err


PROFILE = """
    import sys
    import edgekv.profile.run as run
    run.measure_bandwidth = lambda **k: 1e10      # no 512 MiB sweep: the child is what is under test
    sys.executable = {sleeper!r}                   # the measuring child: a process that runs until it is stopped
    from edgekv.cli import main
    main(["profile", {export!r}, "--ctx", "32", "--steps", "4", "--threads", "1"])
"""


@pytest.mark.skipif(not LINUX, reason="the kernel's PR_SET_PDEATHSIG and /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_profile_measuring_child_dies_with_profile(tiny_onnx_export, tmp_path, sig):
    sleeper = tmp_path / "sleeper"
    sleeper.write_text("#!/bin/sh\nexec sleep 120\n")
    sleeper.chmod(0o755)
    parent = _start(PROFILE.format(sleeper=str(sleeper), export=str(tiny_onnx_export)), tmp_path)
    try:
        _wait_for(lambda: [p for p in _descendants(parent.pid) if p.name() == "sleep"], 60, "the child")
        _stop_and_check(parent, sig, tmp_path)
    finally:
        parent.kill()


RING = """
    import dataclasses
    import edgekv.ring.launch as launch
    run_ring = launch.run_ring
    # rank 1 stops answering after the warm-up (the launcher's own test fault), so the ranks run until stopped
    launch.run_ring = lambda cfg, *a, **k: run_ring(dataclasses.replace(cfg, fault="hang:1"), *a, **k)
    from edgekv.cli import main
    main(["ring", "--world", "2", "--ctx", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
          "--timeout", "300"])
"""


@pytest.mark.skipif(not LINUX, reason="the kernel's PR_SET_PDEATHSIG and /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_ring_ranks_and_their_helpers_die_with_ring(tmp_path, sig):
    parent = _start(RING, tmp_path)
    try:
        def ranks():
            found = [p for p in _descendants(parent.pid) if any("spawn_main" in c for c in p.cmdline())]
            return found if len(found) >= 2 else None
        _wait_for(ranks, 120, "two ranks")
        time.sleep(3)  # past the warm-up: rank 1 hangs, rank 0 waits on it
        _stop_and_check(parent, sig, tmp_path)
    finally:
        parent.kill()
