"""edgekv profile / report on a small exported model: fresh-process measurement, the budget demonstrated, the
report schema shared with the Android app, one page with plan, measurement and baseline."""
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import run_cli
from edgekv.profile.procmem import status_bytes
from edgekv.profile.run import SCHEMA


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("src")
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=4096)).save_pretrained(src)
    out = tmp_path_factory.mktemp("exp") / "tiny"
    p = run_cli("export", "--model", src, "--strategy", "kv", "--format", "onnx", "--max-ctx", "512", "--out", out,
                "--json", check=True)
    (out.parent / "export.stdout").write_text(p.stdout)
    return out


def test_export_json_is_the_manifest_it_wrote(export_dir):
    """`export --json`: stdout is one JSON object (progress on stderr), the manifest as written to the folder."""
    printed = json.loads((export_dir.parent / "export.stdout").read_text())
    assert printed["out"] == str(export_dir)
    assert printed["manifest"] == json.loads((export_dir / "manifest.json").read_text())


def test_proc_status_parsing_by_hand():
    s = status_bytes("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t1\n")
    assert s == {"VmHWM": 2048 * 1024, "VmRSS": 1024 * 1024}


def test_profile_measures_each_context_in_a_fresh_process(export_dir, tmp_path):
    p = run_cli("profile", export_dir, "--ctx", "128,512", "--steps", "16", "--threads", "1", "--json",
                "--out", tmp_path / "r.json", check=True)
    rep = json.loads(p.stdout)
    jsonschema.validate(rep, json.loads(SCHEMA.read_text()))
    assert [r["ctx"] for r in rep["runs"]] == [128, 512]
    for r in rep["runs"]:
        assert r["status"] == "ok" and r["fits"]
        assert r["measured_bytes"] > 0 and r["runtime_baseline_bytes"] > 10e6  # python + onnxruntime
        assert r["tokens_per_s"] > 0 and r["latency_ms"]["p90"] >= r["latency_ms"]["p50"]
        assert r["roofline_tokens_per_s"] > 0
    assert rep["host"]["bandwidth_bytes_per_s"] > 1e9
    assert json.loads((tmp_path / "r.json").read_text()) == rep


def test_repeats_report_the_median_run_with_every_runs_memory(export_dir):
    p = run_cli("profile", export_dir, "--ctx", "128", "--steps", "8", "--threads", "1", "--repeats", "3", "--json",
                check=True)
    assert p.stderr.count("in a fresh process") == 3 and "(3 of 3)" in p.stderr
    run = json.loads(p.stdout)["runs"][0]
    m = run["measured_bytes_runs"]
    assert len(m) == 3 and run["measured_bytes"] == sorted(m)[1]
    assert run["peak_bytes"] - run["runtime_baseline_bytes"] == run["measured_bytes"]  # one real run's numbers


def test_median_run_picks_a_real_run_and_never_hides_a_failed_one():
    from edgekv.profile.run import median_run

    runs = [{"peak_bytes": 100 + m, "runtime_baseline_bytes": 100, "tag": t} for m, t in ((30, "a"), (10, "b"),
                                                                                           (20, "c"), (40, "d"))]
    assert median_run(runs)["tag"] == "c" and median_run(runs)["measured_bytes_runs"] == [30, 10, 20, 40]
    assert median_run(runs[:3])["tag"] == "c" and "measured_bytes_runs" not in median_run(runs[:1])
    over = {"status": "exceeded", "peak_bytes": 500, "runtime_baseline_bytes": 100, "tag": "x"}
    assert median_run(runs[:2] + [over])["tag"] == "x"


def test_repeats_with_adb_is_one_line(export_dir):
    p = run_cli("profile", export_dir, "--adb", "--repeats", "2")
    assert p.returncode == 2 and "--repeats" in p.stderr and "Traceback" not in p.stderr


