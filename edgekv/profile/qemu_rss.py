"""The arm64 memory of a run under qemu-user, split out of qemu's own (edgekv.profile.arm64 measures with it).

Under qemu-user the guest is one host process (qemu running the aarch64 python), whose VmRSS/VmHWM also hold qemu's
own memory: its translated-code buffer, its heap, its binary. The guest's own mappings are what qemu's emulated
/proc/self/maps lists (the guest reads it at each mark below); the parent reads the host's /proc/PID/smaps of the same
process at that moment and splits its Rss into the part inside those guest mappings and the rest (qemu's own). Marks:
after the interpreter starts, at the runtime baseline, and after the run. The guest's peak above its baseline = (host
VmHWM at the end - qemu's own at the end) - guest RSS at the baseline. qemu's own only grows (it translates code on
first execution and keeps it), so subtracting its end value gives a lower bound of the guest's peak; the guest RSS at
the end mark is another, and the larger one is reported. A run of the interpreter alone checks the split: its guest
RSS should be near the host python's own RSS.
"""
from __future__ import annotations

import re
from pathlib import Path

SMAPS_HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def parse_maps(text: str) -> list[tuple[int, int, str]]:
    out = []
    for line in text.splitlines():
        m = SMAPS_HEAD.match(line)
        if m:
            out.append((int(m[1], 16), int(m[2], 16), m[4]))
    return out


def parse_smaps(text: str) -> list[tuple[int, int, str, int]]:
    """[(start, end, path, Rss bytes)] of a /proc/PID/smaps."""
    out, cur = [], None
    for line in text.splitlines():
        m = SMAPS_HEAD.match(line)
        if m:
            cur = [int(m[1], 16), int(m[2], 16), m[4], 0]
            out.append(cur)
        elif cur is not None and line.startswith("Rss:"):
            cur[3] = int(line.split()[1]) * 1024
    return [tuple(c) for c in out]


def guest_base(guest: list, host: list, root: Path) -> int:
    """host address - guest address, from a file both maps show (qemu maps a guest's file at guest_base + its guest
    address; the host's smaps names it by its path outside the root)."""
    prefix = str(root.resolve())
    files = {}
    for lo, _hi, path, _rss in host:
        if path.startswith(prefix + "/"):
            files.setdefault(path[len(prefix):], lo)
    for lo, _hi, path in guest:
        if path in files:
            return files[path] - lo
    return 0


def split_rss(smaps_text: str, guest_maps_text: str, root: Path) -> dict:
    """{"total", "guest", "qemu"} bytes resident: the host's smaps Rss split into the guest's mappings (prorated by
    overlap where a host mapping straddles a guest one's edge) and the rest."""
    host, guest = parse_smaps(smaps_text), parse_maps(guest_maps_text)
    base = guest_base(guest, host, root)
    spans = sorted((lo + base, hi + base) for lo, hi, _ in guest)
    total = sum(r for *_, r in host)
    inside = 0.0
    for lo, hi, _p, rss in host:
        if not rss:
            continue
        ov = sum(max(0, min(hi, b) - max(lo, a)) for a, b in spans if a < hi and b > lo)
        inside += rss * min(1.0, ov / (hi - lo))
    return {"total": total, "guest": int(inside), "qemu": total - int(inside)}
