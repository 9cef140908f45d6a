"""checksum end to end: segments with a bad TCP checksum reach a node namespace, its TCP stack
drops them (kfree_skb TCP_CSUM) and nptrace labels them `checksum`, naming the interface.

The corruption is made on the sender: this kernel has neither act_pedit nor act_csum
(CONFIG_NET_ACT_PEDIT/CSUM unset) for a tc rewrite after the checksum, so the client writes the
segment itself through a raw socket with its checksum off by one. The receiving side is the
kernel's own path: veth does not mark received packets CHECKSUM_UNNECESSARY (since Linux 4.6),
so tcp_v4_rcv verifies and drops with TCP_CSUM."""
import os

import pytest

from nodelab import client_node, segment, send_raw, traced

pytestmark = pytest.mark.privileged
PID = os.getpid() % 100000
CLI, NODE = f"npt-csc{PID}", f"npt-csn{PID}"


@pytest.fixture
def lab():
    with client_node("10.95", CLI, NODE):
        yield


def test_bad_checksum_is_checksum(lab, tmp_path, monkeypatch):
    with traced(NODE, tmp_path, monkeypatch) as (t, sink):
        t.run(duration=0.5)
        # a SYN whose checksum is off by one
        send_raw(CLI, "10.95.0.2", segment("10.95.0.1", "10.95.0.2", 41500, 30080, 0x02,
                                           csum_off=1), times=3)
        t.run(duration=2.5)
    ours = [v for v in sink.verdicts if v.event.dport == 30080 and v.event.sport == 41500]
    assert ours, [(v.cause, v.event.flow, v.reason) for v in sink.verdicts]
    assert all(v.cause == "checksum" and v.reason == "TCP_CSUM" for v in ours), \
        [(v.cause, v.reason, v.hint) for v in ours]
    assert ours[0].iface and ours[0].iface.endswith("nc0"), ours[0].iface
    assert f"arrived on {ours[0].iface} with a bad checksum" in ours[0].hint
