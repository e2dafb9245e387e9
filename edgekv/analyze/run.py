"""Teacher-forced error measurement: the fp32 reference and each variant over the same real text, in lockstep.

Each variant is the SAME export module with a different StateLayout (kv-int4 instead of kv fp32, ssm int8 instead
of fp32, a converted-MLA rank, a window) and/or fake-quantized weights, so the error measured is the error the
exported program makes: the cache writes quantize with edgekv.quant exactly as the artifact does. The text is fed in
calls of `chunk` tokens (chunked prefill for caches, C = 1 decode stepping for recurrent states, where runtimes step),
and the reference pass is computed once per chunk and shared by every variant.

Per position t (the prediction of token t+1): KL(reference || variant) of the next-token distribution, top-1
agreement, NLL difference on the true next token, relative error of the final hidden state; at every call boundary
the relative error of the state itself (dequantized, vs the reference's).
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import EdgekvError
from ..quant import roundtrip
from ..strategies import Strategy, parse_strategy


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


def tokenize(loaded, text: str, n: int) -> list[int]:
    """Byte-level models (vocab 256) read bytes; others the tokenizer edgekv exports with them."""
    vocab = loaded.arch.vocab
    if vocab == 256:
        ids = list(text.encode("utf-8"))
    else:
        import tempfile

        from tokenizers import Tokenizer

        from ..export.tokenizer import write_tokenizer
        with tempfile.TemporaryDirectory() as d:
            if write_tokenizer(Path(loaded.source), Path(d)) is None:
                raise EdgekvError(f"{loaded.source}: no tokenizer to read the text with")
            ids = Tokenizer.from_file(str(Path(d) / "tokenizer.json")).encode(text).ids
    if len(ids) < n + 1:
        raise EdgekvError(f"the text has {len(ids)} tokens; --ctx {n} needs {n + 1}")
    return ids[:n + 1]


def fake_quantize_weights(module: torch.nn.Module, bits: int, group: int = 32) -> None:
    """Round every matmul weight (nn.Linear and the tied output matrix) to `bits` with per-group scales along the
    input axis, in place: what a weight-quantized artifact computes (up to the runtime's kernels)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.shape[-1] % group == 0:
                # a new tensor, never in place: loaders may share weight tensors between the reference and variants
                m.weight = torch.nn.Parameter(roundtrip(m.weight, bits, group), requires_grad=False)


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


def _dequant_state(layout, state: list[torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, role) -> fp32 tensor of what the state holds (quantized tensors dequantized)."""
    from ..quant import dequantize
    out, by = {}, {}
    for t, x in zip(layout.tensors, state):
        by[(t.layer, t.role)] = (t, x)
    for (layer, role), (t, x) in by.items():
        if "." in role:
            continue
        if t.dtype in ("int8", "uint8") and (layer, role + ".scale") in by:
            sc = by[(layer, role + ".scale")][1]
            z = by.get((layer, role + ".zero"), (None, None))[1]
            bits = 8 if t.dtype == "int8" else t.packed_bits
            group = 0 if sc.shape[-1] == 1 else x.shape[-1] * (8 // bits if bits < 8 else 1) // sc.shape[-1]
            out[(layer, role)] = dequantize(x, sc, z, bits, group)
        else:
            out[(layer, role)] = x.float()
    return out


def state_rel_err(layout_ref, ref_state, layout_var, var_state, slots: slice | None) -> float | None:
    """Mean over layers of ||var - ref|| / ||ref|| for the state roles both keep (for caches: only `slots`)."""
    a, b = _dequant_state(layout_ref, ref_state), _dequant_state(layout_var, var_state)
    errs = []
    for k, r in a.items():
        if k not in b or b[k].shape != r.shape or k[1] == "conv":
            continue
        v = b[k]
        if k[1] in ("key", "value") and slots is not None:
            r, v = r[:, :, slots], v[:, :, slots]
        n = r.norm()
        if n > 0:
            errs.append(float((v - r).norm() / n))
    return float(np.mean(errs)) if errs else None


class Runner:
    """Loads the reference and the variants, then advances all of them through the text one call at a time."""

    def __init__(self, model: str, base: Strategy, variants: list[Variant], ctx: int, chunk: int, seed: int = 0):
        from ..models import load_any

        self.model, self.ctx, self.chunk = model, ctx, chunk
        ref_strategy = reference_strategy(base)
        self.ref = load_any(model, ref_strategy, ctx)
        self.variants = variants
        self.loaded = []
        for i, v in enumerate(variants):
            lv = load_any(model, v.strategy, ctx)
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

    @torch.no_grad()
    def run(self, tokens: list[int], on_step=None) -> None:
        """Feed tokens[:-1] in calls of `chunk`; metrics predict tokens[1:]. on_step(done_tokens) for progress;
        KeyboardInterrupt stops cleanly with the curves measured so far."""
        ids = torch.tensor(tokens, dtype=torch.int64)[None]
        n = ids.shape[1] - 1
        hooks = [self._capture("ref", self.ref.module)] + [self._capture(i, lv.module)
                                                             for i, lv in enumerate(self.loaded)]
        ref_state = self.ref.module.empty_state()
        var_states = [lv.module.empty_state() for lv in self.loaded]
        try:
            for start in range(0, n, self.chunk):
                c = min(self.chunk, n - start)
                x = ids[:, start:start + c]
                pos = torch.tensor([start], dtype=torch.int64)
                target = ids[0, start + 1:start + c + 1]
                ref_logits, *ref_state = self.ref.module(x, pos, *ref_state)
                ref_lp = F.log_softmax(ref_logits[0].float(), -1)  # [C, V]
                ref_top = ref_lp.argmax(-1)
                ref_nll = -ref_lp.gather(-1, target[:, None])[:, 0]
                ref_h = self._hidden.get("ref")
                for i, lv in enumerate(self.loaded):
                    logits, *var_states[i] = lv.module(x, pos, *var_states[i])
                    lp = F.log_softmax(logits[0].float(), -1)
                    cv = self.curves[i]
                    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0)
                    cv.positions += list(range(start + 1, start + c + 1))
                    cv.kl += kl.tolist()
                    cv.top1 += (lp.argmax(-1) == ref_top).float().tolist()
                    cv.nll_diff += (-lp.gather(-1, target[:, None])[:, 0] - ref_nll).tolist()
                    h = self._hidden.get(i)
                    if ref_h is not None and h is not None:
                        cv.hidden_rel_err += ((h[0] - ref_h[0]).norm(dim=-1) / ref_h[0].norm(dim=-1)).tolist()
                    e = state_rel_err(self.ref.layout, ref_state, lv.layout, var_states[i], slice(start, start + c))
                    if e is not None:
                        cv.state_positions.append(start + c)
                        cv.state_rel_err.append(e)
                if on_step:
                    on_step(start + c)
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            for h in hooks:
                if h is not None:
                    h.remove()


def reference_strategy(base: Strategy) -> Strategy:
    """The fp32 version of the state a variant changes."""
    if base.name in ("kv", "kv-int8", "kv-int4", "kv-int2", "window"):
        return parse_strategy("kv:dtype=fp32")
    if base.name == "mla":
        return parse_strategy("kv:dtype=fp32")
    if base.name in ("ssm", "linear"):
        return parse_strategy(f"{base.name}:dtype=fp32")
    if base.name == "hybrid":
        return parse_strategy("hybrid:dtype=fp32,state_dtype=fp32")
    raise EdgekvError(f"analyze does not handle strategy {base.name!r}")


def make_variants(base: Strategy, bits: list[int] | None, roundings: list[str], weight_bits: int | None,
                  ranks: list[int] | None = None, windows: list[int] | None = None) -> list[Variant]:
    """The variants a request names, with the weight-only and weight+state sources beside the state ones."""
    out: list[Variant] = []
    if base.name in ("kv", "kv-int8", "kv-int4", "kv-int2"):
        for b in bits or [base.kv_bits or 4]:
            if b not in (8, 4, 2, 16):
                raise EdgekvError(f"--bits {b}: a KV cache is stored in 16 (fp16), 8, 4 or 2 bits")
            spec = "kv:dtype=fp16" if b == 16 else f"kv-int{b}"
            for r in (roundings if b != 16 else ["nearest"]):
                out.append(Variant(f"state {spec} {r}", "state", parse_strategy(spec), b, r))
        if weight_bits:
            out.append(Variant(f"weights int{weight_bits}", "weights", parse_strategy("kv:dtype=fp32"), None,
                               "nearest", weight_bits))
            for b in bits or [base.kv_bits or 4]:
                if b != 16:
                    out.append(Variant(f"both int{weight_bits} weights + kv-int{b}", "both",
                                       parse_strategy(f"kv-int{b}"), b, "nearest", weight_bits))
    elif base.name in ("ssm", "linear", "hybrid"):
        key = "state_dtype" if base.name == "hybrid" else "dtype"
        for b in bits or [8]:
            if b not in (8, 16):
                raise EdgekvError(f"--bits {b}: a {base.name} state is stored in 16 (fp16) or 8 bits here")
            prefix = "hybrid:dtype=fp32," if base.name == "hybrid" else f"{base.name}:"
            spec = f"{prefix}{key}={'int8' if b == 8 else 'fp16'}"
            for r in (roundings if b == 8 else ["nearest"]):
                out.append(Variant(f"state {base.name} {'int8' if b == 8 else 'fp16'} {r}", "state",
                                   parse_strategy(spec), b, r))
        if weight_bits:
            out.append(Variant(f"weights int{weight_bits}", "weights", reference_strategy(base), None, "nearest",
                               weight_bits))
    elif base.name == "mla":
        for r in ranks or [base.params.get("rank") or 0]:
            spec = "mla" + (f":rank={r}" if r else "")
            out.append(Variant(f"mla rank {r or 'default'}", "state", parse_strategy(spec), None, "nearest",
                               extra={"rank": r or None}))
    elif base.name == "window":
        for w in windows or [base.params["w"]]:
            out.append(Variant(f"window {w}+{base.params['sinks']}", "state",
                               parse_strategy(f"window:w={w},sinks={base.params['sinks']},dtype=fp32"),
                               None, "nearest", extra={"window": w}))
    else:
        raise EdgekvError(f"analyze does not handle strategy {base.name!r}")
    return out
