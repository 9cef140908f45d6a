"""A reset sent from a LISTEN socket carries the packet's tuple.

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
from nodelab import bare_ack, client_node, send_raw, traced

pytestmark = pytest.mark.privileged
PID = os.getpid() % 100000
CLI, NODE = f"npt-lrc{PID}", f"npt-lrn{PID}"
LISTEN = "import socket,time\ns=socket.socket(); s.bind(('0.0.0.0', 8080)); s.listen(); time.sleep(30)\n"


@pytest.fixture
def lab():
    with client_node("10.94", CLI, NODE):
        server = subprocess.Popen(["ip", "netns", "exec", NODE, sys.executable, "-c", LISTEN])
        try:
            time.sleep(0.5)
            yield
        finally:
            server.kill()
            server.wait()


def test_listener_reset_has_the_packets_tuple(lab, tmp_path, monkeypatch):
    with traced(NODE, tmp_path, monkeypatch) as (t, sink):
        t.run(duration=0.5)
        send_raw(CLI, "10.94.0.2", bare_ack("10.94.0.1", "10.94.0.2", 41003, 8080))
        t.run(duration=2.0)
    sent = [l.ev for v in sink.verdicts for l in v.labeled if l.ev.type == ev.EvType.RST_SENT]
    assert sent, [(v.cause, v.event.flow) for v in sink.verdicts]
    assert all(e.flow == ("10.94.0.2", 8080, "10.94.0.1", 41003) for e in sent), [e.flow for e in sent]
    assert all(e.flags & ev.F_HAS_SOCK for e in sent)
