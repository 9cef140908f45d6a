"""nf_tables trace events, decoded: which table, chain and rule handle gave a packet its verdict.

A packet whose skb has nf_trace set (nptrace sets it only for flows of interest, see
nftrace_live.py) makes nf_tables send one NFT_MSG_TRACE message per rule that matched and per
chain policy or return, to the NFNLGRP_NFTRACE netlink group of its network namespace. This is
what `nft monitor trace` prints; iptables-nft rules are nf_tables rules, so their drops are
traced too, while iptables-legacy's are not (they log TRACE through nf_log instead).

Pure decoding and bookkeeping, no sockets: tests feed it recorded bytes. A datagram is
kernel input, but decode() never raises on a short or odd one (a truncated attribute is
absent; tests/unit/test_fuzz_netlink.py fuzzes it), and names are kept as sent: whoever
prints one escapes it, whoever passes one to nft checks it (rules_source.nft_name).
"""
from __future__ import annotations

import ipaddress
import struct
from collections import OrderedDict
from dataclasses import dataclass

from nptrace.node.nlmsg import NFGENMSG_LEN, NLMSG, attrs, messages

# include/uapi/linux/netlink.h, netfilter/nfnetlink.h, netfilter/nf_tables.h
NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_TRACE = 17
NFNLGRP_NFTRACE = 9
NFTA_TRACE_TABLE = 1
NFTA_TRACE_CHAIN = 2
NFTA_TRACE_RULE_HANDLE = 3
NFTA_TRACE_TYPE = 4
NFTA_TRACE_VERDICT = 5
NFTA_TRACE_ID = 6
NFTA_TRACE_NETWORK_HEADER = 8
NFTA_TRACE_TRANSPORT_HEADER = 9
NFTA_TRACE_IIF = 10
NFTA_TRACE_OIF = 12
NFTA_TRACE_POLICY = 16
NFTA_VERDICT_CODE = 1
NFTA_VERDICT_CHAIN = 2

TRACETYPE_POLICY = 1
TRACETYPE_RETURN = 2
TRACETYPE_RULE = 3

NF_DROP = 0
NF_VERDICT_MASK = 0xFF  # NF_DROP_ERR() keeps an errno in the upper bits

NFPROTO_NAMES = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}


@dataclass(frozen=True)
class TraceMsg:
    """One NFT_MSG_TRACE. ``pkt`` is (saddr, daddr, sport, dport, l4proto), present in the first
    message of each chain walk only (the kernel dumps the headers once per base chain)."""

    trace_id: int
    family: str           # of the table: ip, ip6, inet, ...
    table: str
    chain: str
    kind: int             # TRACETYPE_*
    handle: int | None    # rule handle (RULE messages)
    verdict: int | None   # verdict code of a RULE message
    jump_chain: str | None
    policy: int | None    # chain policy (POLICY messages)
    iif: int | None
    oif: int | None
    pkt: tuple | None

    @property
    def drops(self) -> bool:
        """This message is the packet's end: a rule that dropped or rejected it, or a DROP
        policy. (nft's reject expression and iptables' REJECT target both give NF_DROP.)"""
        if self.kind == TRACETYPE_RULE and self.verdict is not None:
            return self.verdict >= 0 and self.verdict & NF_VERDICT_MASK == NF_DROP
        if self.kind == TRACETYPE_POLICY and self.policy is not None:
            return self.policy & NF_VERDICT_MASK == NF_DROP
        return False


def _headers(net: bytes, l4: bytes | None) -> tuple | None:
    if not net:
        return None
    ver = net[0] >> 4
    if ver == 4 and len(net) >= 20:
        proto = net[9]
        saddr = str(ipaddress.IPv4Address(net[12:16]))
        daddr = str(ipaddress.IPv4Address(net[16:20]))
    elif ver == 6 and len(net) >= 40:
        proto = net[6]   # the first next-header; extension headers are not walked
        saddr = str(ipaddress.IPv6Address(net[8:24]))
        daddr = str(ipaddress.IPv6Address(net[24:40]))
    else:
        return None
    sport = dport = 0
    if l4 and len(l4) >= 4 and proto in (6, 17, 132):
        sport, dport = struct.unpack_from(">HH", l4)
    return (saddr, daddr, sport, dport, proto)


def decode(data: bytes) -> list[TraceMsg]:
    """Every trace message in one netlink datagram; other message types are skipped."""
    out = []
    want = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_TRACE
    for mtype, start, end in messages(data):
        if mtype == want and end - start >= NLMSG.size + NFGENMSG_LEN:
            msg = _decode_one(data, start, end)
            if msg is not None:
                out.append(msg)
    return out


