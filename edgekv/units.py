"""Context lengths and byte units: the only place that parses "32k" or prints "GB".

Context: "4000" -> 4000, "4k"/"4K" -> 4096, "128k" -> 131072, "1m" -> 1048576 (binary multipliers, as
llama.cpp and transformers users mean them). Anything else ("32kk", "0", "-5", "1e9", "1.5k") is an error.
Bytes: GB = 1e9 and GiB = 2**30; every rendered number says which. Tables and summaries show memory in GB (1e9)
only, with three significant digits (0.00280 GB, not 0.00 GB or 2.8 MB), and say "GB = 1e9 bytes" once per table.
Times: one unit per column (time_unit picks it from the column's largest value).
"""
from __future__ import annotations

import math
import re

from .errors import EdgekvError

MAX_CTX = 16 * 2**20  # 16M tokens: beyond anything a device in the catalog could hold
_CTX_RE = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$", re.ASCII)  # ASCII digits only, not '٣' or '３'
_MULT = {"": 1, "k": 1024, "m": 1024 * 1024}

GB = 10**9
GiB = 2**30
MB = 10**6
MiB = 2**20


def parse_ctx(text: str | int) -> int:
    """'32k' -> 32768. Raises EdgekvError with a one-line message for anything malformed or out of range."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _CTX_RE.match(str(text))
        if not m:
            raise EdgekvError(f"context {text!r} is not a token count: use e.g. 4000, 4k, 32K, 128k or 1m")
        value = int(m.group(1)) * _MULT[m.group(2).lower()]
    if value <= 0:
        raise EdgekvError(f"context {text!r} must be at least 1 token")
    if value > MAX_CTX:
        raise EdgekvError(f"context {text!r} is larger than {MAX_CTX:,} tokens")
    return value


def parse_ctx_list(text: str) -> list[int]:
    """'1k,8k,32k' -> [1024, 8192, 32768]."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise EdgekvError(f"context list {text!r} is empty")
    return [parse_ctx(p) for p in parts]


BYTE_UNITS = ("B", "KB", "KiB", "MB", "MiB", "GB", "GiB")


def parse_bytes(text: str) -> int:
    """'512MB' -> 512e6, '3GiB' -> 3*2**30; a number without its unit is refused ('0.6' could be GB or MB)."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KiB|MB|MiB|GB|GiB)?\s*$", str(text), re.I | re.A)
    if not m:
        raise EdgekvError(f"memory size {text!r} is not a size: use e.g. 3500MB or 3.5GB or 3GiB")
    if not m.group(2):
        raise EdgekvError(f"memory size {text!r} has no unit: give one of {', '.join(BYTE_UNITS)} "
                          f"(e.g. {m.group(1)}GB or {m.group(1)}MB)")
    unit = m.group(2).lower()
    mult = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": MB, "mib": MiB, "gb": GB, "gib": GiB}[unit]
    value = int(float(m.group(1)) * mult)
    if value <= 0:
        raise EdgekvError(f"memory size {text!r} must be positive")
    return value


def fmt_ctx(tokens: int) -> str:
    """4096 -> '4k', 4000 -> '4000', 1048576 -> '1m'."""
    if tokens % (1024 * 1024) == 0:
        return f"{tokens // (1024 * 1024)}m"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}k"
    return str(tokens)


def fmt_bytes(n: float, unit: str = "GB", digits: int = 2) -> str:
    """Bytes with their unit named: fmt_bytes(3.5e9) -> '3.50 GB'; unit one of GB, GiB, MB, MiB."""
    div = {"GB": GB, "GiB": GiB, "MB": MB, "MiB": MiB}[unit]
    return f"{n / div:.{digits}f} {unit}"


def fmt_sig(x: float, sig: int = 3) -> str:
    """x with `sig` significant digits, never in exponent form: 1.584 -> '1.58', 0.0028 -> '0.00280', 414.2 -> '414',
    12345 -> '12345'; 0 -> '0'."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    exp = math.floor(math.log10(abs(x)))
    decimals = max(0, sig - 1 - exp)
    out = f"{x:.{decimals}f}"
    if float(out) != 0 and math.floor(math.log10(abs(float(out)))) > exp and decimals > 0:
        out = f"{x:.{decimals - 1}f}"  # 0.9996 rounds up to 1.000: keep `sig` digits, not sig + 1
    return out


def fmt_gb(n: float, sig: int = 3) -> str:
    """Bytes as a bare number of GB (1e9), `sig` significant digits: for a column headed "... GB"."""
    return fmt_sig(n / GB, sig)


def fmt_mem(n: float, sig: int = 3) -> str:
    """Bytes in GB (1e9) with the unit: 1.584e9 -> '1.58 GB', 2.8e6 -> '0.00280 GB' (the one unit tables use)."""
    return f"{fmt_gb(n, sig)} GB"


def fmt_auto(n: float) -> str:
    """Kept for callers outside the tables: the same as fmt_mem (one unit, GB = 1e9)."""
    return fmt_mem(n)


TIME_UNITS = (("ms", 1e-3), ("s", 1.0), ("min", 60.0), ("h", 3600.0))


def time_unit(seconds: list[float]) -> tuple[str, float]:
    """One unit for a column of durations, chosen by its largest value: under 1 s ms, under 10 min s, under 10 h
    min, else h. -> (unit name, seconds per unit)."""
    top = max((abs(s) for s in seconds if s is not None and math.isfinite(s)), default=0.0)
    if top < 1:
        return TIME_UNITS[0]
    if top < 600:
        return TIME_UNITS[1]
    if top < 36000:
        return TIME_UNITS[2]
    return TIME_UNITS[3]
