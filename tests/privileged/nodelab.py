"""The small lab the single-mechanism root tests share: a client namespace and a node namespace
joined by a veth (and a pod behind the node), the tracer on the node's client-side interface
with a sink that keeps every verdict, and hand-made TCP segments sent from the client through
a raw socket (a bare ACK of no connection, a SYN with a wrong checksum).

Addresses, for a /16 prefix NET such as "10.97": NET.0.1 the client, NET.0.2 the node,
NET.1.1 the node's pod side, NET.1.5 the pod."""
import contextlib
import socket
import struct
import subprocess
import sys

from nptrace.config import Config, IfaceSpec
from nptrace.sinks.pcapng import inet_checksum
from nptrace.daemon.tracer import Tracer


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


@contextlib.contextmanager
def client_node(net: str, cli: str, node: str, pod: str | None = None):
    """The namespaces, up; all deleted at the end, also when building them failed halfway."""
    made = []
    try:
        for ns in (cli, node) + ((pod,) if pod else ()):
            sh("ip", "netns", "add", ns)
            made.append(ns)
        sh("ip", "link", "add", "c0", "netns", cli, "type", "veth", "peer", "name", "nc0", "netns", node)
        addrs = [(cli, "c0", f"{net}.0.1/24"), (node, "nc0", f"{net}.0.2/24")]
        if pod:
            sh("ip", "link", "add", "p0", "netns", pod, "type", "veth", "peer", "name", "np0", "netns", node)
            addrs += [(node, "np0", f"{net}.1.1/24"), (pod, "p0", f"{net}.1.5/24")]
        for ns, dev, addr in addrs:
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", cli, "route", "add", "default", "via", f"{net}.0.2")
        if pod:
            sh("ip", "-n", pod, "route", "add", "default", "via", f"{net}.1.1")
        yield
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Collect:
    def __init__(self):
        self.verdicts = []

    def write(self, v):
        self.verdicts.append(v)

    def close(self):
        pass


@contextlib.contextmanager
def traced(node: str, tmp_path, monkeypatch, iface: str = "nc0"):
    """(tracer, sink): nptrace attached to the node's interface, stopped at the end."""
    monkeypatch.setenv("NPTRACE_LOCK_FILE", str(tmp_path / "lock"))
    monkeypatch.setenv("NPTRACE_STATE_DIR", str(tmp_path / "state"))
    sink = Collect()
    t = Tracer(Config(ifaces=(IfaceSpec(node, iface),)), [sink])
    t.status_every = 0
    t.start()
    try:
        yield t, sink
    finally:
        t.stop()


def segment(src: str, dst: str, sport: int, dport: int, flags: int, ack: int = 0,
            csum_off: int = 0) -> bytes:
    """A 20-byte TCP header; csum_off != 0 makes its checksum wrong by that much."""
    hdr = struct.pack("!HHIIBBHHH", sport, dport, 1000, ack, 5 << 4, flags, 64240, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(hdr))
    return hdr[:16] + struct.pack("!H", (inet_checksum(pseudo + hdr) + csum_off) & 0xFFFF) + hdr[18:]


def bare_ack(src: str, dst: str, sport: int, dport: int) -> bytes:
    """A TCP ACK (no SYN) of no connection: conntrack with tcp_loose=0 calls it INVALID."""
    return segment(src, dst, sport, dport, 0x10, ack=2000)


_SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
for _ in range(int(sys.argv[3])):
    s.sendto(bytes.fromhex(sys.argv[2]), (sys.argv[1], 0))
"""


def send_raw(cli: str, dst: str, pkt: bytes, times: int = 1) -> None:
    subprocess.run(["ip", "netns", "exec", cli, sys.executable, "-c", _SEND, dst, pkt.hex(),
                    str(times)], check=True, timeout=10)
