"""The compiled hot path (nptrace/compiled.py's MODULES) driven by callbacks that change what it
is working on while it runs them: Context lookups, record buffers, a sink's stream and storm
collapse, a rule. They clear, extend or shorten the list being fed, delete the classifier's
dict entries, replace fields, re-enter the classifier or the sink, raise, answer oddly, or
collect garbage.

Cython compiles these modules from their own sources, so each scenario runs twice: on the
module as imported (compiled where `make setup` built it) and on the same source run as
Python. Both must end alike, step by step: the same result, or an exception of the same type.
A crash is the failure this is for; `make sanitize` (scripts/sanitize.sh) runs this file
against a build with AddressSanitizer and UBSan, which report a use-after-free or an overflow
even where nothing crashes."""
import gc
import importlib
import importlib.util
import io
import os
import sys
from collections import Counter

import pytest

from nptrace import events as E
from nptrace.classify import Context
from nptrace.classify import correlate, flowkey, rules
from nptrace.sinks import jsonl


def _source(mod):
    """The module's .py run as Python, under a private name in the same package: its relative
    imports resolve to the package's own (compiled) modules, so only this one runs as source."""
    pkg, _, leaf = mod.__name__.rpartition(".")
    path = os.path.join(os.path.dirname(mod.__file__), leaf + ".py")
    spec = importlib.util.spec_from_file_location(f"{pkg}._source_{leaf}", path)
    src = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = src       # dataclasses look their module up while building
    try:
        spec.loader.exec_module(src)
    finally:
        del sys.modules[spec.name]
    return src


SOURCES = {m.__name__: _source(m) for m in (E, correlate, flowkey, rules, jsonl)}


class Boom(Exception):
    """What a raising callback raises."""


def outcome(fn, norm=repr):
    try:
        return ("returned", norm(fn()))
    except Exception as e:          # noqa: BLE001 (the type is the result compared)
        return ("raised", type(e).__name__)


# --- records of a small node -------------------------------------------------------------
DROPS = {1: "NETFILTER_DROP", 2: "IP_RPFILTER", 3: "TCP_CSUM", 4: "NOT_SPECIFIED",
         5: "NEIGH_FAILED"}
NODE, POD = "10.0.0.1", "10.244.0.5"
HOLD = 1_000_000_000


def _record(i: int, ts_ns: int) -> bytes:
    """Record i of a mix that asks every Context lookup: resets of a missing listener, drops
    by netfilter, rp_filter, a bad checksum, weak drops, peer resets, a DNATed connection to a
    gone endpoint, a reply on the wrong interface. Every fifth one is on the flow of the one
    two before it."""
    j = i - 2 if i % 5 == 4 else i
    client, cport = f"192.168.1.{j % 200 + 1}", 40000 + j
    kind = j % 8
    f = dict(ts_ns=ts_ns, skb=i + 1, ifindex=2, netns=7, l4proto=6, tcpflags=E.TCP_SYN)
    if kind == 0:
        f.update(type=E.EvType.RST_SENT, hook=E.Hook.TCP_SEND_RST, reason=1, aux=E.TCP_SYN,
                 saddr=POD, sport=8080, daddr=client, dport=cport)
    elif kind == 5:
        f.update(type=E.EvType.RST_RECV, hook=E.Hook.TCP_RECV_RST, saddr=NODE, sport=30080,
                 daddr=client, dport=cport)
    elif kind == 6:
        f.update(type=E.EvType.DROP, hook=E.Hook.KFREE_SKB, reason=5, saddr=client,
                 sport=cport, daddr=POD, dport=8080, flags=E.F_HAS_CT,
                 ct_status=E.IPS_DST_NAT | E.IPS_CONFIRMED, ct_osrc=client, ct_osport=cport,
                 ct_odst=NODE, ct_odport=30080, ct_rsrc=POD, ct_rsport=8080, ct_rdst=client,
                 ct_rdport=cport)
    elif kind == 7:
        f.update(type=E.EvType.ASYM_IFACE, hook=E.Hook.TC_EGRESS, dir=E.Dir.EGRESS, aux=9,
                 saddr=POD, sport=8080, daddr=client, dport=cport)
    else:
        f.update(type=E.EvType.DROP, hook=E.Hook.KFREE_SKB, reason=kind, ifindex=kind + 1,
                 saddr=client, sport=cport, daddr=NODE, dport=30080)
    return E.encode(**f)


