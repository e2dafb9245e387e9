"""benchmarks/filled_context.py: the prompt that fills a context, the quality columns (KL and top-1 against the fp32
model's logits, checked against hand arithmetic), the bytes a window row reads, the row selection and its bad input."""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "filled_context.py"

fc = load_benchmark("filled_context")


def test_the_prompt_fills_the_context_up_to_the_last_decode_step():
    # ctx 2048, 16 new tokens: the first comes from the prefill, 15 steps at positions 2033..2047, the last slot
    n = fc.prompt_len(2048, 16)
    assert n == 2033
    assert n + 16 - 1 == 2048


def test_quality_is_kl_of_the_reference_against_the_row_and_top1_agreement():
    ref = np.array([[0.0, math.log(3.0)], [2.0, 0.0]])  # softmax: (1/4, 3/4), (e^2, 1) / (e^2 + 1)
    got = np.array([[0.0, 1.0], [0.0, 3.0]])  # (1, e) / (1 + e): top-1 agrees; row 2: top-1 flipped
    q = fc.quality(ref, got)
    p0, e1 = (0.25, 0.75), math.e
    kl0 = sum(p * math.log(p / r) for p, r in zip(p0, (1 / (1 + e1), e1 / (1 + e1))))
    e = math.exp(2.0)
    p1 = (e / (e + 1), 1 / (e + 1))
    q1 = (1 / (1 + math.exp(3.0)), math.exp(3.0) / (1 + math.exp(3.0)))
    kl1 = sum(p * math.log(p / r) for p, r in zip(p1, q1))
    assert q["kl_mean"] == pytest.approx((kl0 + kl1) / 2)
    assert q["kl_max"] == pytest.approx(max(kl0, kl1))
    assert q["top1_agree"] == 0.5 and q["positions"] == 2
    same = fc.quality(ref, ref + 5.0)  # a constant shift of the logits is the same distribution
    assert same["kl_mean"] == pytest.approx(0.0, abs=1e-12) and same["top1_agree"] == 1.0
    with pytest.raises(ValueError, match="shapes differ"):
        fc.quality(ref, got[:1])

    assert q["kl_per_position"] == pytest.approx([kl0, kl1], abs=1e-6)


def test_paired_is_the_mean_per_position_difference_with_its_standard_error():
    # by hand: differences (0.1, -0.1, 0.3), mean 0.1, sample sd 0.2, se 0.2 / sqrt(3)
    a = {"kl_per_position": [0.5, 0.2, 0.9]}
    b = {"kl_per_position": [0.4, 0.3, 0.6]}
    p = fc.paired(a, b)
    assert p["kl_diff_mean"] == pytest.approx(0.1, abs=1e-6)
    assert p["kl_diff_se"] == pytest.approx(0.2 / math.sqrt(3), abs=1e-6)
    assert p["positions"] == 3 and p["a_lower_at"] == 1
    assert fc.paired(a, {"kl_per_position": [0.1, 0.2]}) is None  # not the same positions
    rows = [{"name": "x", "ctx": 64, "quality": a}, {"name": "y", "ctx": 64, "quality": b},
            {"name": "z", "ctx": 128, "quality": b}, {"name": "w", "ctx": 64, "error": "failed"}]
    assert [(r["a"], r["b"]) for r in fc.pairs(rows)] == [("x", "y")]


def test_forced_writes_every_logit_row_to_the_file_and_times_the_steps(tmp_path):
    """The prefill's last row, then one row per step fed the text's next token, in a .npy read back whole."""
    width = 5
    seen = []

    def prefill(ids):
        seen.append(("prefill", list(ids)))
        return np.arange(width, dtype=np.float32)

    def step(token, pos):
        seen.append(("step", token, pos))
        row = np.zeros(width, dtype=np.float32)
        row[token % width] = pos
        return row

    out = tmp_path / "rows.npy"
    r = fc._forced(prefill, step, [1, 2, 3, 4, 5, 6], 3, 3, str(out))
    rows = np.load(out)
    assert seen == [("prefill", [1, 2, 3]), ("step", 4, 3), ("step", 5, 4)]
    assert rows.shape == (3, width) and rows.dtype == np.float32
    assert rows[0].tolist() == list(range(width)) and rows[1][4] == 3 and rows[2][0] == 4
    assert r["tokens"] == [4, 4, 0] and r["decode_s"] >= 0

def test_a_window_row_reads_its_whole_window_at_a_filled_context():
    nbytes = {"weights_read": 10, "weights_stored": 10, "state_at_pos": 3.0, "state_full": 8}
    assert fc.state_read(nbytes, "window:w=512")["state_at_pos"] == 8
    assert fc.state_read(nbytes, "kv-int8")["state_at_pos"] == 3.0


