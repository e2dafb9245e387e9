"""Recall past the trained context and its use by the planner: the distance ladder gains the longest distance that
still fits the trained context, the probe loads a model past its trained length (an export refuses to), a short real
run on a trained fixture stores curves the planner reads (edgekv/measured.py), `edgekv plan` cites the stored
SmolLM2-135M measurement, and a damaged or missing file is a note in the evidence, never an exception."""
import json
import re

import pytest
import torch

from conftest import ROOT, run_cli
from edgekv import measured
from edgekv.analyze.recall import (LAST_FIT, RecallProbe, compare_variants, distances, load_beyond_trained,
                                   make_trials, store, trained_context)
from edgekv.analyze.run import Encoder, default_text
from edgekv.errors import EdgekvError
from edgekv.models import load_any
from edgekv.strategies import parse_strategy


def test_the_ladder_has_a_point_just_inside_the_trained_context():
    assert distances(12288, 8192) == [16, 64, 256, 1024, 4096, 8192 - LAST_FIT, 12288]
    assert distances(4096, 8192) == [16, 64, 256, 1024, 4096]  # nothing added below the trained length
    assert distances(256, 256) == [16, 64, 256 - LAST_FIT, 256]
    assert measured.TRIAL_EXTRA == LAST_FIT  # the planner's idea of a trial's length is the probe's


def test_the_probe_loads_past_the_trained_context_where_an_export_refuses():
    kv = parse_strategy("kv:dtype=fp32")
    with pytest.raises(EdgekvError, match="exceeds the model's trained context 8192"):
        load_any("fixtures/tiny/llama", kv, 9000)
    lv = load_beyond_trained("fixtures/tiny/llama", kv, 9000)
    assert 9000 in lv.layout.tensors[0].shape  # a cache of 9000 slots
    assert trained_context(lv) == (256, "train_log.json seq_len")  # the fixture's training window, not 8192


@pytest.fixture(scope="module")
def tiny_llama_curves(tmp_path_factory):
    """A real (short) run: the trained tiny Llama, its fp32 cache, a 64-token window and kv-int4, 2 trials to 256
    tokens (past its 256-token training window), stored the way --save stores it."""
    torch.set_num_threads(1)
    base = parse_strategy("kv:dtype=fp32")
    probe = RecallProbe("fixtures/tiny/llama", base, compare_variants(["window:w=32,sinks=0", "kv-int4:group=16"]),
                        256, 64)
    dists = distances(256, probe.trained[0])
    rows = make_trials(Encoder.for_model(probe.loaded), default_text(), dists, 2, seed=0)
    result = probe.summarise(rows, probe.run(rows), "stdlib")
    folder = tmp_path_factory.mktemp("measurements")
    path = store(result, "tiny-llama", "edgekv analyze --probe recall (test)", folder)
    return result, folder, json.loads(path.read_text())


def test_a_short_run_stores_curves_with_their_command_and_date(tiny_llama_curves):
    result, _, rec = tiny_llama_curves
    assert result["distances"] == [16, 64, 128, 256] and result["beyond_trained"] == [False, False, False, True]
    assert set(rec["curves"]) == {"kv:dtype=fp32", "window:w=32,sinks=0,dtype=fp16", "kv-int4:group=16"}
    for c in rec["curves"].values():
        assert [p["distance"] for p in c["points"]] == [16, 64, 128, 256]
        for p in c["points"]:
            assert 0 <= p["value"] <= 1 and p["trials"] == 2 and p["date"] and "--probe recall" in p["command"]
            assert p["seconds"] > 0
    # a 32-slot window holds nothing of a needle 64+ tokens back: exact recall is impossible by construction
    win = rec["curves"]["window:w=32,sinks=0,dtype=fp16"]["points"]
    assert all(p["value"] == 0 for p in win if p["distance"] >= 64)


