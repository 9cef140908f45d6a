"""Metrics: verdict counters, the scrape-time kernel collector, bounded labels, a real scrape
of a served endpoint on 127.0.0.1 (no root)."""
import socket
import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from nptrace import events as ev
from nptrace.classify import Context, classify
from nptrace.config import parse_metrics_addr
from nptrace.errors import NptraceError
from nptrace.sinks import prometheus as P
from nptrace.sinks.health import serve

NS = 4026531840
CTX = Context(drop_name=lambda v: {16: "IP_RPFILTER"}.get(v, f"REASON_{v}"),
              rst_name=lambda v: {1: "NO_SOCKET"}.get(v, f"REASON_{v}"),
              iface_name=lambda ns, i: {3: "npt-node1/eth1", 5: "eth0"}.get(i),
              service_of=lambda a, p: {("10.0.0.2", 30080): "default/web:http"}.get((a, p)))


def verdicts():
    raws = [
        ev.encode(ts_ns=1, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16, ifindex=3,
                  saddr="192.168.2.10", sport=5000, daddr="10.0.0.2", dport=30080),
        ev.encode(ts_ns=2, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16, ifindex=3,
                  saddr="192.168.2.10", sport=5001, daddr="10.0.0.2", dport=30080),
        ev.encode(ts_ns=3, type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, ifindex=5,
                  saddr="203.0.113.9", sport=443, daddr="10.0.0.9", dport=5555),
        ev.encode(ts_ns=4, type=ev.EvType.ASYM_IFACE, hook=ev.Hook.TC_EGRESS,
                  saddr="10.0.0.9", sport=80, daddr="203.0.113.7", dport=6000),
    ]
    return list(classify([ev.decode(r) for r in raws], CTX))


def test_sink_counts_verdicts_by_bounded_labels():
    reg = CollectorRegistry()
    sink = P.MetricsSink(reg)
    vs = verdicts()
    for v in vs:
        sink.write(v)
    by_kind = {v.kind: v for v in vs}     # incidents come out in report order, not input order
    vs = [by_kind["drop"], by_kind["drop"], by_kind["rst"], by_kind["anomaly"]]
    drop_cause = vs[0].cause
    assert reg.get_sample_value("nptrace_drops_total",
                                {"cause": drop_cause, "iface": "npt-node1/eth1"}) == 2
    assert reg.get_sample_value("nptrace_resets_total",
                                {"cause": vs[2].cause, "iface": "eth0", "direction": "received"}) == 1
    assert reg.get_sample_value("nptrace_anomalies_total",
                                {"cause": vs[3].cause, "iface": "none"}) == 1
    assert reg.get_sample_value("nptrace_service_events_total",
                                {"service": "default/web:http", "kind": "drop", "cause": drop_cause}) == 2
    # No label anywhere carries an address or a port.
    for fam in reg.collect():
        for s in fam.samples:
            for val in s.labels.values():
                assert not any(x in val for x in ("192.168", "203.0.113", "10.0.0", "5000", "443"))


def test_iface_and_service_labels_are_capped():
    reg = CollectorRegistry()
    sink = P.MetricsSink(reg, max_ifaces=3, max_services=2)
    base = next(v for v in verdicts() if v.kind == "rst")
    from dataclasses import replace
    for i in range(10):
        sink.write(replace(base, iface=f"cni-{i}/eth0", service=f"ns/svc{i}"))
    got = {s.labels["iface"] for f in reg.collect() if f.name == "nptrace_resets" for s in f.samples
           if s.name == "nptrace_resets_total"}
    assert got == {"cni-0/eth0", "cni-1/eth0", "cni-2/eth0", "other"}
    assert reg.get_sample_value("nptrace_resets_total",
                                {"cause": base.cause, "iface": "other", "direction": "received"}) == 7
    svcs = {s.labels["service"] for f in reg.collect() for s in f.samples
            if s.name == "nptrace_service_events_total"}
    assert svcs == {"ns/svc0", "ns/svc1", "other"}


def kernel_counts():
    counts = {(int(ev.EvType.DROP), int(ev.Hook.KFREE_SKB), 16, 3, NS): 7,
              (int(ev.EvType.DROP), int(ev.Hook.KFREE_SKB), 16, 3, NS + 1): 2,   # other netns, same name
              (int(ev.EvType.RST_SENT), int(ev.Hook.TCP_SEND_RST), 1, 0, NS): 4,
              (int(ev.EvType.ICMP_UNREACH), int(ev.Hook.ICMP_SEND), (3 << 8) | 3, 9, NS): 1}
    return counts, {"emitted": 12, "lost": 2, "filtered": 30, "sampled": 5}


def watched(reg=None, counters=kernel_counts, **kw):
    reg = reg or CollectorRegistry()
    sink = P.MetricsSink(reg)
    kw.setdefault("iface_name", lambda ns, i: {3: "eth1"}.get(i))
    sink.watch_kernel(counters, drop_name=CTX.drop_name, rst_name=CTX.rst_name,
                      flows=lambda: 17, probes=lambda: {"skb:kfree_skb": True, "tc:eth1": False}, **kw)
    return reg, sink


