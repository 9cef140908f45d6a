"""The kernel's storm protection (--max-rate / --max-burst, a token bucket per kind of
record for the node, kept per CPU): 3000 resets in a namespace of the test's own with a burst
of 20 and 50 records a second: every reset is still counted exactly, each record is emitted or
sampled, and what reached the ring is no more than the bucket lets through."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.privileged

from loopback import CLOSED_PORT, GENERATOR, TRACEPOINTS, loopback_netns  # noqa: E402
from test_counters_live import settled_snapshot  # noqa: E402


@pytest.fixture
def netns():
    with loopback_netns("npt-rl") as ns:
        yield ns


def test_token_bucket_sends_a_sample_and_counts_all(netns):
    from nptrace import btf, counters, offsets, reasons
    from nptrace.config import Config, per_cpu
    from nptrace.loader import Probes

    ns, inode = netns
    n, burst, rate = 3000, 20, 50
    b = btf.default()
    drops, resets = reasons.load_tables(b)
    probes = Probes(Config(max_rate=rate, max_burst=burst), offsets.cflags(b), drops, TRACEPOINTS)
    try:
        before = settled_snapshot(probes, drops, resets)
        t0 = time.monotonic()
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", GENERATOR,
                            str(n), str(CLOSED_PORT)], capture_output=True, text=True, timeout=60)
        secs = time.monotonic() - t0
        assert r.returncode == 0 and int(r.stdout) == n, r.stderr
        after = settled_snapshot(probes, drops, resets)
        d = counters.delta(before, after)
        assert d.total(type="RST_SENT", netns=inode) == n        # counted: every one
        assert d.sampled > 0 and d.lost == 0
        assert d.emitted + d.sampled == d.counted
        # per kind, the node's burst then its rate, kept per CPU as each CPU's share (rounded
        # up); the test's kinds are RST_SENT and RST_RECV in its namespace (plus whatever the
        # host does meanwhile)
        cpus = os.cpu_count() or 1
        ours = d.total(type="RST_SENT", netns=inode) + d.total(type="RST_RECV", netns=inode)
        bound = 2 * cpus * (per_cpu(burst, cpus) + per_cpu(rate, cpus) * (secs + 1))
        assert d.emitted <= bound + (d.counted - ours), (d.emitted, bound, secs)
        print(f"\n{n} resets in {secs:.2f}s: counted {d.counted}, emitted {d.emitted}, "
              f"sampled {d.sampled} (bound {bound:.0f})")
    finally:
        probes.close()
