"""`edgekv profile --arch arm64`: the refusal lines and the memory split (default suite, nothing built), and, marked
slow, the tiny fixtures run in the arm64 root under qemu against this host's run."""
import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_cli
from edgekv.profile.arm64 import compare
from edgekv.profile.qemu_rss import guest_base, parse_smaps, split_rss


def one_line_error(p):
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def test_unknown_arch_is_one_line(tmp_path):
    line = one_line_error(run_cli("profile", tmp_path, "--arch", "sparc"))
    assert "sparc" in line and "arm64" in line


def test_arm64_without_the_environment_is_one_line(tmp_path):
    line = one_line_error(run_cli("profile", tmp_path, "--arch", "arm64", env={"EDGEKV_ARM64_DIR": str(tmp_path)}))
    assert "make arm64-env" in line


@pytest.mark.parametrize("extra, word", [(["--limit", "1GB"], "--limit"), (["--device", "pixel8"], "--device"),
                                         (["--repeats", "3"], "--repeats"), (["--adb"], "--adb"),
                                         (["--ctx", "64,128"], "one --ctx")])
def test_options_that_do_not_apply_to_arm64_are_one_line(tmp_path, extra, word):
    line = one_line_error(run_cli("profile", tmp_path, "--arch", "arm64", *extra,
                                  env={"EDGEKV_ARM64_DIR": str(tmp_path)}))
    assert word in line


def smaps_entry(lo, hi, perms, path, rss_kb):
    return (f"{lo:08x}-{hi:08x} {perms} 00000000 00:00 0 {path}\nSize: {(hi - lo) // 1024} kB\n"
            f"Rss: {rss_kb} kB\nPss: {rss_kb} kB\n")


def test_the_qemu_process_splits_into_guest_and_qemu_by_the_guests_own_mappings(tmp_path):
    """Hand arithmetic: the guest maps python at 0x400000 (qemu put it at host 0x10400000: guest_base 0x10000000)
    and an anonymous block at 0x1000000-0x1400000; the host adds qemu's binary, its heap and its code buffer, and a
    host mapping that only half overlaps a guest one counts half its Rss as the guest's."""
    root = tmp_path / "root"
    root.mkdir()
    py = f"{root.resolve()}/usr/bin/python3.11"
    host = (smaps_entry(0x10400000, 0x10800000, "r-xp", py, 2048)                 # guest: python's text
            + smaps_entry(0x11000000, 0x11400000, "rw-p", "", 4000)               # guest: anonymous
            + smaps_entry(0x11400000, 0x11c00000, "rw-p", "", 1000)               # half inside the guest's block
            + smaps_entry(0x7f0000000000, 0x7f0040000000, "rwxp", "", 30000)      # qemu: translated code
            + smaps_entry(0x20000000, 0x20100000, "r-xp", "/usr/libexec/qemu-binfmt/aarch64-binfmt-P", 900)
            + smaps_entry(0x30000000, 0x30200000, "rw-p", "[heap]", 1500))        # qemu's own heap
    guest = ("00400000-00800000 r-xp 00000000 00:00 0 /usr/bin/python3.11\n"
             "01000000-01800000 rw-p 00000000 00:00 0\n")
    assert guest_base([(0x400000, 0x800000, "/usr/bin/python3.11")], parse_smaps(host), root) == 0x10000000
    s = split_rss(host, guest, root)
    assert s["total"] == (2048 + 4000 + 1000 + 30000 + 900 + 1500) * 1024
    assert s["guest"] == (2048 + 4000 + 500) * 1024
    assert s["qemu"] == s["total"] - s["guest"]


