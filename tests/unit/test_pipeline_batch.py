"""The batch APIs of the hot path (events.decode_many, Classifier.feed_many,
JsonLines.write_many, jsonl.verdict_line) give exactly what the one-at-a-time calls give, over
seeded random streams that exercise NAT merges, hold/max_hold/window expiry, max_flows
eviction, evidence-only events and bad records."""
import io
import random

import pytest

from nptrace import events as ev
from nptrace.classify import Classifier, Context
from nptrace.sinks.collapse import StormCollapse
from nptrace.sinks.jsonl import JsonLines, _encode, verdict_dict, verdict_line

ADDRS4 = ["10.0.0.1", "10.0.0.2", "192.168.1.5", "10.244.1.10"]
ADDRS6 = ["fd00::1", "fd00::2"]
PORTS = [80, 8080, 30080, 40000, 40001]


def _ctx(rnd: random.Random) -> Context:
    svc = {(a, p): f"ns/svc{p}:{p}" for a in ADDRS4[:2] for p in PORTS[:3] if rnd.random() < .5}
    nat = {(rnd.choice(ADDRS4), rnd.choice(PORTS), rnd.choice(ADDRS4), rnd.choice(PORTS)):
           (rnd.choice(ADDRS4), rnd.choice(PORTS), rnd.choice(ADDRS4), rnd.choice(PORTS))
           for _ in range(4)}
    tags = ["no_local_endpoint", "no_endpoints", "other", None]
    return Context(
        drop_name=lambda v: {2: "NOT_SPECIFIED", 3: "NO_SOCKET", 12: "NETFILTER_DROP",
                             16: "IP_RPFILTER", 20: "NEIGH_FAILED", 5: 'WE"IRD\u00e9'}
        .get(v, f"REASON_{v}"),
        rst_name=lambda v: {0: "NOT_SPECIFIED", 1: "NO_SOCKET"}.get(v, f"REASON_{v}"),
        iface_name=lambda ns, i: {2: "eth0", 7: "npt-n1/eth1", 9: 'q"\u00fc{port}'}.get(i),
        service_of=lambda a, p: svc.get((a, p)),
        endpoint_of=lambda a, p: "ns/ep" if p == 8080 else None,
        nf_rule=lambda *a: {"tag": tags[a[3] % 4], "where": "filter/KUBE", "text": "-j REJECT",
                            "service": "ns/s:p", "to_pod": a[3] % 3 == 0},
        nat_peer=lambda *a: nat.get(a),
        route_iface=lambda ns, a: "eth9" if a.startswith("10.") else None,
        hold_ns=rnd.choice([10, 100, 1000, 10_000]), max_hold_ns=rnd.choice([50, 1000, 50_000]),
        window_ns=rnd.choice([50, 500, 2000, 100_000]), max_flows=rnd.choice([3, 10, 50, 16384]))


