"""Exact counters survive a full ring buffer: with a 4 KiB ring (about 18 records) and no
consumer while 2000 resets happen, the counts map still has all of them, and every counted
event is accounted for as emitted or lost."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from nptrace import counters
from nptrace import events as ev
from nptrace.kernel import ringbuf as rb

pytestmark = pytest.mark.privileged

from loopback import CLOSED_PORT, GENERATOR, TRACEPOINTS, loopback_netns  # noqa: E402


@pytest.fixture
def netns():
    with loopback_netns("npt-ct") as ns:
        yield ns


def settled_snapshot(probes, drops, resets) -> counters.CounterSnapshot:
    """Counts and stats are separate map reads: host traffic between them (or an event between
    its count and its ring outcome) shows as unaccounted; read again until both agree."""
    deadline = time.monotonic() + 5
    while True:
        s = counters.snapshot(probes.counts(), probes.stats(), drops, resets)
        if s.unaccounted == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def test_counts_exact_when_ring_overflows(netns):
    from nptrace import reasons
    from nptrace.kernel import btf, offsets
    from nptrace.config import Config
    from nptrace.kernel.loader import Probes

    ns, inode = netns
    n = 2000
    b = btf.default()
    drops, resets = reasons.load_tables(b)
    probes = Probes(Config(ringbuf_pages=1), offsets.cflags(b), drops, TRACEPOINTS)
    try:
        before = settled_snapshot(probes, drops, resets)
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", GENERATOR,
                            str(n), str(CLOSED_PORT)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and int(r.stdout) == n, r.stderr
        after = settled_snapshot(probes, drops, resets)
        d = counters.delta(before, after)

        assert d.total(type="RST_SENT", netns=inode) == n
        assert d.total(type="RST_SENT", reason="NO_SOCKET", netns=inode) == n
        assert d.total(type="RST_RECV", netns=inode) == n
        assert d.lost > 0
        assert after.emitted + after.lost == after.counted
        assert d.emitted + d.lost == d.counted
        assert counters.loss_line(d) is not None

        # What did fit is readable: a 4 KiB ring holds 18 records of 224 bytes.
        with rb.RingReader(probes.ring_map_fd()) as reader:
            assert reader.data_size == 4096
            got = reader.read_batch()
        assert 0 < len(got) <= 4096 // rb.stride_of(ev.SIZE)
        assert len(got) <= after.emitted
        for t in got:
            ev.from_tuple(t)
        print(f"\n{n} resets: counted {d.counted}, emitted {d.emitted}, lost {d.lost}; "
              f"{len(got)} records left in the ring")
    finally:
        probes.close()


def test_a_full_counts_map_still_counts_every_record(netns):
    """More kinds of record than the counts map has slots: the records that find it full are
    counted in the count_full stat, so counts + count_full is every record (emitted + lost)."""
    from nptrace import reasons
    from nptrace.config import Config
    from nptrace.kernel import btf, offsets
    from nptrace.kernel.loader import Probes

    ns, _inode = netns
    b = btf.default()
    drops, _ = reasons.load_tables(b)
    # two slots: a refused connect alone makes three kinds (the SYN's drop, the RST sent,
    # the RST received)
    probes = Probes(Config(max_counts=2), offsets.cflags(b), drops, TRACEPOINTS)
    try:
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", GENERATOR,
                            "200", str(CLOSED_PORT)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 5
        while True:
            counted = sum(probes.counts().values())
            st = probes.stats()
            if counted + st["count_full"] == st["emitted"] + st["lost"] or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(probes.counts()) <= 2
        assert st["count_full"] > 0, st
        assert counted + st["count_full"] == st["emitted"] + st["lost"], (counted, st)
    finally:
        probes.close()
