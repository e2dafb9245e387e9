"""Recall probe: can the model still return an exact value it read d tokens ago, with its state at each precision?

The published claim (Arora et al. 2023, "Zoology"; Jelassi et al. 2024, "Repeat After Me"): a fixed-size recurrent
state (SSM, linear attention) loses exact associative recall as the distance grows, where a transformer's KV cache
keeps every token. This measures it on real weights, per strategy and state precision, teacher-forced.

One trial, in tokens (bytes for the byte-level fixtures), all of it real stdlib text except the needle:
  bos      the tokenizer's BOS id, only when the model's metadata says its tokenizer adds one (Gemma 3's GGUF:
           tokenizer.ggml.add_bos_token; SmolLM2's adds none, the byte-level fixtures have none)
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
   "chance" (top-1 accuracy of a guess), "chance_logprob", "interrupted", "seconds", "bos" (the id every trial
   starts with, null for none),
   "variants": [{"label", "strategy", "bits" (32: the fp32 reference, always first), "rounding", "source",
                 "weight_bits", "accuracy": [per distance], "logprob": [...], "exact": [...] (fraction of trials
                 with every value token right), "trials": [per distance], "cpu_seconds": [per distance: CPU seconds
                 spent scoring this variant's trials there]}]}

Each model is stepped as analyze steps it: calls of `chunk` tokens (chunked prefill for caches, C = 1 decode stepping
for recurrent states), through the export module whose StateLayout quantizes the state (edgekv.quant) at every write.
"""
from __future__ import annotations

import math
import random
import time
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
LAST_FIT = 2 * PREFIX_LEN  # tokens of a trial beside its filler, with room (prefix 64 + needle ~14 + cue + value ~14)
TEXT_CHARS = 300_000  # of the text, at least, that fillers and prefixes are drawn from


@dataclass
class Trial:
    tokens: list[int]  # [bos] + prefix + needle + filler + cue + value + closing quote
    distance: int  # filler tokens between the needle's end and the cue's start
    key: str
    value: list[int]  # token ids
    needle_at: int  # index of the needle's first token
    needle_end: int  # index just past the needle's line break (= the filler's first token)
    cue_at: int  # index of the cue's first token (= needle_end + distance)
    value_at: int  # index of the cue's first value token: tokens[value_at:value_at + len(value)] == value


def distances(max_distance: int, trained: int | None = None) -> list[int]:
    """16, 64, 256, 1k, 4k ... (x4) up to max_distance, and max_distance itself when the ladder stops short; with the
    model's trained context, also the longest distance whose whole trial still fits in it (trained - LAST_FIT), so a
    ladder that goes past the trained context has a point just inside it."""
    if max_distance < FIRST_DISTANCE:
        raise EdgekvError(f"--ctx {max_distance}: the recall probe needs at least {FIRST_DISTANCE} tokens of distance")
    out = [FIRST_DISTANCE]
    while out[-1] * 4 <= max_distance:
        out.append(out[-1] * 4)
    out += [max_distance] if out[-1] < max_distance else []
    if trained and FIRST_DISTANCE <= trained - LAST_FIT < max_distance:
        out = sorted(set(out) | {trained - LAST_FIT})
    return out


def trial_len(distance: int) -> int:
    """Upper bound on a trial's tokens at this distance: prefix + needle + filler + cue + value (LAST_FIT covers
    every part but the filler, for keys and values of the lengths make_trials draws, with room)."""
    return distance + LAST_FIT


def load_beyond_trained(model: str, strategy, max_ctx: int):
    """edgekv.models.load_any without its trained-context check: the reader of a family that refuses max_ctx >
    max_position_embeddings (Family.ctx_capped, as an export should) is given no context; the StateLayout and module
    are built for max_ctx. Past the trained length the positions are ones the model never saw: what the probe
    measures there."""
    from ..models import Loaded, _function, check_strategy, family_of, layout_for
    from ..models.weights import resolve_model

    fam = check_strategy(family_of(resolve_model(model)), strategy)
    src = _function(fam.read)(model, None if fam.ctx_capped else max_ctx)
    fam = check_strategy(fam, strategy)
    layout = layout_for(src.arch, strategy, max_ctx)
    return Loaded(_function(fam.build)(src, layout), src.args, src.arch, layout, src.path, src.fmt)


def trained_context(loaded) -> tuple[int, str] | None:
    """(tokens, where the number comes from) the model was trained at: a trained fixture's own training window
    (train_log.json's training.seq_len, written by scripts/train_tiny.py), else the config's max_position_embeddings
    (the GGUF's <arch>.context_length). None when neither says."""
    import json
    folder = loaded.source if loaded.source.is_dir() else None
    log = folder / "train_log.json" if folder else None
    if log is not None and log.is_file():
        try:
            seq = json.loads(log.read_text()).get("training", {}).get("seq_len")
        except (OSError, ValueError, AttributeError):
            seq = None
        if isinstance(seq, int) and seq > 0:
            return seq, f"{log.name} seq_len"
    n = getattr(loaded.args, "max_position", None) or getattr(loaded.arch, "max_position", None)
    return (int(n), "max_position_embeddings") if n else None


