"""A rollout's in-flight connections: conntrack keeps steering an established
NodePort connection to an endpoint the rules no longer list. (a) nobody has the address:
neighbour failure; (b) a new pod has it and its listening socket resets the old connection.
Both are `proxy`, naming the Service, the stale endpoint and the remedy. A container restart
keeps the pod and its address as an endpoint: the endpoint lost the connection's state, which
is said so, not `proxy`."""
from __future__ import annotations

import pytest

from nptrace import events as ev
from nptrace.classify import Context, classify
from nptrace.lab.kuberules import Endpoint, Service, render_iptables
from nptrace.services import parse_iptables_restore

NODE, CLIENT, OLD, NEW = "192.168.10.11", "192.168.10.100", "10.244.1.5", "10.244.1.6"


def ctx_for(endpoints):
    svc = Service("default", "web", "http", 80, "10.96.0.10", node_port=30080,
                  endpoints=tuple(Endpoint(ip, 8080, "node1") for ip in endpoints))
    smap = parse_iptables_restore(render_iptables([svc], "node1", "10.244.0.0/16")) \
        .with_local_addrs([NODE, "127.0.0.1"])
    return Context(
        drop_name=lambda v: {9: "NEIGH_FAILED"}.get(v, f"R{v}"),
        rst_name=lambda v: {2: "TCP_FLAGS"}.get(v, f"R{v}"),
        service_of=lambda a, p: (lambda s: s.name if s else None)(smap.lookup(a, p)),
        endpoint_of=lambda a, p: next((s.name for s in smap.lookup_all(a, p) if s.kind == "endpoint"), None))


CT = dict(flags=ev.F_HAS_CT, ct_osrc=CLIENT, ct_osport=40000, ct_odst=NODE, ct_odport=30080,
          ct_rsrc=OLD, ct_rsport=8080, ct_rdst=CLIENT, ct_rdport=40000, ct_status=ev.IPS_DST_NAT)


def reset_from_new_pod():
    pod = ev.decode(ev.encode(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=2,
                              aux=ev.TCP_ACK, state=10, flags=ev.F_HAS_SOCK, ts_ns=1,
                              saddr=OLD, sport=8080, daddr=CLIENT, dport=40000))
    wire = ev.decode(ev.encode(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_EGRESS, dir=ev.Dir.EGRESS,
                               ts_ns=2, saddr=NODE, sport=30080, daddr=CLIENT, dport=40000, **CT))
    return [pod, wire]


def test_new_pod_on_a_removed_endpoints_address_resets_old_connections():
    [v] = classify(reset_from_new_pod(), ctx_for([NEW]))
    assert v.cause == "proxy" and v.service == "default/web:http"
    assert f"to {OLD}:8080, which default/web:http's rules no longer list" in v.hint
    assert "A new pod has that address" in v.hint
    assert f"conntrack -D --orig-dst {NODE} --dst-nat {OLD}" in v.hint


def test_removed_endpoints_address_unused_is_a_neighbour_failure():
    drop = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=9, ts_ns=1,
                               saddr=CLIENT, sport=40000, daddr=OLD, dport=8080, **CT))
    [v] = classify([drop], ctx_for([NEW]))
    assert v.cause == "proxy" and "Nobody has that address" in v.hint and OLD in v.hint


@pytest.mark.parametrize("endpoints", [[OLD], [OLD, NEW]])
def test_container_restart_is_lost_state_not_proxy(endpoints):
    [v] = classify(reset_from_new_pod(), ctx_for(endpoints))
    assert v.cause != "proxy", v.hint
    assert v.cause == "app_reset" and "lost the connection's state" in v.hint


def test_a_dead_endpoint_still_listed_is_named_not_the_frontend():
    """The rules still list the endpoint nobody answers for (stale rules): the hint names the
    endpoint conntrack DNATs to and says it does not answer, even for an event whose own
    destination is still the NodePort frontend (seen before the DNAT)."""
    drop = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=9, ts_ns=1,
                               saddr=CLIENT, sport=40000, daddr=NODE, dport=30080, **CT))
    [v] = classify([drop], ctx_for([OLD]))
    assert v.cause == "proxy", v.hint
    assert f"DNATs {NODE}:30080 to the endpoint {OLD}:8080, which does not answer" in v.hint
    assert f"to the endpoint {NODE}" not in v.hint


