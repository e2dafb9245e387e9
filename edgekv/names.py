"""Did-you-mean for a name edgekv does not know (a device id, a catalog model): the closest known names, in one
line, instead of the whole list."""
from __future__ import annotations

import difflib
import re


def _key(name: str) -> str:
    """A name as typed loosely: case, '-', '_', '.', ' ' ignored ('Llama3.2-1B' and 'llama-3.2-1b' are one key)."""
    return re.sub(r"[-_. ]", "", name.lower())


def did_you_mean(name: str, known: list[str], aliases: dict[str, str] | None = None, n: int = 3) -> list[str]:
    """Known names close to name: those equal to it but for case and punctuation, an alias (e.g. an HF repo id ->
    its catalog name), else difflib's closest matches (ratio at least 0.6 and within 0.1 of the best), best first."""
    loose = {}
    for k in known:
        loose.setdefault(_key(k), k)
    for a, k in (aliases or {}).items():
        loose.setdefault(_key(a), k)
    if _key(name) in loose:
        return [loose[_key(name)]]
    scored = sorted(((difflib.SequenceMatcher(None, _key(name), k).ratio(), k) for k in loose), reverse=True)
    best = scored[0][0] if scored else 0.0
    close = [k for r, k in scored if r >= max(0.6, best - 0.1)][:n]  # the best, and those nearly as close
    return list(dict.fromkeys(loose[c] for c in close))


def suggestion(name: str, known: list[str], aliases: dict[str, str] | None = None) -> str:
    """'did you mean pixel8?' / 'did you mean a, b or c?', or '' when nothing is close."""
    got = did_you_mean(name, known, aliases)
    if not got:
        return ""
    return "did you mean " + (got[0] if len(got) == 1 else ", ".join(got[:-1]) + " or " + got[-1]) + "?"