def test_storing_again_keeps_the_distances_it_did_not_measure(tiny_llama_curves, tmp_path):
    result, _, _ = tiny_llama_curves
    store(result, "m", "first", tmp_path)
    short = {**result, "distances": [16], "beyond_trained": [False],
             "variants": [{**v, "exact": v["exact"][:1], "accuracy": v["accuracy"][:1], "logprob": v["logprob"][:1],
                           "trials": [5]} for v in result["variants"]]}
    rec = json.loads(store(short, "m", "second", tmp_path).read_text())
    pts = rec["curves"]["kv:dtype=fp32"]["points"]
    assert [(p["distance"], p["command"], p["trials"]) for p in pts] == \
        [(16, "second", 5), (64, "first", 2), (128, "first", 2), (256, "first", 2)]


def _q():
    return {"risk": "low", "evidence": "published", "source": "published", "cite": "ref"}


def test_the_plan_side_cites_the_point_within_the_context(tiny_llama_curves):
    _, folder, rec = tiny_llama_curves
    ref = {p["distance"]: p["value"] for p in rec["curves"]["kv:dtype=fp32"]["points"]}
    q = measured.cite(_q(), "tiny-llama", parse_strategy("kv"), 200, folder)  # fp16 cache -> the fp32 curve
    assert q["cite"] == f"ref; recall at 128: {ref[128]:.2f} exact (model's own), measured"
    assert "fp32 cache" in q["evidence"] and "(test)" in q["evidence"]
    far = measured.cite(_q(), "tiny-llama", parse_strategy("kv"), 32768, folder)
    assert "recall at 256:" in far["cite"] and "measured up to 256, not 32,768" in far["evidence"]
    assert "past the trained context" in far["evidence"]
    w = measured.cite(_q(), "tiny-llama", parse_strategy("window:w=32,sinks=0"), 256, folder)
    if ref[256] >= 0.5:  # the fp32 cache recalls what the window dropped: the measured loss makes the risk high
        assert w["risk"] == "high" and w["source"] == "measured"
    assert measured.cite(_q(), "tiny-llama", parse_strategy("mla"), 256, folder) == _q()  # not measured: unchanged
    assert measured.cite(_q(), "no-such-model", parse_strategy("kv"), 256, folder) == _q()


def test_the_measured_loss_raises_the_risk(tmp_path):
    pts = lambda vals: [{"distance": d, "value": v, "trials": 4} for d, v in vals]  # noqa: E731
    (tmp_path / "m__recall.json").write_text(json.dumps({"curves": {
        "kv:dtype=fp32": {"points": pts([(1024, 1.0), (8064, 0.75)])},
        "kv-int4:group=32": {"points": pts([(1024, 1.0), (8064, 0.25)])}}}))
    q = measured.cite(_q(), "m", parse_strategy("kv-int4"), 8192, tmp_path)
    assert q["risk"] == "high" and q["source"] == "measured"
    assert q["cite"] == "ref; recall at 8,064: 0.25 exact (fp32 0.75), measured"
    assert "the fp32 cache 0.75" in q["evidence"]
    assert measured.cite(_q(), "m", parse_strategy("kv-int4"), 4096, tmp_path)["risk"] == "low"  # 1.0 at 1k


@pytest.mark.parametrize("content", ["{not json", "[]", '{"curves": {"kv:dtype=fp32": {"points": [{"distance": "x"}]}}}',
                                     '{"curves": 3}'])
def test_a_damaged_file_is_a_note_never_an_exception(tmp_path, content):
    (tmp_path / "m__recall.json").write_text(content)
    q = measured.cite(_q(), "m", parse_strategy("kv"), 8192, tmp_path)
    assert q["risk"] == "low" and q["cite"] == "ref"
    assert q["evidence"].startswith("published; recall measurement not cited: m__recall.json")


