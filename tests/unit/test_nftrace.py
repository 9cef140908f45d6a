"""nf_tables trace decoding and the rule it names, without root: the netlink datagrams in
tests/fixtures/nft_trace.hex were read from the kernel (6.18) by nftrace_live's socket while
`table ip filter2 { chain in { ... tcp dport 81 reject with tcp reset; tcp dport 82 drop } }`
met two traced SYNs from 127.0.0.1 (the 82 one retransmitted once)."""
import binascii
import struct
from pathlib import Path

import pytest

from nptrace.node import nftrace, nftrace_live
from nptrace.classify import Context
from nptrace.services import parse_iptables_save, parse_nft

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def datagrams():
    return [binascii.unhexlify(l.strip()) for l in (FIX / "nft_trace.hex").read_text().splitlines()
            if l.strip()]


def messages():
    return [m for d in datagrams() for m in nftrace.decode(d)]


def test_decode_recorded_trace():
    msgs = messages()
    assert len(msgs) == 21
    drops = [m for m in msgs if m.drops]
    assert [(m.family, m.table, m.chain, m.handle) for m in drops] == \
        [("ip", "filter2", "in", 2), ("ip", "filter2", "in", 3), ("ip", "filter2", "in", 3)]
    first = msgs[0]
    assert (first.family, first.table, first.chain, first.kind) == ("inet", "nptrace_trace", "out",
                                                                    nftrace.TRACETYPE_RULE)
    assert first.pkt == ("127.0.0.1", "127.0.0.1", first.pkt[2], 81, 6)
    assert first.verdict == -1 and not first.drops         # NFT_CONTINUE
    policies = [m for m in msgs if m.kind == nftrace.TRACETYPE_POLICY]
    assert policies and all(m.policy == 1 and not m.drops for m in policies)  # accept


def test_decode_skips_other_messages_and_garbage():
    other = struct.pack("=IHHII", 20, (10 << 8) | 15, 0, 0, 0) + b"\x00" * 4   # NEWGEN
    assert nftrace.decode(other) == []
    assert nftrace.decode(b"") == []
    assert nftrace.decode(b"\x03\x00\x00\x00" + b"\x00" * 12) == []       # length < header
    data = datagrams()[0]
    assert len(nftrace.decode(other + data)) == len(nftrace.decode(data))


def test_book_pairs_drop_with_packet_of_its_walk():
    book = nftrace.TraceBook(skip_table="nptrace_trace")
    new = book.feed(messages(), now=10.0)
    assert len(new) == 3
    d = book.lookup("127.0.0.1", [("127.0.0.1", 82)], now=11.0, max_age=60)
    assert d.where() == "table ip filter2 chain in handle 3" and d.dport == 82 and d.iif == 1
    assert book.lookup("127.0.0.1", [("127.0.0.1", 82)], now=100.0, max_age=60) is None  # stale
    assert book.lookup("10.0.0.1", [("127.0.0.1", 82)], now=11.0, max_age=60) is None    # other client
    # after DNAT the drop is keyed by the endpoint; the lookup offers both destinations
    assert book.lookup("127.0.0.1", [("10.1.1.1", 80), ("127.0.0.1", 81)], 11.0, 60).handle == 2


def test_book_is_bounded_and_ignores_its_own_table():
    book = nftrace.TraceBook(skip_table="filter2")
    assert book.feed(messages(), now=1.0) == []      # the only drops are in the skipped table
    book = nftrace.TraceBook()
    book.MAX_DROPS = 2
    base = messages()
    for i in range(5):
        ms = [nftrace.TraceMsg(**{**m.__dict__, "trace_id": m.trace_id + i,
                                  "pkt": (m.pkt[0], f"10.0.0.{i}", *m.pkt[2:]) if m.pkt else None})
              for m in base]
        book.feed(ms, now=float(i))
    assert len(book._drops) == 2


def test_policy_drop_is_a_drop():
    m = nftrace.TraceMsg(1, "ip", "filter", "FORWARD", nftrace.TRACETYPE_POLICY, None, None, None,
                         0, None, None, None)
    assert m.drops
    book = nftrace.TraceBook()
    pkt = nftrace.TraceMsg(1, "ip", "filter", "FORWARD", nftrace.TRACETYPE_RULE, 5, -3, "X", None,
                           None, None, ("1.1.1.1", "2.2.2.2", 1000, 80, 6))
    book.feed([pkt, m], 0.0)
    assert book.lookup("1.1.1.1", [("2.2.2.2", 80)], 0.0, 1).where() == \
        "table ip filter chain FORWARD policy drop"


