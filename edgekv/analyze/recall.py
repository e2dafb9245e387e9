"""Recall probe: can the model still return an exact value it read d tokens ago, with its state at each precision?

The published claim (Arora et al. 2023, "Zoology"; Jelassi et al. 2024, "Repeat After Me"): a fixed-size recurrent
state (SSM, linear attention) loses exact associative recall as the distance grows, where a transformer's KV cache
keeps every token. This measures it on real weights, per strategy and state precision, teacher-forced.

One trial, in tokens (bytes for the byte-level fixtures), all of it real stdlib text except the needle:
  prefix   PREFIX_LEN tokens of stdlib text from a random line start, the last one a line break
  needle   key_7f3a = "q8vz2k"<LF>        key: 4 random hex digits; value: VALUE_LEN tokens, each drawn uniformly
                                           from the single-character tokens of ALPHABET
  filler   exactly d tokens of stdlib text from a random line start, the last one a line break
  cue      key_7f3a = "                    the same key tokens again
  value    q8vz2k                           scored: top-1 and log-prob of each value token given all before it
The distance d is the filler's length: the tokens between the needle's end and the cue's start. Trial k uses the
same needle, prefix and filler offset at every distance and for every variant (seeded), so curves are paired. With
a BPE tokenizer the value is fed as one token per character (a valid token sequence, not necessarily the one the
tokenizer would choose): copying it is still exact recall, and chance stays exact.
Chance: each value token is uniform over ALPHABET, so a prediction that does not know it is right 1/|ALPHABET| of
the time, and the best log-prob it can expect is log(1/|ALPHABET|) (mass spread evenly over the alphabet).

JSON (`edgekv analyze --probe recall --json`; other tools parse it, keep the names):
  {"model", "strategy", "probe": "recall", "chunk", "text", "seed", "value_len", "alphabet", "distances": [...],
   "chance" (top-1 accuracy of a guess), "chance_logprob", "interrupted", "seconds",
   "variants": [{"label", "strategy", "bits" (32: the fp32 reference, always first), "rounding", "source",
                 "weight_bits", "accuracy": [per distance], "logprob": [...], "exact": [...] (fraction of trials
                 with every value token right), "trials": [per distance]}]}

Each model is stepped as analyze steps it: calls of `chunk` tokens (chunked prefill for caches, C = 1 decode stepping
for recurrent states), through the export module whose StateLayout quantizes the state (edgekv.quant) at every write.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import EdgekvError
from .run import (Variant, _set_rounding, check_variant_changes_something, fake_quantize_weights,
                  reference_strategy)

ALPHABET = b"abcdefghijklmnopqrstuvwxyz0123456789"
VALUE_LEN = 6
PREFIX_LEN = 64
FIRST_DISTANCE = 16
TEXT_CHARS = 300_000  # of the text, at least, that fillers and prefixes are drawn from


@dataclass
class Trial:
    tokens: list[int]  # prefix + needle + filler + cue + value + closing quote
    distance: int  # filler tokens between the needle's end and the cue's start
    key: str
    value: list[int]  # token ids
    needle_at: int  # index of the needle's first token
    needle_end: int  # index just past the needle's line break (= the filler's first token)
    cue_at: int  # index of the cue's first token (= needle_end + distance)
    value_at: int  # index of the cue's first value token: tokens[value_at:value_at + len(value)] == value


def distances(max_distance: int) -> list[int]:
    """16, 64, 256, 1k, 4k ... (x4) up to max_distance, and max_distance itself when the ladder stops short."""
    if max_distance < FIRST_DISTANCE:
        raise EdgekvError(f"--ctx {max_distance}: the recall probe needs at least {FIRST_DISTANCE} tokens of distance")
    out = [FIRST_DISTANCE]
    while out[-1] * 4 <= max_distance:
        out.append(out[-1] * 4)
    return out + ([max_distance] if out[-1] < max_distance else [])


def chance() -> dict:
    return {"accuracy": 1 / len(ALPHABET), "logprob": -math.log(len(ALPHABET))}


def _single(enc, piece: str) -> int:
    ids = enc(piece)
    if len(ids) != 1:
        raise EdgekvError(f"the model's tokenizer has no single token for {piece!r}: the recall probe needs one")
    return ids[0]


def make_trials(enc, text: str, dists: list[int], n_trials: int, seed: int = 0) -> list[list[Trial]]:
    """trials[k][j]: trial k at distance dists[j]; enc: str -> token ids (run.Encoder). Needle, prefix and filler
    offset are drawn once per trial."""
    longest = max(dists)
    text = text[:max(TEXT_CHARS, 40 * (longest + PREFIX_LEN))]  # enough to draw from; BPE over all of it takes s
    ids = np.asarray(enc(text))
    if len(ids) < 2 * (longest + PREFIX_LEN):
        raise EdgekvError(f"the text has {len(ids)} tokens; distance {longest} needs {2 * (longest + PREFIX_LEN)}")
    alphabet = [_single(enc, chr(c)) for c in ALPHABET]
    nl = _single(enc, "\n")
    ends = [i for i in np.unique(ids).tolist() if enc.decode([i]).endswith("\n")]
    starts = np.flatnonzero(np.isin(ids, ends)) + 1  # token indices that begin a line

    def line_start(limit: int) -> int:
        return int(starts[min(np.searchsorted(starts, rng.randrange(limit)), len(starts) - 1)])

    rng = random.Random(seed)
    out = []
    while len(out) < n_trials:
        key = "key_" + "".join(rng.choice("0123456789abcdef") for _ in range(4))
        value = [rng.choice(alphabet) for _ in range(VALUE_LEN)]
        p = line_start(len(ids) - longest - PREFIX_LEN - 2)
        f = line_start(len(ids) - 2 * longest - 2)
        if key in text or p + PREFIX_LEN > len(ids) or f + longest > len(ids):  # the key occurs only as needle/cue
            continue
        prefix = ids[p:p + PREFIX_LEN - 1].tolist() + [nl]
        cue = enc(key + ' = "')
        needle = cue + value + enc('"\n')
        row = []
        for d in dists:
            filler = ids[f:f + d - 1].tolist() + [nl]
            seq = prefix + needle + filler + cue + value + enc('"')
            needle_end = len(prefix) + len(needle)
            cue_at = needle_end + len(filler)
            row.append(Trial(seq, d, key, value, len(prefix), needle_end, cue_at, cue_at + len(cue)))
        out.append(row)
    return out


def score(module, trial: Trial, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced over the trial in calls of `chunk` tokens -> (top-1 correct [VALUE_LEN] bool, log-prob of each
    value token [VALUE_LEN]). Value token i is predicted by the logits at index value_at + i - 1."""
    n = trial.value_at + len(trial.value) - 1  # tokens fed: through the last prediction needed
    ids = torch.tensor(trial.tokens[:n], dtype=torch.int64)[None]
    first = trial.value_at - 1
    state = module.empty_state()
    rows = []
    for start in range(0, n, chunk):
        c = min(chunk, n - start)
        logits, *state = module(ids[:, start:start + c], torch.tensor([start], dtype=torch.int64), *state)
        if start + c > first:
            rows.append(logits[0, max(0, first - start):])
    lp = F.log_softmax(torch.cat(rows).float(), -1)  # [VALUE_LEN, V]
    target = torch.tensor(trial.value, dtype=torch.int64)
    return lp.argmax(-1) == target, lp.gather(-1, target[:, None])[:, 0]


