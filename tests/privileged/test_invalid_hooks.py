"""conntrack-INVALID drops in INPUT and in FORWARD: each hint names the rule that dropped.

A node namespace has a firewall's `-A INPUT -m conntrack --ctstate INVALID -j DROP` and
kube-proxy's `-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP` (nf_conntrack_tcp_loose=0,
so a bare ACK without a connection is INVALID). A client sends one bare ACK to the node's own
address (INPUT: delivered locally) and one to a pod behind it (FORWARD: routed); nptrace must
label both conntrack_invalid, each with its own chain in the hint."""
import os
import socket
import struct
import subprocess
import sys

import pytest

from nptrace.config import Config, IfaceSpec
from nptrace.tracer import Tracer

pytestmark = pytest.mark.privileged
PID = os.getpid() % 100000
CLI, NODE, POD = f"npt-invc{PID}", f"npt-invn{PID}", f"npt-invp{PID}"


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def lab():
    made = []
    try:
        for ns in (CLI, NODE, POD):
            sh("ip", "netns", "add", ns)
            made.append(ns)
        sh("ip", "link", "add", "c0", "netns", CLI, "type", "veth", "peer", "name", "nc0", "netns", NODE)
        sh("ip", "link", "add", "p0", "netns", POD, "type", "veth", "peer", "name", "np0", "netns", NODE)
        for ns, dev, addr in ((CLI, "c0", "10.97.0.1/24"), (NODE, "nc0", "10.97.0.2/24"),
                              (NODE, "np0", "10.97.1.1/24"), (POD, "p0", "10.97.1.5/24")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", CLI, "route", "add", "default", "via", "10.97.0.2")
        sh("ip", "-n", POD, "route", "add", "default", "via", "10.97.1.1")
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
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _csum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def bare_ack(src: str, dst: str, sport: int, dport: int) -> bytes:
    """A TCP ACK (no SYN) of no connection: conntrack with tcp_loose=0 calls it INVALID."""
    hdr = struct.pack("!HHIIBBHHH", sport, dport, 1000, 2000, 5 << 4, 0x10, 64240, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(hdr))
    c = _csum(pseudo + hdr)
    return hdr[:16] + struct.pack("!H", c) + hdr[18:]


SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
s.sendto(bytes.fromhex(sys.argv[2]), (sys.argv[1], 0))
"""


def send(dst: str, dport: int, sport: int):
    pkt = bare_ack("10.97.0.1", dst, sport, dport).hex()
    subprocess.run(["ip", "netns", "exec", CLI, sys.executable, "-c", SEND, dst, pkt],
                   check=True, timeout=10)


class Collect:
    def __init__(self):
        self.verdicts = []

    def write(self, v):
        self.verdicts.append(v)

    def close(self):
        pass


def test_invalid_drop_hint_names_input_or_forward(lab, tmp_path, monkeypatch):
    monkeypatch.setenv("NPTRACE_LOCK_FILE", str(tmp_path / "lock"))
    monkeypatch.setenv("NPTRACE_STATE_DIR", str(tmp_path / "state"))
    sink = Collect()
    t = Tracer(Config(ifaces=(IfaceSpec(NODE, "nc0"),)), [sink])
    t.status_every = 0
    t.start()
    try:
        t.run(duration=0.5)
        for _ in range(3):
            send("10.97.0.2", 30080, 41001)     # the node's own address: INPUT
            send("10.97.1.5", 8080, 41002)      # a pod behind the node: FORWARD
        t.run(duration=3.0)
    finally:
        t.stop()
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
