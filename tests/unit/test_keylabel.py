"""Per-key labeling of the kernel's cause keys (classify/keylabel.py) and the exact counts
built on it (sinks/exact.py): pure, no bcc, no root."""
import io
import json

from prometheus_client import CollectorRegistry

from nptrace import events as ev
from nptrace.classify import Classifier, Context, classify
from nptrace.classify.keylabel import KeyLabel, KeyLabeler, event_of
from nptrace.kernel.causekeys import decode_key, encode_key, fact_of, key_of
from nptrace.sinks.exact import ExactCounts, summary_dict
from nptrace.sinks.jsonl import JsonLines
from nptrace.sinks.prometheus import MetricsSink

NAMES = {3: "NO_SOCKET", 12: "NETFILTER_DROP", 16: "IP_RPFILTER", 2: "NOT_SPECIFIED",
         5: "TCP_RESET"}
POLICY = {"tag": "other", "to_pod": True, "where": "filter FORWARD", "text": "-j DROP"}


def nf_rule(netns, saddr, daddr, dport, odst, oport, syn, has_ct):
    # a NetworkPolicy-like rule: drops 192.0.2.0/24 to the pod port 8080
    return POLICY if saddr.startswith("192.0.2.") and dport == 8080 else {"tag": "none"}


CTX = Context(drop_name=lambda v: NAMES.get(v, f"REASON_{v}"),
              rst_name=lambda v: {0: "NOT_SPECIFIED", 1: "NO_SOCKET"}.get(v, f"REASON_{v}"),
              iface_name=lambda ns, i: {7: "eth1"}.get(i),
              service_of=lambda a, p: "default/web:80" if (a, p) == ("10.96.0.10", 80) else None,
              nf_rule=nf_rule)
D, RS, RR, WR, SR = (ev.EvType.DROP, ev.EvType.RST_SENT, ev.EvType.RST_RECV, ev.EvType.WIRE_RST,
                     ev.EvType.SYNACK_RETX)


def E(**kw):
    kw.setdefault("ts_ns", 1_000)
    return ev.decode(ev.encode(**kw))


def K(ev_, prior=(0, 0, 0, 0)):
    return key_of(ev_, CTX.drop_name, prior)


RPF = E(type=D, hook=ev.Hook.KFREE_SKB, reason=16, ifindex=7, tcpflags=ev.TCP_SYN,
        saddr="198.51.100.7", sport=5000, daddr="10.0.0.2", dport=30080)
NOLISTEN_RST = E(type=RS, hook=ev.Hook.TCP_SEND_RST, reason=1, aux=ev.TCP_SYN,
                 saddr="10.244.1.5", sport=8081, daddr="192.0.2.10", dport=40000)
NOLISTEN_DROP = E(type=D, hook=ev.Hook.KFREE_SKB, reason=3, tcpflags=ev.TCP_SYN,
                  saddr="192.0.2.10", sport=40000, daddr="10.244.1.5", dport=8081)
POLICY_DROP = E(type=D, hook=ev.Hook.KFREE_SKB, reason=12, tcpflags=ev.TCP_SYN, ifindex=7,
                saddr="192.0.2.20", sport=41000, daddr="10.244.1.9", dport=8080)


def test_key_drops_the_client_port_and_keeps_the_server_end():
    k = K(RPF)
    assert (k.saddr, k.sport, k.daddr, k.dport) == ("0.0.0.0", 0, "10.0.0.2", 30080)
    k = K(NOLISTEN_RST)            # the reset goes to the client: its destination is zeroed
    assert (k.saddr, k.sport, k.daddr, k.dport) == ("10.244.1.5", 8081, "0.0.0.0", 0)
    assert k.tcpflags == ev.TCP_SYN
    # the netfilter verdicts keep the client address: the rules match on it
    k = K(POLICY_DROP)
    assert (k.saddr, k.sport, k.daddr, k.dport) == ("192.0.2.20", 0, "10.244.1.9", 8080)


def test_key_bytes_round_trip():
    k = K(POLICY_DROP)
    assert decode_key(encode_key(k)) == k


