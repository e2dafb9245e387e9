"""The click group every edgekv command line uses: whatever goes wrong ends in one line on stderr, never a traceback.

- EdgekvError (bad input: a file, a flag, a name) and click's usage errors (a missing option, a bad choice, an
  unknown flag): `edgekv: error: ...`, exit code 2.
- Ctrl-C: `edgekv: interrupted`, exit code 130; SIGTERM or SIGHUP: `edgekv: terminated`, exit code 143, after the
  children the command started are stopped (edgekv.children).
- Output that cannot be written (stdout on a full device, `> /dev/full`; a disk that fills while writing): one
  line, exit code 2; it is the machine's state, not a bug.
- Anything else is a bug in edgekv or in a library it calls: `edgekv: internal error: TYPE: first line`, exit code
  1; EDGEKV_TRACEBACK=1 shows the traceback instead.
"""
from __future__ import annotations

import errno
import os
import sys

import click

from .children import Terminated
from .errors import EdgekvError
from .safetext import printable

TRACEBACK_ENV = "EDGEKV_TRACEBACK"
# --threads of every command: more threads than this is a typo or a hostile value, not a machine (ONNX Runtime and
# XNNPACK create the pool up front, one stack per thread)
MAX_THREADS = 256


def threads_option(help: str):
    """The one -t/--threads option of every command that runs compute: 1..MAX_THREADS, else one line and exit 2."""
    return click.option("-t", "--threads", default=None, type=click.IntRange(1, MAX_THREADS), help=help)


def one_line(text, limit: int | None = 400) -> str:
    """The first non-empty line of text, at most `limit` characters (None: no limit), control characters escaped
    (a message may quote a file name or a value read from a file)."""
    first = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    first = printable(first)
    return first if limit is None or len(first) <= limit else first[:limit - 3] + "..."


def joined(text) -> str:
    """Every non-empty line of text, joined into one, control characters escaped."""
    return printable("; ".join(ln.strip() for ln in str(text).splitlines() if ln.strip()))


def _usage_line(e: click.ClickException) -> str:
    msg = one_line(e.format_message())
    ctx = getattr(e, "ctx", None)
    if isinstance(e, click.UsageError) and ctx is not None:
        msg += f" (see: {ctx.command_path} --help)"
    return msg


MIN_WIDTH = 40  # columns: narrower, a table breaks into a line per character; render at this width, the terminal wraps
MAX_WIDTH = 10_000


def sane_terminal_env() -> None:
    """COLUMNS and LINES as rich reads them: rich takes str.isdigit() for a number, and '²'.isdigit() is true while
    int('²') fails; a value that is not plain ASCII digits is dropped (the terminal's own size then counts), and
    COLUMNS is held within MIN_WIDTH..MAX_WIDTH (COLUMNS=1 printed a table one character per line)."""
    for name in ("COLUMNS", "LINES"):
        v = os.environ.get(name)
        if v is None:
            continue
        if not (v.isascii() and v.isdigit() and len(v) <= 6 and int(v) > 0):
            del os.environ[name]
        elif name == "COLUMNS":
            os.environ[name] = str(min(max(int(v), MIN_WIDTH), MAX_WIDTH))