def test_plan_cites_the_stored_smollm2_measurement():
    """The stored SmolLM2-135M curves (edgekv analyze --probe recall --save) in `edgekv plan`: the fp16 cache cites the
    fp32 curve's longest point within 8k, the window its own; converted mla, which the probe measured losing the
    needle the fp32 cache recalls, is high risk from that measurement (published: 'unknown')."""
    rec = measured.load("smollm2-135m")
    assert rec is not None, "edgekv/measurements/smollm2-135m__recall.json is missing"
    out = json.loads(run_cli("plan", "--model", "smollm2-135m", "--ctx", "8k", "--device", "pixel8", "--json",
                             "--weights", "fp16", check=True).stdout)  # fp16: no weight cost sets the cite
    rows = {o["strategy"]: o["quality"] for o in out["options"]}
    for name in ("kv", "kv-int8", "kv-int4", "window", "mla"):
        r = measured.recall_at("smollm2-135m", parse_strategy(name), 8192)
        assert r is not None, name
        d = r["distance"]
        shown = f"{d // 1024}k" if d % 1024 == 0 else f"{d:,}"  # 4096 -> 4k, 8064 -> 8,064
        assert f"recall at {shown}: {r['value']:.2f} exact" in rows[name]["cite"]
        assert r["command"] in rows[name]["evidence"]
        if r["reference"] and r["value"] < measured.LOSS * r["reference"]:
            assert rows[name]["risk"] == "high" and rows[name]["source"] == "measured"
    assert rows["mla"]["risk"] == "high"  # what the stored file says: converted mla loses the needle
    text = run_cli("plan", "--model", "smollm2-135m", "--ctx", "8k", "--device", "pixel8", "--explain",
                   check=True).stdout
    assert re.search(r"exact( \([^)]*\))?, measured", " ".join(text.split()))


def test_a_damaged_stored_file_leaves_the_plan_working(tmp_path, monkeypatch):
    from edgekv.arch import catalog_arch
    from edgekv.devices import load_device
    from edgekv.plan import make_plan

    (tmp_path / "smollm2-135m__recall.json").write_text("{damaged")
    monkeypatch.setattr(measured, "MEASURED_DIR", tmp_path)
    res = make_plan(load_device("pixel8"), 8192, [catalog_arch("smollm2-135m")]).to_json(explain=True)
    notes = [o["quality"]["evidence"] for o in res["options"]]
    assert notes and all("recall measurement not cited: smollm2-135m__recall.json unreadable" in n for n in notes)


# ---- the stored curves in `edgekv plan --explain` ----

# a plan row's strategy -> the stored curve it shows (the fp16 cache keeps every token: the fp32 reference's curve)
SMOLLM2_CURVES = {"kv": "kv:dtype=fp32", "kv-int8": "kv-int8:group=0", "kv-int4": "kv-int4:group=32",
                  "window": "window:w=4096,sinks=4,dtype=fp16", "mla": "mla:dtype=fp16"}


def _stored(name):
    return json.loads((measured.MEASURED_DIR / f"{name}__recall.json").read_text())


def _fragments(points):
    """What the text shows of each stored point, built from the file: '8,064* 0.75 (4' (distance, * past the trained
    context, exact recall, trials)."""
    return [f"{p['distance']:,}{'*' if p['beyond_trained'] else ''} {p['value']:.2f} ({p['trials']}" for p in points]


def _in_order(text, parts):
    at = 0
    for s in parts:
        at = text.find(s, at)
        if at < 0:
            return False
        at += len(s)
    return True


def test_plan_explain_shows_the_stored_curves_of_each_row_and_of_the_reference():
    rec = _stored("smollm2-135m")
    ref = rec["curves"]["kv:dtype=fp32"]["points"]
    out = json.loads(run_cli("plan", "--model", "smollm2-135m", "--ctx", "8k", "--device", "pixel8", "--json",
                             "--explain", check=True).stdout)
    rows = {o["strategy"]: o["explain"]["recall"] for o in out["options"]}
    keys = ("distance", "value", "trials", "beyond_trained", "seconds")
    for name, label in SMOLLM2_CURVES.items():
        want = rec["curves"][label]["points"]
        got = rows[name]
        assert got["curve"] == label and got["file"] == "edgekv/measurements/smollm2-135m__recall.json"
        assert [[p[k] for k in keys] for p in got["points"]] == [[p[k] for k in keys] for p in want], name
        if label == "kv:dtype=fp32":
            assert got["reference"] is None  # the row's curve is the reference
        else:
            assert [[p[k] for k in keys] for p in got["reference"]["points"]] == [[p[k] for k in keys] for p in ref]
    text = " ".join(run_cli("plan", "--model", "smollm2-135m", "--ctx", "8k", "--device", "pixel8", "--explain",
                            check=True).stdout.split())
    for name, label in SMOLLM2_CURVES.items():
        curve = rec["curves"][label]
        line = text.split(f"{curve['label']}: ", 1)[1]
        assert _in_order(line, _fragments(curve["points"])), name
    assert _in_order(text.split(f"{rec['curves']['kv:dtype=fp32']['label']}: ", 1)[1], _fragments(ref))
    for p in (p for c in rec["curves"].values() for p in c["points"]):  # every run that measured a point, its time
        assert f"{p['seconds']:,.0f} s wall" in text and p["command"] in text