def test_labels_of_synthetic_keys():
    lab = KeyLabeler(CTX)
    assert lab.label(K(RPF)) == KeyLabel("drop", "rp_filter", None, "eth1", None,
                                         "skb:kfree_skb", "IP_RPFILTER")
    got = lab.label(K(NOLISTEN_RST))
    assert (got.kind, got.cause, got.direction) == ("rst", "no_listener", "sent")
    assert lab.label(K(NOLISTEN_DROP)).cause == "no_listener"
    assert lab.label(K(POLICY_DROP)).cause == "policy_drop"
    # a source the rule does not match: the same rules give another cause
    other = E(type=D, hook=ev.Hook.KFREE_SKB, reason=12, tcpflags=ev.TCP_SYN,
              saddr="203.0.113.1", sport=41000, daddr="10.244.1.9", dport=8080)
    assert lab.label(K(other)).cause == "netfilter_reject"
    # evidence only: no label, never counted under a cause
    assert lab.label(K(E(type=SR, hook=ev.Hook.SYNACK_RETX, saddr="10.0.0.2", sport=80,
                         daddr="192.0.2.1", dport=40000))) is None
    weak = E(type=D, hook=ev.Hook.KFREE_SKB, reason=5, saddr="192.0.2.10", sport=40000,
             daddr="10.244.1.5", dport=8081, tcpflags=ev.TCP_ACK)
    assert lab.label(K(weak)) is None


def test_prior_fact_names_a_later_record():
    lab = KeyLabeler(CTX)
    recv = E(type=RR, hook=ev.Hook.TCP_RECV_RST, flags=ev.F_HAS_SOCK, saddr="10.244.1.5",
             sport=8081, daddr="192.0.2.10", dport=40000)
    assert lab.label(K(recv)).cause == "peer_reset"
    # the client's received reset of a refused connection: the flow's reset sent names it
    got = lab.label(K(recv, prior=fact_of(NOLISTEN_RST)))
    assert (got.kind, got.cause, got.direction) == ("rst", "no_listener", "received")
    # the client side of a SYN flood: the RST dropped there (no socket) joins its cause too
    rst_drop = E(type=D, hook=ev.Hook.KFREE_SKB, reason=3, tcpflags=ev.TCP_RST | ev.TCP_ACK,
                 saddr="10.244.1.5", sport=8081, daddr="192.0.2.10", dport=40000)
    assert lab.label(K(rst_drop)).cause == "unknown"
    assert lab.label(K(rst_drop, prior=fact_of(NOLISTEN_RST))).cause == "no_listener"
    weak = E(type=D, hook=ev.Hook.KFREE_SKB, reason=5, saddr="192.0.2.10", sport=40000,
             daddr="10.244.1.5", dport=8081, tcpflags=ev.TCP_SYN)
    got = lab.label(K(weak, prior=fact_of(NOLISTEN_RST)))
    assert got is not None and got.cause == "no_listener" and got.kind == "drop"
    # a better-ranked own label wins over the prior's
    assert lab.label(K(RPF, prior=fact_of(POLICY_DROP))).cause == "rp_filter"
    # the fact equal to the record itself adds nothing to the key
    assert K(RPF, prior=fact_of(RPF)) == K(RPF)


def test_service_of_a_dnat_key():
    drop = E(type=D, hook=ev.Hook.KFREE_SKB, reason=3, tcpflags=ev.TCP_SYN,
             saddr="192.0.2.10", sport=40000, daddr="10.244.1.5", dport=8081,
             flags=ev.F_HAS_CT, ct_osrc="192.0.2.10", ct_osport=40000, ct_odst="10.96.0.10",
             ct_odport=80, ct_rsrc="10.244.1.5", ct_rsport=8081, ct_rdst="192.0.2.10",
             ct_rdport=40000, ct_status=ev.IPS_DST_NAT)
    k = K(drop)
    assert (k.odst, k.oport, k.ct_bits) == ("10.96.0.10", 80, 2)
    got = KeyLabeler(CTX).label(k)
    assert got.cause == "no_listener" and got.service == "default/web:80"
    e = event_of(k)
    assert e.ct.dnat and e.ct.orig_dst == "10.96.0.10" and e.ct.reply_src == "10.244.1.5"