def test_table_script_is_one_transaction_with_bounded_tracing():
    s = nftrace_live.table_script()
    assert s.startswith("table inet nptrace_trace {}; delete table inet nptrace_trace; ")
    assert s.count("meta nftrace set 1") == 4 and s.count(f"limit rate {nftrace_live.TRACE_RATE}") == 4
    assert "hook prerouting priority raw - 10" in s and "hook output priority raw - 10" in s


# -- TracedRules: the answer the classifier gets ---------------------------------------------

IPT = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:NETPOL - [0:0]
-A FORWARD -j NETPOL
-A NETPOL -s 10.9.0.0/16 -j ACCEPT
-A NETPOL -m comment --comment "default/web-ingress: default deny ingress" -j DROP
COMMIT
"""


class FakeKnowledge:
    def __init__(self, smap, netns="npt-x", answer=None):
        self.smap, self.netns, self.answer = smap, netns, answer

    def _netns_arg(self, inode):
        return self.netns

    def rules(self, inode):
        return self.smap

    def nf_rule(self, *a):
        return self.answer


class FakeSession:
    def __init__(self, netns=None):
        self.netns = netns
        self.book = nftrace.TraceBook(nftrace_live.TABLE)
        self.armed = {}
        self.lines = []
        self.closed = False

    def arm(self, addr, port, now):
        self.armed[(addr, port)] = now
        return True

    def drain(self, now):
        return 0

    def rule_line(self, d, now):
        return ("meta l4proto tcp counter drop", 2)

    def close(self):
        self.closed = True


@pytest.fixture
def fake_sessions(monkeypatch):
    made = []

    def open_(netns):
        s = FakeSession(netns)
        made.append(s)
        return s
    monkeypatch.setattr(nftrace_live.NsTrace, "open", staticmethod(open_))
    monkeypatch.setattr(nftrace_live.TracedRules, "_start_reader", lambda self: None)
    return made


def _drop(handle=7, chain="NETPOL", table="filter", saddr="10.1.0.5", daddr="10.2.0.9", dport=8080):
    return nftrace.TraceMsg(9, "ip", table, chain, nftrace.TRACETYPE_RULE, handle, 0, None, None,
                            3, None, (saddr, daddr, 40000, dport, 6))


def test_first_drop_is_named_from_the_ruleset_and_arms_the_trace(fake_sessions):
    smap = parse_iptables_save(IPT, backend="iptables-nft")
    answer = {"tag": "other", "where": "filter/NETPOL rule 2", "text": "-A NETPOL ... -j DROP",
              "service": None, "to_pod": True}
    tr = nftrace_live.TracedRules(FakeKnowledge(smap, answer=answer), clock=lambda: 5.0)
    got = tr.nf_rule(1, "10.1.0.5", "10.2.0.9", 8080, "10.96.0.1", 80, True, True)
    assert got["source"] == "ruleset" and "armed" in got["note"] and got["where"] == answer["where"]
    sess = fake_sessions[0]
    assert sess.armed == {}          # the classifier's thread never forks nft
    assert tr.arm_pending() == 2 and tr.arm_pending() == 0
    assert set(sess.armed) == {("10.2.0.9", 8080), ("10.96.0.1", 80)}
    # the next packet is traced: the answer names the traced rule, with its iptables text
    sess.book.feed([_drop()], 5.5)
    got = tr.nf_rule(1, "10.1.0.5", "10.2.0.9", 8080, "10.96.0.1", 80, True, True)
    assert got["source"] == "nft trace"
    assert got["where"] == "table ip filter chain NETPOL handle 7 (rule 2)"
    assert got["text"].startswith("-A NETPOL -m comment") and got["tag"] == "other" and got["to_pod"]
    tr.close()
    assert sess.closed


def test_trace_keeps_kube_proxy_tag_of_the_same_table(fake_sessions):
    smap = parse_nft((FIX / "kube-proxy" / "derived" / "nft-overall.nft-list").read_text())
    answer = {"tag": "no_endpoints", "where": "ip kube-proxy/no-endpoint-services",
              "text": "add element ...", "service": "ns/svc:p", "to_pod": False}
    tr = nftrace_live.TracedRules(FakeKnowledge(smap, answer=answer), clock=lambda: 1.0)
    tr.nf_rule(1, "10.1.0.5", "10.2.0.9", 80, "10.2.0.9", 80, True, True)
    fake_sessions[0].book.feed([_drop(43, "reject-chain", "kube-proxy", daddr="10.2.0.9", dport=80)], 1.0)
    got = tr.nf_rule(1, "10.1.0.5", "10.2.0.9", 80, "10.2.0.9", 80, True, True)
    assert (got["tag"], got["service"], got["source"]) == ("no_endpoints", "ns/svc:p", "nft trace")
    assert got["where"].startswith("table ip kube-proxy chain reject-chain handle 43")


def test_no_trace_where_it_cannot_see(fake_sessions):
    answer = {"tag": "other", "where": "filter/X rule 1", "text": "-A X -j DROP", "service": None}
    legacy = parse_iptables_save(IPT, backend="iptables-legacy")
    got = nftrace_live.TracedRules(FakeKnowledge(legacy, answer=answer)).nf_rule(
        1, "a", "b", 1, "b", 1, True, True)
    assert got["source"] == "ruleset" and "iptables-legacy" in got["note"]
    got = nftrace_live.TracedRules(FakeKnowledge(None, netns=False, answer=answer)).nf_rule(
        1, "a", "b", 1, "b", 1, True, True)
    assert "named network namespace" in got["note"]
    got = nftrace_live.TracedRules(FakeKnowledge(None, answer=answer), enabled=False).nf_rule(
        1, "a", "b", 1, "b", 1, True, True)
    assert "--no-nft-trace" in got["note"]
    assert fake_sessions == []
    assert nftrace_live.TracedRules(FakeKnowledge(None, answer=None)).nf_rule(
        1, "a", "b", 1, "b", 1, True, True) is None


def test_arming_is_rate_limited(fake_sessions):
    now = [0.0]
    tr = nftrace_live.TracedRules(FakeKnowledge(None, answer={"tag": None}), clock=lambda: now[0])
    notes = [tr.nf_rule(1, "a", f"10.0.0.{i}", 80, f"10.0.0.{i}", 80, True, True)["note"]
             for i in range(nftrace_live.ARMS_PER_S + 3)]
    assert sum("armed" in n for n in notes) == nftrace_live.ARMS_PER_S
    assert "at most" in notes[-1]
    now[0] = 1.5
    assert "armed" in tr.nf_rule(1, "a", "10.0.1.1", 80, "10.0.1.1", 80, True, True)["note"]


@pytest.mark.parametrize("answer,says", [
    ({"tag": "other", "where": "table ip filter chain NETPOL handle 7 (rule 2)", "text": "-A NETPOL -j DROP",
      "service": None, "to_pod": True, "source": "nft trace"}, "handle 7 (rule 2): `-A NETPOL -j DROP`, seen by nft trace"),
    ({"tag": "other", "where": "filter/NETPOL rule 2", "text": "-A NETPOL -j DROP", "service": None,
      "to_pod": True, "source": "ruleset", "note": "iptables-legacy rules are invisible to nft trace"},
     "named from the ruleset; iptables-legacy rules are invisible to nft trace"),
    ({"tag": "other", "where": "filter/NETPOL rule 2", "text": "-A NETPOL -j DROP", "service": None,
      "to_pod": True}, "rule 2: `-A NETPOL -j DROP`)"),
])
def test_classifier_hint_says_where_the_rule_came_from(answer, says):
    from nptrace import events as ev
    from nptrace.classify import classify
    ctx = Context(drop_name=lambda v: "NETFILTER_DROP" if v == 12 else f"REASON_{v}",
                  nf_rule=lambda *a: answer)
    [v] = classify([ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12,
                                        tcpflags=ev.TCP_SYN, ts_ns=1000, saddr="10.1.0.5", sport=5,
                                        daddr="10.2.0.9", dport=8080))], ctx)
    assert v.cause == "policy_drop" and says in v.hint, v.hint
