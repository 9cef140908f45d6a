"""Every cache keyed by traffic or by namespaces is bounded, and the state of a
namespace that went away is released (pure: no root, no sockets but socketpairs)."""
from __future__ import annotations

import socket
import time

from nptrace import events as ev
from nptrace.classify import Classifier, Context
from nptrace.classify.correlate import MAX_KEYS


def E(**kw):
    kw.setdefault("ts_ns", 1_000)
    return ev.decode(ev.encode(**kw))


def test_one_flow_with_ever_changing_conntrack_tuples_stays_fast_and_bounded():
    # before: Flow.keys grew by two per event and was scanned with `in`: 40k events took 29 s
    c = Classifier(Context(hold_ns=10**15))
    t0 = time.monotonic()
    for i in range(40_000):
        c.feed(E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12, ts_ns=1000 + i,
                 saddr="10.0.0.1", sport=1000, daddr="10.0.0.2", dport=80,
                 flags=ev.F_HAS_CT, ct_osrc="192.0.2.1", ct_osport=i % 60000 + 1,
                 ct_odst="10.0.0.2", ct_odport=80, ct_rsrc="10.0.0.2", ct_rsport=80,
                 ct_rdst="192.0.2.1", ct_rdport=i % 60000 + 1, ct_status=ev.IPS_DST_NAT))
    took = time.monotonic() - t0
    [flow] = list(c.flows)
    assert len(flow.keys) <= MAX_KEYS
    assert len(c.keys) <= MAX_KEYS
    assert ("10.0.0.1", 1000, "10.0.0.2", 80) in c.keys        # its own tuple stays
    assert took < 10, f"40k events of one flow took {took:.1f}s"


def test_hostile_nat_peer_answers_are_no_answer():
    for bad in ([1, 2], ["a", "b", "c", "d"], [None] * 4, "abcd", {"a": 1}, [1.5, 2, 3, 4]):
        c = Classifier(Context(nat_peer=lambda *a, b=bad: b))
        c.feed(E(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1,
                 saddr="10.0.0.1", sport=1, daddr="10.0.0.2", dport=2))
        assert list(c.flush()) and len(c.keys) == 1   # its own tuple only


def test_non_string_service_and_iface_do_not_crash_hints():
    ctx = Context(iface_name=lambda ns, i: 7, service_of=lambda a, p: ["x"],
                  drop_name=lambda v: "IP_RPFILTER")
    c = Classifier(ctx)
    c.feed(E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16, ifindex=3,
             saddr="192.168.2.10", sport=5000, daddr="10.0.0.2", dport=30080))
    [v] = c.flush()
    assert "ifindex 3" in v.hint


# --- namespaces --------------------------------------------------------------------------
class FakeNames:
    host = 1

    def netns_name(self, inode):
        return "host" if inode == 1 else f"ns{inode}"


def test_node_knowledge_prunes_and_caps(monkeypatch):
    from nptrace.node import knowledge, rules_source
    monkeypatch.setattr(rules_source, "load_service_map", lambda ns: object())
    monkeypatch.setattr(knowledge, "MAX_NAMESPACES", 8)
    kn = knowledge.NodeKnowledge(FakeNames())
    for i in range(2, 100):
        kn.rules(i)
    assert len(kn._maps) <= 8
    kn._routes[(50, "1.2.3.4")] = (0.0, "eth0")
    assert kn.prune({1, 99}) >= 1
    assert set(kn._maps) <= {1, 99} and not kn._routes


def test_names_prune_and_cap(monkeypatch):
    from nptrace.node import netns
    monkeypatch.setattr(netns, "named_namespaces", lambda: {})
    monkeypatch.setattr(netns, "MAX_CACHED_NAMESPACES", 16)
    n = netns.Names(refresh_s=0.0)
    monkeypatch.setattr(n, "_load_links", lambda inode: {1: "eth0"})
    for i in range(1000, 1200):
        n.iface(i, 1)
    assert len(n._links) <= 16 and len(n._last_scan) <= 32
    n.prune({1199})
    assert set(n._links) <= {1199}


def test_traced_rules_release_sockets_of_deleted_namespaces():
    from nptrace.node import nftrace_live
    tr = nftrace_live.TracedRules(knowledge=None)
    socks = []
    for i in range(5):
        a, b = socket.socketpair()
        socks.append((a, b))
        tr._ns[100 + i] = nftrace_live.NsTrace(f"ns{i}", a)
    tr._ns[200] = "nft trace off"
    assert tr.prune({100, 101}) == 4
    assert set(tr._ns) == {100, 101}
    assert socks[4][0].fileno() == -1 and socks[0][0].fileno() != -1
    tr.close = lambda: None
    for a, b in socks:
        a.close()
        b.close()


def test_live_namespaces_sees_processes_and_names(tmp_path):
    from nptrace.node import netns
    got = netns.live_namespaces()
    import os
    assert os.stat("/proc/self/ns/net").st_ino in got