SCENARIOS = [
    [RPF], [NOLISTEN_RST], [NOLISTEN_DROP], [NOLISTEN_RST, NOLISTEN_DROP], [POLICY_DROP],
    [E(type=RR, hook=ev.Hook.TCP_RECV_RST, saddr="203.0.113.9", sport=443, daddr="10.0.0.2",
       dport=5555)],
    [E(type=ev.EvType.ASYM_IFACE, hook=ev.Hook.TC_EGRESS, dir=ev.Dir.EGRESS, ifindex=7, aux=3,
       tcpflags=ev.TCP_SYN | ev.TCP_ACK, saddr="10.0.0.2", sport=80, daddr="192.0.2.1",
       dport=40000)],
    [E(type=WR, hook=ev.Hook.TC_INGRESS, dir=ev.Dir.INGRESS, ifindex=7, tcpflags=ev.TCP_RST,
       saddr="203.0.113.9", sport=443, daddr="10.0.0.2", dport=5555)],
    [E(type=RS, hook=ev.Hook.TCP_SEND_RST, reason=0, flags=ev.F_HAS_SOCK, aux=ev.TCP_ACK,
       saddr="10.0.0.2", sport=80, daddr="192.0.2.1", dport=40000)],
]


def test_primary_event_key_label_equals_the_classifier():
    """For each flow: the label of its primary event's key is the classifier's label of the
    flow (with and without the flow's first causal record as the key's prior)."""
    lab = KeyLabeler(CTX)
    n = 0
    for events in SCENARIOS:
        for v in classify(events, CTX):
            first = next((x for x in events if int(x.type) in (1, 2, 4, 7, 8)), None)
            prior = fact_of(first) if first else (0, 0, 0, 0)
            for p in ((0, 0, 0, 0), prior):
                got = lab.label(K(v.event, p))
                assert got is not None and got.cause == v.cause, (events, v.cause, got)
                assert got.kind == v.kind and got.direction == v.direction
                assert got.iface == v.iface
            n += 1
    assert n == len(SCENARIOS)


def test_exact_counts_totals_and_summary_rows():
    ex = ExactCounts(KeyLabeler(CTX))
    k1, k2 = K(NOLISTEN_RST), K(RPF)
    assert ex.update({k1: (100, 10), k2: (5, 5), None: {}}, 1_000) != []
    rows = ex.update({k1: (300, 12), k2: (7, 5), None: {2: (4, 0)}}, 2_000)
    by = {(r.label.cause, r.label.kind): r for r in rows}
    assert by[("no_listener", "rst")].repeat == 198 and by[("no_listener", "rst")].since_ns == 1_000
    assert by[("rp_filter", "drop")].repeat == 2
    assert by[("other", "rst")].repeat == 4
    tot = ex.snapshot()
    assert tot[("rst", "no_listener", None, "sent", None)] == 300
    assert tot[("drop", "rp_filter", "eth1", None, None)] == 7
    assert tot[("rst", "other", None, "sent", None)] == 4
    # nothing new: no rows; a map recreated (smaller): counted from zero again
    assert ex.update({k1: (300, 12), k2: (7, 5)}, 3_000) == []
    ex.update({k1: (3, 3)}, 4_000)
    assert ex.snapshot()[("rst", "no_listener", None, "sent", None)] == 303
    # every record counted = the sent ones + the summarized ones
    assert ex.unsent == 90 + 0 + 198 + 2 + 4