RECORDS = [_record(i, 400_000_000 * (i + 1)) for i in range(40)]
SPARE = [_record(i, 400_000_000 * (i + 1)) for i in range(40, 46)]
LATER = [_record(i, 400_000_000 * (i + 1)) for i in range(60, 70)]
EVENTS, SPARE_EVENTS, LATER_EVENTS = ([E.decode(r) for r in rs] for rs in (RECORDS, SPARE, LATER))


class Scene:
    """One scenario's state: a Context whose lookups answer as a small node would and, on the
    calls of `name` numbered in `when`, run `action` (which may change anything, and answers
    in the lookup's place)."""

    def __init__(self, name=None, action=None, when=(3,), corr=correlate):
        self.name, self.action, self.when = name, action, set(when)
        self.calls = Counter()
        h = self.hook
        self.ctx = Context(
            drop_name=lambda v: h("drop_name", DROPS.get(v, f"REASON_{v}")),
            rst_name=lambda v: h("rst_name", "NO_SOCKET"),
            iface_name=lambda ns, i: h("iface_name", f"eth{i}"),
            iface_peer=lambda ns, i: h("iface_peer", "pods/web-1"),
            peer_tx_csum=lambda ns, i: h("peer_tx_csum", True),
            service_of=lambda a, p: h("service_of", "default/web:80" if p == 30080 else None),
            endpoint_of=lambda a, p: h("endpoint_of", "default/web:80" if a == POD else None),
            etp_local=lambda a, p: h("etp_local", None),
            nf_rule=lambda *a: h("nf_rule", {"tag": "no_endpoints", "where": "filter/KUBE-SVC",
                                             "text": "-j REJECT", "service": "default/web:80"}),
            nat_peer=lambda s, sp, d, dp: h("nat_peer", (POD, 8080, s, sp) if dp == 30080
                                            else None),
            route_iface=lambda ns, a: h("route_iface", "eth1"),
            pod_of=lambda a: h("pod_of", "default/web-1" if a == POD else None),
            pod_of_netns=lambda ns: h("pod_of_netns", "default/web-1" if ns == 7 else None),
            hold_ns=HOLD, max_hold_ns=2 * HOLD, window_ns=5 * HOLD, max_flows=6)
        self.clf = corr.Classifier(self.ctx)
        self.feed = list(EVENTS)           # the list being fed
        self.spare = list(SPARE_EVENTS)

    def hook(self, name, answer):
        self.calls[name] += 1
        if name == self.name and self.calls[name] in self.when:
            return self.action(self, answer)
        return answer


LOOKUPS = ("drop_name", "rst_name", "nat_peer", "nf_rule", "route_iface", "iface_peer",
           "peer_tx_csum", "iface_name", "service_of", "endpoint_of", "etp_local", "pod_of",
           "pod_of_netns")


# --- what the callbacks do ---------------------------------------------------------------
def clear_fed(s, ans):
    s.feed.clear()
    return ans


def extend_fed(s, ans):
    s.feed.extend(s.spare)
    return ans


def shorten_fed(s, ans):
    del s.feed[:4]
    return ans


def replace_fields(s, ans):
    # a batch keeps the lookups it started with; times and bounds are read as it goes
    s.ctx.drop_name = lambda v: "IP_RPFILTER"
    s.ctx.hold_ns, s.ctx.max_flows = 0, 2
    if s.feed:
        s.feed[-1] = s.spare[0]
    return ans


def delete_entries(s, ans):
    # every other entry of the flow maps, so they no longer agree with each other
    for d in (s.clf.keys, s.clf.flows, s.clf.weak):
        for k in list(d)[::2]:
            del d[k]
    return ans


def clear_state(s, ans):
    for d in (s.clf.keys, s.clf.flows, s.clf.strong, s.clf.weak):
        d.clear()
    return ans


def reenter_feed(s, ans):
    s.clf.feed_many(s.spare[:3])
    return ans


def reenter_flush(s, ans):
    s.clf.flush()
    return ans


def reenter_tick(s, ans):
    s.clf.tick(s.clf.now_ns + 10 * HOLD)
    return ans


def raise_boom(s, ans):
    raise Boom(s.name)


def collect(s, ans):
    gc.collect()
    return ans


def unhashable(s, ans):
    return [ans]


ACTIONS = {f.__name__: f for f in (clear_fed, extend_fed, shorten_fed, replace_fields,
                                   delete_entries, clear_state, reenter_feed, reenter_flush,
                                   reenter_tick, raise_boom, collect, unhashable)}
