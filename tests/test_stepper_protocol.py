"""edgekv.export.generate's one greedy loop over a Stepper whose calls give the last token's logits only (what GenAI's
Generator and the ExecuTorch runner .pte give: Stepper.last_row_only), with a fake runtime whose next token is the
last token + 1: the calls it receives and the tokens generated, counted by hand. No runtime is imported."""
from __future__ import annotations

import numpy as np
import pytest

from edgekv.errors import EdgekvError
from edgekv.export.generate import generate
from edgekv.export.stepper import Stepper

V = 26  # "a".."z", one token per letter
MANIFEST = {"state": {"tensors": []}, "artifacts": [], "max_ctx": 32, "model": {"vocab": V},
            "tokenizer": {"eos_token_ids": [25], "bos_token_id": None, "add_bos_token": False}}


class Letters:
    def encode(self, text):
        return type("Enc", (), {"ids": [ord(c) - ord("a") for c in text]})

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


class LastRowRuntime(Stepper):
    runtime, last_row_only, max_chunk = "fake", True, 4

    def __init__(self):
        self.calls = []
        super().__init__(MANIFEST)

    def reset(self):
        self.state = None

    def _call(self, tokens, pos, rows):
        self.calls.append((list(tokens), pos))
        out = np.zeros((1, V), np.float32)
        out[0, (tokens[-1] + 1) % V] = 1.0  # the last token's row only, whatever rows asks for
        return out


def test_generation_prefills_in_calls_of_max_chunk_and_decodes_one_token_per_call():
    s = LastRowRuntime()
    r = generate(MANIFEST, s, Letters(), "abcdefghij", 3)
    assert r["tokens"] == [10, 11, 12] and r["text"] == "klm" and r["prompt_tokens"] == 10
    assert s.calls == [([0, 1, 2, 3], 0), ([4, 5, 6, 7], 4), ([8, 9], 8), ([10], 10), ([11], 11)]
    assert r["stopped"] == "max_new_tokens"


def test_every_row_of_a_prompt_takes_one_token_per_call():
    s = LastRowRuntime()
    rows = s.prefill([0, 1, 2, 3, 4])
    assert rows.shape == (5, V) and list(rows.argmax(-1)) == [1, 2, 3, 4, 5]
    assert s.calls == [([t], t) for t in range(5)]
    with pytest.raises(EdgekvError, match="last token's logits only"):
        s.step([1, 2], 5)  # every row of a two-token call: this runtime cannot give it
    assert s.step([1, 2], 5, last=True).shape == (1, V)
