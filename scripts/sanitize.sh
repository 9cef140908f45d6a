#!/usr/bin/env bash
# make sanitize: the hot path's Cython modules (nptrace/compiled.py's MODULES) built once more
# with AddressSanitizer and UBSan, into build/asan/ only, then the unit tests that drive them
# run against that build under the sanitizers' runtimes. Any sanitizer report fails it.
#   - The extensions `make setup` put beside the sources are never touched: the sanitized ones
#     go to build/asan/lib/, beside a copy of the package's sources, and the test process
#     imports nptrace from that copy alone. The import finder (nptrace/compiled.py), unchanged,
#     takes each extension there because it is newer than its copied source; a check inside
#     the test process fails the run unless every module came from a sanitized .so there.
#   - setup.py drives the build, as in `make setup`, with the same Cython version (the image's
#     hash-pinned one, deploy/requirements-build.txt, installed into build/asan/tools); only
#     the compiler flags, the output directories and `optional` (a module that fails to build
#     must fail here, not run as Python) differ.
#   - CPython itself is not sanitized: the runtimes are preloaded (gcc's libasan, libubsan),
#     leak detection is off (the interpreter's own allocations would drown the report), and
#     PYTHONMALLOC=malloc sends every object through ASan's allocator, so an object freed while
#     compiled code still uses it is reported, not silently reused from a Python arena.
# Exit 2, with one line saying what is missing, without gcc, its sanitizer runtimes, Python's
# headers, the venv's pytest or Cython.
set -euo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
PY=.venv/bin/python
out=build/asan
lib=$out/lib
reports=$top/$out/reports
FLAGS=("-fsanitize=address,undefined" -fno-omit-frame-pointer -O1 -g)
# the unit tests of the compiled modules (decode, correlate and label, the JSON lines), none of
# which starts a subprocess (it would inherit the preloaded runtimes) or measures memory
TESTS=()
for t in mutating_callbacks events classify label_memo pipeline_batch collapse oncall_output \
         bounded_state client_keys dualstack keylabel nf_cause conntrack_full_rule ipvs \
         fuzz_rules service_naming_scale explain_predict filter_logic offline pcap_packets; do
    TESTS+=("tests/unit/test_$t.py")
done
# SANITIZE_TESTS="tests/unit/test_x.py ..." runs others instead
if [ -n "${SANITIZE_TESTS:-}" ]; then read -ra TESTS <<<"$SANITIZE_TESTS"; fi

lacks() { echo "sanitize: cannot run without $*" >&2; exit 2; }

if [ ! -x "$PY" ] || ! "$PY" -c 'import pytest' 2>/dev/null; then
    lacks "the venv's pytest ($PY: run make setup)"
fi
command -v gcc >/dev/null || lacks "gcc (apt-get install gcc)"
runtime() {   # the shared runtime gcc links a sanitizer with, resolved to its file
    local f
    f=$(gcc -print-file-name="$1")
    [ "$f" != "$1" ] && [ -e "$f" ] && readlink -f "$f"
}
asan=$(runtime libasan.so) || lacks "gcc's libasan.so (apt-get install libasan8 libgcc-12-dev)"
ubsan=$(runtime libubsan.so) || lacks "gcc's libubsan.so (apt-get install libubsan1 libgcc-12-dev)"
"$PY" -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
    2>/dev/null || lacks "Python's headers (apt-get install python3-dev)"
if ! PYTHONPATH=$out/tools "$PY" -c 'import Cython.Build' 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$out/tools" \
        --require-hashes -r deploy/requirements-build.txt >&2 || true
fi
PYTHONPATH=$out/tools "$PY" -c 'import Cython.Build' 2>/dev/null \
    || lacks "Cython (pip could not install deploy/requirements-build.txt's into $out/tools)"

echo "sanitize: building ${FLAGS[*]} into $lib" >&2
PYTHONPATH=$out/tools "$PY" -W ignore::FutureWarning - "$lib" "$out/temp" "$out/c" "${FLAGS[@]}" <<'EOF'
import os
import runpy
import shutil
import sys

import Cython.Build

lib, temp, cdir, *flags = sys.argv[1:]
shutil.rmtree(lib, ignore_errors=True)
# copy2 keeps the sources' times: the extensions built next are newer, as in the work tree
shutil.copytree("nptrace", os.path.join(lib, "nptrace"), ignore=shutil.ignore_patterns(
    "*.so", "__pycache__"))
