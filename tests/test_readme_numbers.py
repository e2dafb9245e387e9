"""Every benchmark figure in README.md and benchmarks/README.md cites a JSON file in benchmarks/results/ that exists
and holds the number.

A figure: a number with a unit of measurement (tok/s, GB/s, MiB, MB, ms, us), in prose or in a table, or any number
in a table's cells past its first column (ratios such as 1.06x and names such as fp32 or Q4_1 are not figures). It
must stand in a paragraph (or list item) that cites `results/NAME.json` (`benchmarks/results/NAME.json`, or a bare
`NAME.json`; `NAME_{a,b}.json` names both), or, for a table, in the table right after such a paragraph. The cited
files must hold it: some number in them that rounds to it at its printed precision, directly or as the unit says
(bytes -> MiB / MB, bytes/s -> GB/s, seconds -> ms / us, ms -> us).
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# the status page, and the dated runs behind it (benchmarks/log/: verbatim history, so held to the same rule; its
# plan_accuracy_probes.md is a probe log whose figures predate the results files)
DOCS = ["README.md", "benchmarks/README.md"] + sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks" / "log").glob("*.md") if p.name != "plan_accuracy_probes.md")

CITE = re.compile(r"(?:benchmarks/)?results/([\w{},./-]+?)\.json|`([\w{},-]+_[\w{},-]+)\.json`")
NUM = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"  # 1,083 or 18.7
# a run of numbers joined by /, -, to, vs, and, then a unit: "30 / 36 tok/s", "3-8 GB/s", "8.98 / 14.08 / 17.33 ms"
FIGURE = re.compile(rf"(?<![\w.])({NUM}(?:\s*(?:/|-|to|vs\.?|and)\s*{NUM})*)\s*(tok/s|GB/s|MiB|MB|ms|us)\b")
CELL_NUM = re.compile(rf"(?<![\w.+-])({NUM})(?![\w.%]|\s*x\b)")
SCALE = {"tok/s": (1,), "GB/s": (1, 1e-9), "MiB": (1, 2.0**-20), "MB": (1, 1e-6), "ms": (1, 1e3),
         "us": (1, 1e3, 1e6), None: (1, 2.0**-20, 1e3)}


def expand(name: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [x for part in m.group(1).split(",") for x in expand(name[:m.start()] + part + name[m.end():])]


PROFILE = re.compile(r"device_profiles/([\w.-]+)\.toml")
DIR = re.compile(r"(?:benchmarks/)?results/([\w-]+)/")


def cited(text: str) -> list[str]:
    """The JSON files a block cites (names under benchmarks/results/, without .json; a folder: every JSON in it),
    and the device profiles (device_profiles/NAME.toml, for the facts a profile holds)."""
    out = [n for m in CITE.finditer(text) for n in expand(m.group(1) or m.group(2))]
    for m in DIR.finditer(text):
        out += sorted(p.relative_to(RESULTS).with_suffix("").as_posix() for p in (RESULTS / m.group(1)).rglob("*.json"))
    return out + [f"../../device_profiles/{m.group(1)}.toml" for m in PROFILE.finditer(text)]


def blocks(text: str):
    """(kind, text) per paragraph, list item or table, in order; kind is 'table' or 'prose'; code fences skipped."""
    out, cur, kind, fence = [], [], None, False
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        k = "table" if line.startswith("|") else "prose"
        new_item = k == "prose" and (line.startswith(("- ", "#")) or not line.strip())
        if cur and (k != kind or new_item):
            out.append((kind, "\n".join(cur)))
            cur = []
        if line.strip():
            cur.append(line)
            kind = k
    return out


def json_numbers(name: str) -> list[float]:
    out = []

    def walk(x):
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            out.append(float(x))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    if name.endswith(".toml"):  # a device profile: every number in it, its sources' words included
        text = (RESULTS / name).read_text()
        return [float(n.replace(",", "").replace("_", "")) for n in re.findall(r"\d[\d,_]*(?:\.\d+)?", text)]
    walk(json.loads((RESULTS / f"{name}.json").read_text()))
    return out


def exists(name: str) -> bool:
    return (RESULTS / (name if name.endswith(".toml") else f"{name}.json")).is_file()


def holds(values: list[float], figure: str, unit: str | None) -> bool:
    figure = figure.replace(",", "")
    x = float(figure)
    half = 0.5 * 10.0 ** -(len(figure.split(".")[1]) if "." in figure else 0) * 1.0001
    return any(abs(v * s - x) <= half for v in values for s in SCALE[unit])


def figures(kind: str, text: str):
    """(number as printed, unit or None) for every figure of a block."""
    if kind != "table":
        for m in FIGURE.finditer(text):
            for n in re.findall(NUM, m.group(1)):
                yield n, m.group(2)
        return
    for row in text.splitlines()[2:]:  # past the header and the |---| line
        for cell in row.strip().strip("|").split("|")[1:]:
            for m in FIGURE.finditer(cell):
                for n in re.findall(NUM, m.group(1)):
                    yield n, m.group(2)
            rest = FIGURE.sub("", cell)
            for m in CELL_NUM.finditer(rest):
                yield m.group(1), None


def check(doc: str) -> list[str]:
    text = (ROOT / doc).read_text()
    problems = []
    previous = paragraph = []
    for kind, block in blocks(text):
        names = cited(block)
        for n in names:
            if not exists(n):
                problems.append(f"{doc}: cites {n}, which is not there")
        if block.startswith("#"):
            previous = paragraph = []
            continue
        if kind == "table":
            names = names + previous  # a table takes the paragraph's before it, and what its rows cite
        elif kind == "prose" and block.startswith("- "):
            names = names or paragraph  # a list item goes on from the paragraph that opens the list
            previous = names
        elif kind == "prose":
            previous = paragraph = names
        if kind == "table" and not names:
            kind = "uncited table"  # not a benchmark table: only its figures with units are checked
        names = [n for n in names if exists(n)]
        values = [v for n in names for v in json_numbers(n)]
        where = block.splitlines()[0][:70]
        for fig, unit in figures(kind, block):
            if not names:
                problems.append(f"{doc}: {fig} {unit or ''} cites no JSON (block: {where!r})")
            elif not holds(values, fig, unit):
                problems.append(f"{doc}: {fig} {unit or ''} is not in {', '.join(names)} (block: {where!r})")
    return problems


@pytest.mark.parametrize("doc", DOCS)
def test_every_benchmark_figure_cites_a_json_that_holds_it(doc):
    problems = check(doc)
    assert not problems, f"{len(problems)} figures:\n" + "\n".join(problems)


def test_the_checker_finds_a_wrong_figure_and_one_without_json(tmp_path, monkeypatch):
    """The rule itself, on a made-up page: a figure held by its JSON passes, a changed one and an uncited one fail."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "r.md").write_text(
        "Decode 18.7 / 30.9 tok/s, 641 MiB above the baseline (`results/decode_speed_interleaved_2048.json`).\n\n"
        "| row | decode | MiB |\n|---|---|---|\n| a | 18.7 | 641 |\n\n"
        "Cache read at 3-8 GB/s.\n\n"
        "Decode 18.9 tok/s (`results/decode_speed_interleaved_2048.json`).\n")
    problems = check("r.md")
    assert len(problems) == 3, problems
    assert any("3 GB/s cites no JSON" in p for p in problems) and any("18.9 tok/s is not in" in p for p in problems)
