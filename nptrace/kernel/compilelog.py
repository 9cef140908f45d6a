"""What a bcc compile prints on fd 2, and LLVM ending the process inside one.

capture_stderr() keeps libbcc's diagnostics for the error message, log_tail() picks what of
them to show, and llvm_exits() turns an exit() or fatal error inside LLVM into one line and
exit 2. nptrace/kernel/loader.py compiles (and alone imports bcc: it passes libbcc in as
`llvm_lib`); nothing here imports bcc.
"""
from __future__ import annotations

import ctypes as ct
import os
import re
import tempfile
import threading
from contextlib import contextmanager

from nptrace.errors import LoadError, exit_now

__all__ = ["HOW_TO_REPORT", "capture_stderr", "llvm_exits", "llvm_failure", "llvm_message",
           "log_tail", "map_failure"]


@contextmanager
def capture_stderr():
    """libbcc prints compiler diagnostics straight to fd 2; keep them for the error message
    instead of spraying header warnings over the user's terminal."""
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        box = {"text": "", "saved": saved, "file": tmp}   # the last two for llvm_exits
        try:
            yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box["text"] = tmp.read().decode(errors="replace")


def log_tail(text: str, lines: int = 12) -> str:
    """What to show of a compiler/verifier log: its `error:` lines first (clang prints the
    notes of a macro expansion after them, and those alone would fill the tail), then the
    last lines, warnings left out."""
    keep = [ln for ln in text.splitlines() if ln.strip() and "warning:" not in ln]
    errors = [ln for ln in keep if " error: " in ln or ln.startswith("error: ")]
    rest = [ln for ln in keep if ln not in errors]
    room = lines - len(errors)
    return "\n".join(errors[:lines] + (rest[-room:] if room > 0 else []))


# --- a map the kernel would not create -------------------------------------------------------
# bcc creates every map before it loads a program, and says only "could not open bpf map: NAME,
# error: STRERROR" among the compile's warnings, then raises "Failed to compile BPF module".
# The maps a flag sizes name that flag; the others are fixed sizes, so a refusal of one is the
# kernel's memory (the memory cgroup since 5.11, RLIMIT_MEMLOCK before) or its map limits.
_MAP_REFUSED = re.compile(r"could not open bpf map: (\w+), error: (.+)")
MAP_FLAGS = {"events": ("the event ring buffer", "--ring-pages"),
             "pkt_scratch": ("the packet copy buffer", "--snaplen")}


def map_failure(log: str, sizes: dict[str, str] | None = None) -> str | None:
    """One line for a compile that failed because the kernel refused to create a map, or None.
    ``sizes``: map name -> the size asked for, as the user gave it ("--ring-pages 262144")."""
    m = next((m for ln in log.splitlines() if (m := _MAP_REFUSED.search(ln))), None)
    if m is None:
        return None
    name, why = m.group(1), m.group(2).strip()
    what, flag = MAP_FLAGS.get(name, (None, None))
    asked = (sizes or {}).get(name)
    if flag:
        return (f"the kernel would not create BPF map {name} ({what}"
                f"{', ' + asked if asked else ''}): {why}: lower {flag}, or give nptrace "
                "more locked memory (its memory cgroup's memory.max, or RLIMIT_MEMLOCK before "
                "Linux 5.11)")
    return (f"the kernel would not create BPF map {name}: {why} (a fixed size: the node's "
            "memory cgroup memory.max, RLIMIT_MEMLOCK before Linux 5.11, or the kernel's "
            "map limits)")


# --- LLVM ending the process inside a compile ---------------------------------------------
# LLVM has two ways out of a compile it cannot finish, and bcc 0.26 (LLVM 14) catches neither:
# - an error diagnostic: bcc's LLVMContext has no handler, so LLVMContext::diagnose prints it
#   to fd 2 and calls exit(1). The BPF backend's "Looks like the BPF stack limit of 512 bytes
#   is exceeded", "A call to built-in function 'abort' is not supported", inline-asm errors.
# - report_fatal_error ("Unsupported dynamic stack allocation"): "LLVM ERROR: ..." on fd 2,
#   then abort() (a core, status 134).
# Either would leave no line (fd 2 is captured, capture_stderr) and a status other than 2.
# llvm_exits stands in the way of both for the length of one compile: a C exit handler
# (glibc __cxa_atexit under a handle of our own; glibc passes handlers the exit status) and
# LLVM's fatal-error handler (the C API's LLVMInstallFatalErrorHandler) each put fd 2 back,
# print the one line and exit 2 (errors.exit_now). After the compile the exit handler is taken
# off with __cxa_finalize(handle), which runs it once, disarmed, while the interpreter is
# alive: a ctypes exit handler left registered is called after the interpreter's shutdown at
# a normal exit, and segfaults there. Cost: about 40 us a compile (start-up unchanged). A
# compile in a thread other than the main one gets the fatal-error handler only (the main
# thread could shut the interpreter down under it); a crash inside LLVM (SIGSEGV) is not
# caught.
_EXIT_FN = ct.CFUNCTYPE(None, ct.c_void_p, ct.c_int)
_FATAL_FN = ct.CFUNCTYPE(None, ct.c_char_p)
_LLVM_ERROR = re.compile(r"(?:LLVM ERROR|error): (.+)")   # LLVM's; clang's start with a location
HOW_TO_REPORT = ("nptrace's BPF C does not build with these switches: report it with the "
                 "output of `nptrace dump-bpf` given the same options")