# --- odd inputs, losses, signals, a lost interface: each handled where it arises --------
def test_decode_refuses_non_buffers_with_decode_error():
    import pytest
    for x in (None, 5, "abc", [1], {"a": 1}):
        with pytest.raises(ev.DecodeError):
            ev.decode(x)
    assert ev.decode_many([None, 3, b"x"]) == ([], 3)


def test_reasons_strip_takes_any_value():
    from nptrace import reasons
    assert reasons.strip(5, "SKB_") == "5" and reasons.strip("SKB_X", "SKB_") == "X"


def test_error_messages_are_escaped_for_the_terminal():
    import click
    from click.testing import CliRunner
    from nptrace.errors import NptraceError, one_line_errors

    @click.command()
    @one_line_errors
    def cmd():
        raise NptraceError("bad iface \x1b[31mred")
    r = CliRunner().invoke(cmd, [])
    assert r.exit_code == 2 and "\x1b" not in r.output and "\\x1b" in r.output


def test_losses_ledger_gives_deltas_and_survives_a_failing_source():
    from nptrace.daemon.losses import Ledger
    n = {"v": 0}
    led = Ledger()
    led.watch("undecodable", lambda: n["v"])
    led.watch("broken", lambda: 1 / 0)
    assert led.poll() == {}
    n["v"] = 3
    assert led.poll() == {"undecodable": 3}
    assert led.poll() == {}
    assert led.summary() == "3 undecodable"


def test_live_loss_line_has_replays_shape():
    import io
    import json
    from nptrace.sinks.jsonl import JsonLines
    out = io.StringIO()
    JsonLines(0, stream=out).loss("ring_lost", 7, "7 records ...")
    d = json.loads(out.getvalue())
    assert set(d) == {"kind", "loss", "records", "bytes", "path", "offset", "message"}
    assert (d["kind"], d["loss"], d["records"]) == ("loss", "ring_lost", 7)


def test_metrics_count_user_space_losses():
    from prometheus_client import CollectorRegistry
    from nptrace.sinks.prometheus import MetricsSink
    reg = CollectorRegistry()
    m = MetricsSink(reg)
    m.loss("recorder_dropped", 4)
    m.loss("nft_trace_malformed", None)
    m.loss("ring_lost", 9)           # the kernel's counter says that one
    assert reg.get_sample_value("nptrace_user_losses_total", {"stage": "recorder_dropped"}) == 4
    assert reg.get_sample_value("nptrace_user_losses_total", {"stage": "nft_trace_malformed"}) == 1
    assert reg.get_sample_value("nptrace_user_losses_total", {"stage": "ring_lost"}) is None


def test_signals_are_counted_and_checked_between_steps():
    import os
    import signal
    import pytest
    from nptrace.daemon.lifecycle import Interrupted, Signals, run_steps
    s = Signals()
    s.install()
    try:
        s.checkpoint("a")
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Interrupted):
            s.checkpoint("compile")
    finally:
        s.restore()
    done = []
    failed = run_steps([("one", lambda: 1 / 0), ("two", lambda: done.append(2)),
                        ("three", lambda: (_ for _ in ()).throw(KeyboardInterrupt())),
                        ("four", lambda: done.append(4))], lambda m: None)
    assert failed == ["one", "three"] and done == [2, 4]


def test_iface_watch_reattaches_once_and_reports_the_gap():
    from nptrace.config import IfaceSpec
    from nptrace.node.ifwatch import IfaceWatch

    class FakeTc:
        def __init__(self):
            self.at, self.calls = (1, 5), []

        def where(self, spec):
            return self.at

        def reattach(self, spec, ifindex, inode):
            self.calls.append((inode, ifindex))
            self.at = (inode, ifindex)
    now = {"t": 0.0}
    state = {"cur": (1, 5)}
    tc, logs, gaps = FakeTc(), [], []
    w = IfaceWatch([IfaceSpec("ns", "eth0")], tc, logs.append, clock=lambda: now["t"],
                   lookup=lambda spec: state["cur"], on_gap=gaps.append)
    w.poll(force=True)
    assert tc.calls == [] and not logs
    state["cur"] = None
    now["t"] = 2.0
    w.poll(force=True)
    assert "disappeared" in logs[-1]
    state["cur"] = (1, 9)
    now["t"] = 5.0
    w.poll(force=True)
    w.poll(force=True)
    assert tc.calls == [(1, 9)] and gaps[0].seconds == 3.0 and "is back" in logs[-1]


def test_table_owner_rules():
    import os
    from nptrace.node.nftrace_live import owner_alive, owner_comment
    assert owner_alive(owner_comment(os.getppid()))            # a live process
    assert not owner_alive("nptrace 999999 1")                   # dead
    assert not owner_alive("")                                   # unowned, under the node lock
    assert owner_alive("", node_lock=False)                      # unowned, private lock: kept
