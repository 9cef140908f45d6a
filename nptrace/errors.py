"""Typed errors. The CLI maps each to one line on stderr and exit code 2 (cli.py, one place)."""
from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager
from typing import NoReturn

from nptrace.text import printable


class NptraceError(Exception):
    """Expected failure: the message says what failed, the likely cause and what to do."""


class LoadError(NptraceError):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


class InterfaceError(NptraceError):
    pass


class LockError(NptraceError):
    pass


PRIVILEGE_HINT = "needs root or CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN: run with sudo"


class FeatureMissing(NptraceError):
    """A kernel feature is absent. Message format of cilium/ebpf internal/feature.go."""

    def __init__(self, name: str, min_kernel: str | None, hint: str = ""):
        need = f">= {min_kernel}" if min_kernel else "kernel support"
        super().__init__(f"{name} not supported (requires {need})" + (f": {hint}" if hint else ""))
        self.name, self.min_kernel, self.hint = name, min_kernel, hint


class OutputError(NptraceError):
    """An output cannot be written (a full disk, a quota): the run cannot go on as asked."""


# What a write to a full or failing file system raises: ENOSPC, EDQUOT, EFBIG, EIO.
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def output_error(what: str, e: OSError) -> OutputError:
    hint = {errno.ENOSPC: "the file system is full: free space or write elsewhere",
            errno.EDQUOT: "the disk quota is used up: raise it or write elsewhere",
            errno.EFBIG: "the file is at the file system's size limit: write elsewhere"}.get(
                e.errno, "the device failed: check dmesg")
    return OutputError(f"cannot write {what}: {e.strerror} ({hint})")


class PrivilegeError(NptraceError):
    def __init__(self, message: str = PRIVILEGE_HINT):
        super().__init__(message)


EXIT_FAILURE = 1     # an operation that failed (the lab's), not bad input
EXIT_USAGE = 2       # bad input or an environment nptrace cannot work in: one line, exit 2


def error_line(message: str) -> str:
    """The one line every command prints for an expected failure (cli.main, exit_now)."""
    return f"nptrace: error: {printable(message)}"


_SKIPPED_FINALLY: list = []     # exit_now's stand-ins for the finally blocks it skips


@contextmanager
def on_exit_now(cleanup):
    """Within the block, exit_now calls `cleanup()` first: the finally it does not reach
    (tracer.py Tracer.start: its stop, so outputs end with their stop records and the lock is
    released, as after any start-up error)."""
    _SKIPPED_FINALLY.append(cleanup)
    try:
        yield
    finally:
        _SKIPPED_FINALLY.remove(cleanup)


def exit_now(e: NptraceError) -> NoReturn:
    """The mapper's line for `e` and exit 2, now, without unwinding: for a failure inside C
    code that is ending the process (LLVM inside a bcc compile, kernel/loader.py). The
    on_exit_now cleanups run first, and Python's stdout and stderr buffers are flushed, so
    nothing printed or written before is lost; the interpreter's shutdown does not run (it
    cannot, from inside the C call)."""
    try:
        while _SKIPPED_FINALLY:
            try:
                _SKIPPED_FINALLY.pop()()
            except BaseException:
                pass
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        os.write(2, (error_line(" ".join(str(e).split())) + "\n").encode(errors="replace"))
    finally:
        os._exit(EXIT_USAGE)


def one_line_errors(fn=None, *, usage: tuple = (), failures: tuple = ()):
    """Every command's error-to-exit mapper (cli.py, sessions/commands.py, doctor.py, lab/cli.py):
    an NptraceError is one line on stderr and exit 2 (a compile's log tail first), an exception
    of `usage` a click usage error (exit 2, with a pointer to --help), one of `failures` one line
    and exit 1, and a closed stdout pipe (`| head`) a quiet exit 1. Never a traceback."""
    import functools

    import click

    class Fail(click.ClickException):
        exit_code = EXIT_USAGE

    def wrap(f):
        @functools.wraps(f)
        def wrapper(*a, **kw):
            try:
                return f(*a, **kw)
            except usage as e:
                raise click.UsageError(printable(str(e))) from None
            except NptraceError as e:
                tail = getattr(e, "log_tail", "")
                if tail:
                    click.echo(printable(tail), err=True)
                raise Fail(printable(str(e))) from None
            except failures as e:
                raise click.ClickException(printable(str(e))) from None
            except BrokenPipeError:
                quiet_stdout()
                sys.exit(EXIT_FAILURE)
        return wrapper
    return wrap if fn is None else wrap(fn)


def quiet_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush stays silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
