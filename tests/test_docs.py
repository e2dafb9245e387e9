"""The user-facing docs point at things that exist, and the manifest schema has one source.

The Markdown docs (README.md, docs/*.md, SECURITY.md and every folder's README.md) name files of this repository
(links, and paths in backticks under a top-level folder); a file that moved or went away leaves a reader at a dead end. The manifest
schema is the package's own file, the one export and load validate against: a second copy kept by hand drifts.
"""
import os
import re
from pathlib import Path

from edgekv.export import manifest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".venv", ".venv-mutate", ".arm64", "build", "node_modules", "test-artifacts", "__pycache__",
             ".pytest_cache", "out"}


def repo_files(suffix: str) -> list[Path]:
    """The repository's files whose name ends with suffix, never entering SKIP_DIRS (`make arm64-env`'s .arm64/
    holds a whole Debian root, with /proc mounted in it while debootstrap runs)."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        out += [Path(folder) / f for f in files if f.endswith(suffix)]
    return out


DOCS = sorted(p.relative_to(ROOT).as_posix() for p in repo_files(".md")  # README.md, docs/, SECURITY.md, every README
              if p.relative_to(ROOT).parts[0] != "export" or p.relative_to(ROOT).as_posix() == "export/README.md")
TOP = ("edgekv/", "docs/", "benchmarks/", "tests/", "scripts/", "device_profiles/", "fixtures/", "android_demo/",
       "export/", "experiments/")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
TICKED = re.compile(r"`([A-Za-z0-9_./-]+)`")


def missing_paths(doc: str, root: Path = ROOT) -> list[str]:
    """Every repository path the doc names that is not there: relative links (from the doc's folder) and backticked
    paths that start with a top-level folder (from the root); globs, templates and example exports (export/NAME)
    are left out."""
    text = (root / doc).read_text()
    named = [(m, (root / doc).parent / m) for m in LINK.findall(text) if "://" not in m and not m.startswith("mailto:")]
    named += [(m, root / m) for m in TICKED.findall(text)
              if m.startswith(TOP) and not any(c in m for c in "*{}") and not re.match(r"export/(?!README\.md$)", m)]
    return [f"{doc}: {written}" for written, path in named if not path.exists()]


def test_every_path_the_docs_name_exists():
    missing = [m for doc in DOCS for m in missing_paths(doc)]
    assert not missing, "docs name paths that are not there:\n" + "\n".join(missing)


def test_the_path_check_finds_a_dead_link(tmp_path):
    """The rule itself: a link and a backticked path that exist pass, ones that do not are reported."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "edgekv").mkdir()
    (tmp_path / "edgekv" / "here.py").write_text("")
    (tmp_path / "docs" / "a.md").write_text("")
    (tmp_path / "README.md").write_text("[a](docs/a.md) [b](docs/b.md#x) `edgekv/here.py` `edgekv/gone.py` "
                                        "`export/my-run/report.html` `edgekv/*.py`\n")
    assert missing_paths("README.md", tmp_path) == ["README.md: docs/b.md", "README.md: edgekv/gone.py"]


def test_one_manifest_schema_in_the_repository():
    copies = [p.relative_to(ROOT).as_posix() for p in repo_files("manifest.schema.json")
              if p.name == "manifest.schema.json"]
    assert copies == ["edgekv/export/manifest.schema.json"], copies
    assert manifest.SCHEMA_PATH.resolve() == (ROOT / copies[0]).resolve()


def test_the_readme_is_a_guide_not_a_log():
    """No pointers outside the repository (an issue's closing note) and no section that logs runs."""
    text = (ROOT / "README.md").read_text()
    assert not re.search(r"closing note|^## Status", text, re.M | re.I)
    for section in ("## Install", "## Commands", "## Reading the output", "## The artifact contract", "## Limits"):
        assert section in text, section