def test_a_model_folder_shows_its_own_stored_curve_not_one_of_a_namesake():
    """fixtures/tiny-recall/llama is stored as tiny-recall-llama (measured.folder_key); fixtures/tiny/llama, another
    folder named llama, has none."""
    rec = _stored("tiny-recall-llama")
    out = json.loads(run_cli("plan", "--model", "fixtures/tiny-recall/llama", "--ctx", "2k", "--device", "pixel8",
                             "--json", "--explain", check=True).stdout)
    kv = next(o for o in out["options"] if o["strategy"] == "kv")
    assert [(p["distance"], p["value"], p["beyond_trained"]) for p in kv["explain"]["recall"]["points"]] == \
        [(p["distance"], p["value"], p["beyond_trained"]) for p in rec["curves"]["kv:dtype=fp32"]["points"]]
    assert rec["trained_ctx"] == 512  # train_log.json's seq_len: the points past it are marked
    other = json.loads(run_cli("plan", "--model", "fixtures/tiny/llama", "--ctx", "2k", "--device", "pixel8",
                               "--json", "--explain", check=True).stdout)
    assert all(o["explain"]["recall"] is None for o in other["options"])


def test_plan_stays_free_of_torch_with_the_curves():
    import subprocess
    import sys
    code = ("import sys; from edgekv.arch import catalog_arch; from edgekv.devices import load_device; "
            "from edgekv.plan import make_plan; "
            "p = make_plan(load_device('pixel8'), 8192, [catalog_arch('smollm2-135m')]).to_json(explain=True); "
            "assert any(o['explain']['recall'] for o in p['options']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_recurrent_models_curves_cite_its_fp32_state_and_the_files_note_is_kept(tmp_path, tiny_llama_curves):
    # a stored curve as edgekv analyze writes one (its "value" names the probe), with a note a person added
    value = json.loads((ROOT / "edgekv/measurements/tiny-recall-mamba__recall.json").read_text())["value"]
    (tmp_path / "m__recall.json").write_text(json.dumps({"value": value, "note": "never learned to copy", "curves": {
        "ssm:dtype=fp32": {"label": "reference ssm fp32", "points": [{"distance": 64, "value": 0.5, "trials": 4}]},
        "ssm:dtype=int8": {"label": "state ssm int8", "points": [{"distance": 64, "value": 0.0, "trials": 4}]}}}))
    c = measured.curves("m", parse_strategy("ssm:dtype=int8"), tmp_path)
    assert c["reference"]["curve"] == "ssm:dtype=fp32" and c["note"] == "never learned to copy"
    q = measured.cite(_q(), "m", parse_strategy("ssm:dtype=int8"), 64, tmp_path)
    assert q["risk"] == "high" and "the fp32 state 0.50" in q["evidence"]
    result, _, _ = tiny_llama_curves
    rec = json.loads(store(result, "m", "again", tmp_path).read_text())  # a run that adds points keeps the note
    assert rec["note"] == "never learned to copy" and "ssm:dtype=int8" in rec["curves"]


def test_recall_lost_past_the_trained_context_raises_the_risk(tmp_path):
    pts = [{"distance": 256, "value": 1.0, "trials": 8, "beyond_trained": False},
           {"distance": 2048, "value": 0.0, "trials": 8, "beyond_trained": True}]
    (tmp_path / "m__recall.json").write_text(json.dumps({"curves": {"kv:dtype=fp32": {"points": pts}}}))
    q = measured.cite(_q(), "m", parse_strategy("kv"), 4096, tmp_path)
    assert q["risk"] == "high" and q["source"] == "measured"
    assert "exact recall 1.00 inside the trained context, 0.00 past it" in q["evidence"]
    assert measured.cite(_q(), "m", parse_strategy("kv"), 1024, tmp_path)["risk"] == "low"  # 256 is inside
