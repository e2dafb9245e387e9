"""matplotlib for edgekv's figures: the Agg backend (no display), and a configuration folder that works.

matplotlib keeps its configuration and font cache under $XDG_CONFIG_HOME / $XDG_CACHE_HOME (default ~/.config and
~/.cache); when those cannot be written (HOME=/nonexistent, a read-only HOME) it falls back to a temporary folder and
logs a warning on stderr for each. Where that would happen, edgekv points MPLCONFIGDIR at a private temporary folder
of its own first (removed at exit), so the figure is made without a word on stderr."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path


def _usable(base) -> bool:
    """Whether base()/matplotlib is (or can be made) a writable folder, as matplotlib checks it."""
    try:
        d = Path(base(), "matplotlib").resolve()
        d.mkdir(parents=True, exist_ok=True)
        return d.is_dir() and os.access(d, os.W_OK)
    except (OSError, RuntimeError):  # RuntimeError: Path.home() cannot be resolved
        return False


def _config_dir() -> None:
    if os.environ.get("MPLCONFIGDIR") or "matplotlib" in sys.modules:
        return  # the user's own choice, or too late to choose
    if _usable(lambda: os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") and \
            _usable(lambda: os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"):
        return
    d = tempfile.mkdtemp(prefix="edgekv-matplotlib-")
    atexit.register(shutil.rmtree, d, True)
    os.environ["MPLCONFIGDIR"] = d


def pyplot():
    """matplotlib.pyplot on the Agg backend."""
    _config_dir()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
