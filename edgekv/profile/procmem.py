"""Memory of this process from /proc/self/status (Linux and Android): VmRSS now, VmHWM = the peak so far."""
from __future__ import annotations


def status_bytes(text: str | None = None) -> dict[str, int]:
    """{'VmRSS': bytes, 'VmHWM': bytes, ...} from /proc/self/status (values are in kB there)."""
    if text is None:
        with open("/proc/self/status") as f:
            text = f.read()
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key.startswith("Vm") and len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


def rss() -> int:
    return status_bytes()["VmRSS"]


def hwm() -> int:
    return status_bytes()["VmHWM"]


def reset_hwm() -> bool:
    """Reset the peak to the current RSS (writing 5 to /proc/self/clear_refs); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
