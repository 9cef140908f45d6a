"""One connection, one incident: a connection's later events (SYN retransmissions, the same drop
again, its own resets) join the incident reported for it, for as long as the connection can
still produce them (Context.window_ns after its last event); a later line only for a new cause
or a new place, with the same incident id; a reused client port (another initial sequence
number) is a new incident; unexplained drops alone are counted, not reported. And the counts
of every output say connections and events apart."""
import io
import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from nptrace import events as ev
from nptrace.classify import Classifier, Context, classify
from nptrace.classify.filters import StopAfter
from nptrace.sessions.replay import Replay
from nptrace.sessions.report import render_text, report_data
from nptrace.sinks.console import Console
from nptrace.sinks.jsonl import JsonLines
from nptrace.sinks.prometheus import MetricsSink

S = 10**9
NAMES = {16: "IP_RPFILTER", 99: "TCP_OLD_SEQUENCE"}
CTX = Context(drop_name=lambda v: NAMES.get(v, f"REASON_{v}"),
              rst_name=lambda v: {1: "NO_SOCKET"}.get(v, f"REASON_{v}"),
              iface_name=lambda ns, i: {3: "node1/eth1", 7: "node2/eth0"}.get(i))
SESSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "sessions"


def E(**kw):
    return ev.decode(ev.encode(**kw))


def syn_drop(ts, isn=1000, sport=40000, ifindex=3, reason=16, netns=1):
    """A client's SYN dropped (rp_filter by default)."""
    return E(ts_ns=ts, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=reason,
             ifindex=ifindex, netns=netns, saddr="192.168.10.100", sport=sport,
             daddr="172.16.21.11", dport=30080, l4proto=6, tcpflags=ev.TCP_SYN, seq=isn)


def syn_retx(ts, isn=1000, sport=40000):
    return E(ts_ns=ts, type=ev.EvType.SYN_RETX, hook=ev.Hook.TC_INGRESS, ifindex=3, netns=1,
             saddr="192.168.10.100", sport=sport, daddr="172.16.21.11", dport=30080,
             l4proto=6, tcpflags=ev.TCP_SYN, seq=isn, aux=2)


# Linux's SYN retries with tcp_syn_retries 6: 1, 3, 7, 15, 31 and 63 s after the first
RETRIES = (1, 3, 7, 15, 31, 63)


def test_a_timed_out_connection_is_one_incident():
    evs = [syn_drop(0)]
    for t in RETRIES:
        evs += [syn_retx(t * S), syn_drop(t * S + 1000)]
    vs = list(classify(evs, CTX))
    assert len(vs) == 1
    [v] = vs
    assert v.cause == "rp_filter" and not v.continues and v.incident == f"{0:x}"
    assert v.tally.events == 13 and v.tally.last_ns == 63 * S + 1000


def test_past_the_bound_a_later_event_is_a_new_incident():
    ctx = Context(drop_name=CTX.drop_name, window_ns=130 * S)
    within = list(classify([syn_drop(0), syn_drop(129 * S)], ctx))
    assert len(within) == 1 and within[0].tally.events == 2
    past = list(classify([syn_drop(0), syn_drop(132 * S)], ctx))
    assert len(past) == 2 and past[0].incident != past[1].incident