def test_a_reset_is_labeled_with_the_rules_its_packet_met(monkeypatch):
    """The rollout's resets against a rules view with a time axis (NodeKnowledge.at): OLD is
    an endpoint until T, NEW from T (its address handed to a new pod at once). A reset whose
    packet came after T names the stale endpoint (proxy) even though the view also holds the
    old generation; one from before T is the endpoint's own (the rules still listed it)."""
    from nptrace.node import knowledge, rules_source

    class Names:
        def netns_name(self, inode):
            return "host"

    def smap(endpoints):
        svc = Service("default", "web", "http", 80, "10.96.0.10", node_port=30080,
                      endpoints=tuple(Endpoint(ip, 8080, "node1") for ip in endpoints))
        return parse_iptables_restore(render_iptables([svc], "node1", "10.244.0.0/16"))
    state = {"fp": (1, None), "map": smap([OLD])}
    monkeypatch.setattr(rules_source, "load_service_map", lambda ns: state["map"])
    monkeypatch.setattr(rules_source, "fingerprint", lambda ns: state["fp"])
    monkeypatch.setattr(rules_source, "nft_generation", lambda ns: state["fp"][0])
    monkeypatch.setattr(rules_source, "legacy_digest", lambda ns: None)
    monkeypatch.setattr(rules_source, "local_addresses", lambda ns: (NODE, "127.0.0.1"))
    kn = knowledge.NodeKnowledge(Names())
    kn.preload({1})
    T = 10**9
    state.update(fp=(2, None), map=smap([NEW]))
    assert kn.check_changes(since_ns=T) == 1
    ctx = Context(drop_name=lambda v: f"R{v}", rst_name=lambda v: {2: "TCP_FLAGS"}.get(v, f"R{v}"),
                  service_of=kn.service_of, endpoint_of=kn.endpoint_of, at=kn.at)

    def reset_at(ts):
        pod, wire = reset_from_new_pod()
        return [pod._replace(ts_ns=ts), wire._replace(ts_ns=ts + 1)]
    [after] = classify(reset_at(T + 5), ctx)
    [before] = classify(reset_at(T - 5_000_000), ctx)
    assert after.cause == "proxy" and f"to {OLD}:8080" in after.hint, after.hint
    assert before.cause == "app_reset", before.hint


def _smap(endpoints):
    svc = Service("default", "web", "http", 80, "10.96.0.10", node_port=30080,
                  endpoints=tuple(Endpoint(ip, 8080, "node2") for ip in endpoints))
    return parse_iptables_restore(render_iptables([svc], "node2", "10.244.0.0/16"))


def test_the_node_remembers_the_endpoints_a_rollout_removed():
    """node/knowledge.py removed_endpoint: what a namespace's rules stopped listing, from when
    they did, until it is listed again; a record older than the removal was still an endpoint's."""
    from nptrace.node import knowledge as kmod
    from nptrace.node.netns import Names
    kn = kmod.NodeKnowledge.__new__(kmod.NodeKnowledge)
    kmod.NodeKnowledge.__init__(kn, Names())
    old, new = _smap([OLD]), _smap([NEW])
    kn._maps = {7: (0.0, new)}
    kn._keep(7, 0, old)
    kn._keep(7, 1000, new)
    kn._snapshot()
    kn.at(2000)
    assert kn.removed_endpoint(OLD, 8080) == "default/web:http"
    assert kn.removed_endpoint(NEW, 8080) is None
    kn.at(500)                       # before the rollout: it was an endpoint then
    assert kn.removed_endpoint(OLD, 8080) is None
    kn.at(None)
    kn._keep(7, 3000, old)           # listed again
    assert kn.removed_endpoint(OLD, 8080) is None


def test_a_cause_key_of_a_reply_translated_back_is_not_taken_for_a_stale_endpoint():
    """The reset a node sends the client for its pod (tc egress, source the NodePort again):
    the cause key does not carry the endpoint, so the exact counts must not call it proxy."""
    from nptrace.classify.keylabel import event_of, label_event
    from nptrace.kernel.causekeys import CauseKey
    key = CauseKey(type=int(ev.EvType.WIRE_RST), hook=int(ev.Hook.TC_EGRESS), reason=0,
                   netns=1, ifindex=2, dir=int(ev.Dir.EGRESS), saddr=NODE, sport=30080,
                   daddr=CLIENT, dport=0, family=2, flags=ev.F_HAS_CT, tcpflags=ev.TCP_RST,
                   ct_bits=0x02, odst=NODE, oport=30080)
    e = event_of(key)
    assert e.ct.reply_src == "" and label_event(e, ctx_for([NEW]))[0] != "proxy"
