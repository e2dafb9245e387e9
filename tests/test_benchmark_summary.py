"""benchmarks/README.md's summary is what benchmarks/summary.py computes from benchmarks/results/, and its ratios and
quality verdicts follow from the figures printed beside them.

The first test ties the page to the script (regenerate with `python benchmarks/summary.py --write`). The others
read only the README's own table and redo its arithmetic by hand, so a script that computed a ratio the wrong way
round, or called a ratio at a higher loss a like-for-like result, fails even after its table was written back.
test_readme_numbers.py checks that every figure of the table is in the JSON its row cites.
"""
import re
from pathlib import Path

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
summary = load_benchmark("summary")

# a ratio: bold (a headline) or plain, "not a headline"
SPEED = re.compile(r"(\d+(?:\.\d+)?) against (?:[^|]*? )?(\d+(?:\.\d+)?) (?:decode tokens per CPU second|tok/s)"
                   r"[^|*]*: (?:\*\*(\d+\.\d+)x\*\*|(\d+\.\d+)x, not a headline)")
MEMORY = re.compile(r"in (\d+) against (\d+) MiB above the baseline \((\d+\.\d+)x\)")
KL = re.compile(r"KL (\d+\.\d+) against (\d+\.\d+) nats")


def summary_rows() -> list[list[str]]:
    text = (ROOT / "benchmarks" / "README.md").read_text()
    block = summary.readme_block(text)
    rows = [line.strip().strip("|").split(" | ") for line in block.splitlines() if line.startswith("| ")]
    return rows[1:]  # past the header


def test_the_readme_summary_is_the_scripts_output():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert summary.readme_block(text) == summary.block(), (
        "benchmarks/README.md's summary differs from the results: run python benchmarks/summary.py --write")


def test_each_ratio_is_the_quotient_of_the_figures_beside_it():
    rows = summary_rows()
    speeds = [(r[0], SPEED.search(r[1])) for r in rows]
    speeds = [(q, m) for q, m in speeds if m]
    assert len(speeds) >= 7, [r[0] for r in rows]  # six filled-context rows and the short prompt's
    for question, m in speeds:
        mine, peer, ratio = (float(x) for x in m.groups() if x is not None)
        assert abs(mine / peer - ratio) <= 0.006, (question, mine, peer, ratio)
    for r in rows:
        if m := MEMORY.search(r[1]):
            mine, peer, ratio = (float(x) for x in m.groups())
            # the MiB are printed whole, the ratio is of the bytes: it lies between the printed figures' rounding bounds
            low, high = (mine - 0.5) / (peer + 0.5), (mine + 0.5) / (peer - 0.5)
            assert low - 0.005 <= ratio <= high + 0.005, (r[0], mine, peer, ratio)


def test_a_ratio_at_a_higher_loss_says_it_is_not_at_equal_quality_and_is_no_headline():
    """Equal quality (issue 38): edgekv's KL at most 1.2x the peer's. Only such a ratio is bold."""
    graded = 0
    for r in summary_rows():
        m = KL.search(r[2])
        if not m:
            continue
        mine, peer = (float(x) for x in m.groups())
        not_equal = "not at equal quality" in r[2]
        assert not_equal == (mine > 1.2 * peer), (r[0], r[2])
        speed = SPEED.search(r[1])
        assert speed and (speed.group(3) is None) == not_equal, (r[0], r[1])
        graded += 1
    assert graded >= 6


def test_the_summary_cites_one_json_per_row_that_exists():
    for r in summary_rows():
        names = re.findall(r"`results/([\w-]+)\.json`", r[-1])
        assert len(names) == 1 and (ROOT / "benchmarks" / "results" / f"{names[0]}.json").is_file(), r
