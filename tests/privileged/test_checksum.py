"""checksum end to end: segments with a bad TCP checksum reach a node namespace, its TCP stack
drops them (kfree_skb TCP_CSUM) and nptrace labels them `checksum`, naming the interface.

The corruption is made on the sender: this kernel has neither act_pedit nor act_csum
(CONFIG_NET_ACT_PEDIT/CSUM unset) for a tc rewrite after the checksum, so the client writes the
segment itself through a raw socket with its checksum off by one. The receiving side is the
kernel's own path: veth does not mark received packets CHECKSUM_UNNECESSARY (since Linux 4.6),
so tcp_v4_rcv verifies and drops with TCP_CSUM."""
import os
import subprocess

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
    """The hint names the sender found from the path (the veth's other end, c0 in the client's
    namespace, not the port it arrived on) and that device's TX checksum offload as it is set
    when the drop is labeled: on first, then off (ethtool -K c0 tx off between two sends)."""
    with traced(NODE, tmp_path, monkeypatch) as (t, sink):
        t.run(duration=0.5)
        # a SYN whose checksum is off by one, with c0's offload on (a veth's default), then off
        send_raw(CLI, "10.95.0.2", segment("10.95.0.1", "10.95.0.2", 41500, 30080, 0x02,
                                           csum_off=1), times=3)
        t.run(duration=2.5)
        subprocess.run(["ip", "netns", "exec", CLI, "ethtool", "-K", "c0", "tx", "off"],
                       check=True, capture_output=True)
        send_raw(CLI, "10.95.0.2", segment("10.95.0.1", "10.95.0.2", 41501, 30080, 0x02,
                                           csum_off=1), times=3)
        t.run(duration=2.5)
    first, second = ([v for v in sink.verdicts if v.event.dport == 30080 and v.event.sport == p]
                     for p in (41500, 41501))
    assert first and second, [(v.cause, v.event.flow, v.reason) for v in sink.verdicts]
    for v in first + second:
        assert v.cause == "checksum" and v.reason == "TCP_CSUM", (v.cause, v.reason, v.hint)
        assert v.iface and v.iface.endswith("nc0"), v.iface
        assert f"arrived on {v.iface} with a bad checksum" in v.hint
        assert f"sent by {CLI}/c0, the other end of the veth {v.iface}" in v.hint, v.hint
    assert "TX checksum offload is on" in first[0].hint, first[0].hint
    assert f"ip netns exec {CLI} ethtool -K c0 tx-checksum-ip-generic off" in first[0].hint
    assert "TX checksum offload is off" in second[0].hint, second[0].hint
    assert "changed after it left" in second[0].hint and "ethtool -K" not in second[0].hint