# the export_dir model by hand (LlamaConfig: vocab 512, hidden 128, MLP 256, 2 layers, 4 heads of 32, 2 KV heads,
# untied head): embedding and head 512 x 128 each; per layer q, o 128 x 128, k, v 128 x 64, gate, up, down 128 x 256,
# two norms of 128; a final norm of 128
TINY_EMB = 512 * 128
TINY_LINEAR = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256)
TINY_SMALL = 2 * 2 * 128 + 128
TINY_PARAMS = 2 * TINY_EMB + TINY_LINEAR + TINY_SMALL  # 426,624
TINY_STATE = 2 * 2 * 2 * 512 * 32 * 2  # kv fp16 at max_ctx 512: layers x (K, V) x KV heads x slots x head_dim x 2 B


def test_the_prediction_counts_the_weights_the_export_stored(export_dir):
    """fp32 weights are 4 B per parameter; int4 in ONNX Runtime (its own layout, as `edgekv plan --runtime ort`
    prices it: edgekv's ONNX quantizes every MatMul with MatMulNBits and the table with GatherBlockQuantized, 4 bits
    + one fp32 scale per 32): linear layers, the head and the embedding 0.5 B + 4 B per 32 weights, norms fp32. By
    hand from the config, not from the manifest's own count."""
    import copy

    from edgekv.profile.run import predicted

    m = json.loads((export_dir / "manifest.json").read_text())
    assert m["model"]["n_params"] == TINY_PARAMS == 426_624
    p = predicted(m, "ort")
    assert p["weights"] == 4 * TINY_PARAMS and p["state"] == TINY_STATE == 262_144
    q = copy.deepcopy(m)
    q["weights"]["dtype"] = "int4"
    int4 = (2 * TINY_EMB + TINY_LINEAR) * (0.5 + 4 / 32) + 4 * TINY_SMALL
    assert predicted(q, "ort")["weights"] == int4 == 268_800


# a profile child whose memory is known: after its baseline it writes ALLOC[ctx] bytes (every page touched) and
# reports what edgekv.profile.child reports
KNOWN_CHILD = """
import json, sys, time
from edgekv.profile.procmem import hwm, reset_hwm, rss
n = int(sys.argv[1])
base = rss()
reset_hwm()
x = b"\\x01" * n
peak = hwm()
del x
print(json.dumps({"status": "ok", "runtime_baseline_bytes": base, "peak_bytes": peak, "latencies_s": [0.01, 0.03],
                  "after_load_bytes": base}))
"""
ALLOC = {128: 4_000_000, 512: 96_000_000}


def test_profile_reports_a_known_allocation_against_the_prediction_with_the_right_sign(export_dir, monkeypatch):
    """The report's numbers for children whose peak is known: measured = the allocation (+ at most 3 MB of the
    interpreter's own), predicted = the planner's components summed, error_pct = (measured - predicted) / predicted
    with its sign: below the prediction at ctx 128 (4 MB), above it at ctx 512 (96 MB); the roofline is the
    bandwidth over the weights + state a decode step reads, by hand."""
    import subprocess
    import sys

    from edgekv.profile import run as prun

    def known_child(folder, runtime, ctx, steps, tokens, limit, threads, timeout=1800):
        n = ALLOC[ctx + steps]
        p = subprocess.run([sys.executable, "-c", KNOWN_CHILD, str(n)], capture_output=True, text=True, timeout=60)
        return json.loads(p.stdout.strip().splitlines()[-1])

    monkeypatch.setattr(prun, "run_child", known_child)
    monkeypatch.setattr(prun, "measure_bandwidth", lambda threads=None: 1e9)
    rep = prun.profile(str(export_dir), [128, 512], 16, "ort", None, 1)
    prun.validate_report(rep)
    for run in rep["runs"]:
        comp = run["predicted_components"]
        assert comp["weights"] == 4 * TINY_PARAMS and comp["state"] == TINY_STATE
        assert run["predicted_bytes"] == comp["weights"] + comp["state"] + comp["workspace"] + comp["load"]
        assert 10e6 < run["predicted_bytes"] < 90e6  # ORT's 17 MB session + this model's 2 MB
        n = ALLOC[run["ctx"]]
        assert n <= run["measured_bytes"] <= n + 3_000_000
        want = 100 * (n - run["predicted_bytes"]) / run["predicted_bytes"]
        assert run["error_pct"] == pytest.approx(want, abs=100 * 3e6 / run["predicted_bytes"])
        assert run["roofline_tokens_per_s"] == pytest.approx(1e9 / (4 * TINY_PARAMS + TINY_STATE))
        assert run["tokens_per_s"] == pytest.approx(2 / 0.04) and run["fits"]
    low, high = rep["runs"]
    assert low["error_pct"] < 0 < high["error_pct"]


