"""scripts/train_tiny.py --recall-mix: the associative-recall training windows. The mask marks exactly the value bytes
of repeated lines (checked against an independent parse of the window), the lines never use the recall probe's
needle format."""
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import train_tiny  # noqa: E402

LINE = re.compile(rb'^([a-z][a-z0-9_]{2,7})(?: = "([A-Za-z0-9]{3,10})"| = \'([A-Za-z0-9]{3,10})\'|: ([A-Za-z0-9]{3,10}))\n',
                  re.M)


@pytest.fixture(scope="module")
def text():
    # real stdlib text, as the script trains on (a slice, for speed)
    return np.frombuffer(b"".join(p.read_bytes() for _, p in train_tiny.stdlib_files()[:150]), np.uint8)


@pytest.mark.parametrize("seq", [320, 512])  # long enough that every line lands at a line start
def test_the_mask_marks_exactly_the_repeated_values(text, seq):
    rng = np.random.default_rng(seq)
    for _ in range(200):
        w, mask = train_tiny.recall_window(text, seq, rng)
        assert w.shape == (seq + 1,) and mask.shape == (seq,)
        b = bytes(w)
        want = np.zeros(seq + 1, bool)
        seen = {}
        for m in LINE.finditer(b):
            name, value = m.group(1), next(g for g in m.groups()[1:] if g)
            if seen.get(name) == value:  # a repeat: its value is the copy target
                s = m.start() + m.group(0).rindex(value)
                want[s:s + len(value)] = True
            seen[name] = value
        assert mask.tolist() == want[1:].tolist()  # mask[i] is about target byte i + 1
        assert b'key_' not in b or not re.search(rb'^key_[0-9a-f]{4} = "', b, re.M)  # never the probe's needle


def test_a_batch_depends_only_on_its_step_and_its_masks_only_on_recall_rows(text):
    """make_batch (the --workers path): the same (seed, step) gives the same batch in any process, another step
    another batch; text rows carry no copy target, recall rows carry exactly recall_window's mask."""
    train_tiny._worker_init(text)
    a = train_tiny.make_batch((7, 6, 320, 0.5, 99))
    b = train_tiny.make_batch((7, 6, 320, 0.5, 99))
    c = train_tiny.make_batch((8, 6, 320, 0.5, 99))
    assert a[0].shape == (6, 321) and a[1].shape == (6, 320) and a[1].dtype == bool
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and not np.array_equal(a[0], c[0])
    masked = [bool(m.any()) for m in a[1]]
    assert any(masked) and not all(masked)  # this seed draws both kinds of row
    for w, m in zip(*a):
        assert set(w[1:][m].tolist()) <= set(train_tiny.RECALL_VALUE)  # targets are value characters only
    plain = train_tiny.make_batch((7, 6, 320, 0.0, 99))
    assert not plain[1].any()
    for w in plain[0]:  # a text window is a contiguous slice of the training bytes
        assert bytes(w) in bytes(text)


def test_the_budget_schedule_warms_up_linearly_and_ends_decayed_to_a_tenth():
    peak = 2e-3
    assert train_tiny.lr_budget(0, 10, 0.0, peak) == pytest.approx(peak / 10)
    assert train_tiny.lr_budget(9, 10, 0.0, peak) == pytest.approx(peak)
    assert train_tiny.lr_budget(10, 10, 0.0, peak) == pytest.approx(peak)
    assert train_tiny.lr_budget(500, 10, 0.5, peak) == pytest.approx(peak * (0.1 + 0.45))
    assert train_tiny.lr_budget(500, 10, 1.0, peak) == pytest.approx(peak * 0.1)
    assert train_tiny.lr_budget(500, 10, 3.0, peak) == pytest.approx(peak * 0.1)  # past the budget: stays at the floor


RECALL_LLAMA = Path(__file__).resolve().parent.parent / "fixtures" / "tiny-recall" / "llama"


def test_the_recall_trained_llama_copies_the_probe_needle_inside_its_training_window():
    """fixtures/tiny-recall/llama (scripts/gpu_recall.sh) learned to copy: on the recall probe's own needles, never
    seen in training (key_ + 4 hex digits, 6 values of [a-z0-9]), transformers' model (independent of edgekv's)
    predicts every value byte at distances 16 and 256, inside its 512-byte training window, and edgekv's chunked
    cache agrees; the needle-free fixture in fixtures/tiny/llama does not."""
    import torch
    from transformers import AutoModelForCausalLM

    from edgekv.analyze.recall import make_trials, score
    from edgekv.analyze.run import Encoder, default_text
    from edgekv.models import load_any
    from edgekv.strategies import parse_strategy

    torch.set_num_threads(1)
    log = json.loads((RECALL_LLAMA / "train_log.json").read_text())
    assert log["training"]["seq_len"] == 512 and log["final"]["recall_val_accuracy"] > 0.9
    rows = make_trials(Encoder(), default_text(), [16, 256], 3, seed=11)
    hits = {}
    for folder in (RECALL_LLAMA, RECALL_LLAMA.parent.parent / "tiny" / "llama"):
        hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        right = 0
        for row in rows:
            for t in row:
                with torch.no_grad():
                    pred = hf(input_ids=torch.tensor([t.tokens])).logits[0].argmax(-1)
                right += sum(int(pred[t.value_at + i - 1]) == v for i, v in enumerate(t.value))
        hits[folder.parent.name] = right / (len(rows) * 2 * len(rows[0][0].value))
    assert hits["tiny-recall"] == 1.0 and hits["tiny"] < 0.2, hits
    module = load_any(str(RECALL_LLAMA), parse_strategy("kv:dtype=fp32"), 1024).module
    for t in rows[0]:
        ok, _ = score(module, t, chunk=64)
        assert ok.all()
