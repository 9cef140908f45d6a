"""Storm collapsing of the line sinks (sinks/collapse.py): every incident is still accounted for
(sum of `repeat`, sum of `events`), fewer lines are written, ordinary traffic is untouched."""
import io
import json

from nptrace import events as ev
from nptrace.classify import Classifier, Context, classify
from nptrace.sinks.collapse import StormCollapse, server_end
from nptrace.sinks.console import Console
from nptrace.sinks.jsonl import JsonLines

CTX = Context(drop_name=lambda v: {3: "NO_SOCKET"}.get(v, f"REASON_{v}"),
              rst_name=lambda v: {1: "NO_SOCKET"}.get(v, f"REASON_{v}"))
MS = 1_000_000


def resets(n, t0=0, gap=MS, server="10.0.0.2", port=9999):
    """n no_listener resets from distinct clients, `gap` apart (each a flow of its own)."""
    out = []
    for i in range(n):
        out.append(ev.decode(ev.encode(
            ts_ns=t0 + i * gap, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1,
            aux=ev.TCP_SYN, saddr=server, sport=port, daddr=f"10.1.{i // 250}.{i % 250 + 1}",
            dport=1024 + i % 60000)))
    return out


def lines(verdicts, collapse, ticks=()):
    buf = io.StringIO()
    sink = JsonLines(0, buf, collapse)
    for v in verdicts:
        sink.write(v)
    for t in ticks:
        sink.tick(t)
    sink.close()
    return [json.loads(x) for x in buf.getvalue().splitlines()]


def test_every_line_says_repeat_and_default_is_one_line_per_incident():
    vs = list(classify(resets(30), CTX))
    out = lines(vs, None)
    assert len(out) == 30 and all(d["repeat"] == 1 for d in out)
    assert "repeat_since" not in out[0]


def test_a_storm_collapses_but_every_incident_and_event_is_counted():
    vs = list(classify(resets(1000, gap=MS // 2) + resets(5, port=80), CTX))   # 1000 in 0.5 s
    out = lines(vs, StormCollapse(burst=20))
    storm = [d for d in out if d["sport"] == 9999]
    assert len(storm) == 21                                  # 20 as usual, then one summary
    assert sum(d["repeat"] for d in storm) == 1000
    assert sum(d["events"] for d in storm) == sum(v.events for v in vs if v.event.sport == 9999)
    summary = storm[-1]
    assert summary["repeat"] == 980 and summary["repeat_since"] <= summary["ts"]
    assert summary["cause"] == "no_listener"
    assert len([d for d in out if d["sport"] == 80]) == 5   # another server: its own lines


def test_windows_reopen_each_second_and_tick_writes_a_quiet_summary():
    vs = list(classify(resets(300, gap=10 * MS), CTX))     # 3 s of 100 resets/s
    c = StormCollapse(burst=10)
    buf = io.StringIO()
    sink = JsonLines(0, buf, c)
    for v in vs:
        sink.write(v)
    before = len(buf.getvalue().splitlines())
    sink.tick(vs[-1].event.ts_ns + 2 * 10**9)               # quiet: the last summary is due
    out = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert len(out) > before and sum(d["repeat"] for d in out) == 300
    assert len(out) == 3 * 11                                # 10 lines + 1 summary per second
    sink.close()
    assert len(buf.getvalue().splitlines()) == len(out)      # nothing left to drain


def test_server_end_ignores_the_client_side():
    vs = list(classify(resets(3), CTX))
    assert {server_end(v) for v in vs} == {("10.0.0.2", 9999)}
    syn_drop = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=3,
                                   tcpflags=ev.TCP_SYN, saddr="10.1.0.1", sport=1000,
                                   daddr="10.0.0.2", dport=9999))
    [v] = classify([syn_drop], CTX)
    assert server_end(v) == ("10.0.0.2", 9999)


def test_console_collapses_and_summary_counts_every_incident():
    vs = list(classify(resets(100, gap=MS), CTX))
    buf = io.StringIO()
    con = Console(0, buf, StormCollapse(burst=5))
    for v in vs:
        con.write(v)
    con.close()
    text = buf.getvalue()
    assert "... and 95 more no_listener like this since" in text
    assert con.by_cause["no_listener"] == 100


def test_bad_settings_are_refused():
    import pytest
    with pytest.raises(ValueError):
        StormCollapse(burst=0)


def test_classifier_output_is_the_same_whatever_the_sink():
    c = Classifier(CTX)
    out = []
    for e in resets(50):
        out += c.feed(e)
    out += c.flush()
    assert [v.cause for v in out] == ["no_listener"] * 50