def _records(rnd: random.Random, n: int) -> list[bytes]:
    ts, out = 10**6, []
    for _ in range(n):
        # events of several CPUs: time mostly forward, sometimes back (queue order and time
        # order then differ, which is where skipping a tick is easiest to get wrong)
        ts += rnd.choice([0, 1, 10, 50, 200, 1000, 5000, 30000]) if rnd.random() < .7 \
            else -rnd.choice([1, 100, 2000, 20000])
        typ = rnd.choice(list(ev.EvType))
        pool = ADDRS6 if rnd.random() < .1 else ADDRS4
        f = dict(ts_ns=max(ts, 0), type=typ, hook=rnd.choice(list(ev.Hook)),
                 dir=rnd.choice(list(ev.Dir)), ifindex=rnd.choice([0, 2, 7, 9]),
                 netns=rnd.choice([1, 2]), family=10 if pool is ADDRS6 else 2,
                 reason=rnd.choice([0, 1, 2, 3, 5, 12, 16, 20, 3 << 8 | 3, 3 << 8 | 1]),
                 saddr=rnd.choice(pool), daddr=rnd.choice(pool), sport=rnd.choice(PORTS),
                 dport=rnd.choice(PORTS), l4proto=6, tcpflags=rnd.choice([0, 2, 18, 4, 20]),
                 aux=rnd.choice([0, 2, 18, 7]), skb=rnd.randint(0, 99),
                 flags=rnd.choice([0, 0, 0, ev.F_HAS_SOCK, ev.F_HAS_CT, ev.F_ENCAP,
                                   ev.F_ICMP_QUOTE]))
        if f["flags"] & ev.F_HAS_CT:
            f.update(ct_osrc=rnd.choice(pool), ct_odst=rnd.choice(pool), ct_rsrc=rnd.choice(pool),
                     ct_rdst=rnd.choice(pool), ct_osport=rnd.choice(PORTS + [0]),
                     ct_odport=rnd.choice(PORTS + [0]), ct_rsport=rnd.choice(PORTS),
                     ct_rdport=rnd.choice(PORTS), ct_status=rnd.choice([0, 32, 48, 2]))
        if f["flags"] & (ev.F_ENCAP | ev.F_ICMP_QUOTE) or typ == ev.EvType.ASYM_SRC:
            f.update(outer_saddr="172.16.0.1", outer_daddr="172.16.0.2")
        out.append(ev.encode(**f))
    out.insert(rnd.randrange(len(out)), out[0][:-3])              # short record
    bad = bytearray(out[-1])
    bad[ev.RawEvent.abi.offset] = 99                                # another ABI
    out.insert(rnd.randrange(len(out)), bytes(bad))
    return out


def _summary(vs) -> list:
    return [(v.cause, v.kind, v.direction, v.hook, v.reason, v.confidence, v.hint, v.iface,
             v.service, v.events, v.event, v.labeled) for v in vs]


def _one_by_one(recs, ctx, offset):
    """The reference: decode one record at a time, feed each with a full tick before it (what
    feed always did: the classifier may only skip a tick when it knows nothing is due), write
    one verdict at a time."""
    c, buf, buf2 = Classifier(ctx), io.StringIO(), io.StringIO()
    sinks = [JsonLines(offset, buf), JsonLines(offset, buf2, StormCollapse(2, 3000))]
    got, bad = [], 0
    for raw in recs:
        try:
            e = ev.decode(raw)
        except ev.DecodeError:
            bad += 1
            continue
        c._due_ns = float("-inf")
        vs = c.feed(e)
        got += vs
        for v in vs:
            for s in sinks:
                s.write(v)
    vs = c.flush()
    got += vs
    for v in vs:
        for s in sinks:
            s.write(v)
    for s in sinks:
        s.close()
    return _summary(got), bad, buf.getvalue(), buf2.getvalue(), (len(c.flows), len(c.keys))


def _batched(recs, ctx, offset, rnd):
    c, buf, buf2 = Classifier(ctx), io.StringIO(), io.StringIO()
    sinks = [JsonLines(offset, buf), JsonLines(offset, buf2, StormCollapse(2, 3000))]
    got, bad, i = [], 0, 0
    while i < len(recs):
        n = rnd.choice([1, 2, 7, 64, 300])
        events, nbad = ev.decode_many(recs[i:i + n])
        i += n
        bad += nbad
        vs = c.feed_many(events)
        got += vs
        for s in sinks:
            s.write_many(vs)
    vs = c.flush()
    got += vs
    for s in sinks:
        s.write_many(vs)
        s.close()
    return _summary(got), bad, buf.getvalue(), buf2.getvalue(), (len(c.flows), len(c.keys))


@pytest.mark.parametrize("seed", range(40))
def test_batches_equal_one_at_a_time(seed):
    rnd = random.Random(seed)
    recs = _records(rnd, rnd.choice([50, 400, 1500]))
    offset = rnd.choice([0, 123_456_789])
    want = _one_by_one(recs, _ctx(random.Random(seed)), offset)
    got = _batched(recs, _ctx(random.Random(seed)), offset, rnd)
    assert got[1] == want[1] == 2                   # the short record and the other ABI
    assert got[0] == want[0]
    assert got[2] == want[2] and got[3] == want[3]
    assert got[4] == want[4]


