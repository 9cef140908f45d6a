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
    from nptrace import counters, reasons
    from nptrace.kernel import btf, offsets
    from nptrace.config import Config, per_cpu
    from nptrace.kernel.loader import Probes

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


# Bare RSTs to the closed port from distinct source ports: each is a flow of one record, a
# drop (NO_SOCKET: a reset is never answered), so they use up the drop kind's bucket alone.
RAW_RESETS = r"""
import socket, struct, sys
n, port, base = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
lo = socket.inet_aton("127.0.0.1")
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16:
        s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
for i in range(n):
    h = struct.pack("!HHIIBBHHH", base + i, port, 1000 + i, 0, 5 << 4, 0x04, 0, 0, 0)
    c = csum(lo + lo + struct.pack("!BBH", 0, 6, len(h)) + h)
    s.sendto(h[:16] + struct.pack("!H", c) + h[18:], ("127.0.0.1", 0))
print(n)
"""


def test_sample_is_of_flows_not_of_records(netns):
    """A refused connect makes three records of three kinds: tcp_send_reset, the SYN's drop,
    tcp_receive_reset. With the drop kind's bucket already empty (bare resets) and the other
    two full, a per-record sample would send some connections' resets without their drop;
    the kernel keeps a flow whole: all three records of a connection, or none."""
    from nptrace import counters, reasons
    from nptrace.kernel import btf, offsets
    from nptrace import events as ev
    from nptrace.kernel import ringbuf as rb
    from nptrace.config import Config
    from nptrace.kernel.loader import Probes
    from test_ringbuf_live import baseline, drain_until_settled

    ns, inode = netns
    b = btf.default()
    drops, resets = reasons.load_tables(b)
    # per CPU: a burst of 10 and 1 record/s, so nothing refills during the test
    probes = Probes(Config(max_rate=1, max_burst=20), offsets.cflags(b), drops, TRACEPOINTS)
    pin = ["taskset", "-c", "0", "ip", "netns", "exec", ns, sys.executable, "-c"]
    try:
        got: list = []
        with rb.RingReader(probes.ring_map_fd()) as reader:
            before = baseline(probes, reader)
            snap0 = settled_snapshot(probes, drops, resets)
            for script, args in ((RAW_RESETS, ["200", str(CLOSED_PORT), "40000"]),
                                 (GENERATOR, ["100", str(CLOSED_PORT)])):
                r = subprocess.run(pin + [script] + args, capture_output=True, text=True,
                                   timeout=60)
                assert r.returncode == 0 and int(r.stdout) == int(args[0]), r.stderr
            stats = drain_until_settled(probes, reader, got, before["emitted"])
            d = counters.delta(snap0, settled_snapshot(probes, drops, resets))
    finally:
        probes.close()
    assert d.total(type="RST_SENT", netns=inode) == 100 and d.lost == 0
    flows: dict[int, set] = {}
    for t in got:
        e = ev.from_tuple(t)
        if e.netns != inode or CLOSED_PORT not in (e.sport, e.dport):
            continue
        client = e.dport if e.sport == CLOSED_PORT else e.sport
        if client < 40000 or client >= 40200:         # the connects', not the bare resets'
            flows.setdefault(client, set()).add(e.type)
    whole = {ev.EvType.RST_SENT, ev.EvType.DROP, ev.EvType.RST_RECV}
    broken = {c: sorted(k.name for k in kinds) for c, kinds in flows.items() if kinds != whole}
    assert flows and not broken, broken
    assert stats.get("flow_kept", 0) - before.get("flow_kept", 0) > 0   # drops sent on credit
    print(f"\n{len(flows)} of 100 connections sent whole, the rest not at all; "
          f"{stats['flow_kept'] - before.get('flow_kept', 0)} records on their flow's credit")