def test_quick_rows_are_a_subset_and_every_row_has_int4_weights_or_is_a_peer():
    full, quick = fc.row_names(False), fc.row_names(True)
    assert set(quick) <= set(full) and len(quick) < len(full)
    for n in full:
        assert n.endswith(("/int4", "/gguf")) or n.split(":")[0] in ("llamacpp", "genai") or (n.startswith("et-llama:") and n.endswith("/8da4w")), n
    for s in fc.STRATEGIES:  # both formats for every strategy
        assert f"edgekv-pte:{s}/int4" in full and f"edgekv-ort:{s}/int4" in full
    assert set(fc.LLAMACPP_KV) == {n.split(":")[1] for n in full if n.startswith("llamacpp:")}


@pytest.mark.parametrize("args, says", [(["--ctx", "2k"], "--ctx"), (["--only", "nothing-matches"], "selects no row"),
                                        (["--ctx", "16", "--new-tokens", "16"], "no room"),
                                        (["--new-tokens", "1"], "at least 2"),
                                        (["--stop-prefill", "edgekv-pte:kv-int8c/int4=soon"], "positive number"),
                                        (["--stop-prefill", "llamacpp:f16=60"], "an edgekv row")])
def test_bad_options_are_one_clear_error(args, says):
    p = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2
    assert says in p.stderr and "Traceback" not in p.stderr


GEMMA3 = dict(cls="Gemma3TextConfig", vocab_size=103, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
              num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
              sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              initializer_range=0.2, rope_theta=1e5, rope_local_base_freq=1e3)