def test_kernel_collector_reads_exact_counts_at_scrape_time():
    state = {"n": 7}

    def counters():
        c, s = kernel_counts()
        c[(int(ev.EvType.DROP), int(ev.Hook.KFREE_SKB), 16, 3, NS)] = state["n"]
        return c, s
    reg, _ = watched(counters=counters)
    labels = {"type": "DROP", "hook": "skb:kfree_skb", "reason": "IP_RPFILTER", "iface": "eth1"}
    assert reg.get_sample_value("nptrace_kernel_events_total", labels) == 9
    state["n"] = 100
    assert reg.get_sample_value("nptrace_kernel_events_total", labels) == 102
    assert reg.get_sample_value("nptrace_kernel_events_total",
                                {"type": "RST_SENT", "hook": "tcp:tcp_send_reset",
                                 "reason": "NO_SOCKET", "iface": "none"}) == 4
    assert reg.get_sample_value("nptrace_kernel_events_total",
                                {"type": "ICMP_UNREACH", "hook": "icmp:icmp_send",
                                 "reason": "ICMP_3_3", "iface": "unknown"}) == 1
    assert reg.get_sample_value("nptrace_events_lost_total") == 2
    assert reg.get_sample_value("nptrace_events_emitted_total") == 12
    assert reg.get_sample_value("nptrace_events_filtered_total") == 30
    assert reg.get_sample_value("nptrace_events_sampled_total") == 5
    assert reg.get_sample_value("nptrace_flows_tracked") == 17
    assert reg.get_sample_value("nptrace_probe_up", {"probe": "skb:kfree_skb"}) == 1
    assert reg.get_sample_value("nptrace_probe_up", {"probe": "tc:eth1"}) == 0
    assert reg.get_sample_value("nptrace_kernel_counters_up") == 1


def test_unreadable_counters_do_not_break_the_scrape():
    def broken():
        raise RuntimeError("map closed")
    reg, sink = watched(counters=broken)
    sink.write(verdicts()[2])
    assert reg.get_sample_value("nptrace_kernel_counters_up") == 0
    assert reg.get_sample_value("nptrace_events_lost_total") is None
    assert reg.get_sample_value("nptrace_probe_up", {"probe": "skb:kfree_skb"}) == 1


def test_registering_reads_no_kernel_state():
    calls = []
    reg = CollectorRegistry(auto_describe=True)
    watched(reg=reg, counters=lambda: calls.append(1) or kernel_counts())
    assert calls == []


def test_nothing_lands_in_the_global_registry():
    before = set(REGISTRY._names_to_collectors)
    watched()
    assert set(REGISTRY._names_to_collectors) == before
    assert not any(n.startswith("nptrace") for n in REGISTRY._names_to_collectors)


def test_metric_names_constant_matches_exposition():
    reg, sink = watched()
    for v in verdicts():
        sink.write(v)
    exposed = {s.name for f in reg.collect() for s in f.samples if not s.name.endswith("_created")}
    assert exposed == set(P.METRIC_NAMES)


@pytest.mark.parametrize("addr,want", [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)),
    ("[::1]:9464", ("::1", 9464)),
    ("0.0.0.0:1", ("0.0.0.0", 1)),
    ("node1.example:80", ("node1.example", 80)),
    ("fd00::1:9464", ("fd00::1", 9464)),          # $(NODE_IP):9464 on an IPv6 node
])
def test_parse_addr(addr, want):
    assert parse_metrics_addr(addr) == want


@pytest.mark.parametrize("addr", ["9464", ":9464", "127.0.0.1:", "127.0.0.1:99999",
                                  "[::1:9464", "127.0.0.1:http", "127.0.0.1:٩٤٦٤",
                                  "999.1.1.1:80", "host name:80"])
def test_parse_addr_rejects(addr):
    with pytest.raises(NptraceError, match="bad metrics address"):
        parse_metrics_addr(addr)


def test_serve_and_scrape_a_real_endpoint():
    reg, sink = watched()
    for v in verdicts():
        sink.write(v)
    srv = serve("127.0.0.1:0", reg)
    try:
        assert srv.port > 0
        with urllib.request.urlopen(srv.url, timeout=10) as r:
            body = r.read().decode()
    finally:
        srv.close()
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in fams.values() for s in f.samples}
    assert samples[("nptrace_events_lost_total", ())] == 2
    assert samples[("nptrace_kernel_events_total",
                    (("hook", "skb:kfree_skb"), ("iface", "eth1"), ("reason", "IP_RPFILTER"),
                     ("type", "DROP")))] == 9
    assert fams["nptrace_resets"].type == "counter"
    assert fams["nptrace_flows_tracked"].type == "gauge"
    names = {s.name for f in fams.values() for s in f.samples}
    assert set(P.METRIC_NAMES) <= names


def test_port_in_use_is_one_line():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        with pytest.raises(NptraceError) as ex:
            serve(f"127.0.0.1:{port}", CollectorRegistry())
    finally:
        s.close()
    assert str(ex.value).startswith(f"metrics address 127.0.0.1:{port} in use")
    assert "\n" not in str(ex.value)


def test_address_not_on_this_host_is_one_line():
    with pytest.raises(NptraceError, match="no such local address"):
        serve("192.0.2.123:0", CollectorRegistry())     # TEST-NET-1: never local; no traffic sent
