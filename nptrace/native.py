"""The hot path's compiled helpers (issue #16 item 3): optional C extensions that setup.py
builds beside the modules they speed up (events_fast.c; classify/correlate_fast.c with
feed_fast.c; sinks/jsonl_fast.c with jsonl_multi.c and jsonl_seconds.c). Each module keeps its
pure-Python path as the reference and as the fallback where the helper was not built; doctor's
`hot path` row says which runs."""
from __future__ import annotations

import importlib
import os

PURE_ENV = "NPTRACE_PURE"     # =1: the pure paths (tests compare the two; an SRE can rule a helper out)


# What each helper must define: a module built from older sources (a `git pull` without
# `make setup`) lacks the newer ones, and is then not used rather than failing the import.
# verdict_slots marks a build that stores Verdict's fields as slots (session 11).
ENTRY_POINTS = {
    "nptrace.events_fast": ("configure", "decode_many"),
    "nptrace.classify.correlate_fast": ("configure", "one", "configure_feed", "feed_many",
                                        "verdict_slots", "rootless", "make_verdict", "service"),
    "nptrace.sinks.jsonl_fast": ("configure", "one_line", "lines", "configure_multi",
                                 "multi_line", "configure_verdict"),
}


def missing(mod) -> list[str]:
    """The entry points the imported helper lacks (ENTRY_POINTS)."""
    return [n for n in ENTRY_POINTS.get(mod.__name__, ()) if not hasattr(mod, n)]


def load(module: str):
    """The helper module, or None when it is not built, built from older sources, or
    PURE_ENV=1 (ImportError of a helper that is built but does not load is None too: doctor
    says why)."""
    if os.environ.get(PURE_ENV) == "1":
        return None
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return None if missing(mod) else mod
