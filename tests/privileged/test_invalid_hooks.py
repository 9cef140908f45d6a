"""conntrack-INVALID drops in INPUT and in FORWARD: each hint names the rule that dropped.

A node namespace has a firewall's `-A INPUT -m conntrack --ctstate INVALID -j DROP` and
kube-proxy's `-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP` (nf_conntrack_tcp_loose=0,
so a bare ACK without a connection is INVALID). A client sends one bare ACK to the node's own
address (INPUT: delivered locally) and one to a pod behind it (FORWARD: routed); nptrace must
label both conntrack_invalid, each with its own chain in the hint."""
import os

import pytest

from nodelab import bare_ack, client_node, send_raw, sh, traced

pytestmark = pytest.mark.privileged
PID = os.getpid() % 100000
CLI, NODE, POD = f"npt-invc{PID}", f"npt-invn{PID}", f"npt-invp{PID}"


@pytest.fixture
def lab():
    with client_node("10.97", CLI, NODE, POD):
        ipt = ["ip", "netns", "exec", NODE, "iptables"]
        sh(*ipt, "-N", "KUBE-FORWARD")
        sh(*ipt, "-A", "FORWARD", "-m", "comment", "--comment", "kubernetes forwarding rules",
           "-j", "KUBE-FORWARD")
        sh(*ipt, "-A", "KUBE-FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")
        sh(*ipt, "-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "ACCEPT")
        sh(*ipt, "-A", "INPUT", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")
        for k, v in (("net.ipv4.ip_forward", 1), ("net.netfilter.nf_conntrack_tcp_loose", 0),
                     ("net.netfilter.nf_conntrack_tcp_be_liberal", 0)):
            sh("ip", "netns", "exec", NODE, "sysctl", "-qw", f"{k}={v}")
        yield


def send(dst: str, dport: int, sport: int):
    send_raw(CLI, dst, bare_ack("10.97.0.1", dst, sport, dport))


def test_invalid_drop_hint_names_input_or_forward(lab, tmp_path, monkeypatch):
    with traced(NODE, tmp_path, monkeypatch) as (t, sink):
        t.run(duration=0.5)
        for _ in range(3):
            send("10.97.0.2", 30080, 41001)     # the node's own address: INPUT
            send("10.97.1.5", 8080, 41002)      # a pod behind the node: FORWARD
        t.run(duration=3.0)
    got = {}
    for v in sink.verdicts:
        e = v.event
        if e.dport in (30080, 8080) and e.sport in (41001, 41002):
            got.setdefault(e.dport, v)
    assert set(got) == {30080, 8080}, [(v.cause, v.event.flow, v.hint) for v in sink.verdicts]
    assert got[30080].cause == "conntrack_invalid", got[30080].hint
    assert "filter/INPUT rule 2" in got[30080].hint, got[30080].hint
    assert got[8080].cause == "conntrack_invalid", got[8080].hint
    assert "filter/KUBE-FORWARD rule 1" in got[8080].hint, got[8080].hint
