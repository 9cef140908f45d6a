"""LLVM ending the process inside bcc's compile (kernel/loader.py _llvm_exits): one line on
stderr naming the failure and LLVM's message, exit 2, no traceback, no core, and stdout
printed before the compile kept. Both of LLVM's ways out are provoked with real BPF C:
- a 1024-byte stack array: the BPF backend's "BPF stack limit of 512 bytes is exceeded", an
  error diagnostic LLVM answers with exit(1); through `nptrace run --record` itself, the
  program added to a copy of bpf/tracepoints.bpf.c (NPTRACE_BPF_DIR);
- a variable-length array: report_fatal_error("Unsupported dynamic stack allocation"), which
  would abort() (status 134, a core), through loader.compile_families.
Each compile runs in a child process: it is meant to end it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
privileged = pytest.mark.privileged

STACK_HOG = """
/* test_llvm_exit.py: more than the 512-byte BPF stack */
int npt_stack_hog(void *ctx)
{
	volatile char buf[1024];
	for (int i = 0; i < 1024; i++)
		buf[i] = i;
	bpf_probe_read_kernel((void *)buf, sizeof(buf), ctx);
	return 0;
}
"""
VLA = """
#include <uapi/linux/ptrace.h>
int npt_vla(struct pt_regs *ctx)
{
	int n = PT_REGS_PARM1(ctx) & 63;
	volatile char b[n];
	b[0] = 1;
	return b[0];
}
"""
FITS = "int npt_fits(void *ctx) { return 0; }\n"

COMPILE = r"""
import sys
from nptrace.kernel import loader
print("printed before", end="")
loader.compile_families((sys.argv[1],), ["-Wno-ignored-attributes"]).cleanup()
print(" and after")
"""


def _bpf_dir(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "bpf"
    shutil.copytree(ROOT / "bpf", d)
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def _compile(tmp_path: Path, name: str, text: str):
    env = dict(os.environ, NPTRACE_BPF_DIR=str(_bpf_dir(tmp_path, **{name: text})))
    return subprocess.run([sys.executable, "-c", COMPILE, name], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("nptrace: error: ")]
    assert len(errors) == 1 and stderr.splitlines()[-1] == errors[0], stderr
    return errors[0]


@pytest.mark.usefixtures("root_and_bcc")
@privileged
def test_run_with_a_stack_overflow_says_so_and_exits_2(tmp_path):
    tp = (ROOT / "bpf" / "tracepoints.bpf.c").read_text() + STACK_HOG
    env = dict(os.environ, NPTRACE_BPF_DIR=str(_bpf_dir(tmp_path, **{"tracepoints.bpf.c": tp})),
               NPTRACE_LOCK_FILE=str(tmp_path / "lock"))
    ready, rec = tmp_path / "ready", tmp_path / "rec"
    r = subprocess.run([sys.executable, "-m", "nptrace.cli", "run", "--ready-file", str(ready),
                        "--record", str(rec)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    line = _one_error_line(r.stderr)
    assert line.startswith("nptrace: error: BPF compile/load failed: LLVM ended the compile "
                           "(exit status 1): in function npt_stack_hog: Looks like the BPF "
                           "stack limit of 512 bytes is exceeded."), line
    assert "nptrace dump-bpf" in line
    # the rest of stderr is start-up's own log lines, none of the compiler's noise
    assert all(ln.startswith("nptrace: ") for ln in r.stderr.splitlines()), r.stderr
    assert not ready.exists() and r.stdout == ""
    # the session opened before the compile was closed as after any start-up error: it ends
    # with its stop record (errors.on_exit_now ran the tracer's stop)
    rep = subprocess.run([sys.executable, "-m", "nptrace.cli", "report", str(rec)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert rep.returncode == 0 and "no stop record" not in rep.stderr, rep.stderr


@pytest.mark.usefixtures("root_and_bcc")
@privileged
def test_a_fatal_llvm_error_is_one_line_and_exit_2_not_a_core(tmp_path):
    r = _compile(tmp_path, "vla.bpf.c", VLA)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stdout == "printed before"
    line = _one_error_line(r.stderr)
    assert r.stderr == line + "\n"
    assert line.startswith("nptrace: error: BPF compile failed (vla.bpf.c): LLVM ended the "
                           "compile (fatal error): LLVM ERROR: Unsupported dynamic stack "
                           "allocation ("), line


@pytest.mark.usefixtures("root_and_bcc")
@privileged
def test_a_compile_that_fits_leaves_a_normal_exit(tmp_path):
    """The exit handler is gone once the compile is done: the interpreter's own exit after
    it neither segfaults nor prints (a ctypes handler left registered did both)."""
    r = _compile(tmp_path, "fits.bpf.c", FITS)
    assert (r.returncode, r.stdout, r.stderr) == (0, "printed before and after\n", ""), r
