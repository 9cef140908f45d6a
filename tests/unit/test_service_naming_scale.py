"""Service names on a real cluster's ruleset: with 2000 Services whose
nodePorts spread over 30000-32767, a pod-side reset of a masqueraded NodePort flow must be
named from the flow's NAT mapping (conntrack's original destination, the frontend), never from
the masqueraded port, which the masquerade may pick inside the NodePort range."""
from __future__ import annotations

import random

import pytest

from nptrace import events as ev
from nptrace.classify import Context, classify
from nptrace.lab.kuberules import Endpoint, Service, render_iptables
from nptrace.services import parse_iptables_restore

NODE_IP, MASQ = "192.168.10.11", "10.244.1.1"


@pytest.fixture(scope="module")
def cluster():
    rnd = random.Random(20)
    ports = rnd.sample(range(30000, 32768), 2001)
    web_np, ports = ports[0], ports[1:]
    svcs = [Service("default", "web", "http", 80, "10.96.0.10", node_port=web_np,
                    endpoints=(Endpoint("10.244.1.5", 8081, "node1"),))]
    for i, np in enumerate(ports[:2000]):
        svcs.append(Service("scale", f"svc-{i:04d}", "http", 80, f"10.97.{i // 250}.{i % 250 + 1}",
                            node_port=np, endpoints=(Endpoint(f"10.245.{i // 250}.{i % 250 + 1}", 8080, "node2"),)))
    text = render_iptables(svcs, "node1", "10.244.0.0/16")
    smap = parse_iptables_restore(text).with_local_addrs([NODE_IP, MASQ, "127.0.0.1"])
    assert len(smap) == 2001 and len(text.splitlines()) > 20000
    return smap, web_np, {s.node_port: s.port_name_string for s in svcs[1:]}


def E(**kw):
    return ev.decode(ev.encode(**kw))


def test_pod_side_reset_is_named_from_the_frontend(cluster):
    smap, web_np, by_np = cluster
    ctx = Context(rst_name=lambda v: {1: "NO_SOCKET"}.get(v, f"REASON_{v}"),
                  service_of=lambda a, p: (lambda s: s.name if s else None)(smap.lookup(a, p)),
                  endpoint_of=lambda a, p: next((s.name for s in smap.lookup_all(a, p)
                                                 if s.kind == "endpoint"), None))
    wrong = 0
    for n, masq_port in enumerate(sorted(by_np)[:20]):    # every masquerade port a NodePort
        client_port = 40000 + n
        t0 = 1_000_000 * (n + 1)
        # the client's SYN at the node, with its conntrack entry (DNAT + masquerade)
        wire = E(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_EGRESS, dir=ev.Dir.EGRESS, ts_ns=t0 + 2,
                 saddr=NODE_IP, sport=web_np, daddr="192.168.10.100", dport=client_port,
                 flags=ev.F_HAS_CT, ct_osrc="192.168.10.100", ct_osport=client_port,
                 ct_odst=NODE_IP, ct_odport=web_np, ct_rsrc="10.244.1.5", ct_rsport=8081,
                 ct_rdst=MASQ, ct_rdport=masq_port, ct_status=ev.IPS_DST_NAT | ev.IPS_SRC_NAT)
        # the pod's own reset, in its namespace (no conntrack): pod -> masquerade address:port
        pod = E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN,
                ts_ns=t0 + 1, saddr="10.244.1.5", sport=8081, daddr=MASQ, dport=masq_port)
        for events in ([pod], [pod, wire]):
            [v] = classify(events, ctx)
            wrong += v.service != "default/web:http"
            assert v.service == "default/web:http", (events[-1].flow, v.service, by_np[masq_port])
    assert wrong == 0
