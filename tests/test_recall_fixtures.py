"""scripts/train_tiny.py --recall-mix: the associative-recall training windows. The mask marks exactly the value bytes
of repeated lines (checked against an independent parse of the window), the lines never use the recall probe's
needle format."""
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import train_tiny  # noqa: E402

LINE = re.compile(rb'^([a-z][a-z0-9_]{2,7})(?: = "([A-Za-z0-9]{3,10})"| = \'([A-Za-z0-9]{3,10})\'|: ([A-Za-z0-9]{3,10}))\n',
                  re.M)


@pytest.fixture(scope="module")
def text():
    # real stdlib text, as the script trains on (a slice, for speed)
    return np.frombuffer(b"".join(p.read_bytes() for _, p in train_tiny.stdlib_files()[:150]), np.uint8)


@pytest.mark.parametrize("seq", [320, 512])  # long enough that every line lands at a line start
def test_the_mask_marks_exactly_the_repeated_values(text, seq):
    rng = np.random.default_rng(seq)
    for _ in range(200):
        w, mask = train_tiny.recall_window(text, seq, rng)
        assert w.shape == (seq + 1,) and mask.shape == (seq,)
        b = bytes(w)
        want = np.zeros(seq + 1, bool)
        seen = {}
        for m in LINE.finditer(b):
            name, value = m.group(1), next(g for g in m.groups()[1:] if g)
            if seen.get(name) == value:  # a repeat: its value is the copy target
                s = m.start() + m.group(0).rindex(value)
                want[s:s + len(value)] = True
            seen[name] = value
        assert mask.tolist() == want[1:].tolist()  # mask[i] is about target byte i + 1
        assert b'key_' not in b or not re.search(rb'^key_[0-9a-f]{4} = "', b, re.M)  # never the probe's needle