WHEN = {"collect": (1, 3, 9, 27)}


def _verdicts(vs):
    return [(v.cause, v.kind, v.reason, v.iface, v.service, v.events, v.hint,
             tuple(l.ev.ts_ns for l in v.labeled), v.pods) for v in vs]


def _classify(corr, name, action) -> list:
    """A batch with the callback's disturbance, the flush after it, then a quiet batch: the
    classifier must still work (or fail cleanly) once a callback has done its worst."""
    s = Scene(name, ACTIONS.get(action), WHEN.get(action, (3,)), corr)
    steps = [outcome(lambda: s.clf.feed_many(s.feed), _verdicts),
             outcome(s.clf.flush, _verdicts)]
    s.name = None
    steps.append(outcome(lambda: s.clf.feed_many(LATER_EVENTS) + s.clf.flush(), _verdicts))
    steps.append((len(s.clf.keys), len(s.clf.flows), len(s.clf.strong), len(s.clf.weak),
                  s.calls[name] >= min(s.when)))
    return steps


def test_every_lookup_is_asked_often_enough():
    """The matrix below disturbs each lookup on its third call: each must get one."""
    s = Scene()
    got = s.clf.feed_many(s.feed) + s.clf.flush()
    assert len(got) >= 10 and {v.cause for v in got} >= {"no_listener", "no_endpoints",
                                                         "rp_filter", "checksum", "proxy"}
    assert all(s.calls[n] >= 3 for n in LOOKUPS), s.calls


@pytest.mark.parametrize("action", sorted(ACTIONS))
@pytest.mark.parametrize("name", LOOKUPS)
def test_classifier_under_a_mutating_lookup(name, action):
    got = _classify(correlate, name, action)
    assert got == _classify(SOURCES["nptrace.classify.correlate"], name, action)
    assert got[-1][-1], f"{name} was not called {min(WHEN.get(action, (3,)))} times"


def _fed_by_generator(corr, action):
    """feed_many over a generator that disturbs the classifier between two events."""
    s = Scene(corr=corr)

    def gen():
        for i, ev in enumerate(s.feed):
            if i == 5:
                ACTIONS[action](s, None)
            yield ev
    return [outcome(lambda: s.clf.feed_many(gen()), _verdicts), outcome(s.clf.flush, _verdicts)]


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_classifier_fed_by_a_mutating_generator(action):
    assert _fed_by_generator(correlate, action) == \
        _fed_by_generator(SOURCES["nptrace.classify.correlate"], action)


def _feed_changes_its_own_events(corr):
    """Events whose address fields compare and hash through Python code that deletes the
    classifier's entries and collects garbage while the flow key is being built and looked up."""
    s = Scene(corr=corr)

    class Addr(str):
        __slots__ = ()

        def __lt__(self, other):
            for k in list(s.clf.keys)[::3]:
                del s.clf.keys[k]
            return str.__lt__(self, other)

        def __hash__(self):
            gc.collect(0)
            return str.__hash__(self)

        __eq__ = str.__eq__

    evs = [ev._replace(saddr=Addr(ev.saddr)) for ev in s.feed]
    return [outcome(lambda: s.clf.feed_many(evs), _verdicts), outcome(s.clf.flush, _verdicts)]


def test_classifier_with_fields_that_run_code():
    assert _feed_changes_its_own_events(correlate) == \
        _feed_changes_its_own_events(SOURCES["nptrace.classify.correlate"])


# --- the JSON sink -----------------------------------------------------------------------
def _lines(jl, trigger, action):
    """JsonLines.write_many over verdicts whose interface-name lookup, the storm collapse or
    the stream disturbs the list being written, the verdicts, or the sink itself."""
    s = Scene()
    vs = s.clf.feed_many(s.feed) + s.clf.flush()
    s.feed, s.spare = vs[:8], vs[8:]          # the list being written, and more of them
    s.calls.clear()

    class Collapse:
        def add(self, v):
            got = s.hook("collapse", [(v, 1, None, None)])
            return got if isinstance(got, list) and all(isinstance(x, tuple) for x in got) \
                else [(got, 1, None, None)]

    class Stream(io.StringIO):
        def write(self, text):
            return io.StringIO.write(self, s.hook("write", text))

    out = Stream()
    sink = jl.JsonLines(10**18, out, Collapse() if trigger == "collapse" else None, "node-1")
    s.sink = sink
    s.name, s.action = trigger, SINK_ACTIONS[action]
    s.when = {1, 2, 4} if action == "collect" else {1 if trigger == "write" else 3}
    first = outcome(lambda: sink.write_many(s.feed))
    s.name = None
    second = outcome(lambda: sink.write_many(vs[:3]))
    return [first, second, out.getvalue(), s.calls[trigger] >= min(s.when)]