@dataclass
class Tally:
    correct: list = field(default_factory=list)  # per distance: per trial [VALUE_LEN] bools
    logprob: list = field(default_factory=list)


class RecallProbe:
    """The fp32 reference and each variant (the export module with a quantized StateLayout) over the same trials."""

    def __init__(self, model: str, base, variants: list[Variant], max_distance: int, chunk: int, seed: int = 0):
        from ..models import load_any

        self.model, self.base, self.chunk, self.seed = model, base, chunk, seed
        self.max_ctx = max_distance + 2 * PREFIX_LEN  # prefix + needle + filler + cue + value fit with room
        ref_strategy = reference_strategy(base)
        self.labels = [f"reference {ref_strategy.short}"] + [v.label for v in variants]
        self.variants = [Variant(self.labels[0], "state", ref_strategy, 32)] + list(variants)
        self.modules = []
        for i, v in enumerate(self.variants):
            lv = load_any(model, v.strategy, self.max_ctx)
            if i == 0:
                self.loaded = lv
            else:
                check_variant_changes_something(model, self.loaded, v, lv)
            if v.weight_bits:
                fake_quantize_weights(lv.module, v.weight_bits)
            _set_rounding(lv.module, v.rounding, seed + i)
            self.modules.append(lv.module)
        self.interrupted = False

    @torch.inference_mode()
    def run(self, trials: list[list[Trial]], on_step=None) -> list[Tally]:
        """Trial-major (every distance of trial 0, then trial 1, ...), so a stopped run still covers every distance.
        on_step(tokens fed) after each scored sequence; KeyboardInterrupt keeps what was scored."""
        tallies = [Tally([[] for _ in trials[0]], [[] for _ in trials[0]]) for _ in self.modules]
        try:
            for row in trials:
                for j, trial in enumerate(row):
                    for module, t in zip(self.modules, tallies):
                        ok, lp = score(module, trial, self.chunk)
                        t.correct[j].append(ok)
                        t.logprob[j].append(lp)
                        if on_step:
                            on_step(trial.value_at + len(trial.value) - 1)
        except KeyboardInterrupt:
            self.interrupted = True
        return tallies

    def summarise(self, trials: list[list[Trial]], tallies: list[Tally], text_label: str) -> dict:
        """The recall JSON: per variant and distance the mean top-1 accuracy and log-prob over all value tokens of all
        trials, the fraction of trials with every value token right (exact), and the trial count."""
        dists = [t.distance for t in trials[0]]
        ch = chance()
        out = {"model": self.model, "strategy": self.base.label, "probe": "recall", "chunk": self.chunk,
               "text": text_label, "seed": self.seed, "value_len": VALUE_LEN, "alphabet": ALPHABET.decode(),
               "distances": dists, "chance": ch["accuracy"], "chance_logprob": ch["logprob"],
               "interrupted": self.interrupted, "variants": []}
        for v, t in zip(self.variants, tallies):
            acc, lps, exact, n = [], [], [], []
            for ok, lp in zip(t.correct, t.logprob):
                n.append(len(ok))
                acc.append(float(torch.stack(ok).float().mean()) if ok else None)
                lps.append(float(torch.stack(lp).mean()) if lp else None)
                exact.append(float(torch.stack(ok).all(-1).float().mean()) if ok else None)
            out["variants"].append({"label": v.label, "strategy": v.strategy.label, "bits": v.bits,
                                    "rounding": v.rounding, "source": v.source, "weight_bits": v.weight_bits,
                                    "accuracy": acc, "logprob": lps, "exact": exact, "trials": n})
        return out


def plot(result: dict, out: str) -> None:
    """Accuracy and mean log-prob of the value tokens against distance (log x), chance dashed."""

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for v in result["variants"]:
        ax.plot(result["distances"], v["accuracy"], marker="o", ms=4, label=v["label"])
        ax2.plot(result["distances"], v["logprob"], marker="o", ms=4, label=v["label"])
    ax.axhline(result["chance"], color="grey", ls="--", lw=1, label=f"chance ({result['chance']:.3f})")
    ax2.axhline(result["chance_logprob"], color="grey", ls="--", lw=1, label="chance (uniform over the alphabet)")
    for a, name in ((ax, "top-1 accuracy of the value tokens"), (ax2, "mean log-prob of the value tokens (nats)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("distance: tokens between the needle and the cue")
        a.set_ylabel(name)
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    ax.set_ylim(-0.02, 1.02)
    n = max((max(v["trials"]) for v in result["variants"]), default=0)
    fig.suptitle(f"{result['model']} ({result['strategy']}): recall at distance, {n} trials x "
                 f"{result['value_len']} value tokens per point")
    from .report import save_png
    save_png(fig, out)
