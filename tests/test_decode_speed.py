"""benchmarks/decode_speed.py: its bytes-per-token arithmetic against the KV sizes llama.cpp itself prints for SmolLM2
and against hand arithmetic, and the JSON of a tiny real run (transformers on the trained tiny llama fixture; peers
that need a GGUF become error rows instead of stopping the run)."""
import json
import os
import struct
from importlib.metadata import version
from pathlib import Path

import pytest

from edgekv.arch import load_arch

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "fixtures" / "tiny" / "llama"
MIB = 2**20

ds = load_benchmark("decode_speed")


def test_roofline_fraction_is_bytes_per_second_over_bandwidth():
    # 100 tok/s x 0.5 GB read per token = 50 GB/s, half of a 100 GB/s machine
    assert ds.roofline_fraction(100, 5e8, 1e11) == pytest.approx(0.5)
    assert ds.roofline_fraction(None, 5e8, 1e11) is None  # a failed row has no fraction
    assert ds.roofline_fraction(100, 5e8, None) is None


def test_mean_decode_position_averages_the_positions_the_decode_steps_run_at():
    # 500-token prompt, 128 new tokens: the first comes from the prefill, 127 steps run at positions 500..626
    assert ds.mean_decode_position(500, 128) == pytest.approx(sum(range(500, 627)) / 127)


def test_kv_bytes_for_llama_cpp_rows_match_what_llama_cpp_prints(gguf_path):
    # llama.cpp's own log for SmolLM2-135M (what it prints when it allocates the cache): KV f16 45.00 MiB at n_ctx 2048 and 180.00 at
    # 8192; q8_0 23.91 and 95.62 MiB
    arch = load_arch(str(gguf_path))
    for ctx, f16, q8 in ((2048, 45.00, 23.91), (8192, 180.00, 95.62)):
        for kv, mib in (("f16", f16), ("q8_0", q8)):
            full = ds.peer_bytes(arch, "gguf", ds.LLAMACPP_KV[kv], ctx, ctx)["state_full"]
            assert full / MIB == pytest.approx(mib, abs=0.005), (kv, ctx)
    at = ds.peer_bytes(arch, "gguf", "kv", 2048, 563)
    assert at["state_at_pos"] == pytest.approx(45 * MIB * 563 / 2048)  # the cache filled up to the decode position
    # the GGUF's tensors are all read once per token (tied embeddings: the output projection reads the whole table),
    # and they are the file less its metadata (tokenizer vocabulary, a few MB)
    size = gguf_path.stat().st_size
    assert size - 8 * MIB < at["weights_read"] < size


def test_edgekv_bytes_come_from_the_manifest():
    manifest = {"weights": {"bytes": 538_060_032}, "state": {"bytes": 47_185_920}, "max_ctx": 2048}
    b = ds.edgekv_bytes(manifest, 563.0)
    assert b["weights_read"] == 538_060_032 and b["state_full"] == 47_185_920
    assert b["state_at_pos"] == pytest.approx(47_185_920 * 563 / 2048)


def test_only_selects_rows_by_substring_and_quick_is_smaller():
    full, quick = ds.row_names(False), ds.row_names(True)
    assert set(quick) < set(full)
    assert ds.select(full, "llamacpp") == ["llamacpp:f16", "llamacpp:q8_0"]
    assert ds.select(full, "edgekv-pte:kv-int8,genai:fp32") == ["edgekv-pte:kv-int8/fp32", "genai:fp32"]
    assert ds.select(full, "nothing-like-this") == []