def test_metrics_export_exact_counts_and_ignore_verdicts():
    reg = CollectorRegistry()
    m = MetricsSink(reg)
    ex = ExactCounts(KeyLabeler(CTX))
    m.count_exactly(ex)
    ex.update({K(NOLISTEN_RST): (300_000, 200), K(RPF): (7, 7), K(POLICY_DROP): (50, 1)}, 1)
    for v in classify([NOLISTEN_RST], CTX):
        m.write(v)                        # the sample adds no count
    g = reg.get_sample_value
    assert g("nptrace_resets_total", {"cause": "no_listener", "iface": "none",
                                      "direction": "sent"}) == 300_000
    assert g("nptrace_drops_total", {"cause": "rp_filter", "iface": "eth1"}) == 7
    assert g("nptrace_drops_total", {"cause": "policy_drop", "iface": "eth1"}) == 50
    assert g("nptrace_service_events_total", {"service": "none", "kind": "rst",
                                              "cause": "no_listener"}) == 300_000


def test_summary_line_has_the_collapse_shape():
    ex = ExactCounts(KeyLabeler(CTX))
    ex.update({}, 1_000_000_000)
    rows = ex.update({K(NOLISTEN_RST): (500, 20)}, 2_000_000_000)
    out = io.StringIO()
    JsonLines(0, out).write_summary(rows)
    [d] = [json.loads(x) for x in out.getvalue().splitlines()]
    assert d["repeat"] == 480 and d["repeat_since"] == 1.0 and d["ts"] == 2.0
    assert (d["cause"], d["kind"], d["direction"], d["service"], d["iface"]) == \
        ("no_listener", "rst", "sent", None, None)
    assert summary_dict(rows[0], 0) == d


def test_a_storm_from_many_client_ports_is_one_key():
    other = E(type=D, hook=ev.Hook.KFREE_SKB, reason=16, ifindex=7, tcpflags=ev.TCP_SYN,
              saddr="198.51.100.8", sport=6001, daddr="10.0.0.2", dport=30080)
    assert K(other) == K(RPF)


def test_idle_keys_are_forgotten_and_restart_from_zero():
    ex = ExactCounts(KeyLabeler(CTX))
    k = K(RPF)
    ex.update({k: (10, 10)}, 0)
    assert ex.idle(30_000_000_000) == []
    assert ex.idle(60_000_000_000) == [k]
    ex.forget([k])
    ex.update({k: (3, 3)}, 61_000_000_000)       # recreated in the kernel: 3 new records
    assert ex.snapshot()[("drop", "rp_filter", "eth1", None, None)] == 13


def test_the_client_side_drop_of_a_reset_keys_by_the_flow_fact():
    # the kernel orients it by the server end the flow's reset named: one key for every client
    a = E(type=D, hook=ev.Hook.KFREE_SKB, reason=3, tcpflags=ev.TCP_RST | ev.TCP_ACK,
          saddr="10.0.0.2", sport=9999, daddr="10.251.130.7", dport=1234)
    b = E(type=D, hook=ev.Hook.KFREE_SKB, reason=3, tcpflags=ev.TCP_RST | ev.TCP_ACK,
          saddr="10.0.0.2", sport=9999, daddr="10.251.131.9", dport=4321)
    assert K(a) != K(b)                       # by ports alone: the client looks like a server
    ka = key_of(a, CTX.drop_name, fact_of(NOLISTEN_RST), client_is_src=False)
    kb = key_of(b, CTX.drop_name, fact_of(NOLISTEN_RST), client_is_src=False)
    assert ka == kb and (ka.saddr, ka.sport, ka.dport) == ("10.0.0.2", 9999, 0)
    assert KeyLabeler(CTX).label(ka).cause == "no_listener"


def test_a_keys_namespace_rules_are_read_before_its_first_label():
    """A key may be labeled before any record of its namespace was (the labeler runs once a
    second, records wait for their batch): its namespace's rules are read first, once, so
    its Service is named (an overlay-outer drop in a node namespace the tracer was not told of)."""
    maps: dict = {}
    ctx = Context(drop_name=CTX.drop_name, rst_name=CTX.rst_name,
                  service_of=lambda a, p: maps.get((a, p)))
    loads = []

    def load(netns):
        loads.append(netns)
        maps[("10.0.0.2", 30080)] = "default/web:http"
    lab = KeyLabeler(ctx, load_netns=load)
    k = K(RPF)
    assert lab.label(k).service == "default/web:http"
    lab.clear()
    assert lab.label(k).service == "default/web:http" and loads == [k.netns]
