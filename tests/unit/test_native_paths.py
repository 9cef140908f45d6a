"""The compiled helpers of the hot path (nptrace/events_fast.c, nptrace/sinks/jsonl_fast.c;
issue #16 item 3) give exactly what the pure-Python paths give, which stay the reference:
the same Events (values and types) and bad count for good, rare, damaged and hostile records;
the same JSON lines, and the same Context lookups in the same order, for seeded streams that
reach every branch of verdict_line. `make setup` builds them; NPTRACE_PURE=1 turns them off."""
import io
import math
import os
import random
import struct
import subprocess
import sys

import pytest

from nptrace import events as ev
from nptrace.bench import pipeline as bench
from nptrace.classify import Classifier
from nptrace.sinks import jsonl
from tests.unit.test_pipeline_batch import _ctx, _records

PURE = os.environ.get("NPTRACE_PURE") == "1"
needs_native = pytest.mark.skipif(PURE, reason="NPTRACE_PURE=1: the compiled helpers are off")


@needs_native
def test_the_helpers_are_built():
    # make setup builds them (setup.py; gcc and python3-dev from scripts/setup.sh). Without
    # them nptrace still runs, on the pure paths; here that means the setup is broken.
    assert ev.NATIVE == "compiled", "nptrace/events_fast not built: run `make setup`"
    assert jsonl.NATIVE == "compiled", "nptrace/sinks/jsonl_fast not built: run `make setup`"


def _same_events(a, b):
    assert a[1] == b[1]
    assert len(a[0]) == len(b[0])
    for x, y in zip(a[0], b[0]):
        assert x == y
        assert type(x) is type(y)
        assert [type(f) for f in x] == [type(f) for f in y], x


def _damaged(rnd: random.Random, recs: list[bytes], n: int) -> list:
    out = []
    for _ in range(n):
        r = bytearray(rnd.choice(recs))
        for _ in range(rnd.randint(0, 8)):
            r[rnd.randrange(len(r))] = rnd.randrange(256)
        k = rnd.random()
        if k < .05:
            r = r[:rnd.randrange(len(r))]
        elif k < .1:
            r += b"xyz"
        x = bytes(r)
        k = rnd.random()
        if k < .05:
            x = bytearray(x)
        elif k < .08:
            x = memoryview(x)
        elif k < .09:
            x = rnd.choice([None, 5, "text", [1, 2], b""])
        out.append(x)
    return out


@needs_native
@pytest.mark.parametrize("seed", range(8))
def test_decode_many_compiled_equals_python(seed):
    rnd = random.Random(seed)
    recs = _records(rnd, 500) + bench.records(200, True)
    _same_events(ev.decode_many(recs), ev.decode_many_py(recs))
    bad = _damaged(rnd, recs, 3000)
    _same_events(ev.decode_many(bad), ev.decode_many_py(bad))


@needs_native
def test_decode_many_address_cache_stays_bounded_and_right():
    # more distinct addresses than the cache holds (it is emptied when full, as the dicts are)
    tpl = bench.records(1, False)[0]
    off = ev.RawEvent.daddr.offset
    recs = []
    for i in range(20_000):
        b = bytearray(tpl)
        b[off:off + 4] = (0x0A000000 + i).to_bytes(4, "big")
        recs.append(bytes(b))
    _same_events(ev.decode_many(recs), ev.decode_many_py(recs))
    assert ev.decode_many(recs)[0][12_345].daddr == "10.0.48.57"


def _counting(ctx):
    """ctx with every lookup logged, in order (a session records what the sinks ask)."""
    log = []
    for name in ("iface_name", "service_of", "endpoint_of", "pod_of", "pod_of_netns"):
        fn = getattr(ctx, name)
        setattr(ctx, name, lambda *a, _f=fn, _n=name: (log.append((_n, a)), _f(*a))[1])
    return ctx, log


