"""Teacher-forced error measurement: the fp32 reference and each variant over the same real text, in lockstep.

Each variant is the SAME export module with a different StateLayout (kv-int4 instead of kv fp32, ssm int8 instead
of fp32, a converted-MLA rank, a window) and/or fake-quantized weights, so the error measured is the error the
exported program makes: the cache writes quantize with edgekv.quant exactly as the artifact does. The text is fed in
calls of `chunk` tokens (chunked prefill for caches, C = 1 decode stepping for recurrent states, where runtimes step),
and the reference pass is computed once per chunk and shared by every variant.

Per position t (the prediction of token t+1): KL(reference || variant) of the next-token distribution, top-1
agreement, NLL difference on the true next token, relative error of the final hidden state; at call boundaries the
relative error of the state itself (dequantized, vs the reference's): after every call up to position 16, then on a
log schedule (STATE_PER_DOUBLING samples per doubling of the position, and after the last call). Curves are windowed
on a log scale anyway, and at C = 1 comparing the whole state after every token would be a sizeable share of the cost.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import EdgekvError
from . import WEIGHT_BITS
from ..strategies import DEFAULTS, REGISTRY, Kv, KvStorage, Strategy, kv_storage_of, parse_strategy


@dataclass
class Variant:
    label: str
    source: str  # "state" | "weights" | "both"
    strategy: Strategy  # the state the module keeps
    bits: int | None = None  # state bits (None: the strategy's own precision)
    rounding: str = "nearest"
    weight_bits: int | None = None
    extra: dict = field(default_factory=dict)  # e.g. {"rank": 64} or {"window": 512}


@dataclass
class Curves:
    positions: list = field(default_factory=list)
    kl: list = field(default_factory=list)
    top1: list = field(default_factory=list)
    nll_diff: list = field(default_factory=list)
    hidden_rel_err: list = field(default_factory=list)
    state_positions: list = field(default_factory=list)
    state_rel_err: list = field(default_factory=list)


def default_text() -> str:
    """Real text on every machine: the Python documentation's topic pages and the stdlib's own source."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for rel in ("pydoc_data/topics.py", "collections/__init__.py", "textwrap.py", "argparse.py"):
        p = stdlib / rel
        if p.is_file():
            parts.append(p.read_text(errors="replace"))
    return "\n".join(parts)


class Encoder:
    """str -> token ids: bytes when tokenizer is None (the byte-level fixtures), else a `tokenizers.Tokenizer`.
    bos: the id a sequence starts with when the model's tokenizer metadata says it adds one (a GGUF's
    tokenizer.ggml.add_bos_token), else None; encoding a piece of text never adds it."""

    def __init__(self, tokenizer=None, bos: int | None = None):
        self.tokenizer, self.bos = tokenizer, bos

    @classmethod
    def for_model(cls, loaded) -> "Encoder":
        """Byte-level models (vocab 256) read bytes; others the tokenizer edgekv exports with them."""
        if loaded.arch.vocab == 256:
            return cls()
        import tempfile

        from ..export.generate import load_tokenizer
        from ..export.tokenizer import bos_prefix, write_tokenizer
        with tempfile.TemporaryDirectory() as d:
            entry = write_tokenizer(Path(loaded.source), Path(d))
            if entry is None:
                raise EdgekvError(f"{loaded.source}: no tokenizer to read the text with")
            bos = (bos_prefix(entry) or [None])[0]
            return cls(load_tokenizer(Path(d) / "tokenizer.json", loaded.arch.vocab), bos)

    def __call__(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) if self.tokenizer is None else self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", "replace") if self.tokenizer is None else self.tokenizer.decode(ids)