def test_compare_names_the_first_differing_token_and_holds_logits_to_the_manifests_limit():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 32)).astype(np.float32) * 10
    host = {"logits": logits, "state0": np.ones((2, 3), np.float16), "state1": np.arange(6, dtype=np.int8)}
    near = dict(host, logits=logits + 1e-3)
    r = compare({"tokens": [1, 2, 3, 4, 5]}, {"tokens": [1, 2, 3, 4, 5]}, host, near,
                {"max_abs_diff_over_logit_scale": 2e-3})
    assert r["tokens_equal"] and r["logits_within_tolerance"] and r["state"]["codes_differ_fraction"] == 0
    scale = float(np.abs(logits).max())
    assert r["max_abs_diff_over_logit_scale"] == pytest.approx(1e-3 / scale, rel=1e-2)
    far = dict(host, logits=logits + 0.1 * scale, state1=np.array([0, 1, 2, 3, 4, 9], np.int8))
    r = compare({"tokens": [1, 2, 3, 4, 5]}, {"tokens": [1, 2, 7, 4, 5]}, host, far,
                {"max_abs_diff_over_logit_scale": 2e-3})
    assert not r["tokens_equal"] and r["first_token_difference"] == 2 and r["top1_agreement"] == 0.8
    assert not r["logits_within_tolerance"] and r["state"]["codes_differ_fraction"] == pytest.approx(1 / 6)


# ---- slow: the arm64 root, built or reused, and the tiny fixtures in it ----


def arm64_ready_or_skip():
    if platform.system() != "Linux" or os.geteuid() != 0:
        pytest.skip("the arm64 root needs Linux and root (chroot, mounts): not this machine")
    p = subprocess.run(["sh", str(ROOT / "scripts/arm64_env.sh")], capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        pytest.skip("make arm64-env cannot run here: " + (p.stderr.strip().splitlines() or ["?"])[-1])


@pytest.mark.slow
@pytest.mark.parametrize("fixture, strategy, cpu", [("llama", "kv:dtype=fp32", None), ("mamba", "ssm", None),
                                                    ("llama", "kv:dtype=fp16", "cortex-a57")])
def test_tiny_fixtures_on_arm64_match_this_host(tmp_path, fixture, strategy, cpu):
    """Both formats of a trained fixture, in the arm64 root under qemu against the x86 run: the guest really is
    aarch64, its greedy tokens equal the host's, logits within the export's own verification limit, the state
    within it too, and the arm64 memory above the baseline is measured (non-zero, below the process's RSS).
    An fp16 cache runs on an ARMv8.0 core (cortex-a57): on qemu's default `max` core, which has ARMv8.2 FP16
    arithmetic as phones do, ONNX Runtime's fp16 attention kernels move its cache rows by more than that limit
    (tokens and logits still agree; benchmarks/log/arm64.md). On that ARMv8.0 core the .pte, whose attention is
    ExecuTorch's custom_sdpa, stops with SIGILL (the wheel's LLM kernels need ARMv8.2), which the report names."""
    arm64_ready_or_skip()
    out = tmp_path / fixture
    run_cli("export", "--model", ROOT / "fixtures/tiny" / fixture, "--strategy", strategy, "--format", "onnx,pte",
            "--max-ctx", "64", "--verify-steps", "2", "--threads", "1", "--out", out, check=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"QEMU_CPU": cpu} if cpu else {})}
    p = subprocess.run([sys.executable, "-m", "edgekv.cli", "profile", str(out), "--arch", "arm64", "--ctx", "24",
                        "--steps", "4", "--threads", "1", "--json"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=3600)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["qemu_cpu"] == (cpu or "max")
    assert [r["format"] for r in rep["runs"]] == ["onnx", "pte"]
    interp = rep["interpreter"]
    assert 0.5 < interp["arm64_guest_bytes"] / interp["host_python_bytes"] < 2.0, interp
    for r in rep["runs"]:
        if cpu == "cortex-a57" and r["format"] == "pte":
            assert "exit -4" in r["status"] and "ARMv8.2" in r["status"], r
            continue
        assert r["status"] == "ok", r
        assert r["machine"] == {"host": platform.machine(), "arm64": "aarch64"}
        assert r["tokens_equal"] and r["logits_within_tolerance"] and r["state"]["float_within_tolerance"], r
        assert 0 < r["arm64"]["measured_bytes"] < r["arm64"]["process_rss_bytes"]["end"], r["arm64"]


def test_the_logits_limit_is_the_exports_own_else_verifys_quantized_weights_limit():
    from edgekv.export.verify import REL_TOL
    from edgekv.profile.arm64 import limit_for
    m = {"verification": {"pte": {"tolerance": {"max_abs_diff_over_logit_scale": 2e-3}}}}
    assert limit_for(m, "pte")["max_abs_diff_over_logit_scale"] == 2e-3
    assert limit_for(m, "onnx")["max_abs_diff_over_logit_scale"] == REL_TOL["quantized-weights"]