@needs_native
@pytest.mark.parametrize("seed", range(20))
def test_lines_compiled_equal_python_with_the_same_lookups(seed):
    rnd = random.Random(seed)
    recs = _records(rnd, 800)
    c = Classifier(_ctx(random.Random(seed)))
    verdicts = []
    for i in range(0, len(recs), 64):
        events, _ = ev.decode_many(recs[i:i + 64])
        verdicts += c.feed_many(events)
    verdicts += c.flush()
    assert verdicts
    offset = rnd.choice([0, 123_456_789, 1_700_000_000 * 10**9])
    prefix = rnd.choice(["{", '{"node":"n\\u00e9",'])
    ctx, log = _counting(c.ctx)
    py = [jsonl.verdict_line(v, offset, 1, None, None, prefix) for v in verdicts]
    py_log = list(log)
    log.clear()
    jsonl._LINES.clear()
    assert jsonl._FAST.lines(verdicts, offset, prefix) == py
    assert log == py_log
    one = sum(jsonl._FAST.one_line(v, offset, prefix) is not None for v in verdicts)
    multi = sum(jsonl._FAST.multi_line(v, offset, prefix) is not None for v in verdicts)
    assert one and multi and one + multi < len(verdicts)     # all three paths were taken


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_lines_of_many_events_with_hostile_values(seed):
    """The line of several events (jsonl_multi.c) over values that make either path decline
    or escape: non-ASCII and quoted interface names and hints, unhashable lookup answers,
    many evidence events, big ints."""
    rnd = random.Random(seed)
    c = Classifier(_ctx(random.Random(seed)))
    verdicts = []
    for i in range(0, 1600, 64):
        events, _ = ev.decode_many(_records(rnd, 64))
        verdicts += c.feed_many(events)
    verdicts += c.flush()
    names = ["eth0", 'q"\u00fc', "\u2603\n", ["unhashable"], None]
    c.ctx.iface_name = lambda ns, i: names[(ns + i) % len(names)]
    for v in verdicts:
        if rnd.random() < .2:
            object.__setattr__(v, "hint", rnd.choice(['say "{port}"', "\u00e9t\u00e9", "x" * 300]))
        if rnd.random() < .05:
            object.__setattr__(v, "events", 1 << 70)
    want, got = [], []
    for v in verdicts:
        try:
            want.append(jsonl.verdict_line(v, 5, 1, None, None, "{"))
        except TypeError as e:
            want.append(("raises", str(e)))
        try:
            got.append(jsonl._FAST.lines([v], 5, "{")[0])
        except TypeError as e:
            got.append(("raises", str(e)))
    assert got == want
    wrote = [v for v, w in zip(verdicts, want)
             if isinstance(w, str) and jsonl._FAST.multi_line(v, 5, "{") is not None]
    raised = [w for w in want if not isinstance(w, str)]
    assert wrote and raised


@needs_native
def test_one_line_declines_before_any_lookup():
    rnd = random.Random(7)
    c = Classifier(_ctx(rnd))
    verdicts = []
    for i in range(0, 3000, 100):
        events, _ = ev.decode_many(_records(rnd, 100))
        verdicts += c.feed_many(events)
    verdicts += c.flush()
    ctx, log = _counting(c.ctx)
    declined = multi_declined = 0
    for v in verdicts:
        log.clear()
        if jsonl._FAST.one_line(v, 0, "{") is None:
            declined += 1
            assert log == [], v
        log.clear()
        if jsonl._FAST.multi_line(v, 0, "{") is None:
            multi_declined += 1
            assert log == [], v
    assert declined and multi_declined


@needs_native
def test_a_changed_template_cache_is_read_again():
    """one() reuses the last line's template while jsonl._LINES is unchanged (same_key); any
    change of the dict makes it look the key up again, as verdict_line does."""
    v = next(x for x in _storm_verdicts() if jsonl._FAST.one_line(x, 7, "{") is not None)
    first = jsonl._FAST.lines([v, v], 7, "{")
    assert first == [jsonl.verdict_line(v, 7, 1, None, None, "{")] * 2
    for k, tpl in list(jsonl._LINES.items()):
        jsonl._LINES[k] = (tpl[0] + '"seen":1,',) + tpl[1:]
    again = jsonl._FAST.lines([v], 7, "{")
    assert again == [jsonl.verdict_line(v, 7, 1, None, None, "{")] and '"seen":1,' in again[0]
    jsonl._LINES.clear()
    assert jsonl._FAST.lines([v], 7, "{") == first[:1]


def _storm_verdicts(n=2000):
    recs = bench.records(n, False)
    c = Classifier(bench_ctx())
    out = []
    for i in range(0, len(recs), 256):
        events, _ = ev.decode_many(recs[i:i + 256])
        out += c.feed_many(events)
    return out + c.flush()


