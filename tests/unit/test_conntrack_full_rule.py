"""conntrack_full: a new connection dropped because the conntrack table was full (the kernel's
"nf_conntrack: table full, dropping packet"). The kernel gives no drop reason of its own for it
(NETFILTER_DROP at nf_hook_slow, as a rule's DROP), so it is told apart by the SYN carrying no
conntrack entry while the table is at its limit, or conntrack's own drop counter moving."""
import pytest
from nptrace import events as ev
from nptrace.classify import CAUSES, Context, classify
from nptrace.classify.verdict import PRIORITY
from nptrace.node.checks import _conntrack_drops, _conntrack_finding
from nptrace.node.knowledge import conntrack_drops

STAT = """entries  clashres found new invalid ignore delete chainlength insert insert_failed drop early_drop icmp_error  expect_new expect_create expect_delete search_restart
00000064  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000007 00000000 00000000  00000000 00000000 00000000 00000000
00000064  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 0000000a 00000000 00000000  00000000 00000000 00000000 00000000
"""


def syn_drop():
    return ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12, tcpflags=ev.TCP_SYN,
                               ts_ns=1000, saddr="192.168.10.100", sport=40000,
                               daddr="192.168.10.11", dport=30080))


def ctx_with(table):
    asked = []

    def nf_rule(netns, saddr, daddr, dport, odst, oport, syn, has_ct):
        asked.append((syn, has_ct))
        return {"tag": None, **table}
    return Context(drop_name=lambda v: {12: "NETFILTER_DROP"}.get(v, f"R{v}"), nf_rule=nf_rule), asked


def test_cause_is_known_and_ranked():
    assert "conntrack_full" in CAUSES and PRIORITY.index("conntrack_full") < PRIORITY.index("netfilter_reject")


def test_full_table_names_conntrack_full_with_the_numbers():
    ctx, asked = ctx_with({"ct_count": 100, "ct_max": 100, "ct_drop": 17, "ct_drop_new": 3})
    [v] = classify([syn_drop()], ctx)
    assert asked == [(True, False)]
    assert v.cause == "conntrack_full"
    assert "100/100 entries" in v.hint and "drop counter: 17, 3 since" in v.hint
    assert "nf_conntrack_max=200" in v.hint


def test_drop_counter_moving_is_enough():
    ctx, _ = ctx_with({"ct_count": 60, "ct_max": 100, "ct_drop": 4, "ct_drop_new": 4})
    [v] = classify([syn_drop()], ctx)
    assert v.cause == "conntrack_full"


def test_a_table_with_room_is_a_rules_drop():
    ctx, _ = ctx_with({"ct_count": 60, "ct_max": 100, "ct_drop": 4, "ct_drop_new": 0})
    [v] = classify([syn_drop()], ctx)
    assert v.cause == "netfilter_reject"


def test_conntrack_drop_counter_parse(tmp_path):
    p = tmp_path / "nf_conntrack"
    p.write_text(STAT)
    assert conntrack_drops(p) == 17 == _conntrack_drops(STAT)
    assert conntrack_drops(tmp_path / "absent") is None and _conntrack_drops(None) is None


def test_doctor_warns_on_drops_and_near_full():
    f = _conntrack_finding(10, 1000, 17)
    assert f.status == "warn" and "drop counter is 17" in f.detail and "conntrack_full" in f.detail
    f = _conntrack_finding(950, 1000, 0)
    assert f.status == "warn" and "nearly full" in f.detail
    assert f.remedy == "sysctl -w net.netfilter.nf_conntrack_max=2000"
    assert _conntrack_finding(100, 1000, 0).status == "ok"


# -- checksum ---------------------------------------------------------------------------------
def test_bad_tcp_checksum_is_checksum_naming_the_interface():
    names = {10: "TCP_CSUM", 11: "UDP_CSUM", 12: "NETFILTER_DROP"}
    ctx = Context(drop_name=lambda v: names.get(v, f"R{v}"),
                  iface_name=lambda ns, i: {7: "npt-node1/eth1"}.get(i))
    e = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=10, ifindex=7,
                            tcpflags=ev.TCP_SYN, ts_ns=1000, saddr="192.168.10.100", sport=40000,
                            daddr="192.168.10.11", dport=30080))
    [v] = classify([e], ctx)
    assert v.cause == "checksum" and v.iface == "npt-node1/eth1"
    assert "arrived on npt-node1/eth1 with a bad checksum" in v.hint and "TCP_CSUM" in v.hint
    assert "ethtool -K" in v.hint and "192.168.10.100:40000" in v.hint
    assert "checksum" in CAUSES and PRIORITY[0] == "checksum"
    assert "the peer of npt-node1/eth1 for a veth" in v.hint


def test_checksum_hint_names_the_veth_peer_that_sent_it():
    names = {10: "TCP_CSUM"}
    ctx = Context(drop_name=lambda v: names.get(v, f"R{v}"),
                  iface_name=lambda ns, i: {7: "npt-node1/eth1"}.get(i),
                  iface_peer=lambda ns, i: "npt-mbox/east" if i == 7 else None)
    e = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=10, ifindex=7,
                            tcpflags=ev.TCP_SYN, ts_ns=1000, saddr="192.168.10.100", sport=40000,
                            daddr="192.168.10.11", dport=30080))
    [v] = classify([e], ctx)
    assert "sent by npt-mbox/east, the other end of the veth npt-node1/eth1" in v.hint
    assert "ip netns exec npt-mbox ethtool -K east tx-checksum-ip-generic off" in v.hint
    assert "offload is" not in v.hint                    # its setting not known: not said


@pytest.mark.parametrize("offload", [True, False])
def test_checksum_hint_says_the_senders_offload_setting(offload):
    ctx = Context(drop_name=lambda v: "TCP_CSUM" if v == 10 else f"R{v}",
                  iface_name=lambda ns, i: {7: "npt-node1/eth1"}.get(i),
                  iface_peer=lambda ns, i: "npt-mbox/east" if i == 7 else None,
                  peer_tx_csum=lambda ns, i: offload if i == 7 else None)
    e = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=10, ifindex=7,
                            tcpflags=ev.TCP_SYN, ts_ns=1000, saddr="192.168.10.100", sport=40000,
                            daddr="192.168.10.11", dport=30080))
    [v] = classify([e], ctx)
    assert v.cause == "checksum" and "sent by npt-mbox/east" in v.hint
    if offload:
        assert "TX checksum offload is on" in v.hint and "ethtool -K east" in v.hint
    else:
        # the sender computed it: the change came after it, and turning offload off is no remedy
        assert "TX checksum offload is off" in v.hint and "ethtool -K" not in v.hint
        assert "changed after it left npt-mbox/east" in v.hint
