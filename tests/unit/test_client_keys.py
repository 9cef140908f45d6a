"""Issue 20 item 5: every incident's JSON line names the client's own address and port as the
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
