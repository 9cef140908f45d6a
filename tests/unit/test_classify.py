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


def test_received_reset_joins_the_incident_of_its_cause():
    # the kernel reports the client's received RST before the pod's tcp_send_reset: order
    # does not matter, one incident names the cause
    recv = E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, flags=ev.F_HAS_SOCK,
             saddr="10.0.0.2", sport=30080, daddr="192.0.2.10", dport=40000, ts_ns=10)
    sent = E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN,
             saddr="10.0.0.2", sport=30080, daddr="192.0.2.10", dport=40000, ts_ns=20)
    [v] = classify([recv, sent], CTX)
    assert v.cause == "no_listener" and v.events == 2
    assert v.hook == "tcp:tcp_send_reset" and len(v.evidence) == 2


def test_incidents_join_across_nat():
    # pod's RST (pod -> masquerade address), node egress RST with conntrack, client's RST
    pod = E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN, ts_ns=1,
            saddr="10.244.1.10", sport=8080, daddr="10.244.0.0", dport=40000)
    wire = E(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_EGRESS, dir=ev.Dir.EGRESS, ts_ns=2,
             saddr="192.168.10.11", sport=30080, daddr="192.168.10.100", dport=40000,
             flags=ev.F_HAS_CT, ct_osrc="192.168.10.100", ct_osport=40000,
             ct_odst="192.168.10.11", ct_odport=30080, ct_rsrc="10.244.1.10", ct_rsport=8080,
             ct_rdst="10.244.0.0", ct_rdport=40000, ct_status=ev.IPS_DST_NAT | ev.IPS_SRC_NAT)
    client = E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, ts_ns=3,
               saddr="192.168.10.11", sport=30080, daddr="192.168.10.100", dport=40000)
    [v] = classify([client, wire, pod], CTX)
    assert v.cause == "no_listener" and v.events == 3


def test_quiet_flow_is_reported_by_tick_without_new_events():
    c = Classifier(Context(drop_name=CTX.drop_name, hold_ns=100))
    assert c.feed(E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16, ts_ns=1000)) == []
    assert c.tick(1050) == []
    [v] = c.tick(1200)
    assert v.cause == "rp_filter"


def test_weak_incident_waits_for_a_root_cause():
    c = Classifier(Context(hold_ns=100, max_hold_ns=10_000))
    c.feed(E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, ts_ns=0, saddr="1.1.1.1",
             sport=80, daddr="2.2.2.2", dport=5000))
    assert c.tick(500) == []                  # quiet, but only a weak label: keep waiting
    [v] = c.tick(10_001)
    assert v.cause == "peer_reset"


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
    reported = 0
    for i in range(5000):
        reported += len(c.feed(E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST,
                                 sport=i % 65535 + 1, ts_ns=i)))
    assert len(c.flows) <= 101 and len(c.keys) <= 101
    assert reported + len(c.flush()) == 5000       # evicted incidents are reported, not lost


def test_flows_expire_by_event_time():
    c = Classifier(Context(drop_name=CTX.drop_name, window_ns=1000, hold_ns=10))
    c.feed(E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16, sport=1, ts_ns=0))
    c.feed(E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16, sport=2, ts_ns=5000))
    c.tick(5000)      # the first flow was reported at 5000 and is past its window
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


def test_asymmetric_reply_is_wrong_iface_and_explains_the_reset():
    asym = E(type=ev.EvType.ASYM_IFACE, hook=ev.Hook.TC_EGRESS, ifindex=2, aux=7, ts_ns=1,
             saddr="172.16.21.11", sport=30080, daddr="192.168.10.100", dport=40000)
    rst = E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, ts_ns=2,
            saddr="172.16.21.11", sport=30080, daddr="192.168.10.100", dport=40000)
    [v] = classify([asym, rst], CTX)
    assert v.cause == "wrong_iface" and v.kind == "anomaly" and v.events == 2
    assert "npt-node1/eth1" in v.hint


def test_asymmetric_reply_from_a_pod_is_missing_snat():
    ctx = Context(iface_name=CTX.iface_name,
                  endpoint_of=lambda a, p: "default/web:http" if (a, p) == ("10.244.1.10", 8080) else None)
    [v] = classify([E(type=ev.EvType.ASYM_IFACE, hook=ev.Hook.TC_EGRESS, ifindex=2, aux=7,
                      saddr="10.244.1.10", sport=8080, daddr="192.168.10.100", dport=40000)], ctx)
    assert v.cause == "snat"