# a profile child (edgekv.profile.child.main) over a stepper whose memory is known: loading peaks at LOAD_PEAK and
# keeps WEIGHTS; the prefill keeps STATE and peaks CALL_EXTRA above it; a decode step allocates nothing
FAKE_STEPPER_CHILD = """
import json, sys
import numpy as np
import edgekv.export.runtime as er
from edgekv.profile import child
MB = 1_000_000
LOAD_PEAK, WEIGHTS, STATE, CALL_EXTRA = 240 * MB, 20 * MB, 60 * MB, 30 * MB

class Fake:
    chunk, max_chunk = 64, 64
    def __init__(self, *a):
        t = np.ones(LOAD_PEAK, np.uint8)  # every page touched, then freed: the load's transient
        del t
        self.weights = np.ones(WEIGHTS, np.uint8)
    def prefill(self, prompt, last=True, after_call=None):
        self.state = np.ones(STATE, np.uint8)
        t = np.ones(CALL_EXTRA, np.uint8)
        del t
        after_call()
        return [np.arange(8, dtype=np.float32)]
    def step(self, toks, pos):
        return [np.arange(8, dtype=np.float32)]

er.open_stepper = lambda *a: Fake()
res = child.main({"export": sys.argv[1], "runtime": "ort", "ctx": 100, "steps": 2, "tokens": list(range(100)),
                  "threads": 1})
print(json.dumps(res))
"""