def llvm_message(log: str) -> str:
    """LLVM's last error in a compile's captured stderr, on one line: a backend error's
    source location (always :0:0) and the function's IR signature left out."""
    found = [m.group(1) for ln in log.splitlines() if (m := _LLVM_ERROR.fullmatch(ln.strip()))]
    if not found:
        return log_tail(log, 1).strip() or "nothing printed"
    msg = re.sub(r"^\S+:0:0: ", "", found[-1])
    msg = re.sub(r"^in function (\S+) [^:]*: ", r"in function \1: ", msg)
    return " ".join(msg.split())


def llvm_failure(what: str, how: str, message: str) -> str:
    """The one line of a compile LLVM ended: what failed, LLVM's words, what to do."""
    return f"{what}: LLVM ended the compile ({how}): {message} ({HOW_TO_REPORT})"


_glibc = None


def _glibc_exit_calls():
    """(__cxa_atexit, __cxa_finalize), or () where the C library is not glibc (musl's
    __cxa_finalize does nothing: a handler could not be taken off again)."""
    global _glibc
    if _glibc is None:
        try:
            libc = ct.CDLL(None)
            libc.gnu_get_libc_version       # AttributeError: not glibc
            reg, fin = libc.__cxa_atexit, libc.__cxa_finalize
            reg.argtypes, reg.restype = [_EXIT_FN, ct.c_void_p, ct.c_void_p], ct.c_int
            fin.argtypes, fin.restype = [ct.c_void_p], None
            _glibc = (reg, fin)
        except (OSError, AttributeError):
            _glibc = ()
    return _glibc


def _llvm_fatal_calls(lib):
    """(LLVMInstallFatalErrorHandler, LLVMResetFatalErrorHandler) as `lib` (bcc's libbcc,
    whose dependencies dlsym searches: libLLVM-14) sees them, or ()."""
    try:
        inst, reset = lib.LLVMInstallFatalErrorHandler, lib.LLVMResetFatalErrorHandler
    except AttributeError:
        return ()
    inst.argtypes, inst.restype = [_FATAL_FN], None
    reset.argtypes, reset.restype = [], None
    return inst, reset


@contextmanager
def llvm_exits(box, what: str, llvm_lib=None):
    """Inside capture_stderr()'s `box`: an exit() or LLVM fatal error until the block ends is
    one line naming `what` and LLVM's message, and exit 2 (see above)."""
    armed = [True]

    def die(how: str, message: str = "") -> None:
        if not armed[0]:
            return          # __cxa_finalize taking the handler off after the compile
        armed[0] = False
        try:
            os.dup2(box["saved"], 2)
            box["file"].seek(0)
            message = message or llvm_message(box["file"].read().decode(errors="replace"))
        except Exception:
            message = message or "its message was lost"
        exit_now(LoadError(llvm_failure(what, how, message)))

    def on_exit(_arg, status):
        die(f"exit status {status}")

    def on_fatal(reason):
        die("fatal error", "LLVM ERROR: " + (reason or b"").decode(errors="replace"))

    exits = _glibc_exit_calls() if threading.current_thread() is threading.main_thread() else ()
    fatal = _llvm_fatal_calls(llvm_lib) if llvm_lib is not None else ()
    exit_cb, fatal_cb = _EXIT_FN(on_exit), _FATAL_FN(on_fatal)   # kept alive until the end
    handle = ct.create_string_buffer(1)                         # ours alone: __cxa_finalize's key
    if exits:
        exits[0](exit_cb, None, ct.addressof(handle))
    if fatal:
        fatal[0](fatal_cb)
    try:
        yield
    finally:
        armed[0] = False
        if fatal:
            fatal[1]()
        if exits:
            exits[1](ct.addressof(handle))