@needs_native
def test_lines_read_verdict_slots_as_getattr_does():
    """jsonl_fast reads a Verdict's fields at their slots' offsets (vget): only for the exact
    type, and an unset slot raises as getattr does. A subclass's property is honoured."""
    from nptrace.classify import Verdict
    rnd = random.Random(3)
    c = Classifier(_ctx(rnd))
    events, _ = ev.decode_many(_records(rnd, 400))
    verdicts = c.feed_many(events) + c.flush()
    assert verdicts

    class Renamed(Verdict):
        __slots__ = ()

        @property
        def service(self):
            return "other/svc:80"

    for v in verdicts[:50]:
        sub = object.__new__(Renamed)
        for f in Verdict.__slots__:
            Verdict.__dict__[f].__set__(sub, getattr(v, f))
        want = [jsonl.verdict_line(x, 7, 1, None, None, "{") for x in (v, sub)]
        jsonl._LINES.clear()
        assert jsonl._FAST.lines([v, sub], 7, "{") == want
        assert '"service":"other/svc:80"' in want[1]
    bare = object.__new__(Verdict)
    Verdict.__dict__["event"].__set__(bare, verdicts[0].event)
    with pytest.raises(AttributeError):
        jsonl.verdict_line(bare, 7, 1, None, None, "{")
    with pytest.raises(AttributeError):
        jsonl._FAST.lines([bare], 7, "{")


@needs_native
@pytest.mark.parametrize("offset", [42, 1_764_633_600_123_456_789])   # and a live epoch offset
def test_write_many_output_is_the_python_text(offset):
    recs = bench.records(5000, False)
    ctx = bench_ctx()
    texts = []
    for fast in (True, False):
        c, buf = Classifier(ctx), io.StringIO()
        sink = jsonl.JsonLines(offset, buf, node="node-a")
        saved = jsonl._fast_lines
        jsonl._fast_lines = saved if fast else None
        try:
            for i in range(0, len(recs), 256):
                events, _ = ev.decode_many(recs[i:i + 256])
                sink.write_many(c.feed_many(events))
            sink.write_many(c.flush())
        finally:
            jsonl._fast_lines = saved
        texts.append(buf.getvalue())
    assert texts[0] == texts[1] and texts[0].count("\n") == 5000


def _seconds_cases(rnd):
    """Doubles for seconds_repr: random ones of its whole range [2^30, 2^34), the short
    decimals (0-7 places) and their neighbours 1-3 ulps away (where the shortest repr is
    decided), its edges, and values it must leave to dtoa."""
    for _ in range(60_000):
        yield struct.unpack("<d", struct.pack("<Q", (1023 + rnd.randrange(30, 34)) << 52
                                              | rnd.getrandbits(52)))[0]
    for _ in range(20_000):
        d = rnd.randrange(0, 8)
        x = rnd.randrange(2**30 * 10**d, 2**34 * 10**d) / 10**d
        for k in (-3, -2, -1, 0, 1, 2, 3):
            y = x
            for _ in range(abs(k)):
                y = math.nextafter(y, math.inf if k > 0 else -math.inf)
            yield y
    edges = [2.0**30, 2.0**31, 2.0**34, 1e10, 9999999999.9999995, 1764633600.0]
    for x in edges:
        yield from (x, math.nextafter(x, 0), math.nextafter(x, math.inf))
    yield from (float("nan"), float("inf"), -float("inf"), -1764633600.5, 0.0, -0.0, 5e-324,
                1e300, 1.5, 12.345678901)


@needs_native
def test_seconds_repr_is_float_repr():
    """jsonl_seconds.c writes a line's `ts` without dtoa: the same text as repr() for every
    double, and it decides nearly all epoch seconds itself (else the gain is gone)."""
    rnd = random.Random(11)
    decided = inside = 0
    for x in _seconds_cases(rnd):
        text, fast = jsonl._FAST._seconds_repr(x)
        assert text == repr(x), x.hex()
        if 2**30 <= x < 2**34:
            inside += 1
            decided += fast
        else:
            assert not fast
    assert decided > 0.999 * inside


def _slots(v):
    return {f: getattr(v, f) for f in v.__slots__}


def bench_ctx():
    from nptrace.classify import Context
    return Context(drop_name=lambda v: "NO_SOCKET" if v == bench.NO_SOCKET else f"REASON_{v}",
                   rst_name=lambda v: "NO_SOCKET" if v == 1 else f"REASON_{v}")


def test_nptrace_pure_turns_them_off():
    code = "from nptrace import events; from nptrace.sinks import jsonl; " \
           "print(events.NATIVE, jsonl.NATIVE)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "NPTRACE_PURE": "1"}, check=True).stdout
    assert out.split() == ["python", "python"]


