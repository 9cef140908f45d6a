"""checksum end to end: segments with a bad TCP checksum reach a node namespace, its TCP stack
drops them (kfree_skb TCP_CSUM) and nptrace labels them `checksum`, naming the interface.

The corruption is made on the sender: this kernel has neither act_pedit nor act_csum
(CONFIG_NET_ACT_PEDIT/CSUM unset) for a tc rewrite after the checksum, so the client writes the
segment itself through a raw socket with its checksum off by one. The receiving side is the
kernel's own path: veth does not mark received packets CHECKSUM_UNNECESSARY (since Linux 4.6),
so tcp_v4_rcv verifies and drops with TCP_CSUM."""
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
CLI, NODE = f"npt-csc{PID}", f"npt-csn{PID}"


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def lab():
    made = []
    try:
        for ns in (CLI, NODE):
            sh("ip", "netns", "add", ns)
            made.append(ns)
        sh("ip", "link", "add", "c0", "netns", CLI, "type", "veth", "peer", "name", "nc0", "netns", NODE)
        for ns, dev, addr in ((CLI, "c0", "10.95.0.1/24"), (NODE, "nc0", "10.95.0.2/24")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
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


def bad_syn(src: str, dst: str, sport: int, dport: int) -> bytes:
    hdr = struct.pack("!HHIIBBHHH", sport, dport, 1000, 0, 5 << 4, 0x02, 64240, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(hdr))
    good = _csum(pseudo + hdr)
    return hdr[:16] + struct.pack("!H", (good + 1) & 0xFFFF) + hdr[18:]


SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
for _ in range(3):
    s.sendto(bytes.fromhex(sys.argv[2]), (sys.argv[1], 0))
"""


class Collect:
    def __init__(self):
        self.verdicts = []

    def write(self, v):
        self.verdicts.append(v)

    def close(self):
        pass


def test_bad_checksum_is_checksum(lab, tmp_path, monkeypatch):
    monkeypatch.setenv("NPTRACE_LOCK_FILE", str(tmp_path / "lock"))
    monkeypatch.setenv("NPTRACE_STATE_DIR", str(tmp_path / "state"))
    sink = Collect()
    t = Tracer(Config(ifaces=(IfaceSpec(NODE, "nc0"),)), [sink])
    t.status_every = 0
    t.start()
    try:
        t.run(duration=0.5)
        pkt = bad_syn("10.95.0.1", "10.95.0.2", 41500, 30080).hex()
        subprocess.run(["ip", "netns", "exec", CLI, sys.executable, "-c", SEND, "10.95.0.2", pkt],
                       check=True, timeout=10)
        t.run(duration=2.5)
    finally:
        t.stop()
    ours = [v for v in sink.verdicts if v.event.dport == 30080 and v.event.sport == 41500]
    assert ours, [(v.cause, v.event.flow, v.reason) for v in sink.verdicts]
    assert all(v.cause == "checksum" and v.reason == "TCP_CSUM" for v in ours), \
        [(v.cause, v.reason, v.hint) for v in ours]
    assert ours[0].iface and ours[0].iface.endswith("nc0"), ours[0].iface
    assert f"arrived on {ours[0].iface} with a bad checksum" in ours[0].hint