def replace_verdict_fields(s, ans):
    # frozen for callers, not for a callback that insists: the next verdict changes under it
    for v in s.feed[1:3]:
        object.__setattr__(v, "hint", "changed {iface}")
        object.__setattr__(v, "labeled", v.labeled[:1])
        object.__setattr__(v, "iface", None)
    s.sink.set_node("node-2")
    s.sink.offset = 0
    return ans


def reenter_write(s, ans):
    s.sink.write_many(s.spare[:2])
    return ans


SINK_ACTIONS = {
    "clear_written": lambda s, ans: (s.feed.clear(), ans)[1],
    "extend_written": lambda s, ans: (s.feed.extend(s.spare), ans)[1],
    "shorten_written": lambda s, ans: (s.feed.__delitem__(slice(0, 3)), ans)[1],
    "replace_fields": replace_verdict_fields,
    "reenter_write": reenter_write,
    "raise_boom": raise_boom,
    "collect": collect,
    "unhashable": unhashable,
    "none": lambda s, ans: None,
}


@pytest.mark.parametrize("action", sorted(SINK_ACTIONS))
@pytest.mark.parametrize("trigger", ["iface_name", "collapse", "write"])
def test_json_lines_under_a_mutating_callback(trigger, action):
    got = _lines(jsonl, trigger, action)
    assert got == _lines(SOURCES["nptrace.sinks.jsonl"], trigger, action)
    assert got[-1], f"{trigger} was not called"


# --- record decoding ---------------------------------------------------------------------
class Sly(bytearray):
    """A record buffer whose length and slices are Python code that may change anything."""
    scene = None

    def __len__(self):
        n = bytearray.__len__(self)        # the length before the callback changed anything
        got = self.scene.hook("len", n) if self.scene else n
        return got if type(got) is int else n

    def __getitem__(self, i):
        got = bytearray.__getitem__(self, i)
        return self.scene.hook("getitem", got) if self.scene else got


def _buffer_action(kind):
    def act(s, ans):
        bufs, me = s.feed, s.current
        if kind == "clear_fed":
            bufs.clear()
        elif kind == "extend_fed":
            bufs.extend(SPARE)
        elif kind == "shorten_fed":
            del bufs[:3]
        elif kind == "replace_items":
            bufs[1:4] = [b"junk", None, RECORDS[7]]
        elif kind == "empty_itself":
            bytearray.clear(me)
        elif kind == "grow_itself":
            bytearray.extend(me, bytes(64))
        elif kind == "change_itself":
            me[0:8] = bytes(8)
        elif kind == "raise_boom":
            raise Boom("buffer")
        elif kind == "collect":
            gc.collect()
        elif kind == "odd_answer":
            return -1 if s.name == "len" else "not bytes"
        return ans
    return act


BUFFER_ACTIONS = ("clear_fed", "extend_fed", "shorten_fed", "replace_items", "empty_itself",
                  "grow_itself", "change_itself", "raise_boom", "collect", "odd_answer")


def _decode(ev_mod, entry, trigger, action):
    s = Scene(trigger, _buffer_action(action), (1, 2, 5) if action == "collect" else (3,))
    s.feed = [Sly(r) if i % 2 else r for i, r in enumerate(RECORDS[:12])]
    if entry == "split_packets":
        s.feed.append(E.encode_packet(b"abc"))
    for b in s.feed:
        if isinstance(b, Sly):
            b.scene = s
    s.current = s.feed[1]
    if entry == "decode":
        got = [outcome(lambda b=b: ev_mod.decode(b)) for b in list(s.feed)]
    elif entry == "decode_many":
        got = [outcome(lambda: ev_mod.decode_many(s.feed))]
    else:
        got = [outcome(lambda: ev_mod.split_packets(s.feed))]
    # quiet again: comparing the results must not run the callbacks
    for b in s.feed:
        if isinstance(b, Sly):
            b.scene = None
    return got + [s.calls[trigger] >= 1]