def tokenize(loaded, text: str, n: int) -> list[int]:
    """The first n + 1 tokens of text (see Encoder.for_model)."""
    ids = Encoder.for_model(loaded)(text)
    if len(ids) < n + 1:
        raise EdgekvError(f"the text has {len(ids)} tokens; --ctx {n} needs {n + 1}")
    distinct = len(set(ids[:n + 1]))
    if distinct < min(8, (n + 1) // 4):  # real text of 33+ tokens has well over 8 distinct ones
        raise EdgekvError(f"the model's tokenizer reads the text as {distinct} distinct id(s) in {n + 1} tokens (a "
                          "vocabulary that does not know its words): an error measured on it would say nothing")
    return ids[:n + 1]


def fake_quantize_weights(module: torch.nn.Module, bits: int) -> None:
    """Quantize the module's weights in place exactly as `edgekv export --weights int{bits}` does for the .pte
    (edgekv.export.wquant.quantize_module: torchao, symmetric int4 in groups of 32 or int8 per output channel (Gemma 3's
    int4: its decoder layers int8, wquant.PTE_INT4_LAYERS_INT8), every
    linear whose input width is a multiple of 32, the tied output matrix untied into its own quantized copy, and the
    activations into each of them rounded to int8 per token at run time), so the weights line is what a quantized
    artifact computes, up to the runtime's kernels. Rounding the linears alone, asymmetrically, would change none of
    SmolLM2-135M's weights (its GGUF is Q4_1, already on that grid) and so measure no error at all."""
    from ..export.wquant import quantize_module

    if bits not in WEIGHT_BITS:
        raise EdgekvError(f"--weight-bits {bits}: an export's weights are int{' or int'.join(map(str, WEIGHT_BITS))}")
    # quantize_ swaps each weight for a new quantized tensor (never writes into the old one): loaders may share
    # weight tensors between the reference and the variants
    quantize_module(module, f"int{bits}")


def check_variant_changes_something(model: str, ref, variant: Variant, loaded) -> None:
    """A state variant whose module keeps exactly the reference's state (e.g. linear:dtype=int8 on RWKV-4, whose
    layout stays fp32) would be measured as a perfect int8 state: refuse it in one line instead."""
    same = [(t.role, t.shape, t.dtype) for t in loaded.layout.tensors] == \
        [(t.role, t.shape, t.dtype) for t in ref.layout.tensors]
    if same and not variant.weight_bits:
        raise EdgekvError(f"{variant.strategy.label} on {model} keeps the same state as the fp32 reference "
                          f"({loaded.layout.tensors[0].dtype}): this model's module has no such state precision yet")


def _set_rounding(module, rounding: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for obj in [module, getattr(module, "kv", None)]:
        if obj is not None and hasattr(obj, "rounding"):
            obj.rounding, obj.generator = rounding, gen


def _final_norm(module):
    for name in ("model.norm", "backbone.norm_f", "rwkv.ln_out", "model.final_layernorm"):
        m = module
        try:
            for part in name.split("."):
                m = getattr(m, part)
            return m
        except AttributeError:
            continue
    return None


class StateDiff:
    """||variant - reference|| / ||reference|| of the state roles both keep, paired once per (reference, variant).

    Built from the two layouts, so each call does a few batched tensor ops and no python bookkeeping: tensors of the
    same shape and precision (the per-layer states of one role) are stacked and dequantized together. Caches compare
    only the slots a call wrote (`slots`); conv windows are skipped (they hold inputs, not state)."""

    def __init__(self, layout_ref, layout_var):
        ref = {(t.layer, t.role): (i, t) for i, t in enumerate(layout_ref.tensors)}
        var = {(t.layer, t.role): (i, t) for i, t in enumerate(layout_var.tensors)}
        groups: dict = {}
        st = kv_storage_of(layout_var)
        for (layer, role), (ri, rt) in ref.items():
            if "." in role or role == "conv" or (layer, role) not in var:
                continue
            vi, vt = var[(layer, role)]
            sc, z = var.get((layer, role + ".scale")), var.get((layer, role + ".zero"))
            if role in ("key", "value") and st is not None and st.quantized and len(st.suffixes(1)) > 1:
                # a KV cache's codes and their scale tensors: read back as its storage reads them
                d = rt.shape[-1]
                if vt.shape[:-1] != rt.shape[:-1] or vt.shape[-1] != st.stored_width(d):
                    continue
                spec = st
                idx = (ri, vi, tuple(var[(layer, role + x)][0] for x in st.suffixes(d)[1:]), None)
            elif vt.dtype in ("int8", "uint8") and sc is not None:
                bits = 8 if vt.dtype == "int8" else vt.packed_bits
                d = vt.shape[-1] * (8 // bits if bits < 8 else 1)
                group = 0 if sc[1].shape[-1] == 1 else d // sc[1].shape[-1]
                spec, idx = (bits, group), (ri, vi, sc[0], z[0] if z else None)
                if vt.shape[:-1] + (d,) != rt.shape:
                    continue
            else:
                spec, idx = None, (ri, vi, None, None)
                if vt.shape != rt.shape:
                    continue
            key = (rt.shape, role in ("key", "value"), spec)
            groups.setdefault(key, []).append(idx)
        self.groups = list(groups.items())

    def needs(self) -> dict[int, bool]:
        """reference state index -> whether it is a cache (compared on the call's slots only)."""
        return {i[0]: cache for (_, cache, _), idx in self.groups for i in idx}

    @staticmethod
    def snapshot(ref_state, needs: dict[int, bool], slots: slice) -> dict[int, torch.Tensor]:
        """What the comparison reads of the reference state after a call: a copy of a cache's slots (a view would
        keep the whole cache alive); a recurrent state as it is (every module returns new state tensors)."""
        return {i: ref_state[i][:, :, slots].float().clone() if cache else ref_state[i].float()
                for i, cache in needs.items()}

    def __call__(self, ref_snap: dict, var_state, slots: slice) -> torch.Tensor | None:
        """ref_snap from snapshot() after the same call -> [2, L]: per compared tensor (||var - ref||, ||ref||);
        None when nothing is comparable."""
        from ..quant import dequantize
        nums, dens = [], []
        for (_, cache, spec), idx in self.groups:
            cut = (lambda x: x[:, :, slots]) if cache else (lambda x: x)
            r = torch.stack([ref_snap[i[0]] for i in idx])
            v = torch.stack([cut(var_state[i[1]]) for i in idx])
            if spec is None:
                v = v.float()
            elif isinstance(spec, KvStorage):
                v = spec.read((v, *(torch.stack([cut(var_state[i[2][k]]) for i in idx])
                                    for k in range(len(idx[0][2])))))
            else:
                sc = torch.stack([cut(var_state[i[2]]) for i in idx])
                z = torch.stack([cut(var_state[i[3]]) for i in idx]) if idx[0][3] is not None else None
                v = dequantize(v, sc, z, *spec)
            nums.append(torch.linalg.vector_norm((v - r).flatten(1), dim=1))
            dens.append(torch.linalg.vector_norm(r.flatten(1), dim=1))
        return torch.stack((torch.cat(nums), torch.cat(dens))) if nums else None


def _mean_ratio(nd: torch.Tensor) -> float | None:
    """Mean over the tensors with a non-zero reference of num / den (nd [2, L] from StateDiff)."""
    keep = nd[1] > 0
    return float((nd[0][keep] / nd[1][keep]).mean()) if bool(keep.any()) else None


STATE_DENSE = 16  # positions up to which the state error is measured after every call
STATE_PER_DOUBLING = 16  # beyond: one sample per 2^(1/16) (~4.4 %) growth of the position


class Runner:
    """Loads the reference and the variants, then advances all of them through the text one call at a time."""

    def __init__(self, model: str, base: Strategy, variants: list[Variant], ctx: int, chunk: int, seed: int = 0):
        from ..export.calibrate import calibrate_loaded
        from ..models import load_any

        self.model, self.ctx, self.chunk = model, ctx, chunk
        ref_strategy = reference_strategy(base)
        self.ref = load_any(model, ref_strategy, ctx)
        self.variants = variants
        self.loaded = []
        for i, v in enumerate(variants):
            lv = load_any(model, v.strategy, ctx)
            calibrate_loaded(lv, Encoder.for_model(lv) if lv.arch.vocab != 256 else None)
            check_variant_changes_something(model, self.ref, v, lv)
            if v.weight_bits:
                fake_quantize_weights(lv.module, v.weight_bits)
            _set_rounding(lv.module, v.rounding, seed + i)
            self.loaded.append(lv)
        self.curves = [Curves() for _ in variants]
        self._hidden = {}

    def curves_by_label(self) -> dict:
        return {v.label: c for v, c in zip(self.variants, self.curves)}

    def _capture(self, key, module):
        norm = _final_norm(module)
        if norm is None:
            return None
        return norm.register_forward_hook(lambda m, i, o: self._hidden.__setitem__(key, o.detach()))

    @torch.inference_mode()
    def run(self, tokens: list[int], on_step=None, block: int = 512) -> None:
        """Feed tokens[:-1] in calls of `chunk`; metrics predict tokens[1:]. on_step(done_tokens) for progress;
        KeyboardInterrupt stops cleanly with the curves measured so far.

        Lockstep by blocks of `block` positions: the reference runs a block of calls first (its logits, final hidden
        states and the state the comparison reads are kept), then each variant runs the same calls. Stepping the
        modules token-interleaved evicted each one's weights from the CPU caches at every token (about half a plain
        pass at C = 1). The per-position metrics are computed for the whole block at once; a stopped run keeps the
        blocks it finished."""
        ids = torch.tensor(tokens, dtype=torch.int64)[None]
        n = ids.shape[1] - 1
        hooks = [self._capture("ref", self.ref.module)] + [self._capture(i, lv.module)
                                                             for i, lv in enumerate(self.loaded)]
        diffs = [StateDiff(self.ref.layout, lv.layout) for lv in self.loaded]
        needs = {k: c for d in diffs for k, c in d.needs().items()}
        ref_state = self.ref.module.empty_state()
        var_states = [lv.module.empty_state() for lv in self.loaded]
        # a block is a whole number of calls, and holds at most ~16 MB of logits per module (a 49k vocabulary: 1 call)
        step = max(self.chunk, min(block, 2**22 // self.ref.arch.vocab) // self.chunk * self.chunk)
        due = 0  # the next position whose state error is measured (see STATE_PER_DOUBLING)
        try:
            for first in range(0, n, step):
                # (start, c, ref logits, ref hidden, ref snapshot or None, [(logits, hidden, state diff)])
                pending = []
                for start in range(first, min(first + step, n), self.chunk):
                    c = min(self.chunk, n - start)
                    end = start + c
                    measure = end <= STATE_DENSE or end >= due or end == n
                    if measure:
                        due = end * 2 ** (1 / STATE_PER_DOUBLING)
                    logits, *ref_state = self.ref.module(ids[:, start:end], torch.tensor([start]), *ref_state)
                    snap = StateDiff.snapshot(ref_state, needs, slice(start, end)) if measure else None
                    pending.append((start, c, logits[0], self._hidden.get("ref"), snap, []))
                for i, lv in enumerate(self.loaded):
                    for start, c, _, _, snap, out in pending:
                        end = start + c
                        logits, *var_states[i] = lv.module(ids[:, start:end], torch.tensor([start]), *var_states[i])
                        out.append((logits[0], self._hidden.get(i),
                                    None if snap is None else diffs[i](snap, var_states[i], slice(start, end))))
                self._flush(pending, ids[0])
                if on_step:
                    on_step(pending[-1][0] + pending[-1][1])
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            for h in hooks:
                if h is not None:
                    h.remove()

    def _flush(self, pending: list, ids: torch.Tensor) -> None:
        """Per-position metrics of a block of calls every module has run, appended to the curves."""
        if not pending:
            return
        first, last = pending[0][0], pending[-1][0] + pending[-1][1]
        target = ids[first + 1:last + 1]
        ref_lp = F.log_softmax(torch.cat([p[2] for p in pending]).float(), -1)  # [T, V]
        ref_top = ref_lp.argmax(-1)
        ref_nll = -ref_lp.gather(-1, target[:, None])[:, 0]
        ref_p = ref_lp.exp()
        ref_h = None if pending[0][3] is None else torch.cat([p[3][0] for p in pending])  # [T, d]
        for i, cv in enumerate(self.curves):
            lp = F.log_softmax(torch.cat([p[5][i][0] for p in pending]).float(), -1)
            cv.positions += list(range(first + 1, last + 1))
            cv.kl += (ref_p * (ref_lp - lp)).sum(-1).clamp_min(0).tolist()
            cv.top1 += (lp.argmax(-1) == ref_top).float().tolist()
            cv.nll_diff += (-lp.gather(-1, target[:, None])[:, 0] - ref_nll).tolist()
            if ref_h is not None and pending[0][5][i][1] is not None:
                h = torch.cat([p[5][i][1][0] for p in pending])
                cv.hidden_rel_err += ((h - ref_h).norm(dim=-1) / ref_h.norm(dim=-1)).tolist()
            for start, c, _, _, _, out in pending:
                e = None if out[i][2] is None else _mean_ratio(out[i][2])
                if e is not None:
                    cv.state_positions.append(start + c)
                    cv.state_rel_err.append(e)


def reference_strategy(base: Strategy) -> Strategy:
    """The fp32 version of the state a variant changes (the strategy class's reference)."""
    return base.reference()


def _kv_spec(bits: int, base: Strategy) -> str:
    """The spec of the registered KV cache that stores `bits` per value (16: the float cache in fp16): the base's own
    quantized cache where it stores that many bits (its storage: kv-int8c's static scales, another kind's codes),
    else the first class with those bits, asked of the strategy classes' traits (kv_bits, static_scales, plain_kv),
    not spelled here."""
    if bits == 16:
        return next(n for n, c in REGISTRY.items() if c.plain_kv) + ":dtype=fp16"
    if base.kv_bits == bits:
        return base.name
    return next(n for n, c in REGISTRY.items() if c.kv_cache and c.kv_bits == bits and not c.static_scales)


def make_variants(base: Strategy, bits: list[int] | None, roundings: list[str], weight_bits: int | None,
                  ranks: list[int] | None = None, windows: list[int] | None = None) -> list[Variant]:
    """The variants a request names, with the weight-only and weight+state sources beside the state ones."""
    out: list[Variant] = []
    if isinstance(base, Kv):  # kv and the quantized kv-int8/int4/int2
        for b in bits or [base.kv_bits or 4]:
            if b not in (8, 4, 2, 16):
                raise EdgekvError(f"--bits {b}: a KV cache is stored in 16 (fp16), 8, 4 or 2 bits")
            spec = _kv_spec(b, base)
            group = base.params.get("group") if base.kv_bits and base.kv_bits < 8 else None
            if b < 8 and group not in (None, DEFAULTS[spec]["group"]):  # the group the user asked for, e.g. 16
                spec += f":group={group}"
            for r in (roundings if b != 16 else ["nearest"]):
                out.append(Variant(f"state {spec} {r}", "state", parse_strategy(spec), b, r))
        if weight_bits:
            out.append(Variant(f"weights int{weight_bits}", "weights", parse_strategy("kv:dtype=fp32"), None,
                               "nearest", weight_bits))
            for b in bits or [base.kv_bits or 4]:
                if b != 16:
                    state = next(v.strategy for v in out if v.source == "state" and v.bits == b)
                    out.append(Variant(f"both int{weight_bits} weights + kv-int{b}", "both", state, b, "nearest",
                                       weight_bits))
    elif base.recurrent:
        ref = base.reference()  # the state's dtype key: state_dtype beside a KV cache (hybrid), else dtype
        key = "state_dtype" if "state_dtype" in ref.params else "dtype"
        for b in bits or [8]:
            if b not in (8, 16):
                raise EdgekvError(f"--bits {b}: a {base.name} state is stored in 16 (fp16) or 8 bits here")
            state = type(ref)({**ref.params, key: "int8" if b == 8 else "fp16"})
            for r in (roundings if b == 8 else ["nearest"]):
                out.append(Variant(f"state {base.name} {'int8' if b == 8 else 'fp16'} {r}", "state", state, b, r))
        if weight_bits:
            out.append(Variant(f"weights int{weight_bits}", "weights", reference_strategy(base), None, "nearest",
                               weight_bits))
    elif base.converts_to_latent:
        for r in ranks or [base.params.get("rank") or 0]:
            spec = base.name + (f":rank={r}" if r else "")
            out.append(Variant(f"mla rank {r or 'default'}", "state", parse_strategy(spec), None, "nearest",
                               extra={"rank": r or None}))
    elif base.window_tokens is not None:
        for w in windows or [base.params["w"]]:
            out.append(Variant(f"window {w}+{base.params['sinks']}", "state",
                               parse_strategy(f"{base.name}:w={w},sinks={base.params['sinks']},dtype=fp32"),
                               None, "nearest", extra={"window": w}))
    else:
        raise EdgekvError(f"analyze does not handle strategy {base.name!r}")
    return out
