"""NAT as the data path reports it: a NodePort-style DNAT plus masquerade on a node namespace.
The RST the pod sends back crosses the node's egress, where tc reads the skb's conntrack entry:
original tuple client -> node:30080, reply tuple pod:8080 -> the node's masquerade address,
status DST_NAT and SRC_NAT. The netfilter-hook program put the same pair in the kernel's NAT
map at the SYN, so the pod's own reset (no conntrack in its namespace) is linked to the
client's connection."""
import os
import subprocess
import sys
import threading

import pytest

from nodelab import client_node, sh, traced
from nptrace import events as ev

pytestmark = pytest.mark.privileged
PID = os.getpid() % 100000
CLI, NODE, POD = f"npt-natc{PID}", f"npt-natn{PID}", f"npt-natp{PID}"


@pytest.fixture
def nat_lab():
    with client_node("10.98", CLI, NODE, POD):
        sh("ip", "netns", "exec", NODE, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh("ip", "netns", "exec", NODE, "iptables", "-t", "nat", "-A", "PREROUTING", "-p", "tcp",
           "--dport", "30080", "-j", "DNAT", "--to-destination", "10.98.1.5:8080")
        sh("ip", "netns", "exec", NODE, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "np0",
           "-j", "MASQUERADE")
        yield


def connect_refused(n):
    code = ("import socket\n"
            f"for _ in range({n}):\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    try: s.connect(('10.98.0.2', 30080))\n"
            "    except OSError: pass\n"
            "    s.close()\n")
    subprocess.run(["ip", "netns", "exec", CLI, sys.executable, "-c", code], check=True, timeout=30)


def test_dnat_and_masquerade_tuples(nat_lab, tmp_path, monkeypatch):
    with traced(NODE, tmp_path, monkeypatch) as (t, sink):
        if t.nf_links is None:
            pytest.skip("netfilter-hook programs unavailable on this kernel (Linux 6.4+)")
        gen = threading.Thread(target=connect_refused, args=(5,))
        gen.start()
        t.run(duration=3.0)
        gen.join()
        # the kernel's NAT map, written at the SYN: client tuple -> the pod side's tuple
        port = next(l.ev.ct.orig_sport for v in sink.verdicts for l in v.labeled
                    if l.ev.ct is not None and l.ev.ct.orig_dport == 30080)
        peer = t._nat_peer("10.98.0.1", port, "10.98.0.2", 30080)
        nobody = t._nat_peer("10.98.0.1", 1, "10.98.0.2", 30080)
    assert peer is not None and (peer[0], peer[1], peer[2]) == ("10.98.1.5", 8080, "10.98.1.1")
    assert nobody is None
    labeled = [l.ev for v in sink.verdicts for l in v.labeled]
    wire = [e for e in labeled if e.type == ev.EvType.WIRE_RST and e.ct is not None]
    assert wire, [(e.type.name, e.flow) for e in labeled]
    for e in wire:
        c = e.ct
        assert (c.orig_src, c.orig_dst, c.orig_dport) == ("10.98.0.1", "10.98.0.2", 30080)
        assert (c.reply_src, c.reply_sport, c.reply_dst) == ("10.98.1.5", 8080, "10.98.1.1")
        assert c.dnat and c.snat
    # one incident per connection: the pod's RST (no conntrack there) joined the client's flow
    ours = [v for v in sink.verdicts if v.nat is not None and v.nat.orig_dport == 30080]
    assert len(ours) == 5 and all(v.cause == "no_listener" for v in ours), \
        [(v.cause, v.events) for v in sink.verdicts]
    assert all(any(l.ev.type == ev.EvType.RST_SENT for l in v.labeled) for v in ours)