def test_unmasqueraded_reply_of_an_etp_local_pod_is_no_local_endpoint_of_the_forwarding_node():
    # kube-proxy's IPVS mode sends an eTP=Local NodePort of a node without local endpoints to
    # other nodes' pods unmasqueraded: the reply's cause is that node's missing endpoint
    fb = {"service": "default/web:http", "no_local": ["TCP 192.168.10.11:30080"]}
    ctx = Context(iface_name=CTX.iface_name, rst_name=CTX.rst_name,
                  endpoint_of=lambda a, p: "default/web:http" if (a, p) == ("10.244.1.10", 8080) else None,
                  etp_local=lambda a, p: fb if (a, p) == ("10.244.1.10", 8080) else None)
    asym = E(type=ev.EvType.ASYM_IFACE, hook=ev.Hook.TC_EGRESS, ifindex=2, aux=7,
             saddr="10.244.1.10", sport=8080, daddr="192.168.10.100", dport=40000)
    rst = E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN | ev.TCP_ACK,
            saddr="192.168.10.100", sport=40001, daddr="10.244.1.10", dport=8080)
    for e in (asym, rst):
        [v] = classify([e], ctx)
        assert v.cause == "no_local_endpoint", v
        assert "TCP 192.168.10.11:30080" in v.hint and "externalTrafficPolicy: Local" in v.hint
        assert "10.244.1.10:8080" in v.hint
    # the same reply of a Cluster-policy Service stays a missing masquerade
    [v] = classify([asym], Context(iface_name=CTX.iface_name, endpoint_of=ctx.endpoint_of))
    assert v.cause == "snat"
    # a Local Service whose forwarding node is not among the namespaces read
    [v] = classify([asym], Context(iface_name=CTX.iface_name, endpoint_of=ctx.endpoint_of,
                                   etp_local=lambda a, p: {"service": "default/web:http", "no_local": []}))
    assert v.cause == "no_local_endpoint" and "no local endpoint of default/web:http" in v.hint


def test_weak_drop_alone_is_not_reported():
    assert list(classify([E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=2)], CTX)) == []


def test_netfilter_drop_without_rules_is_netfilter_reject():
    [v] = classify([E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12, tcpflags=ev.TCP_SYN,
                      saddr="192.0.2.1", sport=5, daddr="10.0.0.2", dport=30080)], CTX)
    assert v.cause == "netfilter_reject" and v.confidence < 0.6


def test_evidence_dicts_equal_the_evidence_objects():
    from nptrace.classify import evidence_dicts
    pod = E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN, ts_ns=1,
            saddr="10.244.1.10", sport=8080, daddr="10.244.0.0", dport=40000, ifindex=7)
    wire = E(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_EGRESS, dir=ev.Dir.EGRESS, ts_ns=2,
             saddr="192.168.10.11", sport=30080, daddr="192.168.10.100", dport=40000,
             flags=ev.F_HAS_CT, ct_osrc="192.168.10.100", ct_osport=40000,
             ct_odst="192.168.10.11", ct_odport=30080, ct_rsrc="10.244.1.10", ct_rsport=8080,
             ct_rdst="10.244.0.0", ct_rdport=40000, ct_status=ev.IPS_DST_NAT)
    [v] = classify([wire, pod], CTX)
    assert evidence_dicts(v) == [x.to_dict() for x in v.evidence]
    assert "dnat 192.168.10.11:30080" in evidence_dicts(v)[1]["detail"]


def test_rules_are_asked_only_for_the_event_types_they_declare():
    from nptrace import classify as cl
    asked = []

    @cl.applies_to(ev.EvType.RST_RECV)
    def spy(e, rname, history, ctx):
        asked.append(e.type)

    cl.RULES.insert(0, spy)
    try:
        list(classify([E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16),
                       E(type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, ts_ns=5)], CTX))
    finally:
        cl.RULES.remove(spy)
    assert asked == [ev.EvType.RST_RECV]


def test_a_reported_root_cause_is_kept_without_its_raw_record():
    c = Classifier(Context(drop_name=CTX.drop_name, rst_name=CTX.rst_name, hold_ns=10))
    c.feed(E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN,
             saddr="10.0.0.2", sport=80, daddr="10.0.0.1", dport=4000, ts_ns=1))
    [v] = c.tick(100)
    assert v.event.raw                                 # the incident itself keeps it
    [flow] = c.flows.values()
    assert flow.root.cause == "no_listener" and flow.root.ev.raw == b""


