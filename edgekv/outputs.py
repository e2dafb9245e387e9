"""The output rule (SECURITY.md, "What edgekv writes, and never overwrites"): check an output path before the work
starts and write it atomically.

An output (--out, -o, --plot, --save-state; --save's store) may name a path where nothing is yet, or a plain file
edgekv wrote (edgekv_wrote: the mark below, or a state file / profile report / stored measurement read as such),
which --force replaces (--save's store replaces its own files: it updates them). Nothing else is replaced, with or
without --force: a user's file, a symlink, a folder, a FIFO or device, and no path inside an edgekv export folder
is written except the pages edgekv writes there (manifest.AFTERWARDS). The check runs before the work starts and
again right before the rename into place (write_atomic), as export's publish checks --out twice.
"""
from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

from .errors import EdgekvError
from .jsonfile import MAX_JSON_BYTES, _parse, read_json

PLOT_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg")  # what matplotlib writes, by the name's suffix

MARK_WINDOW = 64 * 1024  # where a mark is looked for: the first and last 64 KiB (a PDF's Info dictionary is at its end)
NAME_ROOM = 32  # bytes write_atomic's temporary name adds to the target's: "." + ".tmp-" + pid + "-" + 8 + suffix
_MARKS = (  # (file kind, how edgekv marks what it writes, matched in the first / last MARK_WINDOW bytes)
    ("PNG", re.compile(rb"\A\x89PNG\r\n\x1a\n.*?tEXtSoftware\x00edgekv ", re.S)),  # savefig(metadata={"Software"})
    ("SVG", re.compile(rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>edgekv ", re.S)),  # metadata={"Creator"}
    ("PDF", re.compile(rb"/Creator \(edgekv ")),  # metadata={"Creator"}, in the Info dictionary
    ("JPEG", re.compile(rb"\A\xff\xd8.*?\xff\xfe..edgekv ", re.S)),  # pil_kwargs={"comment"}: a COM segment
    ("HTML", re.compile(rb"\A\s*<!doctype html>.{0,400}?<meta name=\"generator\" content=\"edgekv ", re.S | re.I)),
    ("Markdown", re.compile(rb"\A<!-- generator: edgekv ")),
)


def generator() -> str:
    """edgekv's mark in what it writes: "edgekv VERSION" (a JSON object's "generator", an HTML page's generator
    meta, a Markdown page's first-line comment, a plot's Software / Creator metadata)."""
    from . import __version__
    return f"edgekv {__version__}"


def marked(obj: dict) -> dict:
    """A JSON object edgekv writes, with its mark first: {"generator": "edgekv VERSION", ...}."""
    return {"generator": generator(), **{k: v for k, v in obj.items() if k != "generator"}}


def plot_marks(path: str | Path) -> dict:
    """savefig keyword arguments that mark a plot of this name's format as edgekv's."""
    suffix = Path(path).suffix.lower()
    if suffix == ".png":
        return {"metadata": {"Software": generator()}}
    if suffix in (".svg", ".pdf"):
        return {"metadata": {"Creator": generator()}}
    if suffix in (".jpg", ".jpeg"):
        return {"pil_kwargs": {"comment": generator()}}
    return {}


def _kind(mode: int) -> str | None:
    """Why a file of this st_mode is not a plain file, or None when it is."""
    if stat.S_ISLNK(mode):
        return "it is a symlink"
    if stat.S_ISDIR(mode):
        return "it is a folder"
    if not stat.S_ISREG(mode):
        return "it is a FIFO, socket or device, not a plain file"
    return None


def open_regular(path: str | Path, follow: bool = False):
    """path opened for reading as bytes, only if it is a plain file: looked at with lstat (follow: stat) first, so a
    FIFO or device is never opened, then opened without blocking (and, unless follow, without following a symlink)
    and fstat'ed again (a file swapped meanwhile). Raises EdgekvError with why not."""
    try:
        why = _kind((os.stat if follow else os.lstat)(path).st_mode)
        if why:
            raise EdgekvError(f"{path}: {why}")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
                     | (0 if follow else getattr(os, "O_NOFOLLOW", 0)))
    except OSError as e:
        raise EdgekvError(f"{path}: cannot read it ({e.strerror or e})") from None
    why = _kind(os.fstat(fd).st_mode)
    if why:
        os.close(fd)
        raise EdgekvError(f"{path}: {why}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _json_wrote(obj) -> bool:
    """Is this JSON object one edgekv wrote: marked, or one of the files edgekv wrote before it marked them (a
    manifest, a profile report per report.schema.json, a stored measurement)?"""
    if not isinstance(obj, dict):
        return False
    gen = obj.get("generator")
    if isinstance(gen, str) and gen.startswith("edgekv "):
        return True
    if "edgekv_version" in obj and isinstance(obj.get("files"), dict):  # manifest.owned_export's test
        return True
    if str(obj.get("source", "")).startswith("edgekv analyze") or "edgekv/analyze/" in str(obj.get("value", "")):
        return True  # analyze --save: report.store, recall.store
    if {"artifact", "runtime", "host", "runs"} <= obj.keys():
        try:
            from .profile.run import validate_report
            validate_report(obj)
            return True
        except (EdgekvError, ImportError):
            return False
    return False


def edgekv_wrote(path: str | Path) -> str | None:
    """None when path is a plain file edgekv wrote (recognisably: its mark, or a state file, manifest, profile report
    or stored measurement read as such); else why not, in words. Reads at most the first and last MARK_WINDOW bytes
    (a JSON file: all of it, up to MAX_JSON_BYTES)."""
    try:
        f = open_regular(path)
    except EdgekvError as e:
        return str(e).removeprefix(f"{path}: ")
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(MARK_WINDOW)
        tail = b""
        if size > MARK_WINDOW:
            f.seek(max(size - MARK_WINDOW, MARK_WINDOW))
            tail = f.read(MARK_WINDOW)
        if len(head) >= 8 and b'"edgekv-state"' in head:  # a safetensors header naming statefile.FORMAT (its
            from .export.statefile import is_state_file  # 8-byte length may start with "{", 0x7b: looked at first)
            if is_state_file(Path(path)):
                return None
        body = head.lstrip(b"\xef\xbb\xbf \t\r\n")
        if body[:1] == b"{" and size <= MAX_JSON_BYTES:
            f.seek(0)
            try:
                obj = _parse(f.read().decode("utf-8"), str(path), nonfinite=True)
            except (EdgekvError, UnicodeDecodeError):
                obj = None
            return None if _json_wrote(obj) else "a JSON file without edgekv's mark"
    for kind, pat in _MARKS:
        if pat.search(head) or (tail and kind == "PDF" and pat.search(tail)):
            return None
    return "it carries no edgekv mark"


def export_holding(path: str | Path) -> tuple[Path, str] | None:
    """(export folder, path relative to it) when path lies inside an edgekv export folder (one of its parents holds
    a manifest.json edgekv wrote, manifest.owned_export's test), else None."""
    from .export.manifest import MANIFEST

    p = Path(os.path.abspath(path))
    try:
        parent = p.parent.resolve()
    except (OSError, RuntimeError):
        parent = p.parent
    for folder in (parent, *parent.parents):
        m = folder / MANIFEST
        try:
            if not stat.S_ISREG(os.stat(m).st_mode):
                continue
        except OSError:
            continue
        try:
            obj = read_json(m, nonfinite=True)
        except EdgekvError:
            continue
        if isinstance(obj, dict) and "edgekv_version" in obj and isinstance(obj.get("files"), dict):
            return folder, (parent / p.name).relative_to(folder).as_posix()
    return None


def _check_name(p: Path, option: str) -> None:
    """A name the file system takes, with room for write_atomic's temporary name beside it; one line if not."""
    parent = p.parent if str(p.parent) else Path(".")
    for part in p.parts:
        if len(os.fsencode(part)) > 255:
            break
    else:
        part = None
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    name = len(os.fsencode(p.name))
    if part is not None and part != p.name:
        raise EdgekvError(f"{option} {path_text(p)}: a folder name of {len(os.fsencode(part))} bytes; file "
                          "systems take 255 at most")
    if name + NAME_ROOM > limit:
        raise EdgekvError(f"{option} {path_text(p)}: a file name of {name} bytes; this file system takes {limit}, "
                          f"and edgekv's temporary file beside it adds up to {NAME_ROOM}: choose a shorter name")
    full = len(os.fsencode(os.path.abspath(p)))
    if full + NAME_ROOM >= 4096:  # PATH_MAX on Linux
        raise EdgekvError(f"{option} {path_text(p)}: a path of {full} bytes; at most {4095 - NAME_ROOM} here")


def path_text(p, limit: int = 120) -> str:
    """A path as an error line shows it: a very long one cut in the middle."""
    s = str(p)
    return s if len(s) <= limit else f"{s[:limit // 2]}...{s[-limit // 2:]} ({len(s)} characters)"


def _may_write(p: Path, option: str, force: bool) -> None:
    """The output rule for p: not inside an export folder but for the pages edgekv writes there, and an existing
    file only if edgekv wrote it and force; else one EdgekvError line naming --force."""
    from .export.manifest import AFTERWARDS

    held = export_holding(p)
    if held and held[1] not in AFTERWARDS:
        raise EdgekvError(f"{option} {path_text(p)}: inside the edgekv export {path_text(held[0])}, where edgekv "
                          f"writes only its pages ({', '.join(AFTERWARDS)}); not written, with or without --force: "
                          "choose a path outside the export")
    if not os.path.lexists(p):
        return
    why = edgekv_wrote(p)
    if why is not None:
        raise EdgekvError(f"{option} {path_text(p)}: exists and edgekv did not write it ({why}); not replaced, "
                          "with or without --force: remove it or choose another name")
    if not force:
        raise EdgekvError(f"{option} {path_text(p)}: exists (an earlier edgekv output: pass --force to replace it, "
                          "or choose another name)")


def check_writable(path: str | Path, option: str, suffixes: tuple[str, ...] | None = None,
                   force: bool = False) -> Path:
    """Before any work starts: may edgekv write a file at path (the output rule above)? Its name fits the file
    system, its folder exists and is writable, it is not inside an export folder (but for the pages edgekv writes
    there), and an existing file there is edgekv's and force is given. suffixes: the allowed name endings (e.g.
    PLOT_FORMATS). Raises one EdgekvError line naming the option; returns the Path."""
    p = Path(path)
    if suffixes is not None and p.suffix.lower() not in suffixes:
        raise EdgekvError(f"{option} {path_text(path)}: the name must end in {', '.join(suffixes)} (it picks the "
                          "format)")
    _check_name(p, option)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise EdgekvError(f"{option} {path_text(path)}: folder {path_text(parent)} does not exist")
    _may_write(p, option, force)
    try:  # a real file, removed at once: permission bits alone do not say it (root, read-only mounts, /proc)
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.probe-{os.getpid()}-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise EdgekvError(f"{option} {path_text(path)}: cannot write in folder {path_text(parent)} "
                          f"({e.strerror or e})") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise EdgekvError(f"{option} {path_text(path)}: the file exists and is not writable")
    return p

def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from open(): 0666 less the umask (0644 under the usual 022)."""
    return 0o666 & ~_umask()


def _tmp_suffix(p: Path) -> str:
    """The temporary's suffix: the target's when short (matplotlib picks the format by it), else none."""
    return p.suffix if 0 < len(p.suffix) <= 8 else ""


def dead_process_entries(folder: Path, patterns) -> list[os.DirEntry]:
    """The entries of folder whose name one of the compiled patterns matches whole, its group 1 a process id that is
    neither this process nor a living one: what a killed edgekv left there (an unreadable folder: none)."""
    from .export.publish import _pid_alive

    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    out = []
    for e in entries:
        m = next((m for m in (pat.fullmatch(e.name) for pat in patterns) if m), None)
        if m is not None and int(m[1]) != os.getpid() and not _pid_alive(int(m[1])):
            out.append(e)
    return out


def clean_stale_temps(path: str | Path) -> list[Path]:
    """Remove the hidden temporaries a killed write to path left beside it: names of edgekv's own patterns
    (write_atomic's `.NAME.tmp-PID-XXXXXXXX[.suffix]`, check_writable's `.NAME.probe-PID-XXXXXXXX`, and
    `.NAME.PID.tmp`, which --save-state used) whose PID is no longer alive (publish.clean_leftovers' test), and only
    plain files. Returns what was removed."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    name = re.escape(p.name)
    pats = (re.compile(rf"\.{name}\.(?:tmp|probe)-(\d+)-[a-z0-9_]{{8}}(?:{re.escape(_tmp_suffix(p))})?"),
            re.compile(rf"\.{name}\.(\d+)\.tmp"))
    removed = []
    for e in dead_process_entries(parent, pats):
        try:
            if e.is_file(follow_symlinks=False):
                os.unlink(e.path)
                removed.append(Path(e.path))
        except OSError:
            pass  # not ours to fight over: the next write tries again
    return removed


def write_atomic(path: str | Path, data: str | bytes = b"", writer=None, option: str | None = None,
                 force: bool = False, package_file: bool = False) -> Path:
    """Write data (or call writer(tmp_path)) to a hidden file of a fresh name beside path, synced, then rename it
    into place: readers see the old file or the whole new one, never a part. Right before the rename an existing
    path is checked again as check_writable checks it (option names it in errors; force: the --force given), so a
    file that appeared meanwhile is never replaced unless edgekv wrote it. Stale temporaries of killed writes to the
    same path are removed first (clean_stale_temps); nothing else beside it is touched. The file gets the mode open()
    would give it. Errors are one EdgekvError line."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    what = f"{option} {path_text(path)}" if option else f"cannot write {path_text(path)}"
    clean_stale_temps(p)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.tmp-{os.getpid()}-", suffix=_tmp_suffix(p), dir=parent)
    except OSError as e:
        raise EdgekvError(f"{what}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            if writer is None:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
        if writer is not None:
            writer(tmp)
        os.chmod(tmp, file_mode())
        if not package_file:  # package_file: a data file of edgekv's own source tree that a dev tool regenerates
            _may_write(p, option or "--out", force)
        os.replace(tmp, p)
    except OSError as e:
        raise EdgekvError(f"{what}: {e.strerror or e}") from None
    finally:
        try:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        except OSError:
            pass  # a folder turned read-only meanwhile: the next write to this path removes it (clean_stale_temps)
    return p