def test_decode_many_equals_decode():
    rnd = random.Random(7)
    recs = _records(rnd, 500) + [bytearray(ev.encode(ts_ns=5, type=ev.EvType.DROP,
                                                     hook=ev.Hook.KFREE_SKB)) + b"\0" * 8]
    want = []
    for r in recs:
        try:
            want.append(ev.decode(r))
        except ev.DecodeError:
            pass
    got, bad = ev.decode_many(recs)
    assert got == want and bad == 2
    assert [type(x.type) for x in got] == [type(x.type) for x in want]


@pytest.mark.parametrize("seed", range(10))
def test_verdict_line_equals_the_encoded_dict(seed):
    rnd = random.Random(seed)
    ctx = _ctx(random.Random(seed))
    events, _ = ev.decode_many(_records(rnd, 300))
    c = Classifier(ctx)
    vs = c.feed_many(events) + c.flush()
    assert vs
    for v in vs:
        for args in ((0,), (10**9, 5, 10**6, 12), (77, 1, None, None)):
            assert verdict_line(v, *args) == _encode(verdict_dict(v, *args))


def test_feed_many_of_a_storm_reports_every_reset_once():
    ctx = Context(rst_name=lambda v: "NO_SOCKET", max_flows=100)
    recs = [ev.encode(ts_ns=1000 + i, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST,
                      reason=1, aux=ev.TCP_SYN, saddr="10.0.0.2", sport=9999,
                      daddr="10.1.0.1", dport=1024 + i) for i in range(1000)]
    events, bad = ev.decode_many(recs)
    c = Classifier(ctx)
    vs = c.feed_many(events)
    # past max_flows the oldest flow is reported when the next event comes
    assert bad == 0 and len(vs) == 899 and len(c.flows) == 101
    vs += c.flush()
    assert sorted(v.event.dport for v in vs) == list(range(1024, 2024))
    assert {v.cause for v in vs} == {"no_listener"}


@pytest.mark.parametrize("seed", range(5))
def test_rules_skipped_for_a_reason_name_would_not_have_matched(seed):
    """rules.for_reasons only skips calls that return None: every rule of a type that
    rules_for(type, reason name) leaves out answers None for such events."""
    from nptrace.classify.rules import rules_for
    rnd = random.Random(seed)
    ctx = _ctx(random.Random(seed))
    names = ["NO_SOCKET", "IP_RPFILTER", "NETFILTER_DROP", "NEIGH_FAILED", "IP_OUTNOROUTES",
             "TCP_CSUM", "UDP_CSUM", "NOT_SPECIFIED", "TCP_ABORT_ON_CLOSE", "REASON_0",
             "REASON_77"]
    events, _ = ev.decode_many(_records(rnd, 600))
    skipped = 0
    for e in events:
        for rname in names:
            allowed = rules_for(int(e.type), rname)
            for rule in rules_for(int(e.type)):
                if rule not in allowed:
                    skipped += 1
                    assert rule(e, rname, [], ctx) is None, (rule.__name__, rname, e)
    assert skipped > 1000


def test_filled_hints_are_remembered_by_what_they_read():
    from nptrace.classify import incident as co
    e4 = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, saddr="10.0.0.1", sport=4000, daddr="10.0.0.2", dport=80,
                             ifindex=3))
    e6 = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, family=10, saddr="fd00::1", sport=4000, daddr="fd00::2", dport=80,
                             ifindex=3))
    hints = ["nothing on {saddr}:{sport}", "to {daddr}:{port} via {iface}", "{service} only",
             "plain", "{daddr} and {saddr}", "set {{a, b}} {port}"]
    for _ in range(2):                         # the second round answers from the cache
        for h in hints:
            for e in (e4, e6):
                for iface, svc in ((None, None), ("eth0", "ns/s:80"), ("", 5)):
                    assert co.fill_hint(h, e, iface, svc) == co._fill_text(h, e, iface, svc)
    assert co.fill_hint("{iface}", e4, ["x"], None) == "ifindex 3"   # unhashable: not kept
