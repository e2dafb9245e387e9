"""Measured recall at distance, as the planner cites it: edgekv/measurements/<model>__recall.json, written by
`edgekv analyze --probe recall --save` (edgekv.analyze.recall.store). JSON only: `edgekv plan` imports this, and it
imports no torch.

A stored file: {"model", "probe": "recall", "value" (what a point's value is), "chance", "trained_ctx",
"trained_from", "note" (optional: what the curves say as a whole, kept when a run adds points), "curves": {<strategy label>: {"label", "points": [{"distance", "value" (fraction of trials with the
whole value recalled exactly), "accuracy", "logprob", "trials", "beyond_trained", "command", "date", "seconds",
"load_average", ...}]}}}. The point cited for a plan at ctx tokens is the longest measured distance within ctx (the
needle that far back is what a full context asks the model to use); a plan longer than every measured distance cites
the longest one and says the context was not reached.

A missing file cites nothing; a file that cannot be read or does not have this shape cites nothing and says so in the
evidence (one note, never an exception: the plan must not fail on a damaged data file).
"""
from __future__ import annotations

from pathlib import Path

from .jsonfile import parsed
from .strategies import Strategy

MEASURED_DIR = Path(__file__).resolve().parent / "measurements"
REFERENCE = "kv:dtype=fp32"  # the recall probe's reference curve: the model with a full fp32 cache
FLOAT_KV = ("fp32", "fp16", "bf16")  # float caches keep every token at (near) the reference's precision
TRIAL_EXTRA = 128  # a trial's tokens beside its distance, at most (edgekv.analyze.recall.LAST_FIT)
LOSS = 0.5  # a strategy below half the reference's exact recall at the same distance has lost what the model recalls


class Unreadable(Exception):
    """A recall file exists but cannot be used (its one-line reason)."""


def folder_key(folder: Path) -> str:
    """The name a local model folder's recall is stored under: its parent's and its own name
    (fixtures/tiny-recall/mamba -> tiny-recall-mamba), so two folders of the same name (fixtures/tiny/mamba) do not
    share a measurement. `edgekv analyze --probe recall --save` stores a folder under it unless --name is given."""
    folder = Path(folder).resolve()
    return f"{folder.parent.name}-{folder.name}" if folder.parent.name else folder.name


def names_for(name: str, source: str = "") -> list[str]:
    """The stored names a planned model may have a recall file under, first match wins: a local folder's
    folder_key (the config.json's folder), then the model's name (a catalog name)."""
    src = Path(source) if source and "://" not in source else None
    if src is not None and src.name == "config.json" and src.is_file():
        return [folder_key(src.parent), name]
    return [name]


def recall_path(model: str, folder: Path | None = None) -> Path:
    return (folder or MEASURED_DIR) / f"{model}__recall.json"


def load(model: str, folder: Path | None = None) -> dict | None:
    """The stored recall curves of a model, None when there are none; Unreadable when the file is damaged."""
    p = recall_path(model, folder)
    if not p.is_file():
        return None
    try:
        rec = parsed(p)  # shared, read-only: a plan reads it for every row of the model
    except (OSError, ValueError) as e:
        raise Unreadable(f"{p.name} unreadable ({type(e).__name__})") from None
    curves = rec.get("curves") if isinstance(rec, dict) else None
    if not isinstance(curves, dict):
        raise Unreadable(f"{p.name} has no curves")
    for label, c in curves.items():
        pts = c.get("points") if isinstance(c, dict) else None
        if not isinstance(pts, list) or not all(
                isinstance(x, dict) and isinstance(x.get("distance"), int) and isinstance(x.get("value"), (int, float))
                for x in pts):
            raise Unreadable(f"{p.name}: curve {label!r} has malformed points")
    return rec


def _curve_key(strategy: Strategy, curves: dict) -> str | None:
    if strategy.label in curves:
        return strategy.label
    if strategy.plain_kv and strategy.params.get("dtype") in FLOAT_KV and REFERENCE in curves:
        return REFERENCE
    return None


def _reference_key(curves: dict) -> str | None:
    """The probe's fp32 reference curve: the fp32 cache's, else the one `edgekv analyze` labelled 'reference ...' (a
    recurrent model's fp32 state)."""
    if REFERENCE in curves:
        return REFERENCE
    return next((k for k, c in curves.items() if str(c.get("label", "")).startswith("reference")), None)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def _stored(model: str, strategy: Strategy, folder: Path | None) -> tuple[dict | None, str | None]:
    """(the model's stored recall record, the key of this strategy's curve in it); (None or rec, None) when none."""
    rec = load(model, folder)
    return rec, (None if rec is None else _curve_key(strategy, rec["curves"]))