@pytest.mark.parametrize("chunk", [5, 16])
def test_the_reference_logits_are_transformers_own_over_the_whole_sequence(tmp_path, chunk):
    """The fp32 reference a Gemma 3 row is compared with: child_reference's chunked run (through a cache built from
    the config, sliding layers of 8 slots, chunks shorter and longer than that window, the head only over the wanted
    positions) against one call of transformers' Gemma3ForCausalLM over all 40 ids, at the 8 positions a row
    decodes; the tiny model has a final logit softcap, so logits taken past the model's own head would differ."""
    import torch

    from conftest import tiny_hf

    model = tiny_hf(GEMMA3, tmp_path / "hf")
    ids = torch.randint(0, 103, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    n_prompt, new = fc.prompt_len(40, 8), 8  # the prefill's last logits (position 32), then 7 steps
    out = tmp_path / "ref.npy"
    before = torch.get_num_threads()
    try:
        r = fc.child_reference({"model_path": str(tmp_path / "hf"), "ids": ids, "n_prompt": n_prompt,
                                "new_tokens": new, "threads": 1, "chunk": chunk, "logits_out": str(out)})
    finally:
        torch.set_num_threads(before)
    assert r["model_class"] == "Gemma3ForCausalLM"
    with torch.no_grad():
        want = model(torch.tensor([ids[:n_prompt + new - 1]])).logits[0, n_prompt - 1:].numpy()
    got = np.load(out)
    assert got.shape == (new, 103)
    scale = np.abs(want).max()
    assert scale > 1 and np.abs(got - want).max() <= 1e-5 * scale


def test_the_rows_run_in_the_order_of_the_only_keys():
    got = fc.main(["--list", "--only", "llamacpp:f16,edgekv-ort:kv-int8c,edgekv-ort:kv:dtype=fp32"])["rows"]
    assert got == ["llamacpp:f16", "edgekv-ort:kv-int8c/int4", "edgekv-ort:kv:dtype=fp32/int4"]
    got = fc.main(["--list", "--only", "genai,edgekv-ort:kv-int"])["rows"]  # within a key, the usual order
    assert got == ["genai:int4", "edgekv-ort:kv-int8/int4", "edgekv-ort:kv-int8c/int4", "edgekv-ort:kv-int4/int4"]
    # the carried GGUF rows only where a key names them
    got = fc.main(["--list", "--only", "edgekv-ort:kv-int8c/gguf,edgekv-ort:kv-int8c"])["rows"]
    assert got == ["edgekv-ort:kv-int8c/gguf", "edgekv-ort:kv-int8c/int4"]


def test_a_row_only_an_export_names_runs_beside_the_listed_one(tmp_path):
    """The same cache built two ways in one run: edgekv-pte:kv/int4 (its export) and edgekv-pte:kv:dtype=fp16/int4,
    a row no list has, named by its --export; each selected by its own --only key, in their order."""
    folder = tmp_path / "x"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    got = fc.main(["--list", "--export", f"edgekv-pte:kv:dtype=fp16/int4={folder}", "--export",
                   f"edgekv-pte:kv/int4={folder}", "--only", "edgekv-pte:kv/,edgekv-pte:kv:dtype=fp16"])["rows"]
    assert got == ["edgekv-pte:kv/int4", "edgekv-pte:kv:dtype=fp16/int4"]
    assert "edgekv-pte:kv:dtype=fp16/int4" not in fc.main(["--list", "--only", "edgekv-pte:kv"])["rows"]


def test_fill_quality_adds_each_rows_kl_from_its_saved_logits(tmp_path):
    """--fill-quality: the KL of a row an earlier --reference-later run measured, from the logits it saved, by hand:
    reference p = (1/2, 1/2), row q = (3/4, 1/4), KL(p || q) = 1/2 ln(4/3); a row that failed is left as it was."""
    import json

    ref, got = tmp_path / "ref.npy", tmp_path / "row.npy"
    np.save(ref, np.zeros((3, 2), dtype=np.float32))
    np.save(got, np.tile(np.array([math.log(3), 0], dtype=np.float32), (3, 1)))
    out = tmp_path / "run.json"
    out.write_text(json.dumps({"rows": [{"name": "llamacpp:f16", "ctx": 64}, {"name": "llamacpp:q8_0", "ctx": 64,
                                                                               "error": "timed out"}]}))
    done = [({"name": "llamacpp:f16"}, None, {"logits_out": str(got)}, [], 64),
            ({"name": "llamacpp:q8_0"}, None, {"logits_out": str(got)}, [], 64)]
    fc.fill_quality(out, done, {64: ref}, 4, lambda s: None)
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["quality"]["kl_mean"] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert rows[0]["quality"]["positions"] == 3 and "quality" not in rows[1]


def test_a_prefill_past_its_cpu_budget_stops_with_what_it_did(monkeypatch):
    """--stop-prefill: the stepper's after_call raises once the prompt's CPU time passes the budget, with the tokens
    sent so far (whole chunks, at most the prompt) and their rate, tokens / CPU seconds, by hand; without a budget
    it never stops."""
    cpu = iter([100.0, 104.0, 109.0, 111.0, 112.0])  # the CPU clock at start, then at each read
    monkeypatch.setattr(fc.time, "process_time", lambda: next(cpu))
    stop = fc.prefill_budget(10.0, 128, 300)
    stop()  # 4 s
    stop()  # 9 s
    with pytest.raises(fc.PrefillStopped) as e:
        stop()  # 11 s: past the budget; 3 chunks of 128 sent, but the prompt is 300 tokens
    assert e.value.progress["tokens"] == 300 and e.value.progress["of"] == 300
    assert e.value.progress["cpu_s"] == 12.0 and e.value.progress["tok_per_cpu_s"] == 25.0
    monkeypatch.setattr(fc.time, "process_time", lambda: 1e9)
    free = fc.prefill_budget(None, 128, 1000)
    for _ in range(20):
        free()
    stopped = fc.PrefillStopped(1024, 512.0, 600.0, 8184)
    assert stopped.progress == {"tokens": 1024, "of": 8184, "cpu_s": 512.0, "wall_s": 600.0, "tok_per_cpu_s": 2.0}
    assert "at token 1024 of 8184: 2.0 tok per CPU s" in str(stopped)


def test_an_export_row_whose_strategy_holds_an_equals_sign_keeps_its_whole_name(tmp_path):
    # the row ends at the first "=" after its "/" (a strategy's options hold "=", weights never do); the folder may
    # hold "=" too
    folder = tmp_path / "a=b"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    assert fc.export_arg(f"edgekv-ort:kv:dtype=fp32/gguf={folder}") == ("edgekv-ort:kv:dtype=fp32/gguf", "=",
                                                                          str(folder))
    assert fc.export_arg("edgekv-ort:kv/int4") == ("edgekv-ort:kv/int4", "", "")
    p = subprocess.run([sys.executable, str(SCRIPT), "--export", f"edgekv-ort:kv:dtype=fp32/gguf={folder}", "--only",
                        "kv:dtype=fp32/gguf", "--list"], check=False, capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["edgekv-ort:kv:dtype=fp32/gguf"]


def test_a_row_on_a_prebuilt_export_records_the_edgekv_kernel_its_pte_calls():
    # a manifest as `edgekv export --format pte --pte-int8-kernel edgekv` writes it (edgekv/export/targets.py:
    # the .pte artifact's custom_ops), and the stock export of the same strategy, which has none
    m = {"model": {"source": "hf:x"}, "strategy": {"label": "kv-int8c"}, "weights": {"dtype": "int4"},
         "artifacts": [{"format": "pte", "custom_ops": {"ops": ["edgekv::int8_sdpa.out"], "sources": []}}]}
    assert fc.export_record("/e", m) == {"folder": "/e", "model_source": "hf:x", "strategy": "kv-int8c",
                                         "weights": "int4", "custom_ops": ["edgekv::int8_sdpa.out"]}
    stock = dict(m, artifacts=[{"format": "pte"}])
    assert "custom_ops" not in fc.export_record("/e", stock)