def test_the_child_measures_the_loads_peak_and_the_calls_peak_apart(export_dir):
    """A runtime that peaks while loading (ORT packing a tied head from the table's pages) hides the state in the
    run's peak: the child reports the load's peak, the calls' peak after it (VmHWM reset after loading) and what
    stays resident after the prefill, each against a stepper whose allocations are known (MB above the baseline:
    load 240 transient + 20 kept; prefill 60 kept + 30 transient)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", FAKE_STEPPER_CHILD, str(export_dir)], capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)})
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    base = r["runtime_baseline_bytes"]
    mb = lambda k: (r[k] - base) / 1e6  # noqa: E731
    assert r["hwm_reset_after_load"]
    print({k: round(mb(k), 1) for k in ("load_peak_bytes", "after_load_bytes", "calls_peak_bytes",
                                        "after_prefill_bytes")})
    assert 235 <= mb("load_peak_bytes") <= 250  # within a few MB: the interpreter's own pages come and go
    assert 15 <= mb("after_load_bytes") <= 26
    assert 105 <= mb("calls_peak_bytes") <= 120  # weights 20 + state 60 + the call's 30, not the load's 240
    assert 75 <= mb("after_prefill_bytes") <= 90
    assert r["peak_bytes"] == r["load_peak_bytes"]


def test_a_budget_too_small_is_demonstrated_not_assumed(export_dir):
    """--limit counts what the measured column counts (peak above the runtime's baseline), and a run over it exits 3:
    half the measured bytes stops the run; three times them fits, though the whole process is far larger."""
    free = json.loads(run_cli("profile", export_dir, "--ctx", "512", "--steps", "8", "--threads", "1", "--json",
                              check=True).stdout)["runs"][0]
    m = free["measured_bytes"]
    assert free["runtime_baseline_bytes"] > 3 * m  # so a whole-process limit of 3 m could not pass
    p = run_cli("profile", export_dir, "--ctx", "512", "--steps", "8", "--threads", "1", "--limit", f"{m // 2}B",
                "--json", env={"EDGEKV_PROGRESS": "1"})
    assert p.returncode == 3, p.stderr[-2000:]
    assert "elapsed" not in p.stderr  # --json: no progress bar
    run = json.loads(p.stdout)["runs"][0]
    assert run["status"] == "exceeded" and run["fits"] is False and "reached_step" in run
    p = run_cli("profile", export_dir, "--ctx", "512", "--steps", "8", "--threads", "1", "--limit", f"{3 * m}B",
                env={"EDGEKV_PROGRESS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "1/1" in p.stderr and "runs" in p.stderr and "elapsed" in p.stderr  # the bar, on stderr
    assert "yes" in p.stdout and "GB = 1e9 bytes" in p.stdout and not re.search(r"\bMi?B\b", p.stdout)


def test_a_peak_inside_one_call_that_holds_the_gil_is_still_caught():
    """The watchdog thread cannot sample while one C call holds the GIL (as ExecuTorch's load and method calls do);
    the check after each call reads the kernel's high-water mark, which saw the peak. Here the call is CPython's
    bytes repetition: 300 MB written and freed under the GIL, with the watchdog running and a limit 150 MB above."""
    import subprocess
    import sys

    code = """
import threading, time
from edgekv.profile import child
from edgekv.profile.procmem import hwm, reset_hwm, rss
reset_hwm()
out = {"status": "ok"}
limit = max(rss(), hwm()) + 150_000_000
threading.Thread(target=child._watchdog, args=(limit, out), daemon=True).start()
time.sleep(0.05)
x = b"x" * 300_000_000
del x
time.sleep(0.05)
seen_by_watchdog = out["status"] != "ok"
child._check_peak(limit, out)
print("not caught", seen_by_watchdog)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stdout + p.stderr
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["status"] == "exceeded" and rep["peak_bytes"] > rep["limit_bytes"]


def test_adb_without_a_device_is_one_line(export_dir):
    p = run_cli("profile", export_dir, "--adb")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_report_page_has_plan_measurement_and_baseline(export_dir, tmp_path):
    out = tmp_path / "report.html"
    run_cli("report", export_dir, "--out", out, check=True)
    page = out.read_text()
    assert "Plan on Google Pixel 8" in page or "plan on Google Pixel 8" in page
    assert "users per GPU" in page and "Measured on this host" in page and "data:image/png;base64" in page
    md = tmp_path / "report.md"
    p = run_cli("report", export_dir, "--out", md, "--json", check=True)
    assert "## Datacenter baseline" in md.read_text()
    # --json: what the page shows, as data; its plan row is the one `edgekv plan` computes for that deployment
    data = json.loads(p.stdout)
    assert data["out"] == str(md) and data["ctx"] == 512
    assert data["baseline"]["gpu"] == "NVIDIA H100 SXM5 80 GB" and data["baseline"]["users"] >= 1
    assert [r["ctx"] for r in data["profile"]["runs"]] == [256, 512]
    # the plan row: this model's weights and state by hand, the parts adding up to the total, set against the
    # Pixel 8's app budget (3 GB: device_profiles/pixel8.toml, the low end of devices.md's 3-4 GB)
    row = data["plan"]
    b = row["bytes"]
    assert row["device"] == "Google Pixel 8" and row["params"]["weights"] == "fp32"
    assert b["weights"] == 4 * TINY_PARAMS and b["state"] == TINY_STATE
    assert b["total"] == b["weights"] + b["state"] + b["workspace"] + b["load"] + b["runtime"]
    assert row["budget_bytes"] == 3_000_000_000 and row["fits"] == (b["total"] <= 3e9)
    assert row["headroom_bytes"] == 3_000_000_000 - b["total"]


def test_the_ort_prefill_call_size_is_the_one_the_export_recorded(export_dir):
    """The export plans each format for a call size and records it; OrtStepper calls with that size (an older
    manifest without one falls back to Stepper.max_chunk), and profile reports and predicts with the same size."""
    from edgekv.export.manifest import load_export
    from edgekv.export.runtime import OrtStepper
    from edgekv.export.stepper import Stepper
    m = load_export(export_dir)
    dep = m["deployment"]["formats"]["onnx"]
    assert dep["runtime"] == "onnxruntime" and dep["prefill_chunk"] == min(Stepper.max_chunk, 512)
    calls = []
    for recorded, want in ((48, 48), (None, Stepper.max_chunk)):
        mm = json.loads(json.dumps(m))
        if recorded:
            mm["deployment"]["formats"]["onnx"]["prefill_chunk"] = recorded
        else:
            del mm["deployment"]
        st = OrtStepper(mm, export_dir, threads=1)
        sizes = []
        call = st._call
        st._call = lambda toks, pos, rows: sizes.append(len(toks)) or call(toks, pos, rows)
        st.prefill(list(range(1, 301)))
        calls.append(sizes)
        assert st.max_chunk == want and max(sizes) == want and sum(sizes) == 300
    assert calls[0] == [48] * 6 + [12]
    p = run_cli("profile", export_dir, "--ctx", "300", "--steps", "4", "--threads", "1", "--json", check=True)
    assert json.loads(p.stdout)["prefill_chunk"] == dep["prefill_chunk"]


ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"  # git-ignored; kept after the run to look at


def _chromium() -> str | None:
    import shutil
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_figures_put_legends_beside_bars_and_draw_the_budget():
    """The memory chart: a linear GB axis, the budget as a line when on the scale, each legend's box clear of every
    bar (compared in the rendered figure's pixels)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.patches import Rectangle

    from edgekv.profile.report import memory_figure, quality_figure, speed_figure
    runs = [{"ctx": 256, "predicted_bytes": 40_000_000, "measured_bytes": 42_000_000, "tokens_per_s": 300.0,
             "roofline_tokens_per_s": 900.0},
            {"ctx": 1024, "predicted_bytes": 60_000_000, "measured_bytes": 58_000_000, "tokens_per_s": 250.0,
             "roofline_tokens_per_s": 700.0}]
    for fig in (memory_figure(runs, 100_000_000, "budget"), speed_figure(runs)):
        fig.canvas.draw()
        ax = fig.axes[0]
        leg = ax.get_legend().get_window_extent()
        bars = [p.get_window_extent() for p in ax.patches if isinstance(p, Rectangle)]
        assert len(bars) == 4 and not any(leg.overlaps(b) for b in bars)
        assert ax.get_yscale() == "linear" and ax.get_ylabel()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "1k"]
    mem = memory_figure(runs, 100_000_000, "budget").axes[0]
    assert "GB" in mem.get_ylabel() and any(list(ln.get_ydata()) == [0.1, 0.1] for ln in mem.get_lines())
    far = memory_figure(runs, 3_000_000_000, "Pixel 8 budget").axes[0]  # 50x the bars: said, not drawn
    assert "off this scale" in far.get_title() and far.get_ylim()[1] < 0.1
    fit = {"law": "power", "params": {"a": 0.02, "b": 0.2}, "class": "bounded"}
    q = quality_figure(fit, 2048, 8192, "smollm2-135m").axes[0]
    assert {"end of measurement (2k)", "this report's context (8k)"} <= {ln.get_label() for ln in q.get_lines()}


def test_report_page_in_headless_chromium(export_dir, monkeypatch):
    """The page as a browser shows it: the analyzer's curve (a stored measurement), the basis note, units; the
    screenshot is kept in test-artifacts/report.png."""
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not installed (make test installs Debian's chromium as root)")
    import subprocess

    import edgekv.quality
    from edgekv.profile.report import build_report
    stored = json.loads((Path(edgekv.quality.__file__).parent / "measurements"
                         / "smollm2-135m__kv-int4_group-32.json").read_text())
    monkeypatch.setattr(edgekv.quality, "measured", lambda *a, **k: stored)
    ARTIFACTS.mkdir(exist_ok=True)
    page = ARTIFACTS / "report.html"
    prof = run_cli("profile", export_dir, "--ctx", "128,512", "--steps", "8", "--threads", "1", "--json",
                   check=True).stdout
    (ARTIFACTS / "profile.json").write_text(prof)
    _, data = build_report(export_dir, str(page), "pixel8", "h100", None, str(ARTIFACTS / "profile.json"),
                           force=True)  # the page of an earlier run is replaced
    text = page.read_text()
    for alt in ("memory", "speed", "quality"):
        assert f'alt="{alt}"' in text
    words = re.sub(r"data:image/png;base64,[^\"]*", "", text)
    assert "count different things" in words and "GB = 1e9 bytes" in words and not re.search(r"\bMi?B\b", words)
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    p = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={shot}", "--window-size=1280,2600", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 50_000, p.stderr[-2000:]
    import matplotlib.image
    img = matplotlib.image.imread(shot)
    assert img.shape[1] == 1280 and img.std() > 0.05  # a page with content, not a blank canvas
