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


def test_ring_refuses_a_context_whose_memory_is_not_there_before_starting_a_rank(no_ranks, monkeypatch):
    """--ctx 16m: every rank keeps its K/V shard, 16,777,216 x 2 (K, V) x 8 KV heads x 128 x 4 bytes = 128 GiB in all
    at the defaults; refused on a machine with 64 GiB free (this one's own free memory, when it has less)."""
    import edgekv.ring.config as config
    free = config.available_bytes()
    assert free is None or 0 < free <= psutil.virtual_memory().total
    monkeypatch.setattr(config, "available_bytes", lambda: min(free or 2**62, 64 * 2**30))
    r = CliRunner().invoke(main, ["ring", "--ctx", "16m"])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "available" in line
    need = float(line.split("needs about ")[1].split(" GiB")[0].replace(",", ""))
    assert need >= 16 * 2**20 * 2 * 8 * 128 * 4 / 2**30  # at least the shards, by hand
    # what fits runs: the default ring's estimate is well inside the same 64 GiB
    assert config.memory_bytes(config.RingConfig(world=4, ctx=2048)) < 4 * 2**30


def test_ring_memory_estimate_is_the_shards_by_hand_plus_the_processes():
    from edgekv.ring.config import RANK_PROCESS_BYTES, TILE_BYTES, RingConfig, memory_bytes
    cfg = RingConfig(world=2, ctx=1000, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=3, decode_steps=4)
    # shard c = 500 tokens (+ 4 // 2 + 1 decode slots) x 2 x 2 heads x 16 x 4 bytes, 3 layers; live: q 500x4x16x4,
    # K/V four times 500 x 256 bytes, fp32 out + accumulator 2 x 500x4x16x4, three score tiles; the link probe sends
    # and receives a 1 MiB message (its floor: the 128,000-byte K/V block is smaller)
    per_rank = (RANK_PROCESS_BYTES + 3 * 503 * 256 + 500 * 256 + 4 * 500 * 256 + 2 * 500 * 256 + 3 * TILE_BYTES
                + 2 * 2**20)
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
    """The command in its own process, its output in files (a pipe would stay open while a child holds it), its
    temporary files in tmp_path/tmp."""
    (tmp_path / "tmp").mkdir()
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, stdout=out, stderr=err,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                                         TMPDIR=str(tmp_path / "tmp")))


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
            # and what it wrote for itself is gone with it (the profile's private copy, the ring's result folder)
            assert not list((tmp_path / "tmp").iterdir())


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


# ---------------------------------------------------------------------------------------------- what is loaded

def _run_json(folder, *extra):
    r = CliRunner().invoke(main, ["run", str(folder), "--prompt", "The cat", "--max-new-tokens", "6", "--threads",
                                  "1", "--json", *extra])
    return r.exit_code, (json.loads(r.stdout) if r.exit_code == 0 else None), r.stderr


def _swap_when_called(monkeypatch, module, attr: str, victim, evil: bytes, seen: list):
    """Replace module.attr by a function that first renames a file holding `evil` over `victim` (as another process
    could, after every check edgekv makes and just before the runtime opens its file), then calls the real one."""
    real = getattr(module, attr)

    def swapped(*a, **k):
        other = victim.with_name(victim.name + ".other")
        other.write_bytes(evil)
        os.replace(other, victim)
        seen.append(a[0] if a else None)
        return real(*a, **k)
    return real, swapped


@pytest.fixture
def export_copy(tiny_onnx_export, tmp_path):
    import shutil
    d = tmp_path / "export"
    shutil.copytree(tiny_onnx_export, d)
    return d


def _reference_tokens(folder) -> list[int]:
    code, out, err = _run_json(folder)
    assert code == 0, err
    return out["tokens"]