cythonize = Cython.Build.cythonize


def sanitized(modules, **kw):
    kw["build_dir"] = cdir           # setup.py's generated C (build/cython) stays as it is
    exts = cythonize(modules, **kw)
    for e in exts:
        # setup.py's -O2 would come after, and win over, CFLAGS: replaced here
        e.extra_compile_args = flags + [a for a in e.extra_compile_args if not a.startswith("-O")]
        e.extra_link_args = [f for f in flags if f.startswith("-fsanitize")]
        e.optional = False
    return exts


Cython.Build.cythonize = sanitized
sys.argv = ["setup.py", "-q", "build_ext", "--build-lib", lib, "--build-temp", temp,
            "-j", str(os.cpu_count() or 1)]
runpy.run_path("setup.py", run_name="__main__")
EOF
find "$lib" -name '*.so' | while read -r so; do
    syms=$(nm -D --undefined-only "$so")
    if ! grep -q __asan_report <<<"$syms" || ! grep -q __ubsan_handle <<<"$syms"; then
        echo "sanitize: $so is not instrumented by ASan and UBSan" >&2
        exit 1
    fi
done

# the check the test process makes first: every compiled module from a sanitized .so here
mkdir -p "$out/plugin"
cat >"$out/plugin/nptrace_sanitized.py" <<'EOF'
"""pytest plugin of scripts/sanitize.sh: the run stops unless each module nptrace/compiled.py
lists was imported from a sanitized extension under NPTRACE_SANITIZED_LIB."""
import ctypes
import importlib
import os

import pytest

# UBSan's reports to a file, set through its runtime, at the plugin's import (before any module
# of nptrace): gcc 12's libubsan ignores UBSAN_OPTIONS' log_path, and a report printed to
# stderr by a test that passes would stay in pytest's capture, unseen.
ctypes.CDLL(os.environ["NPTRACE_UBSAN_RUNTIME"]).__sanitizer_set_report_path(
    os.environ["NPTRACE_UBSAN_LOG"].encode())


@pytest.hookimpl(trylast=True)       # after the terminal reporter it prints with
def pytest_configure(config):
    from nptrace import compiled
    lib = os.path.realpath(os.environ["NPTRACE_SANITIZED_LIB"]) + os.sep
    tw = config.get_terminal_writer()
    bad = []
    for name in compiled.MODULES:
        f = os.path.realpath(importlib.import_module(name).__file__)
        tw.line(f"sanitize: {name} from {f}")
        if not (f.startswith(lib) and f.endswith(".so") and compiled.STATE.get(name) == "compiled"):
            bad.append(f"{name}: {f} ({compiled.STATE.get(name)})")
    if bad:
        raise pytest.UsageError("not the sanitized build: " + "; ".join(bad))
EOF

rm -rf "$reports" && mkdir -p "$reports"
start=$(date +%s)
set +e
env -u NPTRACE_PURE \
    LD_PRELOAD="$asan $ubsan${LD_PRELOAD:+ $LD_PRELOAD}" \
    ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:print_summary=1:log_path=$reports/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=0" \
    NPTRACE_UBSAN_RUNTIME="$ubsan" NPTRACE_UBSAN_LOG="$reports/ubsan" \
    PYTHONMALLOC=malloc PYTHONSAFEPATH=1 PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH="$top/$lib:$top:$top/$out/plugin" NPTRACE_SANITIZED_LIB="$top/$lib" \
    NPTRACE_BPF_DIR="$top/bpf" \
    "$PY" -m pytest -q -p no:cacheprovider -p nptrace_sanitized \
    "${TESTS[@]}"
rc=$?
set -e
# UBSan goes on after a report (all of them are wanted); ASan stops at its first. Either way
# a report file fails the run, whatever pytest said.
found=$(find "$reports" -type f -size +0 | sort)
if [ -n "$found" ]; then
    for f in $found; do echo "=== $f" >&2; cat "$f" >&2; done
    echo "sanitize: FAILED: $(echo "$found" | wc -l) sanitizer report(s) (pytest exit $rc)" >&2
    exit 1
fi
# exit 1, not pytest's own code: 2 here says a tool is missing
[ "$rc" = 0 ] || { echo "sanitize: FAILED: pytest exit $rc, no sanitizer report" >&2; exit 1; }
echo "sanitize: clean: no ASan or UBSan report ($(($(date +%s) - start)) s of tests)" >&2