def recall_at(model: str, strategy: Strategy, ctx: int, folder: Path | None = None) -> dict | None:
    """The point a plan of this model x strategy at ctx cites: {"distance", "value", "trials", "date", "command",
    "curve" (the stored strategy label), "reference" (the fp32 cache's value at that distance, if measured),
    "reached" (False when ctx is past the longest measured trial), "longest"}, or None. Raises Unreadable for a
    damaged file."""
    rec, key = _stored(model, strategy, folder)
    if key is None:
        return None
    pts = sorted(rec["curves"][key]["points"], key=lambda p: p["distance"])
    if not pts:
        return None
    within = [p for p in pts if p["distance"] <= ctx]
    p = within[-1] if within else pts[0]
    ref_key = _reference_key(rec["curves"])
    ref = next((r for r in rec["curves"].get(ref_key, {}).get("points", []) if r.get("distance") == p["distance"]),
               None)
    acc = p.get("accuracy")
    inside = [float(x["value"]) for x in pts if not x.get("beyond_trained")]
    return {"inside_best": max(inside) if inside else None,
            "distance": p["distance"], "value": float(p["value"]), "trials": p.get("trials"), "date": p.get("date"),
            "accuracy": float(acc) if isinstance(acc, (int, float)) else None,
            "command": p.get("command"), "seconds": p.get("seconds"), "curve": key,
            "beyond_trained": bool(p.get("beyond_trained")), "reached": pts[-1]["distance"] + TRIAL_EXTRA >= ctx,
            "longest": pts[-1]["distance"], "reference": None if ref is None else float(ref["value"]),
            "reference_curve": ref_key}


POINT_KEYS = ("distance", "value", "trials", "accuracy", "beyond_trained", "cpu_seconds", "seconds", "load_average",
              "date", "command", "bos")


def _points(curve: dict) -> list[dict]:
    return [{k: p.get(k) for k in POINT_KEYS} for p in sorted(curve.get("points", []), key=lambda p: p["distance"])]


def curves(model: str, strategy: Strategy, folder: Path | None = None) -> dict | None:
    """The stored recall-vs-distance curve of this strategy and the fp32 reference's, for `edgekv plan --explain`:
    {"file", "trained_ctx", "trained_from", "chance", "curve" (the stored strategy label cited), "label",
    "points": [{"distance", "value" (exact recall), "trials", "accuracy", "beyond_trained", "cpu_seconds" (this
    point's own scoring time, where the run recorded it), "seconds" (wall seconds of the whole run that measured
    it), "load_average", "date", "command", "bos"}], "note" (what the file says of its curves, e.g. that a fixture
    never learned recall; null for none), "reference": the same for the fp32 cache (a recurrent model's fp32
    state), or None}. None when
    nothing is stored for the strategy; Unreadable for a damaged file."""
    rec, key = _stored(model, strategy, folder)
    if key is None:
        return None
    c = rec["curves"][key]
    ref_key = _reference_key(rec["curves"])
    ref = rec["curves"].get(ref_key) if ref_key and key != ref_key else None
    return {"file": f"edgekv/measurements/{recall_path(model).name}" if folder is None else str(recall_path(model,
            folder)), "trained_ctx": rec.get("trained_ctx"), "trained_from": rec.get("trained_from"),
            "chance": rec.get("chance"), "curve": key, "label": c.get("label", key), "points": _points(c),
            "note": rec.get("note"),
            "reference": None if ref is None else {"curve": ref_key, "label": ref.get("label", ref_key),
                                                   "points": _points(ref)}}


def cite(q: dict, model: str, strategy: Strategy, ctx: int, folder: Path | None = None) -> dict:
    """quality()'s answer q with the measured recall beside it: the short cite gains "recall at 8k: 0.94 exact,
    measured", the evidence the trials, date and command; where the strategy recalls less than half of what the fp32
    cache recalls at that distance, or a point past the trained context recalls less than half of the best the same
    curve recalled inside it, the risk becomes high (source measured). Unchanged when nothing is stored."""
    try:
        r = recall_at(model, strategy, ctx, folder)
    except Unreadable as e:
        return {**q, "evidence": f"{q['evidence']}; recall measurement not cited: {e}"}
    if r is None:
        return q
    # beside a variant's recall, the fp32 reference's at the same distance: what the model itself recalls there, so
    # a low value the reference shares reads as the model's, not the strategy's (whose risk the label is)
    short = (f"recall at {_k(r['distance'])}: {r['value']:.2f} exact"
             + (f" (fp32 {r['reference']:.2f})" if r["reference"] is not None and r["curve"] != r["reference_curve"]
                else " (model's own)" if r["curve"] == r["reference_curve"] else "") + ", measured")
    how = (f"edgekv analyze --probe recall: exact recall {r['value']:.2f} over {r['trials']} needle(s) at distance "
           f"{r['distance']:,}" + (f" (value tokens right: {r['accuracy']:.2f})" if r["accuracy"] is not None else "") + (" (past the trained context)" if r["beyond_trained"] else "")
           + (f" with the fp32 cache (a {strategy.params.get('dtype')} cache keeps the same tokens)"
              if r["curve"] != strategy.label else "")
           + (f", the fp32 {'cache' if r['reference_curve'] == REFERENCE else 'state'} {r['reference']:.2f}"
              if r["reference"] is not None and r["curve"] != r["reference_curve"] else "")
           + ("" if r["reached"] else f"; measured up to {r['longest']:,}, not {ctx:,}")
           + f" ({r['date']}: {r['command']})")
    out = {**q, "cite": f"{q['cite']}; {short}", "evidence": f"{q['evidence']}; {how}"}
    lost = r["value"] < LOSS * r["reference"] if r["reference"] else False
    past = bool(r["beyond_trained"] and r["inside_best"] and r["value"] < LOSS * r["inside_best"])
    if past:  # what this curve recalled inside the trained context, lost past it
        out["evidence"] += (f"; exact recall {r['inside_best']:.2f} inside the trained context, {r['value']:.2f} past "
                            "it: the usable context ends there")
    if lost or past:  # high, and measured even where a published result already said high
        out.update(risk="high", source="measured")
    return out