def test_onnx_weights_renamed_over_the_checked_ones_are_never_run(export_copy, monkeypatch):
    """model.onnx.data swapped for other weights of the same size between edgekv's hash check and ONNX Runtime's
    load: the run either fails or generates what the vouched weights generate (here: the same export, untouched)."""
    import onnxruntime

    want = _reference_tokens(export_copy)
    data = export_copy / "model.onnx.data"
    evil = bytes(len(data.read_bytes()))  # all weights zero: a model that generates something else
    # the swapped weights do change what runs: ONNX Runtime alone, on a folder holding them
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper
    other = export_copy.parent / "other"
    other.mkdir()
    for name in ("model.onnx", "manifest.json"):
        (other / name).write_bytes((export_copy / name).read_bytes())
    (other / "model.onnx.data").write_bytes(evil)
    manifest = load_export(export_copy)
    ref = OrtStepper(manifest, export_copy, 1).prefill([84, 104, 101], last=True)
    assert (OrtStepper(manifest, other, 1).prefill([84, 104, 101], last=True) != ref).any()

    seen = []
    real, swapped = _swap_when_called(monkeypatch, onnxruntime, "InferenceSession", data, evil, seen)
    monkeypatch.setattr(onnxruntime, "InferenceSession", swapped)
    code, out, err = _run_json(export_copy)
    assert seen, "ONNX Runtime was not called"
    assert data.read_bytes() == evil  # the swap happened
    if code == 0:
        assert out["tokens"] == want
    else:
        assert code == 2 and "sha256 does not match" in err


def test_a_tokenizer_renamed_over_the_checked_one_is_never_read(export_copy, monkeypatch):
    """tokenizer.json swapped between the check and `tokenizers` reading it (another byte mapping: every id + 7)."""
    import tokenizers

    want = _reference_tokens(export_copy)
    tj = export_copy / "tokenizer.json"
    spec = json.loads(tj.read_text())
    spec["model"]["vocab"] = {k: (v + 7) % 256 for k, v in spec["model"]["vocab"].items()}
    evil = json.dumps(spec).encode()
    seen = []
    real = tokenizers.Tokenizer
    # the last point before the tokenizer's bytes are read (load_tokenizer reads them and hands them to the library)
    from edgekv.export import generate
    _, swap = _swap_when_called(monkeypatch, generate, "load_tokenizer", tj, evil, seen)
    # the swapped tokenizer does change the run: the ids of the same prompt differ
    assert real.from_str(evil.decode()).encode("The cat").ids != real.from_file(str(tj)).encode("The cat").ids
    monkeypatch.setattr(generate, "load_tokenizer", swap)
    code, out, err = _run_json(export_copy)
    assert seen
    if code == 0:
        assert out["tokens"] == want
    else:
        assert code == 2 and "sha256 does not match" in err


def test_the_private_copy_is_the_users_alone_and_removed_afterwards(export_copy, monkeypatch):
    import stat
    import tempfile

    import onnxruntime
    made, modes = [], []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*a, **k):
        made.append(real_mkdtemp(*a, **k))
        return made[-1]
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    real = onnxruntime.InferenceSession

    def session(path, *a, **k):
        modes.append((path, stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)))
        return real(path, *a, **k)
    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    code, out, err = _run_json(export_copy)
    assert code == 0, err
    loaded = [p for p, _ in modes]
    assert loaded and all(any(p.startswith(m + os.sep) for m in made) for p in loaded)  # not the export folder
    assert all(mode == 0o700 for _, mode in modes)
    assert made and not any(os.path.exists(m) for m in made)
    # an error while loading removes it too (the graph refused by ONNX Runtime)
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    code, _, err = _run_json(export_copy)
    assert code == 2 and str(export_copy / "model.onnx") in err and "edgekv-load" not in err
    assert not any(os.path.exists(m) for m in made)


def test_a_copy_left_by_a_killed_run_is_removed_by_the_next_and_nothing_else_is(export_copy, tmp_path, monkeypatch):
    """A SIGKILL runs no cleanup: the next private copy removes copies of this host's dead processes, and leaves a
    live process's copy, a symlink, a file, another host's copy and a folder merely named alike."""
    import tempfile

    from edgekv.export import manifest as M

    where = tmp_path / "tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    monkeypatch.setattr(M, "copy_folder", lambda: str(where))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no process holds now
    host = M._host()
    killed = where / f"edgekv-load-{host}-{dead.pid}-abc123"
    (killed / "sub").mkdir(parents=True)
    (killed / "sub" / "model.onnx").write_bytes(b"x" * 100)
    live = where / f"edgekv-load-{host}-{os.getppid()}-live99"
    live.mkdir()
    other_host = where / f"edgekv-load-otherbox-{dead.pid}-abc123"
    other_host.mkdir()
    users = where / f"edgekv-load-{host}-{dead.pid}-notes.txt"
    users.write_text("mine")
    target = tmp_path / "keep"
    target.mkdir()
    (target / "precious").write_text("keep")
    link = where / f"edgekv-load-{host}-{dead.pid}-link"
    link.symlink_to(target)
    code, _, err = _run_json(export_copy)
    assert code == 0, err
    assert not killed.exists()
    assert live.is_dir() and other_host.is_dir() and users.read_text() == "mine"
    assert link.is_symlink() and (target / "precious").read_text() == "keep"
    assert sorted(p.name for p in where.iterdir()) == sorted(p.name for p in (live, other_host, users, link))


