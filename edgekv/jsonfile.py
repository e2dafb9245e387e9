"""Read a JSON file a user handed us (config.json, manifest.json, a safetensors index): one clear line on failure."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import EdgekvError


def read_json(path: str | Path):
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise EdgekvError(f"{p}: cannot read it ({type(e).__name__}: {e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise EdgekvError(f"{p}: not valid JSON ({type(e).__name__}: {e})") from None