def argv_text(value: str, what: str) -> str:
    """A command-line argument as the UTF-8 text its bytes are. Python decodes argv with the locale's encoding: under
    LANG=C (ASCII, outside Python's UTF-8 mode) the bytes of 'héllo' arrive as lone surrogates, which os.fsencode
    turns back into the bytes; only bytes that are not UTF-8 are refused."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:  # lone surrogates: bytes the locale's codec could not decode
        pass
    try:
        return os.fsencode(value).decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise EdgekvError(f"{what} is not valid UTF-8 text") from None


def utf8_streams() -> None:
    """Under an ASCII locale (LANG=C outside Python's UTF-8 mode) stdout and stderr would fail on the first non-ASCII
    character (a prompt, a model's text): write UTF-8 there, as Python's UTF-8 mode does for the C locale."""
    import codecs
    for stream in (sys.stdout, sys.stderr):
        try:
            if codecs.lookup(stream.encoding).name == "ascii":
                stream.reconfigure(encoding="utf-8", errors="backslashreplace")
        except (AttributeError, LookupError, TypeError, ValueError, OSError):
            pass  # not a text stream that can be reconfigured (a test's capture)


NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _no_room(e: OSError) -> None:
    """One line for a write the device had no room for, then exit 2. stdout is pointed at /dev/null first: what is
    still in its buffer would otherwise fail again when Python flushes it at exit (a second message, exit 120)."""
    click.echo(f"edgekv: error: cannot write the output: {e.strerror or e}", err=True)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (a test runner's)
        pass
    sys.exit(2)


class Group(click.Group):
    """Every EdgekvError and usage error becomes one line on stderr and exit code 2, never a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        sane_terminal_env()
        utf8_streams()
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        from .children import on_sigterm
        restore = on_sigterm()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:  # `edgekv` alone: the help is the answer
            click.echo(e.ctx.get_help() if e.ctx else e.format_message(), err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:  # usage errors (2), a bad file argument (click.FileError, 1)
            click.echo(f"edgekv: error: {_usage_line(e)}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:  # click's own Ctrl-C / end of input at a prompt
            click.echo("edgekv: interrupted", err=True)
            sys.exit(130)
        finally:
            restore()
        try:  # what is still buffered: `> /dev/full` fails here, not in Python's flush at exit
            sys.stdout.flush()
        except OSError as e:
            if e.errno in NO_ROOM:
                _no_room(e)
            raise
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EdgekvError as e:
            _exit_if_stopped()
            click.echo(f"edgekv: error: {joined(e)}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("edgekv: interrupted", err=True)
            sys.exit(130)
        except Terminated:  # SIGTERM / SIGHUP: the clean-up on the way here stopped the children
            click.echo("edgekv: terminated", err=True)
            raise
        except (click.ClickException, click.exceptions.Exit, click.Abort, SystemExit):
            raise
        except BrokenPipeError:  # `edgekv plan | head`: the reader left, nothing to say
            sys.stderr.close()
            sys.exit(1)
        except Exception as e:  # noqa: BLE001 - a bug, still one line
            _exit_if_stopped()
            if isinstance(e, OSError) and e.errno in NO_ROOM:  # not a bug: a full disk, `> /dev/full`
                _no_room(e)
            if os.environ.get(TRACEBACK_ENV):
                raise
            click.echo(f"edgekv: internal error: {type(e).__name__}: {one_line(e) or '(no message)'} "
                       f"(set {TRACEBACK_ENV}=1 for the traceback)", err=True)
            sys.exit(1)


def _exit_if_stopped() -> None:
    """A signal's handler has run (edgekv.children.STOPPED_BY): the error on the way out is its exit turned into a
    library's error, so the command exits 128 + the signal with its one line, not as that error."""
    from .children import STOPPED_BY
    if STOPPED_BY:
        signum, said = STOPPED_BY[0]
        if not said:
            click.echo("edgekv: terminated", err=True)
        sys.exit(128 + signum)


# One --runtime vocabulary for plan, run, profile and report (docs/cli.md "Runtime names"): each name means the same
# artifact and runtime wherever it is accepted, and both spellings of a runtime are taken everywhere.
#   ort = onnxruntime       edgekv's ONNX on ONNX Runtime (edgekv's own loop over the explicit state)
#   executorch = edgekv-pte edgekv's .pte on ExecuTorch (edgekv's own loop over the explicit state)
#   genai, executorch-runner   the same artifacts through ONNX Runtime GenAI / the calls of ExecuTorch's LLM runner
#   executorch-llama        plan only: ExecuTorch's own Llama export (examples/models/llama), which edgekv does not build
#   llama.cpp, vllm         plan only: those runtimes' own formats, which edgekv does not build
ARTIFACT_RUNTIMES = ("ort", "executorch", "genai", "executorch-runner")  # what run / profile execute
ARTIFACT_SPELLINGS = {"onnxruntime": "ort", "edgekv-pte": "executorch"}
# plan's --runtime -> the planner's key in edgekv/costs/runtimes.json (its "executorch" is ExecuTorch's Llama export)
PLAN_SPELLINGS = {"ort": "onnxruntime", "onnxruntime": "onnxruntime", "executorch": "edgekv-pte",
                  "edgekv-pte": "edgekv-pte", "executorch-llama": "executorch"}
PLAN_FLAG = {"executorch": "executorch-llama", "edgekv-pte": "executorch", "onnxruntime": "ort"}  # planner key -> --runtime


def artifact_runtime(ctx, param, value):
    """click callback: run / profile --runtime, either spelling -> ort, executorch, genai or executorch-runner."""
    return ARTIFACT_SPELLINGS.get(value, value) if value is not None else None


def artifact_runtime_choice() -> click.Choice:
    return click.Choice(list(ARTIFACT_RUNTIMES) + list(ARTIFACT_SPELLINGS))


# run / profile runtimes that are not a plan's: the API that drives an artifact, whose costs are its runtime's
RUNNER_PLANS = {"genai": "ort", "executorch-runner": "executorch"}


class PlanRuntimeChoice(click.Choice):
    """plan --runtime's choices; genai / executorch-runner (run and profile names) are answered with the runtime
    whose costs they run on, not with the list of choices."""

    def convert(self, value, param, ctx):
        if value in RUNNER_PLANS:
            self.fail(f"{value} drives an export made with --runner (edgekv run / profile); it runs on "
                      f"{RUNNER_PLANS[value]}'s costs: plan with --runtime {RUNNER_PLANS[value]}", param, ctx)
        return super().convert(value, param, ctx)


def plan_runtime(ctx, param, value):
    """click callback: plan --runtime, any spelling -> the planner's key."""
    return PLAN_SPELLINGS.get(value, value) if value is not None else None


def plan_flag(key: str) -> str:
    """The --runtime value a user types for the planner's runtime key."""
    return PLAN_FLAG.get(key, key)