def test_a_fifo_in_place_of_a_listed_file_is_refused_not_read(export_copy):
    """A file the manifest lists replaced by a FIFO: one line, at once (reading it would wait for a writer)."""
    (export_copy / "tokenizer.json").unlink()
    os.mkfifo(export_copy / "tokenizer.json")
    code, _, err = _run_json(export_copy)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{export_copy / 'tokenizer.json'}: not a regular file" in err


@pytest.fixture(scope="module")
def pte_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("pte") / "tiny"
    r = CliRunner().invoke(main, ["export", "--model", str(ROOT / "fixtures" / "tiny" / "llama"), "--format", "pte",
                                  "--max-ctx", "64", "--verify-steps", "1", "--threads", "1", "--out", str(out)])
    assert r.exit_code == 0, r.stderr
    return out


@pytest.mark.slow  # an XNNPACK lowering: a minute or two on 2 shared cores
def test_a_pte_renamed_over_the_checked_one_is_never_run(pte_export, tmp_path, monkeypatch):
    """model.pte swapped, just before ExecuTorch opens it, for the same program with its embedding table negated
    (found in the file by the fixture's own fp32 weights): the run fails or generates what the vouched .pte does."""
    import shutil

    import numpy as np
    from executorch.extension.pybindings import portable_lib
    from safetensors.numpy import load_file

    d = tmp_path / "export"
    shutil.copytree(pte_export, d)
    want = _reference_tokens(d)
    pte = d / "model.pte"
    data = bytearray(pte.read_bytes())
    table = load_file(ROOT / "fixtures" / "tiny" / "llama" / "model.safetensors")["model.embed_tokens.weight"]
    at = bytes(data).find(table.astype(np.float32).tobytes())
    assert at > 0, "the embedding table is not stored as is in the .pte"
    data[at:at + table.nbytes] = (-table.astype(np.float32)).tobytes()
    evil = bytes(data)
    other = tmp_path / "other"  # the swapped program does change the run (loaded without edgekv's checks)
    shutil.copytree(d, other)
    (other / "model.pte").write_bytes(evil)
    from edgekv.export.manifest import load_export
    from edgekv.export.pte_stepper import PteStepper
    m = load_export(d)
    assert (PteStepper(m, other, 1).prefill([84, 104, 101], last=True)
            != PteStepper(m, d, 1).prefill([84, 104, 101], last=True)).any()
    seen = []
    _, swapped = _swap_when_called(monkeypatch, portable_lib, "_load_program", pte, evil, seen)
    monkeypatch.setattr(portable_lib, "_load_program", swapped)
    code, out, err = _run_json(d, "--runtime", "executorch")
    assert seen and pte.read_bytes() == evil
    if code == 0:
        assert out["tokens"] == want
    else:
        assert code == 2 and "sha256 does not match" in err


@pytest.mark.skipif(not LINUX, reason="/proc/self/mounts")
def test_the_copy_is_not_made_in_memory_when_the_temporary_folder_is_a_tmpfs(export_copy, tmp_path, monkeypatch):
    """A tmpfs $TMPDIR would hold the copied weights in RAM beside the runtime's use of them: the copy goes to the
    user's cache folder instead (on disk here, as tmp_path is)."""
    import tempfile

    import onnxruntime
    mounts = {ln.split()[1]: ln.split()[2] for ln in open("/proc/self/mounts") if len(ln.split()) > 2}
    if mounts.get("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    monkeypatch.setenv("TMPDIR", "/dev/shm")
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real, loaded = onnxruntime.InferenceSession, []

    def session(path, *a, **k):
        loaded.append(path)
        return real(path, *a, **k)
    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    code, out, err = _run_json(export_copy)
    assert code == 0, err
    assert loaded and all(p.startswith(str(tmp_path / "cache" / "edgekv") + os.sep) for p in loaded)
    assert not list((tmp_path / "cache" / "edgekv").iterdir())  # and removed
