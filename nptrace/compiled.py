"""The hot path's modules, compiled by Cython from their own sources where `make setup` could
(setup.py), else run as Python: one source either way.

A compiled module is an extension file beside its .py, which Python's import would prefer
even after the .py changed (a `git pull` without `make setup`). The finder installed here
(nptrace/__init__.py) takes the extension only while it is newer than its source, and the
source otherwise or when NPTRACE_PURE=1; STATE says which each module runs, and why, for
doctor's `hot path` row. This file imports nothing of nptrace: setup.py reads MODULES by path.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

# the per-record path: decode, correlate and label, write the JSON line
MODULES = ("nptrace.events", "nptrace.classify.correlate", "nptrace.classify.flowkey",
           "nptrace.classify.incident", "nptrace.classify.rules",
           "nptrace.sinks.jsonl")
PURE_ENV = "NPTRACE_PURE"     # =1: run the sources as Python (rule a compiled module out)
STATE: dict[str, str] = {}    # module -> "compiled" | "python: why"


def _extension(py: str) -> str | None:
    base = py[:-3]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if os.path.exists(base + suffix):
            return base + suffix
    return None


class Finder:
    """A meta-path finder for MODULES only: the extension when it is current, else the source."""

    def find_spec(self, name, path=None, target=None):
        if name not in MODULES or not path:
            return None
        leaf = name.rpartition(".")[2]
        for d in path:
            py = os.path.join(d, leaf + ".py")
            if os.path.exists(py):
                break
        else:
            return None
        ext = _extension(py)
        if os.environ.get(PURE_ENV) == "1":
            why = f"{PURE_ENV}=1"
        elif ext is None:
            why = "not compiled (make setup compiles it with Cython)"
        elif os.path.getmtime(ext) < os.path.getmtime(py):
            why = "its source is newer than its compiled form (run make setup)"
        else:
            STATE[name] = "compiled"
            return importlib.util.spec_from_file_location(name, ext)
        STATE[name] = f"python: {why}"
        return importlib.util.spec_from_file_location(name, py)


def install() -> None:
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, Finder())


def hot_path() -> str:
    """doctor's `hot path` value: "compiled" when every module runs compiled, else
    "python: <module>: <why>" for the first one that does not (importing them)."""
    import importlib
    for m in MODULES:
        importlib.import_module(m)
    slow = [m for m in MODULES if STATE.get(m, "python: imported before the finder") != "compiled"]
    if not slow:
        return "compiled"
    why = STATE.get(slow[0], "python: imported before the finder")[len("python: "):]
    return f"python: {slow[0]}: {why}" + (f" (and {len(slow) - 1} more)" if len(slow) > 1 else "")
