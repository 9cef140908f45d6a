"""The label memo (classify/labelmemo.py) and the one-event line template (sinks/jsonl.py) change
nothing: with the memo on and off, the verdicts and their JSON lines are identical over 60
seeded random streams (test_pipeline_batch's: NAT merges, expiry, eviction, every rule's
branches, IPv6, bad records), both storms of the pipeline bench and every recorded lab
session; and a label is kept only when its rules read nothing but the event's fields."""
import functools
import hashlib
import io
import random
from pathlib import Path

import pytest

from nptrace import events as ev
from nptrace.bench import pipeline as bench
from nptrace.classify import UNKNOWN_HINT, Classifier, Context
from nptrace.classify import labelmemo as lm
from nptrace.sessions import replay as replay_mod
from nptrace.sinks.jsonl import JsonLines, _encode, verdict_dict
from tests.unit.test_pipeline_batch import _ctx, _records, _summary

SESSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "sessions"
SCENARIOS = sorted(p.name for p in SESSIONS.iterdir()) if SESSIONS.is_dir() else []


def _run(recs, ctx, memo: bool, batch: int = 64):
    c = Classifier(ctx, memo_labels=memo)
    buf = io.StringIO()
    sink = JsonLines(123_456_789, buf)
    got = []
    for i in range(0, len(recs), batch):
        events, _ = ev.decode_many(recs[i:i + batch])
        vs = c.feed_many(events)
        if events:
            vs += c.tick(events[-1].ts_ns)
        got += vs
        sink.write_many(vs)
    vs = c.flush()
    got += vs
    sink.write_many(vs)
    sink.close()
    text = buf.getvalue()
    # the reference line of every verdict: the encoded dict (no template, no fragment caches)
    ref = "".join(_encode(verdict_dict(v, 123_456_789)) + "\n" for v in got)
    return _summary(got), text, ref, c


@pytest.mark.parametrize("seed", range(60))
def test_memo_changes_no_verdict_nor_line(seed):
    rnd = random.Random(seed)
    recs = _records(rnd, rnd.choice([50, 400, 1500]))
    batch = rnd.choice([1, 7, 64, 300])
    on = _run(recs, _ctx(random.Random(seed)), True, batch)
    off = _run(recs, _ctx(random.Random(seed)), False, batch)
    assert on[0] == off[0]
    assert on[1] == off[1] == off[2]
    assert off[3].memo is None and on[3].memo.entries > 0


@pytest.mark.parametrize("mix", [False, True])
def test_memo_changes_nothing_in_the_bench_storms(mix):
    recs = bench.records(20_000, mix)
    ctx = Context(drop_name=lambda v: "NO_SOCKET" if v == bench.NO_SOCKET else f"REASON_{v}",
                  rst_name=lambda v: "NO_SOCKET" if v == 1 else f"REASON_{v}")
    on, off = _run(recs, ctx, True, 256), _run(recs, ctx, False, 256)
    assert hashlib.sha256(on[1].encode()).digest() == hashlib.sha256(off[1].encode()).digest()
    assert on[1] == off[2] and on[0] == off[0] and len(on[0]) == 20_000
    # a storm is a handful of keys: 1 kind of record, or the mix's 4
    assert on[3].memo.misses == (4 if mix else 1)


@pytest.mark.skipif(not SCENARIOS, reason="no recorded sessions under tests/fixtures/sessions")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_memo_changes_nothing_in_a_recorded_session(scenario, monkeypatch):
    def lines(memo: bool):
        monkeypatch.setattr(replay_mod, "Classifier",
                            functools.partial(Classifier, memo_labels=memo))
        out = []
        for it in replay_mod.Replay([SESSIONS / scenario]).items():
            v = it.verdict
            out.append((_summary([v]), _encode(verdict_dict(v, 0))))
        return out
    on, off = lines(True), lines(False)
    assert on == off
    assert on or "healthy" in scenario


def _rst(**kw):
    f = dict(ts_ns=1000, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1,
             aux=ev.TCP_SYN, saddr="10.0.0.2", sport=9999, daddr="10.1.0.1", dport=40000)
    f.update(kw)
    return ev.decode(ev.encode(**f))


def _memo_label(memo, rules, e, ctx=None, pending=()):
    """The walk Classifier.feed_many does inline, then LabelMemo.label."""
    t = int(e.type)
    node, key, val = memo.roots.get((t, "X")), None, None
    while node is not None:
        key = node[0](e)
        val = node[2].get(key)
        if type(val) is list:
            node = val
            continue
        if val is None:
            for getter, _fields, table in node[3]:
                val = table.get(getter(e))
                if val is not None:
                    break
        break
    if type(val) is tuple:
        return val
    return memo.label(e, "X", list(pending), ctx or Context(), rules, t, node, key, val)


def test_a_label_is_kept_by_exactly_the_fields_its_rules_read():
    calls = []

    def by_client(e, rname, history, ctx):
        calls.append(e.dport)
        return ("a", 0.5, f"to {e.daddr}") if e.sport == 9999 else None
    memo = lm.LabelMemo()
    a, b = _rst(dport=1), _rst(dport=2)
    assert _memo_label(memo, [by_client], a) == ("a", 0.5, "to 10.1.0.1")
    assert _memo_label(memo, [by_client], b) == ("a", 0.5, "to 10.1.0.1")
    assert calls == [1, 2]                      # dport read: b is another key
    assert _memo_label(memo, [by_client], _rst(dport=2, ts_ns=5)) == ("a", 0.5, "to 10.1.0.1")
    assert calls == [1, 2]                      # the time is not read: kept
    c = _rst(sport=80, dport=2)                 # another branch: sport differs
    assert _memo_label(memo, [by_client], c) == ("unknown", 0.0, UNKNOWN_HINT)
    assert memo.misses == 3


@pytest.mark.parametrize("how", ["ctx", "history", "index", "repr"])
def test_a_rule_that_reads_more_than_fields_is_never_kept(how):
    calls = []

    def rule(e, rname, history, ctx):
        calls.append(1)
        if how == "ctx":
            return ("a", 0.5, ctx.service_of(e.saddr, e.sport) or "none")
        if how == "history":
            return ("a", 0.5, str(len(history)))
        if how == "index":
            return ("a", 0.5, e[8])
        return ("a", 0.5, repr(e)[:5])
    memo = lm.LabelMemo()
    e = _rst()
    for _ in range(3):
        assert _memo_label(memo, [rule], e)[0] == "a"
    assert len(calls) == 3 and memo.misses == 1     # one traced run, then plain runs


def test_the_memo_is_bounded():
    memo = lm.LabelMemo(max_entries=10)

    def rule(e, rname, history, ctx):
        return ("a", 0.5, str(e.dport))
    for p in range(100):
        assert _memo_label(memo, [rule], _rst(dport=p)) == ("a", 0.5, str(p))
    assert memo.entries <= 10
