"""Every incident's JSON line names the client's own address and port as the
client saw them (before masquerade) in `client`, with `frontend` and `endpoint`, on every line
where the NAT mapping is known: also the pod-side line of a masqueraded flow, whose own tuple
has the masquerade address and port."""
from __future__ import annotations

import json

from nptrace import events as ev
from nptrace.classify import Context, classify
from nptrace.sinks.jsonl import verdict_dict, verdict_line

CLIENT, NODE, MASQ, POD = "192.168.10.100", "192.168.10.11", "10.244.0.1", "10.244.0.10"
# node1's entry: client:40000 -> NodePort, DNATed to the pod and masqueraded to cni0's :61000
CT = dict(flags=ev.F_HAS_CT, ct_osrc=CLIENT, ct_osport=40000, ct_odst=NODE, ct_odport=30080,
          ct_rsrc=POD, ct_rsport=8080, ct_rdst=MASQ, ct_rdport=61000,
          ct_status=ev.IPS_DST_NAT | ev.IPS_SRC_NAT)


def _ctx():
    return Context(rst_name=lambda v: {2: "TCP_FLAGS", 1: "NO_SOCKET"}.get(v, f"R{v}"),
                   service_of=lambda a, p: "default/web:http" if (a, p) in ((NODE, 30080), (POD, 8080)) else None)


def _lines(events):
    out = []
    for v in classify(events, _ctx()):
        d, line = verdict_dict(v, 0), json.loads(verdict_line(v, 0))
        assert d == line
        out.append(d)
    return out


def test_pod_side_reset_of_a_masqueraded_flow_names_the_client():
    pod = ev.decode(ev.encode(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN,
                              ts_ns=1, saddr=POD, sport=8080, daddr=MASQ, dport=61000))
    node = ev.decode(ev.encode(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_EGRESS, dir=ev.Dir.EGRESS, ts_ns=2,
                               saddr=NODE, sport=30080, daddr=CLIENT, dport=40000, **CT))
    lines = _lines([pod, node])
    assert lines
    for d in lines:
        assert d["client"] == f"{CLIENT}:40000", d
        assert d["frontend"] == f"{NODE}:30080" and d["endpoint"] == f"{POD}:8080"


def test_a_line_with_only_the_masqueraded_side_still_names_the_client():
    """The node's own event on the pod side (cni0 egress: masquerade address and port) with
    the conntrack entry: `client` is the entry's original source, not the line's daddr."""
    ct = dict(CT)
    wire = ev.decode(ev.encode(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_INGRESS, dir=ev.Dir.INGRESS, ts_ns=1,
                               saddr=POD, sport=8080, daddr=MASQ, dport=61000, **ct))
    [d] = _lines([wire])
    assert (d["saddr"], d["dport"]) == (POD, 61000)
    assert d["client"] == f"{CLIENT}:40000" and d["frontend"] == f"{NODE}:30080"


def test_a_masquerade_only_entry_names_the_client_alone():
    """A pod connecting out through the node's masquerade (SNAT-only entry, no Service): the
    pod's own address and port in `client`, no `frontend` / `endpoint` (nothing was DNATed)."""
    ext, node_ip = "203.0.113.7", "192.168.10.11"
    snat = dict(flags=ev.F_HAS_CT, ct_osrc=POD, ct_osport=45000, ct_odst=ext, ct_odport=443,
                ct_rsrc=ext, ct_rsport=443, ct_rdst=node_ip, ct_rdport=61500, ct_status=ev.IPS_SRC_NAT)
    wire = ev.decode(ev.encode(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_INGRESS, dir=ev.Dir.INGRESS, ts_ns=1,
                               saddr=ext, sport=443, daddr=node_ip, dport=61500, **snat))
    [d] = _lines([wire])
    assert d["client"] == f"{POD}:45000"
    assert "frontend" not in d and "endpoint" not in d


def test_ipv6_client_keys_are_bracketed():
    c6, n6, p6, m6 = "fd00:10::64", "fd00:10::b", "fd00:244::10a", "fd00:244::1"
    ct6 = dict(flags=ev.F_HAS_CT, ct_osrc=c6, ct_osport=40000, ct_odst=n6, ct_odport=30080,
               ct_rsrc=p6, ct_rsport=8080, ct_rdst=m6, ct_rdport=61000,
               ct_status=ev.IPS_DST_NAT | ev.IPS_SRC_NAT)
    wire = ev.decode(ev.encode(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_INGRESS, dir=ev.Dir.INGRESS, ts_ns=1,
                               family=10, saddr=p6, sport=8080, daddr=m6, dport=61000, **ct6))
    [d] = _lines([wire])
    assert d["client"] == f"[{c6}]:40000" and d["frontend"] == f"[{n6}]:30080"
    assert d["endpoint"] == f"[{p6}]:8080"
    assert d["evidence"][0]["detail"].startswith(f"[{p6}]:8080 > [{m6}]:61000 (dnat [{n6}]:30080 ")