@needs_native
@pytest.mark.parametrize("seed", range(20))
def test_one_compiled_equals_python_with_the_same_lookups(seed):
    from nptrace.classify import correlate
    assert correlate.NATIVE == "compiled"
    rnd = random.Random(seed)
    ctx, log = _counting(_ctx(random.Random(seed)))
    pod_of = {"10.0.0.1": "ns/a", "10.0.0.2": "", "fd00::1": "ns/b"}
    ctx.pod_of = lambda a: (log.append(("pod_of", (a,))), pod_of.get(a))[1]
    ctx.pod_of_netns = lambda n: (log.append(("pod_of_netns", (n,))), "ns/n" if n == 2 else "")[1]
    from nptrace.classify.verdict import Labeled
    events, _ = ev.decode_many(_records(rnd, 400))
    hints = ["plain", "to {service} port {port}", "{saddr}:{sport} via {iface}", ""]
    for e in events:
        lab = Labeled(e, rnd.choice(["NO_SOCKET", "X"]), rnd.choice(["no_listener", None]),
                      rnd.choice([0.5, 0.9]), rnd.choice(hints))
        nat = rnd.choice([None, None, e.ct])
        n = rnd.randint(1, 3)
        log.clear()
        want = correlate._one_py(lab, n, ctx, nat)
        want_log = list(log)
        log.clear()
        got = correlate._one(lab, n, ctx, nat)
        assert log == want_log
        assert _slots(got) == _slots(want)       # every field, compared or not
        assert got == want and type(got) is type(want)


@needs_native
@pytest.mark.parametrize("seed", range(4))
def test_rootless_compiled_equals_python(seed):
    """The root cause a flow keeps: the same Labeled and Event types and values, raw b"", and
    the record itself (not a copy) when it has no raw bytes."""
    from nptrace.classify import correlate
    from nptrace.classify.verdict import Labeled
    assert correlate._rootless is not correlate._rootless_py
    rnd = random.Random(seed)
    events, _ = ev.decode_many(_records(rnd, 200))
    for e in events + [e._replace(raw=b"") for e in events[:20]]:
        lab = Labeled(e, "NO_SOCKET", rnd.choice(["no_listener", None]), 0.9, "h")
        want, got = correlate._rootless_py(lab), correlate._rootless(lab)
        assert got == want and type(got) is type(want) and type(got.ev) is type(want.ev)
        assert got.ev.raw == b"" and (got is lab) == (not e.raw)
    for bad in (None, (1, 2), Labeled(("not", "an", "event"), "", None)):
        with pytest.raises(TypeError):
            correlate._rootless(bad)


@needs_native
def test_make_verdict_compiled_equals_python():
    """Every slot as the descriptors set them, pods and natmap None when not given; a wrong
    argument count raises as the Python function does (TypeError)."""
    from nptrace.classify import correlate
    from nptrace.classify.verdict import Labeled
    assert correlate._make_verdict is not correlate._make_verdict_py
    events, _ = ev.decode_many(_records(random.Random(1), 3))
    e = events[0]
    lab = (Labeled(e, "NO_SOCKET", "no_listener", 0.9, "h"),)
    args = [e, "rst", "sent", "tcp:tcp_send_reset", "NO_SOCKET", "no_listener", 0.9, "h",
            "eth0", "ns/svc:80", lab, 3, correlate.Context()]
    for extra in ([], [{"pod": "ns/p"}]):
        want = correlate._make_verdict_py(*args, *extra)
        got = correlate._make_verdict(*args, *extra)
        assert _slots(got) == _slots(want) and type(got) is type(want)
        assert got.natmap is None and got.pods == (extra[0] if extra else None)
    for bad in (args[:-1], args + [None, None]):
        with pytest.raises(TypeError):
            correlate._make_verdict(*bad)


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_service_compiled_equals_python_with_the_same_lookups(seed):
    from nptrace.classify import correlate
    assert correlate._service is not correlate._service_py
    ctx, log = _counting(_ctx(random.Random(seed)))
    events, _ = ev.decode_many(_records(random.Random(seed), 300))
    assert any(e.ct is None for e in events) and any(e.ct is not None for e in events)
    for e in events:
        log.clear()
        want = correlate._service_py(e, ctx)
        want_log = list(log)
        log.clear()
        assert correlate._service(e, ctx) == want and log == want_log
