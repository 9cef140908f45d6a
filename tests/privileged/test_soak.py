"""The short soak (the 10-minute one is `make bench`, section soak): one
nptrace with --record and --metrics-addr under >= 3000 new failing flows/s and a pod created
and deleted every second holds RSS within 10% after warm-up and its fd count flat."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.privileged, pytest.mark.long]

SECS = float(os.environ.get("NPTRACE_SOAK_SECS", "75"))


def test_soak_bounded_rss_and_fds(root_and_bcc, tmp_path):
    from nptrace.bench.context import Bench
    from nptrace.bench.soak import soak
    b = Bench(quick=True, logdir=tmp_path)
    d = soak(b, secs=SECS, rate=3000, step=2.0, warmup=SECS / 3)
    summary = {k: v for k, v in d.items() if k != "samples"}
    print("soak:", summary)
    print("samples:", [(x["t"], x["rss"] >> 20, x["fds"]) for x in d["samples"]])
    assert not d["killed"], summary
    assert d["pods_created"] >= SECS * 0.6 and d["pod_errors"] <= 2, summary
    assert d["flows_sent"] and d["flows_sent"] >= 3000 * SECS * 0.8, summary
    assert d["decoded"] and d["decoded"] >= d["flows_sent"], summary   # >= 1 event a flow
    assert d["rss_ok"], summary
    assert d["fds_ok"], summary
