"""Where an export goes: never over what edgekv did not write, never half-written.

An export is written into a temporary sibling folder (`.NAME.tmp-PID`, marked by manifest.PARTIAL until publish) and
renamed into place at the end (publish). check_out refuses an --out that is not an earlier edgekv export
(manifest.owned_export) unless it does not exist; publish checks again right before the rename, which is atomic
(renameat2 RENAME_NOREPLACE where the kernel has it) and keeps a replaced export that is no longer only edgekv's.
clean_leftovers removes what a killed run left (marked tmp folders and `.NAME.old-PID` exports of dead PIDs).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import EdgekvError
from .manifest import PARTIAL


def _resolved(p: Path) -> Path:
    return Path(os.path.abspath(p)).resolve()


def check_out(out: Path, model: str, force: bool) -> None:
    """Refuse an --out that is, or holds, the model being exported or the working folder, and an existing --out
    unless --force and it is an edgekv export holding nothing else (manifest.owned_export). One line each."""
    from .manifest import owned_export

    target = _resolved(out)
    src = Path(model)
    if src.exists():
        s = _resolved(src)
        if target == s or s.is_relative_to(target):
            raise EdgekvError(f"--out {out} is {'the model' if target == s else 'a folder holding the model'} "
                              f"{model}: choose a new folder for the export")
    if Path.cwd().resolve().is_relative_to(target):
        raise EdgekvError(f"--out {out} is the working folder or one above it: choose a new folder for the export")
    if not os.path.lexists(out):
        return
    if not force:
        raise EdgekvError(f"{out} already exists (pass --force to replace an earlier edgekv export)")
    why = owned_export(out)
    if why:
        raise EdgekvError(f"--force replaces only an earlier edgekv export, and {out} is not one ({why}); "
                          "nothing was changed")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def clean_leftovers(out: Path) -> list[Path]:
    """Remove what an earlier export to `out` left when it was killed: `.NAME.tmp-PID` folders still marked as
    partial (PARTIAL) and `.NAME.old-PID` folders that are edgekv exports, of processes no longer alive. Returns
    what was removed; anything else of that name is left alone."""
    import re

    from .manifest import owned_export

    removed = []
    pat = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-(\d+)$")
    try:
        siblings = list(out.parent.iterdir())
    except OSError:
        return removed
    for p in siblings:
        m = pat.match(p.name)
        pid = int(m[2]) if m else 0  # this process's own pid: left by an earlier export in this process
        if not m or (pid != os.getpid() and _pid_alive(pid)) or p.is_symlink() or not p.is_dir():
            continue
        ours = (p / PARTIAL).is_file() if m[1] == "tmp" else owned_export(p) is None
        if ours:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _remove_partial(tmp: Path) -> None:
    """Remove this run's own temporary folder (it carries PARTIAL until publish)."""
    if tmp.is_dir() and not tmp.is_symlink() and (tmp / PARTIAL).is_file():
        shutil.rmtree(tmp, ignore_errors=True)


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(src, dst) that fails if dst exists, atomically where the kernel offers it (Linux renameat2 with
    RENAME_NOREPLACE); elsewhere a check right before the rename."""
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        at_fdcwd, noreplace = -100, 1
        if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, "exists", str(dst))
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "exists", str(dst))
    os.rename(src, dst)


def publish(tmp: Path, out: Path, model: str, force: bool, echo=print) -> None:
    """Move the finished folder tmp to out. Right before, --out is checked again as at the start (check_out): a
    folder that appeared meanwhile is refused, and with --force only an edgekv export is replaced: moved aside
    (`.NAME.old-PID`), the new one renamed into place (never over anything), the old one removed once it is seen to
    be still only an edgekv export. Every file gets the mode open() gives (0644 under umask 022)."""
    from ..outputs import file_mode

    try:
        check_out(out, model, force)
    except EdgekvError as e:
        raise EdgekvError(f"checked again before publishing: {e}") from None
    mode = file_mode()
    for p in tmp.rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)
    old = None
    if os.path.lexists(out):  # --force, and check_out saw an edgekv export
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    try:
        _rename_noreplace(tmp, out)
    except FileExistsError:
        if old is not None and not os.path.lexists(out):
            os.rename(old, out)
        raise EdgekvError(f"{out} appeared while exporting (another export or program wrote it); it was left as "
                          "it is and nothing was published") from None
    except OSError:
        if old is not None and not os.path.lexists(out):
            os.rename(old, out)
        raise
    (out / PARTIAL).unlink()
    if old is not None:
        from .manifest import owned_export
        why = owned_export(old)
        if why is None:
            shutil.rmtree(old, ignore_errors=True)
        else:
            echo(f"kept the replaced export at {old}: {why}")


def _make_parents(out: Path) -> list[Path]:
    """Create out's missing parent folders; return the ones made, innermost first."""
    made = []
    p = out.parent
    while not p.exists():
        made.append(p)
        p = p.parent
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EdgekvError(f"cannot write {out}: {e.strerror or e}") from None
    return made