def chance() -> dict:
    return {"accuracy": 1 / len(ALPHABET), "logprob": -math.log(len(ALPHABET))}


def _single(enc, piece: str) -> int:
    ids = enc(piece)
    if len(ids) != 1:
        raise EdgekvError(f"the model's tokenizer has no single token for {piece!r}: the recall probe needs one")
    return ids[0]


def make_trials(enc, text: str, dists: list[int], n_trials: int, seed: int = 0) -> list[list[Trial]]:
    """trials[k][j]: trial k at distance dists[j]; enc: str -> token ids (run.Encoder; its bos, when not None, starts
    every trial). Needle, prefix and filler offset are drawn once per trial."""
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
        bos = getattr(enc, "bos", None)
        prefix = ([] if bos is None else [bos]) + ids[p:p + PREFIX_LEN - 1].tolist() + [nl]
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
        # only the rows that predict a value token go through the output layer (on Gemma-3-270M's 262k vocabulary
        # the head costs more than the rest of the model per token); a call before them asks for its last row
        want = torch.arange(max(0, first - start), c) if start + c > first else torch.tensor([c - 1])
        logits, *state = module(ids[:, start:start + c], torch.tensor([start], dtype=torch.int64), *state, rows=want)
        if start + c > first:
            rows.append(logits[0])
    lp = F.log_softmax(torch.cat(rows).float(), -1)  # [VALUE_LEN, V]
    target = torch.tensor(trial.value, dtype=torch.int64)
    return lp.argmax(-1) == target, lp.gather(-1, target[:, None])[:, 0]


@dataclass
class Tally:
    correct: list = field(default_factory=list)  # per distance: per trial [VALUE_LEN] bools
    logprob: list = field(default_factory=list)
    cpu_seconds: list = field(default_factory=list)  # per distance: CPU seconds this variant spent scoring its trials


class RecallProbe:
    """The fp32 reference and each variant (the export module with a quantized StateLayout) over the same trials."""

    def __init__(self, model: str, base, variants: list[Variant], max_distance: int, chunk: int, seed: int = 0):
        self.model, self.base, self.chunk, self.seed = model, base, chunk, seed
        self.max_ctx = trial_len(max_distance)  # prefix + needle + filler + cue + value fit with room
        ref_strategy = reference_strategy(base)
        self.labels = [f"reference {ref_strategy.short}"] + [v.label for v in variants]
        self.variants = [Variant(self.labels[0], "state", ref_strategy, 32)] + list(variants)
        self.modules = []
        self.trained = None
        for i, v in enumerate(self.variants):
            lv = load_beyond_trained(model, v.strategy, self.max_ctx)
            if i == 0:
                self.loaded, self.trained = lv, trained_context(lv)
            else:
                from ..export.calibrate import calibrate_loaded
                from .run import Encoder
                calibrate_loaded(lv, Encoder.for_model(lv) if lv.arch.vocab != 256 else None)
                check_variant_changes_something(model, self.loaded, v, lv)
            if v.weight_bits:
                fake_quantize_weights(lv.module, v.weight_bits)
            _set_rounding(lv.module, v.rounding, seed + i)
            self.modules.append(lv.module)
        self.interrupted, self.seconds = False, None

    @torch.inference_mode()
    def run(self, trials: list[list[Trial]], on_step=None) -> list[Tally]:
        """Trial-major (every distance of trial 0, then trial 1, ...), so a stopped run still covers every distance.
        on_step(tokens fed) after each scored sequence; KeyboardInterrupt keeps what was scored."""
        tallies = [Tally([[] for _ in trials[0]], [[] for _ in trials[0]], [0.0 for _ in trials[0]])
                   for _ in self.modules]
        t0 = time.perf_counter()
        try:
            for row in trials:
                for j, trial in enumerate(row):
                    for module, t in zip(self.modules, tallies):
                        c0 = time.process_time()
                        ok, lp = score(module, trial, self.chunk)
                        t.cpu_seconds[j] += time.process_time() - c0
                        t.correct[j].append(ok)
                        t.logprob[j].append(lp)
                        if on_step:
                            on_step(trial.value_at + len(trial.value) - 1)
        except KeyboardInterrupt:
            self.interrupted = True
        self.seconds = round(time.perf_counter() - t0, 2)
        return tallies

    def summarise(self, trials: list[list[Trial]], tallies: list[Tally], text_label: str) -> dict:
        """The recall JSON: per variant and distance the mean top-1 accuracy and log-prob over all value tokens of all
        trials, the fraction of trials with every value token right (exact), and the trial count."""
        dists = [t.distance for t in trials[0]]
        ch = chance()
        trained = getattr(self, "trained", None)
        out = {"model": self.model, "strategy": self.base.label, "probe": "recall", "chunk": self.chunk,
               "text": text_label, "seed": self.seed, "value_len": VALUE_LEN, "alphabet": ALPHABET.decode(),
               "distances": dists, "chance": ch["accuracy"], "chance_logprob": ch["logprob"],
               "interrupted": self.interrupted, "seconds": getattr(self, "seconds", None),
               "trained_ctx": trained[0] if trained else None,
               "trained_from": trained[1] if trained else None,
               "beyond_trained": [bool(trained) and trial_len(d) > trained[0] for d in dists],
               "variants": []}
        for v, t in zip(self.variants, tallies):
            acc, lps, exact, n = [], [], [], []
            for ok, lp in zip(t.correct, t.logprob):
                n.append(len(ok))
                acc.append(float(torch.stack(ok).float().mean()) if ok else None)
                lps.append(float(torch.stack(lp).mean()) if lp else None)
                exact.append(float(torch.stack(ok).all(-1).float().mean()) if ok else None)
            cpu = [round(x, 2) if k else None for x, k in zip(t.cpu_seconds or [0.0] * len(n), n)]
            out["variants"].append({"label": v.label, "strategy": v.strategy.label, "bits": v.bits,
                                    "rounding": v.rounding, "source": v.source, "weight_bits": v.weight_bits,
                                    "accuracy": acc, "logprob": lps, "exact": exact, "trials": n,
                                    "cpu_seconds": cpu})
        return out