def _str(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode(errors="replace")


def _decode_one(data: bytes, start: int, end: int) -> TraceMsg | None:
    family = data[start + 16]   # nfgenmsg.nfgen_family
    a: dict[int, bytes] = dict(attrs(data, start + NLMSG.size + NFGENMSG_LEN, end))
    if NFTA_TRACE_ID not in a or NFTA_TRACE_TYPE not in a:
        return None
    verdict = jump = None
    if NFTA_TRACE_VERDICT in a:
        v = dict(attrs(a[NFTA_TRACE_VERDICT], 0, len(a[NFTA_TRACE_VERDICT])))
        if len(v.get(NFTA_VERDICT_CODE, b"")) >= 4:
            verdict = struct.unpack_from(">i", v[NFTA_VERDICT_CODE])[0]
        if NFTA_VERDICT_CHAIN in v:
            jump = _str(v[NFTA_VERDICT_CHAIN])

    def u32(k: int) -> int | None:
        return struct.unpack(">I", a[k][:4])[0] if k in a and len(a[k]) >= 4 else None
    return TraceMsg(
        trace_id=u32(NFTA_TRACE_ID),
        family=NFPROTO_NAMES.get(family, str(family)),
        table=_str(a.get(NFTA_TRACE_TABLE, b"")),
        chain=_str(a.get(NFTA_TRACE_CHAIN, b"")),
        kind=u32(NFTA_TRACE_TYPE),
        handle=struct.unpack(">Q", a[NFTA_TRACE_RULE_HANDLE][:8])[0]
        if len(a.get(NFTA_TRACE_RULE_HANDLE, b"")) >= 8 else None,
        verdict=verdict, jump_chain=jump, policy=u32(NFTA_TRACE_POLICY),
        iif=u32(NFTA_TRACE_IIF), oif=u32(NFTA_TRACE_OIF),
        pkt=_headers(a.get(NFTA_TRACE_NETWORK_HEADER, b""), a.get(NFTA_TRACE_TRANSPORT_HEADER)))


@dataclass(frozen=True)
class TracedDrop:
    """The rule (or policy) nf_tables dropped a traced packet with."""

    family: str
    table: str
    chain: str
    handle: int | None     # None: the chain's policy
    saddr: str
    daddr: str
    sport: int
    dport: int
    iif: int | None
    oif: int | None
    at: float              # clock() when it was read

    def where(self) -> str:
        if self.handle is None:
            return f"table {self.family} {self.table} chain {self.chain} policy drop"
        return f"table {self.family} {self.table} chain {self.chain} handle {self.handle}"


class TraceBook:
    """The drops seen in one namespace's trace stream, by (saddr, daddr, dport): a client's
    retries and its later connections to the same place share an entry (the source port
    changes, the rule that drops them does not). Bounded: the oldest entries go first."""

    MAX_DROPS = 4096
    MAX_WALKS = 1024

    def __init__(self, skip_table: str | None = None):
        self.skip_table = skip_table    # nptrace's own table, which only sets nf_trace
        self._pkt: OrderedDict[int, tuple] = OrderedDict()   # trace id -> packet of its walk
        self._drops: OrderedDict[tuple, TracedDrop] = OrderedDict()
        self.messages = 0

    def feed(self, msgs, now: float) -> list[TracedDrop]:
        new = []
        for m in msgs:
            self.messages += 1
            if m.pkt is not None:
                self._pkt[m.trace_id] = m.pkt
                self._pkt.move_to_end(m.trace_id)
                if len(self._pkt) > self.MAX_WALKS:
                    self._pkt.popitem(last=False)
            if m.table == self.skip_table or not m.drops:
                continue
            pkt = self._pkt.get(m.trace_id)
            if pkt is None:
                continue
            d = TracedDrop(m.family, m.table, m.chain,
                           m.handle if m.kind == TRACETYPE_RULE else None,
                           pkt[0], pkt[1], pkt[2], pkt[3], m.iif, m.oif, now)
            key = (d.saddr, d.daddr, d.dport)
            self._drops[key] = d
            self._drops.move_to_end(key)
            if len(self._drops) > self.MAX_DROPS:
                self._drops.popitem(last=False)
            new.append(d)
        return new

    def lookup(self, saddr: str, daddrs, now: float, max_age: float) -> TracedDrop | None:
        """The newest drop of saddr -> any of daddrs [(addr, port), ...] not older than max_age."""
        best = None
        for daddr, dport in daddrs:
            d = self._drops.get((saddr, daddr, dport))
            if d is not None and now - d.at <= max_age and (best is None or d.at > best.at):
                best = d
        return best
