"""Classification from hand-made event lists (pure: no bcc, no root, no clock)."""
from nptrace import events as ev
from nptrace.classify import CAUSES, Classifier, Context, classify

NAMES = {3: "NO_SOCKET", 12: "NETFILTER_DROP", 16: "IP_RPFILTER", 2: "NOT_SPECIFIED"}
CTX = Context(drop_name=lambda v: NAMES.get(v, f"REASON_{v}"),
              rst_name=lambda v: {0: "NOT_SPECIFIED", 1: "NO_SOCKET"}.get(v, f"REASON_{v}"),
              iface_name=lambda ns, i: {7: "npt-node1/eth1"}.get(i))


def E(**kw):
    kw.setdefault("ts_ns", 1_000)
    return ev.decode(ev.encode(**kw))


def test_rp_filter_drop():
    [v] = classify([E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16, ifindex=7,
                      saddr="192.168.2.10", sport=5000, daddr="10.0.0.2", dport=30080)], CTX)
    assert v.cause == "rp_filter" and v.kind == "drop"
    assert v.iface == "npt-node1/eth1"
    assert "rp_filter=2" in v.hint and "npt-node1/eth1" in v.hint


def test_no_listener_reset_sent():
    [v] = classify([E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN,
                      saddr="10.244.1.5", sport=8081, daddr="192.0.2.10", dport=40000)], CTX)
    assert (v.cause, v.kind, v.direction) == ("no_listener", "rst", "sent")
    assert "8081" in v.hint


def test_received_reset_inherits_flow_cause():
    sent = E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN,
             saddr="10.0.0.2", sport=30080, daddr="192.0.2.10", dport=40000, ts_ns=10)
    recv = E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, flags=ev.F_HAS_SOCK,
             saddr="10.0.0.2", sport=30080, daddr="192.0.2.10", dport=40000, ts_ns=20)
    got = list(classify([sent, recv], CTX))
    assert [v.cause for v in got] == ["no_listener", "no_listener"]
    assert got[1].direction == "received" and len(got[1].evidence) == 2


def test_lone_received_reset_is_peer_reset():
    [v] = classify([E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST,
                      saddr="203.0.113.9", sport=443, daddr="10.0.0.2", dport=5555)], CTX)
    assert v.cause == "peer_reset"


def test_app_abort_is_not_a_network_fault():
    [v] = classify([E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=0,
                      flags=ev.F_HAS_SOCK, saddr="10.244.1.5", sport=8080,
                      daddr="192.0.2.10", dport=40000)], CTX)
    assert v.cause == "app_reset"


def test_unexplained_event_is_unknown_with_evidence():
    [v] = classify([E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=99,
                      saddr="1.1.1.1", sport=1, daddr="2.2.2.2", dport=2)], CTX)
    assert v.cause == "unknown" and v.confidence == 0 and v.evidence


def test_evidence_only_events_make_no_verdict():
    assert list(classify([E(type=ev.EvType.SYNACK_RETX, hook=ev.Hook.SYNACK_RETX)], CTX)) == []


def test_flow_state_is_bounded():
    c = Classifier(Context(max_flows=100))
    for i in range(5000):
        c.feed(E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, sport=i % 65535 + 1,
                 ts_ns=i))
    assert len(c.flows) <= 101


def test_flows_expire_by_event_time():
    c = Classifier(Context(window_ns=1000))
    c.feed(E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, sport=1, ts_ns=0))
    c.feed(E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, sport=2, ts_ns=5000))
    assert len(c.flows) == 1


def test_every_cause_is_documented_in_readme():
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [c for c in CAUSES if f"`{c}`" not in readme]
    assert not missing, f"README lacks causes: {missing}"


def test_reset_of_an_unsolicited_syn_ack_is_snat():
    # the client's stack answers a SYN-ACK from the pod address it never connected to
    [v] = classify([E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1,
                      aux=ev.TCP_SYN | ev.TCP_ACK, saddr="192.168.10.100", sport=40000,
                      daddr="10.244.1.10", dport=8080)], CTX)
    assert v.cause == "snat" and "10.244.1.10:8080" in v.hint


def test_asymmetric_reply_is_wrong_iface_and_taints_the_flow():
    asym = E(type=ev.EvType.ASYM_IFACE, hook=ev.Hook.TC_EGRESS, ifindex=2, aux=7, ts_ns=1,
             saddr="172.16.21.11", sport=30080, daddr="192.168.10.100", dport=40000)
    rst = E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, ts_ns=2,
            saddr="172.16.21.11", sport=30080, daddr="192.168.10.100", dport=40000)
    got = list(classify([asym, rst], CTX))
    assert [v.cause for v in got] == ["wrong_iface", "wrong_iface"]
    assert "npt-node1/eth1" in got[0].hint


def test_weak_drop_alone_is_not_reported():
    assert list(classify([E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=2)], CTX)) == []


def test_netfilter_drop_without_rules_is_netfilter_reject():
    [v] = classify([E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12, tcpflags=ev.TCP_SYN,
                      saddr="192.0.2.1", sport=5, daddr="10.0.0.2", dport=30080)], CTX)
    assert v.cause == "netfilter_reject" and v.confidence < 0.6