def test_a_reused_client_port_is_a_new_incident():
    # the same tuple, another SYN (another initial sequence number): another connection
    vs = list(classify([syn_drop(0, isn=1000), syn_drop(5 * S, isn=2000)], CTX))
    assert len(vs) == 2 and vs[0].incident != vs[1].incident
    assert not vs[1].continues and vs[0].tally.events == vs[1].tally.events == 1
    # ...also when it comes while the first one's incident is still open
    vs = list(classify([syn_drop(0, isn=1000), syn_drop(S // 10, isn=2000)], CTX))
    assert len(vs) == 2 and vs[0].incident != vs[1].incident


def test_a_reset_acknowledging_another_syn_is_another_connection():
    drop = syn_drop(0, isn=1000)
    rst = E(ts_ns=4 * S, type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_EGRESS, ifindex=3, netns=1,
            saddr="172.16.21.11", sport=30080, daddr="192.168.10.100", dport=40000,
            tcpflags=ev.TCP_RST | ev.TCP_ACK, seq=0, ack_seq=5001)
    c = Classifier(CTX)
    c.feed(drop)
    c.feed(rst)
    [flow] = c.flows
    assert flow.isn == 5000 and flow.inc is None


def test_a_new_place_is_a_continuation_line_of_the_same_incident():
    vs = list(classify([syn_drop(0), syn_drop(2 * S, ifindex=7, netns=2)], CTX))
    assert len(vs) == 2
    first, later = vs
    assert later.incident == first.incident and later.continues and not first.continues
    assert later.iface == "node2/eth0" and later.joined == 2 and first.joined == 1
    assert first.tally is later.tally and first.tally.events == 2


def test_a_new_cause_is_a_continuation_line_of_the_same_incident():
    peer = E(ts_ns=0, type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, ifindex=3, netns=1,
             saddr="172.16.21.11", sport=30080, daddr="192.168.10.100", dport=40000)
    vs = list(classify([peer, syn_drop(10 * S)], CTX))
    assert [v.cause for v in vs] == ["peer_reset", "rp_filter"]
    assert vs[1].continues and vs[1].incident == vs[0].incident
    # counted once, under its first line's cause (as nptrace_incidents_total counts it)
    assert vs[0].tally.cause == "peer_reset" and vs[0].tally.events == 2


def test_incident_ids_are_unique_when_connections_start_in_the_same_nanosecond():
    vs = list(classify([syn_drop(5, sport=40000), syn_drop(5, sport=40001)], CTX))
    assert sorted(v.incident for v in vs) == ["5", "5.1"]


def test_unexplained_drops_alone_are_counted_not_reported():
    dup = E(ts_ns=0, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=99, netns=1,
            ifindex=1, saddr="127.0.0.1", sport=2379, daddr="127.0.0.1", dport=45000,
            l4proto=6, tcpflags=ev.TCP_ACK)
    c = Classifier(CTX)
    assert c.feed(dup) + c.flush() == []
    assert (c.unreported, c.unreported_events) == (1, 1)
    [v] = classify([dup], Context(drop_name=CTX.drop_name, report_unknown_drops=True))
    assert v.cause == "unknown"
    # a SYN no rule explains is a failed connection: reported
    [v] = classify([syn_drop(0, reason=99)], CTX)
    assert v.cause == "unknown"


def test_json_lines_carry_the_incident_id_and_the_events_joined():
    vs = list(classify([syn_drop(0), syn_retx(S), syn_drop(S + 1),
                        syn_drop(3 * S, ifindex=7, netns=2)], CTX))
    buf = io.StringIO()
    sink = JsonLines(0, buf)
    for v in vs:
        sink.write(v)
    first, later = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert first["incident"] == later["incident"] == f"{0:x}"
    assert (first["continues"], later["continues"]) == (None, first["incident"])
    assert (first["joined"], later["joined"]) == (1, 4)
    assert (first["events"], later["events"]) == (1, 1)


def test_console_one_line_per_connection_and_summary_counts_both():
    vs = list(classify([syn_drop(0), syn_retx(S), syn_drop(S + 1),
                        syn_drop(3 * S, ifindex=7, netns=2), syn_drop(0, sport=40001)], CTX))
    buf = io.StringIO()
    con = Console(0, buf)
    for v in vs:
        con.write(v)
    con.write_summary([])
    text = buf.getvalue()
    assert f"continues #{0:x}" in text and text.count("hint:") == 3
    assert con.by_cause == {"rp_filter": 2}
    summary = con.summary()
    assert "connections" in summary and "events" in summary
    row = next(line for line in summary.splitlines() if line.startswith("rp_filter"))
    assert row.split()[1:] == ["2", "5"]


def test_metrics_count_a_connection_once():
    vs = list(classify([syn_drop(0), syn_drop(2 * S, ifindex=7, netns=2)], CTX))
    assert len(vs) == 2
    reg = CollectorRegistry()
    sink = MetricsSink(reg)
    for v in vs:
        sink.write(v)
    total = sum(s.value for f in reg.collect() for s in f.samples
                if s.name == "nptrace_incidents_total")
    assert total == 1


def test_count_option_counts_connections():
    class T:
        stop_requested = False
    t = T()
    stop = StopAfter(2, t)
    vs = list(classify([syn_drop(0), syn_drop(2 * S, ifindex=7, netns=2)], CTX))
    for v in vs:
        stop.write(v)
    assert not t.stop_requested


def test_recorded_rp_filter_session_is_five_incidents():
    d = report_data(Replay([SESSIONS / "rp-filter-asymmetric"]))
    assert d["by_cause"] == {"rp_filter": 5} and d["incidents"] == 5 and d["lines"] == 5
    assert d["events_by_cause"] == {"rp_filter": 15} and d["incident_events"] == 15
    text = render_text(d)
    assert "5 incidents (connections" in text and "15 events joined" in text


def test_every_recorded_session_names_a_connection_once_per_node():
    """Distinct incident ids per failed connection (the client's port) and node (the
    interface's namespace prefix): one, on every recorded lab session."""
    for path in sorted(SESSIONS.iterdir()):
        ids: dict = {}
        for it in Replay([path]).items():
            v = it.verdict
            e = v.event
            nat = v.nat
            if nat is not None:
                port = nat.orig_sport
            else:
                ports = [p for p in (e.sport, e.dport) if p >= 32768]
                port = ports[-1] if e.saddr.startswith("127.") else ports[0]
            node = (v.iface or "-").split("/")[0]
            ids.setdefault((port, node), set()).add(v.incident)
        split = {k: x for k, x in ids.items() if len(x) > 1}
        assert not split, (path.name, split)


def test_a_storm_under_the_cap_splits_no_connection():
    """Connections that retry their SYN for TCP's whole budget, among 200 new one-record
    flows a second for the 130 s: the flow cap (16384) is not reached before a connection's
    next retry, so none is split."""
    evs = []
    for c in range(20):
        for t in (0,) + RETRIES:
            evs.append(syn_drop(t * S + c * 1000, isn=1000 + c, sport=40000 + c))
    rate = 200
    for i in range(130 * rate):
        t = i * S // rate + 7
        evs.append(E(ts_ns=t, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1,
                     aux=ev.TCP_SYN, saddr="10.0.0.9", sport=9999,
                     daddr=f"10.1.{i // 60000}.1", dport=1024 + i % 60000, seq=7 + i))
    evs.sort(key=lambda e: e.ts_ns)
    c = Classifier(CTX)
    out = c.feed_many(evs) + c.flush()
    ids: dict = {}
    for v in out:
        if v.event.saddr == "192.168.10.100":
            ids.setdefault(v.event.sport, set()).add(v.incident)
    assert len(ids) == 20 and all(len(x) == 1 for x in ids.values()), ids
