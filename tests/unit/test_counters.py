"""Counter snapshots and deltas over plain dicts (the shapes loader.Probes returns)."""
from __future__ import annotations

import pytest

from nptrace import counters as c
from nptrace import events as ev
from nptrace.reasons import ReasonTable

DROPS = ReasonTable({2: "SKB_DROP_REASON_NO_SOCKET", 16: "SKB_DROP_REASON_IP_RPFILTER"},
                    "SKB_DROP_REASON_")
RESETS = ReasonTable({0: "SK_RST_REASON_NOT_SPECIFIED", 1: "SK_RST_REASON_NO_SOCKET"},
                     "SK_RST_REASON_")
NS = 4026532000
T, H = ev.EvType, ev.Hook


def raw(**extra):
    base = {
        (T.RST_SENT, H.TCP_SEND_RST, 1, 1, NS): 10,
        (T.RST_RECV, H.TCP_RECV_RST, 0, 0, NS): 10,
        (T.DROP, H.KFREE_SKB, 16, 3, NS): 4,
        (T.ICMP_UNREACH, H.ICMP_SEND, 3 << 8 | 3, 2, NS + 1): 2,
    }
    base.update(extra)
    return base


STATS = {"emitted": 20, "lost": 6, "filtered": 5}


def test_snapshot_names_and_totals():
    s = c.snapshot(raw(), STATS, DROPS, RESETS)
    assert s.counts[c.CountKey("RST_SENT", "TCP_SEND_RST", "NO_SOCKET", 1, NS)] == 10
    assert s.counts[c.CountKey("DROP", "KFREE_SKB", "IP_RPFILTER", 3, NS)] == 4
    assert s.counts[c.CountKey("ICMP_UNREACH", "ICMP_SEND", "icmp 3/3", 2, NS + 1)] == 2
    assert s.counts[c.CountKey("RST_RECV", "TCP_RECV_RST", "", 0, NS)] == 10
    assert (s.emitted, s.lost, s.filtered) == (20, 6, 5)
    assert s.counted == 26 and s.unaccounted == 0
    assert s.total(netns=NS) == 24
    assert s.total(type="RST_SENT", reason="NO_SOCKET") == 10
    assert s.by("netns") == {(NS,): 24, (NS + 1,): 2}
    with pytest.raises(TypeError):
        s.total(port=80)


def test_unknown_values_and_missing_tables():
    s = c.snapshot({(99, 42, 7, 0, 0): 1, (T.DROP, H.KFREE_SKB, 500, 0, 0): 2}, {})
    keys = set(s.counts)
    assert c.CountKey("TYPE_99", "HOOK_42", "7", 0, 0) in keys
    assert c.CountKey("DROP", "KFREE_SKB", "500", 0, 0) in keys
    s2 = c.snapshot({(T.DROP, H.KFREE_SKB, 500, 0, 0): 2}, {}, DROPS, RESETS)
    assert c.CountKey("DROP", "KFREE_SKB", "REASON_500", 0, 0) in s2.counts
    assert s.emitted == s.lost == s.filtered == 0


def test_delta_and_merge():
    a = c.snapshot(raw(), STATS, DROPS, RESETS)
    more = raw()
    more[(T.RST_SENT, H.TCP_SEND_RST, 1, 1, NS)] = 15
    more[(T.DROP, H.KFREE_SKB, 2, 1, NS)] = 3          # a key that appeared
    b = c.snapshot(more, {"emitted": 24, "lost": 10, "filtered": 5}, DROPS, RESETS)
    d = c.delta(a, b)
    assert d.counts == {c.CountKey("RST_SENT", "TCP_SEND_RST", "NO_SOCKET", 1, NS): 5,
                        c.CountKey("DROP", "KFREE_SKB", "NO_SOCKET", 1, NS): 3}
    assert (d.emitted, d.lost, d.filtered) == (4, 4, 0)
    assert d.unaccounted == 0
    assert c.merge([a, d]).counts == b.nonzero().counts
    assert c.merge([a, d]).lost == b.lost


def test_delta_after_counter_reset_counts_from_zero():
    a = c.snapshot(raw(), STATS)
    b = c.snapshot({(T.RST_SENT, H.TCP_SEND_RST, 1, 1, NS): 3}, {"emitted": 3})
    d = c.delta(a, b)
    assert d.counts == {c.CountKey("RST_SENT", "TCP_SEND_RST", "1", 1, NS): 3}
    assert (d.emitted, d.lost) == (3, 0)


def test_loss_line():
    assert c.loss_line(c.CounterSnapshot({}, 10, 0, 0)) is None
    line = c.loss_line(c.CounterSnapshot({}, 10, 5, 0))
    assert "lost 5 of 15" in line and "\n" not in line