def plot(result: dict, out: str, force: bool = False) -> None:
    """Accuracy and mean log-prob of the value tokens against distance (log x), chance dashed."""

    from ..mpl import pyplot
    plt = pyplot()

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
    save_png(fig, out, force)


def compare_variants(specs: list[str]) -> list[Variant]:
    """One state variant per strategy spec (--compare kv-int8 --compare window:w=512,sinks=4 --compare mla): other
    strategies probed over the same trials as the base's variants, each at its own precision."""
    from ..strategies import parse_strategy

    out = []
    for spec in specs:
        st = parse_strategy(spec)
        out.append(Variant(f"state {st.label}", "state", st, st.kv_bits or None, "nearest"))
    return out


def store(result: dict, name: str, command: str, folder=None):
    """Merge a recall result into <folder>/<name>__recall.json (edgekv/measurements by default), the file the
    planner reads (edgekv.measured): per strategy label a curve of points {distance, value (fraction of trials with
    every value token right), accuracy, logprob, trials, beyond_trained, cpu_seconds (this point's own scoring
    time)}, with the command, date, seconds (wall, the whole run: every variant and distance) and load average of
    the run that measured it. Curves and distances this run did not measure are kept, and so is the file's note
    (what the curves say as a whole, written by hand); the ones it did are replaced.
    Only nearest-rounding state variants with float weights are stored (what a plan row's strategy is). Returns
    the file's path."""
    import datetime
    import json
    import os
    from pathlib import Path

    from ..jsonfile import output_json
    from ..outputs import marked, write_atomic
    from ..quality import MEASURED_DIR

    path = Path(folder or MEASURED_DIR) / f"{name}__recall.json"
    old = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
    if not isinstance(old, dict) or not isinstance(old.get("curves"), dict):
        old = {}
    curves = old.get("curves", {})
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    for v in result["variants"]:
        if v["weight_bits"] or v["rounding"] != "nearest":
            continue
        run = {"command": command, "date": datetime.date.today().isoformat(), "seconds": result.get("seconds"),
               "load_average": round(load, 2) if load is not None else None, "chunk": result["chunk"],
               "text": result["text"], "seed": result["seed"], "bos": result.get("bos")}
        pts = {p["distance"]: p for p in curves.get(v["strategy"], {}).get("points", [])
               if isinstance(p, dict) and "distance" in p}
        for j, d in enumerate(result["distances"]):
            if v["exact"][j] is None:
                continue
            cpu = (v.get("cpu_seconds") or [None] * len(result["distances"]))[j]
            pts[d] = {"distance": d, "value": v["exact"][j], "accuracy": v["accuracy"][j], "logprob": v["logprob"][j],
                      "trials": v["trials"][j], "beyond_trained": result["beyond_trained"][j],
                      **({"cpu_seconds": cpu} if cpu is not None else {}), **run}
        curves[v["strategy"]] = {"label": v["label"], "points": [pts[d] for d in sorted(pts)]}
    out = {"model": name, "probe": "recall",
           "value": "fraction of trials whose every value token is the model's top-1 (exact recall), teacher-forced; "
                    "edgekv/analyze/recall.py",
           "chance": result["chance"], "value_len": result["value_len"],
           "trained_ctx": result.get("trained_ctx"), "trained_from": result.get("trained_from"),
           **({"note": old["note"]} if isinstance(old.get("note"), str) else {}), "curves": curves}
    write_atomic(path, output_json(marked(out)) + "\n", option="--save", force=True)  # updates its own file
    return path
