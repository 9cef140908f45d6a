"""What a failed BPF compile shows the user (loader._tail): the error, not only clang's notes."""
from nptrace.kernel.compilelog import log_tail as _tail


def test_a_compile_error_is_shown_before_the_notes_that_follow_it():
    log = "\n".join(["x.h:1:2: warning: attribute ignored",
                     "/virtual/main.c:163:20: error: no member named 'ringbuf_query'"]
                    + [f"    note {i}: expanded from macro" for i in range(30)]
                    + ["2 warnings and 1 error generated."])
    shown = _tail(log).splitlines()
    assert len(shown) == 12 and "error: no member named 'ringbuf_query'" in shown[0]
    assert shown[-1] == "2 warnings and 1 error generated."
    assert not any("warning:" in ln for ln in shown)
    assert _tail("a\nb\nc", 2) == "b\nc"      # no error line: the last lines, as before


# --- LLVM ending the process inside a compile (loader._llvm_exits) ---------------------------
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from nptrace.kernel.compilelog import llvm_failure, llvm_message  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STACK_LOG = "\n".join([
    "In file included from <built-in>:4:",
    "arch/x86/include/asm/ibt.h:77:8: warning: 'nocf_check' attribute ignored",
    "2 warnings generated.",
    "error: /virtual/main.c:0:0: in function npt_too_big i32 (i8*): Looks like the BPF stack "
    "limit of 512 bytes is exceeded. Please move large on stack variables into BPF per-cpu "
    "array map.", "", ""])


def test_llvm_message_is_the_backend_error_without_location_and_signature():
    assert llvm_message(STACK_LOG) == (
        "in function npt_too_big: Looks like the BPF stack limit of 512 bytes is exceeded. "
        "Please move large on stack variables into BPF per-cpu array map.")


def test_llvm_message_keeps_a_real_location_and_fatal_errors():
    assert llvm_message("error: <inline asm>:1:2: invalid register/token name\n") == \
        "<inline asm>:1:2: invalid register/token name"
    assert llvm_message("1 warning generated.\nLLVM ERROR: Unsupported dynamic stack "
                        "allocation\n") == "Unsupported dynamic stack allocation"
    # no line of LLVM's: what _tail would show first (clang's error lines lead)
    assert llvm_message("a\n/virtual/main.c:3:1: error: expected ';'\nb\n") == \
        "/virtual/main.c:3:1: error: expected ';'"
    assert llvm_message("") == "nothing printed"


def test_the_failure_is_one_line_saying_what_to_do():
    line = llvm_failure("BPF compile/load failed", "exit status 1", llvm_message(STACK_LOG))
    assert "\n" not in line and line.startswith("BPF compile/load failed: LLVM ended the compile "
                                                "(exit status 1): in function npt_too_big: ")
    assert "nptrace dump-bpf" in line


# A child that does what LLVMContext::diagnose does inside a compile: print to fd 2 and call
# exit(1) from C, with fd 2 captured and Python output still buffered.
CHILD = r"""
import ctypes, os, sys
from nptrace.kernel import loader
print("printed before", end="")
with loader._capture_stderr() as box, loader._llvm_exits(box, "BPF compile failed"):
    {body}
print(" and after")
sys.exit({code})
"""
C_EXIT = ('os.write(2, b"warning: noise\\nerror: /virtual/main.c:0:0: in function f i32 (i8*): '
          'Looks like the BPF stack limit of 512 bytes is exceeded.\\n"); '
          'ctypes.CDLL(None).exit(1)')


def _child(body: str, code: int = 0):
    return subprocess.run([sys.executable, "-c", CHILD.format(body=body, code=code)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_an_exit_inside_the_compile_is_one_line_and_status_2():
    r = _child(C_EXIT)
    assert r.returncode == 2, r
    assert r.stdout == "printed before"          # flushed, not lost
    assert r.stderr.splitlines() == [
        "nptrace: error: BPF compile failed: LLVM ended the compile (exit status 1): in "
        "function f: Looks like the BPF stack limit of 512 bytes is exceeded. (" +
        loader_hint() + ")"], r.stderr


def test_the_cleanup_a_skipped_finally_would_run_comes_first():
    """errors.on_exit_now: Tracer.start has its stop run there (outputs closed with
    their stop records, the lock released); it runs before the line, and only inside."""
    body = ("from nptrace.errors import on_exit_now\n"
            "    with on_exit_now(lambda: sys.stderr.write('cleaned up\\n')):\n"
            "        with on_exit_now(lambda: print(' [file closed]', end='')):\n"
            "            " + C_EXIT)
    r = _child(body)
    assert r.returncode == 2, r
    assert r.stdout == "printed before [file closed]"
    assert r.stderr.splitlines()[0] == "cleaned up" and len(r.stderr.splitlines()) == 2, r
    assert r.stderr.splitlines()[1].startswith("nptrace: error: BPF compile failed: LLVM ")
    r = _child("from nptrace.errors import on_exit_now\n"
               "    with on_exit_now(lambda: print('never')):\n        pass\n    " + C_EXIT)
    assert r.returncode == 2 and r.stdout == "printed before", r


def loader_hint():
    from nptrace.kernel.compilelog import HOW_TO_REPORT
    return HOW_TO_REPORT


def test_after_the_compile_the_exit_handler_is_gone():
    """The handler is taken off when the block ends: a normal exit (and sys.exit) afterwards
    never calls into the finalized interpreter (the ctypes exit hook that was left
    registered segfaulted there), and fd 2 is the terminal's again."""
    r = _child('os.write(2, b"captured\\n")', 3)
    assert (r.returncode, r.stdout, r.stderr) == (3, "printed before and after\n", ""), r
    r = _child("pass")
    assert (r.returncode, r.stderr) == (0, ""), r
    # two compiles in a row, then a plain C exit outside any compile: status as asked
    r = subprocess.run([sys.executable, "-c", CHILD.format(body="pass", code=0).replace(
        "sys.exit(0)", "with loader._capture_stderr() as b2, loader._llvm_exits(b2, 'x'):\n"
        "    pass\nsys.stdout.flush()\nctypes.CDLL(None).exit(5)")],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert (r.returncode, r.stderr) == (5, ""), r


BCC_MAP_LOG = """arch/x86/include/asm/ibt.h:78:8: warning: 'nocf_check' attribute ignored
extern __noendbr void ibt_restore(u64 save);
2 warnings generated.
could not open bpf map: {name}, error: Cannot allocate memory
"""


def test_a_refused_map_that_a_flag_sizes_names_the_flag():
    from nptrace.kernel.compilelog import map_failure
    line = map_failure(BCC_MAP_LOG.format(name="events"),
                       {"events": "--ring-pages 262144 = 1024 MiB"})
    assert "\n" not in line
    assert line.startswith("the kernel would not create BPF map events (the event ring buffer, "
                           "--ring-pages 262144 = 1024 MiB): Cannot allocate memory: lower "
                           "--ring-pages")
    assert "lower --snaplen" in map_failure(BCC_MAP_LOG.format(name="pkt_scratch"))


def test_a_refused_fixed_map_names_the_kernel_limit_and_no_flag():
    from nptrace.kernel.compilelog import map_failure
    line = map_failure(BCC_MAP_LOG.format(name="cause_counts"))
    assert "cause_counts: Cannot allocate memory" in line and "lower --" not in line
    assert map_failure("error: use of undeclared identifier 'x'\n") is None