# node2's side of a flow node1 DNATed over the overlay: the endpoint's node sees the masquerade
# address and port, and its own conntrack entry did no NAT; the mapping is only in node1's NAT
# map, which the one daemon tracing both nodes reads (Context.nat_peer).
FLANNEL = "10.244.0.0"
REPLY = (POD, 8080, FLANNEL, 40000)        # the reply tuple of node1's entry (port kept)
ORIG = (CLIENT, 40000, NODE, 30080)


def _nat_map(*slots):
    table = {}
    for orig, reply in slots:
        table[orig], table[reply] = reply, orig
    return lambda *a: table.get(a)


def _node2_drop(ts, sport=40000, **kw):
    return ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=20, ts_ns=ts,
                               tcpflags=ev.TCP_SYN, saddr=FLANNEL, sport=sport, daddr=POD, dport=8080, **kw))


def test_the_other_nodes_line_names_the_client_from_the_nat_map():
    own = dict(flags=ev.F_HAS_CT, ct_osrc=FLANNEL, ct_osport=40000, ct_odst=POD, ct_odport=8080,
               ct_rsrc=POD, ct_rsport=8080, ct_rdst=FLANNEL, ct_rdport=40000, ct_status=0)
    for kw in ({}, own):     # no entry (before conntrack), or node2's own un-NATed one
        ctx = _ctx()
        ctx = Context(**{**ctx.__dict__, "nat_peer": _nat_map((ORIG, REPLY)),
                         "drop_name": lambda v: "NEIGH_FAILED"})
        [v] = list(classify([_node2_drop(1, **kw)], ctx))
        d = verdict_dict(v, 0)
        assert d == json.loads(verdict_line(v, 0))
        assert (d["saddr"], d["sport"]) == (FLANNEL, 40000)
        assert d["client"] == f"{CLIENT}:40000", d
        assert d["frontend"] == f"{NODE}:30080" and d["endpoint"] == f"{POD}:8080"


def test_nat_map_mapping_is_oriented_by_the_kept_port_or_not_named():
    from nptrace.classify.flowkey import nat_mapping as _mapping
    m = _mapping(REPLY, ORIG)
    assert (m.orig_src, m.orig_sport, m.orig_dst, m.reply_src) == (CLIENT, 40000, NODE, POD)
    assert m.dnat and m.snat
    assert _mapping(ORIG, REPLY) == m                   # whichever tuple the event matched
    # no masquerade: the reply goes to the client itself
    plain = _mapping((POD, 8080, CLIENT, 40000), ORIG)
    assert plain.orig_src == CLIENT and plain.dnat and not plain.snat
    # port == targetPort and no SNAT: the addresses decide
    same = _mapping((POD, 80, CLIENT, 40000), (CLIENT, 40000, "10.96.0.80", 80))
    assert same.orig_dst == "10.96.0.80" and same.reply_src == POD
    # the masquerade moved the port: which end is the client is not known
    assert _mapping((POD, 8080, FLANNEL, 40001), ORIG) is None


def test_a_tunnels_outer_entry_joins_no_flows():
    """node2's ICMP errors back over VXLAN carry the tunnel's outer UDP entry (no NAT), the
    same for every connection over it: each connection stays its own incident, with its own
    client (it once joined all of them, naming one client on every line)."""
    outer = dict(flags=ev.F_HAS_CT, ct_osrc="192.168.50.12", ct_osport=50732, ct_odst="192.168.50.11",
                 ct_odport=8472, ct_rsrc="192.168.50.11", ct_rsport=8472, ct_rdst="192.168.50.12",
                 ct_rdport=50732, ct_status=0)
    slots, evs = [], []
    for i, port in enumerate((40000, 40002, 40004)):
        slots.append(((CLIENT, port, NODE, 30080), (POD, 8080, FLANNEL, port)))
        evs.append(_node2_drop(10 + i, sport=port))
        evs.append(ev.decode(ev.encode(type=ev.EvType.WIRE_ICMP, hook=ev.Hook.TC_EGRESS, dir=ev.Dir.EGRESS,
                                       ts_ns=20 + i, reason=3 << 8 | 1, saddr=FLANNEL, sport=port, daddr=POD,
                                       dport=8080, **outer)))
    ctx = Context(**{**_ctx().__dict__, "nat_peer": _nat_map(*slots), "drop_name": lambda v: "NEIGH_FAILED"})
    lines = [verdict_dict(v, 0) for v in classify(evs, ctx)]
    assert sorted(d["client"] for d in lines) == [f"{CLIENT}:{p}" for p in (40000, 40002, 40004)]
    assert all(d["client"].endswith(f":{d['sport']}") for d in lines)
