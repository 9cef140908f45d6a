"""A reset sent from a LISTEN socket carries the packet's tuple (issue 20 item 1).

tcp:tcp_send_reset fills its addresses from a full socket before the skb; a listener is one,
bound to 0.0.0.0:8080 and connected to nobody, so its reset read "0.0.0.0:8080 > 0.0.0.0:0"
(a rollout's new pod answering an old connection's segment with reason TCP_FLAGS). A listener
here answers a bare ACK of no connection; the RST_SENT record must say node:8080 > client:port."""
import os
import subprocess
import sys
import time

import pytest

from nptrace import events as ev
from nptrace.config import Config, IfaceSpec
from nptrace.tracer import Tracer

sys.path.insert(0, os.path.dirname(__file__))
from test_invalid_hooks import Collect, bare_ack, sh  # noqa: E402

pytestmark = pytest.mark.privileged
PID = os.getpid() % 100000
CLI, NODE = f"npt-lrc{PID}", f"npt-lrn{PID}"
SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
s.sendto(bytes.fromhex(sys.argv[2]), (sys.argv[1], 0))
"""
LISTEN = "import socket,time\ns=socket.socket(); s.bind(('0.0.0.0', 8080)); s.listen(); time.sleep(30)\n"


@pytest.fixture
def lab():
    made, server = [], None
    try:
        for ns in (CLI, NODE):
            sh("ip", "netns", "add", ns)
            made.append(ns)
        sh("ip", "link", "add", "c0", "netns", CLI, "type", "veth", "peer", "name", "nc0", "netns", NODE)
        for ns, dev, addr in ((CLI, "c0", "10.94.0.1/24"), (NODE, "nc0", "10.94.0.2/24")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        server = subprocess.Popen(["ip", "netns", "exec", NODE, sys.executable, "-c", LISTEN])
        time.sleep(0.5)
        yield
    finally:
        if server is not None:
            server.kill()
            server.wait()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_listener_reset_has_the_packets_tuple(lab, tmp_path, monkeypatch):
    monkeypatch.setenv("NPTRACE_LOCK_FILE", str(tmp_path / "lock"))
    monkeypatch.setenv("NPTRACE_STATE_DIR", str(tmp_path / "state"))
    sink = Collect()
    t = Tracer(Config(ifaces=(IfaceSpec(NODE, "nc0"),)), [sink])
    t.status_every = 0
    t.start()
    try:
        t.run(duration=0.5)
        pkt = bare_ack("10.94.0.1", "10.94.0.2", 41003, 8080).hex()
        subprocess.run(["ip", "netns", "exec", CLI, sys.executable, "-c", SEND, "10.94.0.2", pkt],
                       check=True, timeout=10)
        t.run(duration=2.0)
    finally:
        t.stop()
    sent = [l.ev for v in sink.verdicts for l in v.labeled if l.ev.type == ev.EvType.RST_SENT]
    assert sent, [(v.cause, v.event.flow) for v in sink.verdicts]
    assert all(e.flow == ("10.94.0.2", 8080, "10.94.0.1", 41003) for e in sent), [e.flow for e in sent]
    assert all(e.flags & ev.F_HAS_SOCK for e in sent)
