"""Classifier.feed_many compiled (nptrace/classify/feed_fast.c, issue #16 item 3) gives what
the Python loop (_feed_many_py, the reference) gives: the same Verdicts, the same Context calls
in the same order (a session records them), the same state after every batch (clock, queue
heads, flows, keys), on seeded streams that reach its branches: NAT tuples that merge flows,
nat_peer answers, evidence-only records, flows past MAX_KEPT, eviction past max_flows, ticks
between batches, time going back, clocks beyond 62 bits, the memo on and off, and an error
raised by a Context call in the middle of a batch."""
import random

import pytest

from nptrace import events as ev
from nptrace.bench import pipeline as bench
from nptrace.classify import Classifier, correlate
from tests.unit.test_native_paths import PURE, bench_ctx
from tests.unit.test_pipeline_batch import _ctx, _records

pytestmark = pytest.mark.skipif(PURE, reason="NPTRACE_PURE=1: the compiled helpers are off")

CALLS = ("drop_name", "rst_name", "iface_name", "service_of", "endpoint_of", "pod_of",
         "pod_of_netns", "nat_peer", "nf_rule", "route_iface")


def _logged(ctx):
    log = []
    for name in CALLS:
        fn = getattr(ctx, name, None)
        if fn is not None:
            setattr(ctx, name, lambda *a, _f=fn, _n=name: (log.append((_n, a)), _f(*a))[1])
    return ctx, log


def _state(c: Classifier):
    def name(f):
        return None if f is None else tuple(f.keys)
    return (c.now_ns, c._due_ns, name(c._hs), name(c._hw), name(c._hf),
            [tuple(f.keys) for f in c.flows], [tuple(f.keys) for f in c.strong],
            [tuple(f.keys) for f in c.weak], sorted(map(repr, c.keys)),
            # a raise between a new Flow and its first record leaves fields unset, in both
            [tuple(getattr(f, a, "unset") for a in ("first_ns", "last_ns", "extra", "strong",
                                                     "pending", "root", "nat"))
             for f in c.flows])


def _plain(v):
    return {f: getattr(v, f) for f in v.__slots__ if f != "ctx"}


def _compare(ctx, log, batches, memo=True, ticks=()):
    """Feed both classifiers the same batches (one ctx: the same lookups answer both)."""
    fast, slow = Classifier(ctx, memo_labels=memo), Classifier(ctx, memo_labels=memo)
    for i, batch in enumerate(batches):
        log.clear()
        want = slow._feed_many_py(batch)
        want_log = list(log)
        log.clear()
        got = fast.feed_many(batch)
        assert log == want_log, i
        assert [_plain(v) for v in got] == [_plain(v) for v in want], i
        assert _state(fast) == _state(slow), i
        if i in ticks:
            now = batch[-1].ts_ns + ticks[i]
            assert [_plain(v) for v in fast.tick(now)] == [_plain(v) for v in slow.tick(now)]
    assert [_plain(v) for v in fast.flush()] == [_plain(v) for v in slow.flush()]
    return fast


def _batches(rnd, events):
    out, i = [], 0
    while i < len(events):
        n = rnd.choice([1, 2, 7, 64, 256])
        out.append(events[i:i + n])
        i += n
    return out


def test_the_loop_is_compiled():
    assert correlate.NATIVE == "compiled", "correlate_fast not built: run `make setup`"
    assert Classifier().feed_many.__func__ is Classifier.feed_many


@pytest.mark.parametrize("seed", range(40))
def test_feed_many_compiled_equals_python(seed):
    rnd = random.Random(seed)
    ctx, log = _logged(_ctx(random.Random(seed)))
    events, _ = ev.decode_many(_records(rnd, 1500))
    batches = _batches(rnd, events)
    ticks = {i: rnd.choice([0, 100, 10**6]) for i in range(len(batches)) if rnd.random() < .2}
    _compare(ctx, log, batches, memo=seed % 4 != 3, ticks=ticks)


@pytest.mark.parametrize("mix", [False, True])
@pytest.mark.parametrize("max_flows", [5, 300, 16384])
def test_a_storm_compiled_equals_python(mix, max_flows):
    ctx = bench_ctx()
    ctx.max_flows = max_flows
    ctx, log = _logged(ctx)
    events, _ = ev.decode_many(bench.records(3000, mix))
    fast = _compare(ctx, log, [events[i:i + 256] for i in range(0, len(events), 256)])
    assert fast.memo.misses < 10


def test_one_flow_past_max_kept():
    """Every record on one connection: pending fills to MAX_KEPT, then better labels replace
    the last one and the rest are counted."""
    rnd = random.Random(7)
    ctx, log = _logged(_ctx(random.Random(7)))
    events, _ = ev.decode_many(_records(rnd, 600))
    one = [e._replace(saddr="10.0.0.1", sport=1234, daddr="10.0.0.2", dport=80, ct=None)
           for e in events]
    _compare(ctx, log, [one[i:i + 50] for i in range(0, len(one), 50)])


def test_clocks_beyond_62_bits_go_to_the_python_loop():
    rnd = random.Random(3)
    ctx, log = _logged(_ctx(random.Random(3)))
    events, _ = ev.decode_many(_records(rnd, 400))
    big = [e._replace(ts_ns=e.ts_ns + (1 << 63)) if i > 200 else e for i, e in enumerate(events)]
    _compare(ctx, log, [big[i:i + 64] for i in range(0, len(big), 64)])


def test_an_error_midway_leaves_the_same_state():
    """A Context call that raises in the middle of a batch: both loops raise it, and what they
    did before it stays done the same way."""
    for seed in range(10):
        rnd = random.Random(seed)
        events, _ = ev.decode_many(_records(rnd, 500))
        clfs = []
        for run in ("py", "c"):
            ctx = _ctx(random.Random(seed))
            calls = [0]
            real = ctx.drop_name

            def failing(v, _real=real, _calls=calls):
                _calls[0] += 1
                if _calls[0] == 10:
                    raise RuntimeError("lookup failed")
                return _real(v)
            ctx.drop_name = failing
            c = Classifier(ctx)
            feed = c._feed_many_py if run == "py" else c.feed_many
            with pytest.raises(RuntimeError, match="lookup failed"):
                for i in range(0, len(events), 128):
                    feed(events[i:i + 128])
            clfs.append(c)
        assert _state(clfs[0]) == _state(clfs[1]), seed