@pytest.mark.parametrize("action", BUFFER_ACTIONS)
@pytest.mark.parametrize("trigger", ["len", "getitem"])
@pytest.mark.parametrize("entry", ["decode", "decode_many", "split_packets"])
def test_decoding_buffers_that_run_code(entry, trigger, action):
    got = _decode(E, entry, trigger, action)
    assert got == _decode(SOURCES["nptrace.events"], entry, trigger, action)
    assert got[-1]


def test_decoded_events_keep_their_bytes_when_the_buffer_changes():
    for ev_mod in (E, SOURCES["nptrace.events"]):
        bufs = [bytearray(r) for r in RECORDS[:4]] + [memoryview(bytearray(RECORDS[4]))]
        got, bad = ev_mod.decode_many(bufs)
        one = ev_mod.decode(bufs[0])
        for b in bufs:
            b[0:8] = bytes(8)
        assert bad == 0 and [e.raw for e in got] == RECORDS[:5] and one.raw == RECORDS[0]
        bufs[4].release()
        assert outcome(lambda: ev_mod.decode_many(bufs)) == ("raised", "ValueError")


def _decode_generator(ev_mod, action):
    bufs = list(RECORDS[:10])

    def gen():
        for i, b in enumerate(bufs):
            if i == 4:
                if action == "raise_boom":
                    raise Boom("generator")
                if action == "collect":
                    gc.collect()
                bufs.clear() if action == "clear_fed" else bufs.extend(SPARE[:2])
            yield bytearray(b) if i % 2 else b
    return outcome(lambda: ev_mod.decode_many(gen()))


@pytest.mark.parametrize("action", ["clear_fed", "extend_fed", "raise_boom", "collect"])
def test_decode_many_of_a_mutating_generator(action):
    assert _decode_generator(E, action) == _decode_generator(SOURCES["nptrace.events"], action)


# --- rules and flow keys -----------------------------------------------------------------
def _run_rules(rules_mod, action):
    """run_rules over a rule list whose rules change the list, the flow's history and the
    event's Context while it walks them."""
    ev = EVENTS[1]
    history = list(EVENTS[:3])
    seen = []

    def first(e, rname, hist, ctx):
        seen.append("first")
        if action == "clear_fed":
            rule_list.clear()
        elif action == "extend_fed":
            rule_list.append(last)
        elif action == "shorten_fed":
            del rule_list[1:]
        elif action == "replace_fields":
            rule_list[1] = last
            hist[:] = [None]
        elif action == "raise_boom":
            raise Boom("rule")
        elif action == "collect":
            gc.collect()
        elif action == "unhashable":
            return ["policy_drop", 0.5, "a list, not a tuple"]
        return None

    def last(e, rname, hist, ctx):
        seen.append("last")
        return ("checksum", 0.9, "from the rule added")
    rule_list = [first, *rules_mod.RULES]
    got = outcome(lambda: rules_mod.run_rules(ev, "NETFILTER_DROP", history, Scene().ctx,
                                              rule_list, int(ev.type)))
    return [got, seen, len(history)]


@pytest.mark.parametrize("action", ["clear_fed", "extend_fed", "shorten_fed", "replace_fields",
                                    "raise_boom", "collect", "unhashable"])
def test_rules_whose_rules_change_the_list(action):
    assert _run_rules(rules, action) == _run_rules(SOURCES["nptrace.classify.rules"], action)


class Shifty(list):
    """A NAT-map answer whose length and items are Python code that empties it."""

    def __len__(self):
        n = list.__len__(self)
        self.clear()
        gc.collect(0)
        return n


def test_nat_peer_answer_that_empties_itself():
    got = [outcome(lambda: fk.nat_peer_tuple(Shifty([POD, 8080, NODE, 30080])))
           for fk in (flowkey, SOURCES["nptrace.classify.flowkey"])]
    assert got[0] == got[1] == ("returned", "None")     # emptied by the truth test: no answer
    assert flowkey.nat_peer_tuple([POD, 8080, NODE, 30080]) == (POD, 8080, NODE, 30080)


def test_the_imported_modules_are_the_compiled_ones_where_built():
    """Where `make setup` compiled them (and here, under make sanitize, the sanitized build),
    the scenarios above compare the extension with its source; as pure Python they compare the
    source with itself, which still checks that nothing fails uncleanly."""
    from nptrace import compiled
    for name in compiled.MODULES:
        mod = importlib.import_module(name)
        assert mod.__file__.endswith(".so") == (compiled.STATE.get(name) == "compiled")