def test_reset_of_a_late_syn_ack_from_the_frontend_is_not_snat():
    # wrong-interface: the middlebox reset the client, then node1 retransmits its SYN-ACK
    # (from the NodePort the client connected to, so un-NATed) and the client, with no socket
    # left, resets it. Landing in the asymmetric reply's incident, it must not outrank it.
    ctx = Context(drop_name=CTX.drop_name, rst_name=CTX.rst_name, iface_name=CTX.iface_name,
                  service_of=lambda a, p: "default/web:http" if p == 30080 else None)
    asym = E(type=ev.EvType.ASYM_IFACE, hook=ev.Hook.TC_EGRESS, ifindex=2, aux=7, ts_ns=1,
             saddr="172.16.21.11", sport=30080, daddr="192.168.10.100", dport=40000)
    late = E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, ts_ns=2,
             aux=ev.TCP_SYN | ev.TCP_ACK, saddr="192.168.10.100", sport=40000,
             daddr="172.16.21.11", dport=30080)
    [v] = classify([asym, late], ctx)
    assert v.cause == "wrong_iface" and v.events == 2
    [alone] = classify([late], ctx)
    assert alone.cause == "unknown"      # alone it shows no masquerade fault


def test_a_reset_answering_the_syn_from_a_remote_endpoint_is_no_listener():
    """The node that DNATed a SYN to a pod on another node sees only that pod's reset come in
    (over the overlay): sequence 0 with ACK answers the SYN itself, so the endpoint refused the
    connection; a mid-connection reset (its own sequence number) is the endpoint aborting an
    established connection (app_reset: its node's trace tells the app's abort from a lost
    state); one from an address that is no endpoint stays a peer's reset."""
    ctx = Context(drop_name=CTX.drop_name, rst_name=CTX.rst_name, iface_name=lambda ns, i: "eth3",
                  endpoint_of=lambda a, p: "default/web:http" if (a, p) == ("10.244.1.10", 8080) else None)

    def wire(seq, saddr="10.244.1.10"):
        return E(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_INGRESS, dir=ev.Dir.INGRESS, ifindex=5,
                 tcpflags=ev.TCP_RST | ev.TCP_ACK, seq=seq, ack_seq=1001, saddr=saddr, sport=8080,
                 daddr="10.244.0.0", dport=59647)
    [v] = classify([wire(0)], ctx)
    assert v.cause == "no_listener"
    assert v.hint.startswith("10.244.1.10:8080, an endpoint of default/web:http, refused the connection")
    assert "arriving on eth3" in v.hint
    [mid] = classify([wire(123456)], ctx)
    assert mid.cause == "app_reset" and "reset an established connection" in mid.hint
    assert "arrives on eth3" in mid.hint
    assert [v.cause for v in classify([wire(0, saddr="203.0.113.9")], ctx)] == ["peer_reset"]


def test_a_client_answering_the_endpoint_directly_is_snat_on_the_node_that_dnated():
    """missing-snat seen from the node that DNATed to a pod on another node: the client's reset
    goes to the pod's own address from the port of its NodePort connection (the pod's reply
    reached it un-NATed), and this node's conntrack drops it INVALID. The NAT map ties the two:
    snat, not conntrack_invalid."""
    def nat_peer(sa, sp, da, dp):      # the reply tuple E -> client maps to the original one
        if (sa, sp, da, dp) == ("10.244.1.10", 8080, "192.168.10.100", 40000):
            return ("192.168.10.100", 40000, "192.168.10.11", 30080)
        return None
    ctx = Context(drop_name=CTX.drop_name, rst_name=CTX.rst_name, iface_name=CTX.iface_name,
                  nat_peer=nat_peer,
                  endpoint_of=lambda a, p: "default/web:http" if (a, p) == ("10.244.1.10", 8080) else None)
    rst = E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12, tcpflags=ev.TCP_RST,
            saddr="192.168.10.100", sport=40000, daddr="10.244.1.10", dport=8080)
    [v] = classify([rst], ctx)
    assert v.cause == "snat"
    assert "192.168.10.100:40000 connected to 192.168.10.11:30080" in v.hint
    other = E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12, tcpflags=ev.TCP_RST,
              saddr="192.168.10.100", sport=40001, daddr="10.244.1.10", dport=8080)
    assert [v.cause for v in classify([other], ctx)] != ["snat"]
    # nftables mode: no INVALID drop, the reset comes in on its way to the pod
    wire = E(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_INGRESS, dir=ev.Dir.INGRESS, ifindex=2,
             tcpflags=ev.TCP_RST, seq=5, saddr="192.168.10.100", sport=40000,
             daddr="10.244.1.10", dport=8080)
    assert [v.cause for v in classify([wire], ctx)] == ["snat"]


