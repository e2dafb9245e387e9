"""Every child process an edgekv command starts dies with it.

Two halves, both needed:
- in the child, die_with_parent(): on Linux the kernel signals the child when the process that started it dies
  (prctl PR_SET_PDEATHSIG), whatever killed it, SIGKILL included. subprocess children get it through
  `preexec_fn=child_setup()`; torch.multiprocessing ranks call it first thing.
- in the parent, on_sigterm(): SIGTERM (and SIGHUP, a closed terminal) become a Terminated exception in the main
  thread, so the code that started children unwinds through its own clean-up: subprocess.run kills its child,
  `edgekv ring` terminates its ranks, temporary folders are removed. The command then exits 143 (128 + SIGTERM)
  with one line, as Ctrl-C exits 130.
Elsewhere than Linux die_with_parent does nothing and the parent's handler alone stops the children.
"""
from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Terminated(SystemExit):
    """Raised in the main thread when the command receives SIGTERM or SIGHUP; exits 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def _prctl():
    """libc's prctl, or None (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM, prctl=None) -> None:
    """In a child: have the kernel send `sig` when its parent dies (Linux; elsewhere nothing). parent: the pid the
    child was started by; if that process is already gone (it died before the request was made, and the kernel would
    never signal), the child signals itself. prctl: libc's, looked up beforehand (child_setup)."""
    prctl = prctl or _prctl()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(sig))
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def child_setup():
    """preexec_fn for subprocess.run / Popen: the child dies with this process (die_with_parent). libc is looked up
    here, in the parent: between fork and exec the child only makes the call (no dlopen, whose lock another thread
    of the parent may hold at the fork)."""
    parent, prctl = os.getpid(), _prctl()
    return lambda: die_with_parent(parent, prctl=prctl) if prctl is not None else None


# the signal that stopped this command, once its handler has run (_raise, the export's own): the SystemExit a handler
# raises can land inside a library's callback that turns it into its own error (safetensors' reader gave "could not
# determine the shape of object type 'torch.storage.UntypedStorage'"), and edgekv.clibase then exits 128 + it for
# whatever error comes out, not as that error: (signal, whether its handler printed its own line)
STOPPED_BY: list[tuple[int, bool]] = []


def stopped(signum: int, said: bool = False) -> None:
    """Record that `signum` is stopping this command (STOPPED_BY); said: the handler printed the command's line."""
    if not STOPPED_BY:
        STOPPED_BY.append((signum, said))


def _raise(signum, frame):
    stopped(signum)
    raise Terminated(signum)


def on_sigterm():
    """In the main thread of a command: SIGTERM and SIGHUP raise Terminated, so clean-up code runs and the children
    it started are stopped. A signal already ignored (nohup's SIGHUP) stays ignored. Returns a function that puts
    the previous handlers back (a command run inside another program, as click's test runner does)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            before[sig] = signal.signal(sig, _raise)

    def restore():
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
    return restore
