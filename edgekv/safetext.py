"""Text read from a file, made safe to print: a device name, a path or a manifest field may carry terminal control
sequences (ESC [2J clears the screen, ESC ] 0; sets the window title). Every control character (Unicode category Cc,
except newline and tab) and every bidirectional override (which can reorder what a terminal shows) is printed as an
escape ('\\x1b'), never raw."""
from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls; the bidirectional embeddings, overrides and isolates
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text) -> str:
    """str(text) with every terminal control character written as an escape."""
    s = str(text)
    return _UNSAFE.sub(_escape, s) if _UNSAFE.search(s) else s


def has_control(text: str) -> bool:
    return bool(_UNSAFE.search(text))