def test_an_unanswered_syn_dnated_to_another_node_says_the_loss_is_past_this_node():
    def nat_peer(sa, sp, da, dp):
        if (sa, sp, da, dp) == ("192.168.10.100", 40000, "192.168.10.11", 30080):
            return ("10.244.1.10", 8080, "10.244.0.0", 40000)
        return None
    ctx = Context(drop_name=CTX.drop_name, rst_name=CTX.rst_name, nat_peer=nat_peer,
                  route_iface=lambda ns, a: "flannel.1" if a == "10.244.1.10" else None)
    retx = E(type=ev.EvType.SYN_RETX, hook=ev.Hook.TC_INGRESS, dir=ev.Dir.INGRESS, ifindex=2,
             tcpflags=ev.TCP_SYN, saddr="192.168.10.100", sport=40000, daddr="192.168.10.11",
             dport=30080)
    [v] = classify([retx], ctx)
    assert v.cause == "unknown"
    assert "DNATs it to 10.244.1.10:8080, reached by flannel.1" in v.hint
    assert "past this node" in v.hint


def test_a_drop_to_an_endpoint_a_rollout_removed_is_proxy_on_the_node_that_had_it():
    """rollout across nodes, seen on the endpoint's node: no DNAT here, the rules no longer
    list the address, and nobody has it (NEIGH_FAILED): another node's conntrack steers it."""
    names = {**NAMES, 70: "NEIGH_FAILED"}
    ctx = Context(drop_name=lambda v: names.get(v, f"REASON_{v}"), rst_name=CTX.rst_name,
                  removed_endpoint=lambda a, p: "default/web:http" if (a, p) == ("10.244.1.11", 8080) else None)
    drop = E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=70, tcpflags=ev.TCP_ACK,
             saddr="10.244.0.0", sport=40000, daddr="10.244.1.11", dport=8080)
    [v] = classify([drop], ctx)
    assert v.cause == "proxy" and "was an endpoint of default/web:http" in v.hint
    assert "conntrack -D --dst-nat 10.244.1.11" in v.hint
    assert [v.cause for v in classify([drop._replace(daddr="10.244.1.12")], ctx)] == ["unknown"]


def test_silence_towards_an_endpoint_found_gone_for_another_connection_is_proxy():
    """stale-endpoint on the node that forwards: the endpoint's node answers a few of the SYNs
    with host unreachable (rate limited); the other connections' retransmitted SYNs to the
    same endpoint get the cause those found."""
    nat = {40000: ("10.244.1.11", 8080), 40001: ("10.244.1.11", 8080), 40002: ("10.244.1.99", 8080)}

    def nat_peer(sa, sp, da, dp):
        if da == "192.168.10.11" and sp in nat:
            return (*nat[sp], "10.244.0.0", sp)
        return None
    names = {**NAMES, 70: "NEIGH_FAILED"}
    ctx = Context(drop_name=lambda v: names.get(v, f"R{v}"), rst_name=CTX.rst_name,
                  nat_peer=nat_peer, hold_ns=10, max_hold_ns=10**9,
                  service_of=lambda a, p: "default/web:http" if p == 30080 else None)
    ct = dict(flags=ev.F_HAS_CT, ct_osrc="192.168.10.100", ct_osport=40000, ct_odst="192.168.10.11",
              ct_odport=30080, ct_rsrc="10.244.1.11", ct_rsport=8080, ct_rdst="10.244.0.0",
              ct_rdport=40000, ct_status=ev.IPS_DST_NAT)
    # the first connection's SYN, freed where nobody has the endpoint's address
    icmp = E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=70, ts_ns=100,
             tcpflags=ev.TCP_SYN, saddr="192.168.10.100", sport=40000, daddr="10.244.1.11",
             dport=8080, **ct)
    def retx(port, ts):
        return E(type=ev.EvType.SYN_RETX, hook=ev.Hook.TC_INGRESS, dir=ev.Dir.INGRESS, ts_ns=ts,
                 tcpflags=ev.TCP_SYN, saddr="192.168.10.100", sport=port, daddr="192.168.10.11",
                 dport=30080)
    vs = classify([icmp, retx(40001, 200), retx(40002, 300)], ctx)
    got = {v.event.sport: v for v in vs}
    assert got[40000].cause == "proxy"
    assert got[40001].cause == "proxy" and "found no host having that address" in got[40001].hint
    assert got[40002].cause == "unknown"       # another endpoint: nothing known of it
