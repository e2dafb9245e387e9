"""benchmarks/resume_state.py: the P / Q split that tokenizes as P then Q (a tokenizer with a SentencePiece-style
dummy prefix makes a naive split unstable: the split must move back to a space), the ratios against hand arithmetic,
the refusal check and the row selection."""
from pathlib import Path

import pytest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "resume_state.py"

rs = load_benchmark("resume_state")


class Enc:
    def __init__(self, ids, offsets):
        self.ids, self.offsets = ids, offsets


class DummyPrefix:
    """One token per character, with a space put in front of a text that does not start with one (SentencePiece's
    add_dummy_prefix): a piece of text that does not start with a space tokenizes differently alone."""

    def encode(self, text, add_special_tokens=True):
        if text.startswith(" "):
            return Enc([ord(c) for c in text], [(i, i + 1) for i in range(len(text))])
        return Enc([32] + [ord(c) for c in text], [(0, 0)] + [(i, i + 1) for i in range(len(text))])


def test_the_split_moves_back_until_p_plus_q_tokenizes_as_p_then_q():
    # " ab cd ef gh": token 5 is "d"; Q = "d " alone would gain a space, so would "cd"; token 3 (" ") is the first
    # stable split: P = "ab", Q = " c"
    s = rs.split(DummyPrefix(), "ab cd ef gh", 5, 2)
    assert (s["P"], s["Q"], s["moved_back"]) == ("ab", " c", 2)
    assert s["p_ids"] == [32, 97, 98] and s["q_ids"] == [32, 99]
    tok = DummyPrefix()
    assert tok.encode(s["P"] + s["Q"]).ids == s["p_ids"] + s["q_ids"]
    with pytest.raises(ValueError, match="within 1 tokens"):
        rs.split(DummyPrefix(), "ab cd ef gh", 5, 2, tries=1)
    with pytest.raises(ValueError, match="fewer than"):
        rs.split(DummyPrefix(), "ab cd", 5, 2)


def test_a_byte_level_tokenizer_splits_where_asked(tmp_path):
    pytest.importorskip("tokenizers")
    from edgekv.export.generate import load_tokenizer
    from edgekv.export.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(tmp_path, tmp_path)
    text = "héllo wörld, prefill once"
    s = rs.split(load_tokenizer(tmp_path / "tokenizer.json"), text, 8, 3)
    assert s["moved_back"] == 0 and s["special_tokens_added"] == [0, 0, 0]
    assert s["p_ids"] == list(text.encode()[:8]) and (s["P"] + s["Q"]).encode() == text.encode()[:11]


def test_ratios_are_re_prefill_over_resume():
    save = {"prefill_s": 60.0, "prefill_cpu_s": 50.0}
    resume = {"load_s": 0.5, "prefill_s": 1.5, "load_cpu_s": 0.2, "prefill_cpu_s": 0.8, "process_wall_s": 8.0,
              "process_cpu_s": 5.0}
    whole = {"prefill_s": 62.0, "prefill_cpu_s": 51.0, "process_wall_s": 70.0, "process_cpu_s": 56.0}
    r = rs.ratios(save, resume, whole)
    assert r == {"save_prefill_over_resume_first_token": 30.0, "save_prefill_cpu_over_resume_first_token_cpu": 50.0,
                 "first_token": 31.0, "first_token_cpu": 51.0, "process_wall": 8.75, "process_cpu": 11.2}
    assert rs.ratios(save, resume, {"error": "not run"}) == {k: r[k] for k in list(r)[:2]}
    assert rs.ratios(save, {"error": "x"}, whole) == {}


def test_a_refusal_is_exit_2_and_one_line():
    assert rs.one_line_error(2, "error: x.state: truncated or damaged\n")["ok"]
    assert not rs.one_line_error(1, "error: x\n")["ok"]
    assert not rs.one_line_error(2, "Traceback (most recent call last):\n  File ...\nValueError: x\n")["ok"]


def test_the_rows_and_bad_input():
    assert {m for m, *_ in rs.ROWS.values()} == {"smollm2-135m", "gemma-3-270m"}
    assert all(w == "int4" for m, _, w, _ in rs.ROWS.values() if m == "smollm2-135m")
    assert {c for *_, c in rs.ROWS.values()} == {8192, 32768}
    for _, _, _, ctx in [*rs.ROWS.values(), *rs.QUICK.values()]:
        assert ctx - rs.ROOM + rs.Q_TOKENS + rs.NEW_TOKENS < ctx
    with pytest.raises(SystemExit):
        rs.main(["--only", "no-such-row"])