def _safetensors_data_bytes(path: Path) -> int:
    """Tensor bytes of a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


def test_a_tiny_run_writes_rows_for_every_selection_even_failing_ones(tmp_path):
    out = tmp_path / "speed.json"
    r = ds.main(["--model", str(TINY), "--only", "hf:dynamic,llamacpp:f16,genai:int4", "--ctx", "128",
                 "--threads", "1", "--prompt-tokens", "24", "--new-tokens", "4", "--bw-mib", "8", "--bw-runs", "2",
                 "--work", str(tmp_path / "work"), "--out", str(out)])
    assert json.loads(out.read_text()) == r
    assert r["versions"]["transformers"] == version("transformers")
    assert r["machine"]["cores"] == os.cpu_count()
    assert r["settings"]["prompt_tokens"] == 24
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == ["hf:dynamic", "llamacpp:f16", "genai:int4"]
    assert "GGUF" in rows["llamacpp:f16"]["error"] and "GGUF" in rows["genai:int4"]["error"]

    hf = rows["hf:dynamic"]
    assert "error" not in hf and hf["ctx"] == 128 and hf["threads"] == 1
    assert hf["decode_tok_s"] > 0 and hf["prefill_tok_s"] > 0 and len(hf["first_tokens"]) == 4
    assert hf["peak_rss_bytes"] >= hf["baseline_rss_bytes"] + _safetensors_data_bytes(TINY / "model.safetensors")
    # bytes per token by hand from the fixture's config: fp32 weights (tied: all of them read once) + the fp32 KV
    # cache of 4 layers x K,V x 4 heads x 48 dims up to the mean decode position 24 + (4 - 2) / 2
    cfg = json.loads((TINY / "config.json").read_text())
    kv_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert hf["bytes_per_token"] == pytest.approx(_safetensors_data_bytes(TINY / "model.safetensors")
                                                  + kv_per_token * 25, abs=1)
    probes = r["bandwidth"]["1"]["probes"]  # before and after the rows; the faster one counts
    assert len(probes) == 2
    bw = r["bandwidth"]["1"]["best_bytes_s"]
    assert bw == pytest.approx(max(8 * MIB / min(p["times_s"]) for p in probes), rel=1e-3)
    assert hf["roofline_fraction"] == pytest.approx(hf["decode_tok_s"] * hf["bytes_per_token"] / bw, rel=1e-2)


@pytest.mark.slow
def test_edgekv_onnx_artifact_and_transformers_pick_the_same_greedy_tokens(tmp_path):
    # exports the tiny fixture (about a minute on 2 cores), then both runtimes decode the same prompt
    r = ds.main(["--model", str(TINY), "--only", "edgekv-ort:kv:dtype=fp32/fp32,hf:dynamic", "--ctx", "128",
                 "--threads", "1", "--prompt-tokens", "40", "--new-tokens", "16", "--bw-mib", "8", "--bw-runs", "2",
                 "--work", str(tmp_path / "work"), "--out", str(tmp_path / "speed.json")])
    ort, hf = r["rows"]
    assert ort["name"] == "edgekv-ort:kv:dtype=fp32/fp32" and "error" not in ort, ort
    assert ort["first_tokens"] == hf["first_tokens"]
    assert ort["weights_plus_state_bytes"] == hf["weights_plus_state_bytes"]  # manifest vs planner: same bytes


def test_a_child_spec_larger_than_one_argument_reaches_the_child_whole(tmp_path):
    """A filled 32k context's ids (~200 KB of JSON) are more than one command-line argument may hold (Linux
    MAX_ARG_STRLEN, 128 KiB: the 32k run once died with E2BIG): run_child sends the spec on stdin."""
    script = tmp_path / "child.py"
    script.write_text("import json, sys\nsys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])\n"
                      f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
                      "from speed_child import child_spec\n"
                      "spec = json.loads(child_spec(sys.argv[2]))\n"
                      "print('RESULT ' + json.dumps({'n': len(spec['ids']), 'last': spec['ids'][-1]}))\n")
    ids = list(range(100_000, 132_768))  # 32,768 six-digit ids: ~262 KB of JSON
    assert len(json.dumps(ids)) > 128 * 1024
    assert ds.run_child({"kind": "x", "ids": ids}, 60, script=str(script)) == {"n": 32768, "last": 132767}


def test_genai_builder_reads_gemma_3s_rope_as_its_gemma_3_path_wants_and_other_configs_unchanged():
    """transformers 5 nests Gemma 3's RoPE per layer type; ONNX Runtime GenAI's builder (0.18) reads a flat
    rope_parameters and rope_local_base_freq (Gemma-3-270M's published config: 1e6 global, 1e4 sliding)."""
    import transformers

    from speed_child import builder_config

    g = builder_config(transformers.Gemma3TextConfig(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}))
    assert g.rope_parameters["rope_type"] == "default" and g.rope_parameters["rope_theta"] == 1_000_000.0
    assert g.rope_local_base_freq == 10_000.0
    assert g.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0  # what transformers reads stays
    llama = transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    before = dict(llama.rope_parameters)
    assert builder_config(llama).rope_parameters == before and not hasattr(llama, "rope_local_base_freq")


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_row_process_dies_with_the_benchmark_that_started_it(tmp_path):
    """A benchmark stopped from outside (kill) must not leave its row's child running for up to its timeout."""
    import signal
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "child.pid"
    child = tmp_path / "child.py"
    child.write_text(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import speed_child; "
                               f"speed_child.run_child({{'kind': 'x'}}, 120, script={str(child)!r})"])
    for _ in range(200):
        if pidfile.is_file() and pidfile.read_text():
            break
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the row's child outlived the benchmark that started it")
