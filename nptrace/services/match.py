"""The best-effort matcher: a packet's flow (``Flow``) and one rule's conditions (``Match``).

Both parsers build ``Match`` objects and ``ServiceMap`` evaluates them, so the matcher stands
apart from either; ``parse_ports`` and ``unquote`` are the value helpers both rule parsers share.

Rule matching (:meth:`ServiceMap.matching_drop_rules`) is best effort, not an iptables or nft
evaluator. Evaluated: source and destination address/CIDR (negation, nft anonymous and named
sets, ranges), protocol, ports (multiport, ranges), ``-i``/``-o``/``iifname``/``oifname``
(``+``/``*`` wildcards), ``ctstate``/``ct state``, and ``addrtype LOCAL`` when the local
addresses are known. The walk starts at the base chains and follows jump/goto within a
table; it does not model the packet path between tables and hooks (NAT rewriting the
destination, which hook a packet takes: pass ``hook``), nor marks set by earlier rules.
Everything else (marks, ipsets, rpfilter/fib, recent, statistic, limit, string, u32,
concatenations, vmaps outside kube-proxy's own maps, ...) is not evaluated: such a rule counts
as a possible match and :attr:`Rule.match` names what was left out.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Protocol

from .model import AddrSet, canon, norm_proto


class MapView(Protocol):
    """What a rule's match and scope ask of the ServiceMap they are evaluated in (a Protocol,
    so this module and facts.py need not import servicemap.py, which imports them)."""
    local_addrs: frozenset[str] | None
    cluster_addrs: frozenset[str]

    def is_live_vip(self, addr: str, port: int, proto: str) -> bool: ...


class Flow:
    __slots__ = ("saddr", "daddr", "sport", "dport", "proto", "iif", "oif", "ctstate", "_ips")

    def __init__(self, saddr=None, daddr=None, sport=None, dport=None, proto=None,
                 iif=None, oif=None, ctstate=None):
        self.saddr = canon(saddr) if saddr else None
        self.daddr = canon(daddr) if daddr else None
        self.sport = int(sport) if sport is not None else None
        self.dport = int(dport) if dport is not None else None
        self.proto = norm_proto(proto) if proto is not None else None
        self.iif = iif
        self.oif = oif
        if isinstance(ctstate, str):
            ctstate = [s for s in re.split(r"[,\s]+", ctstate) if s]
        self.ctstate = frozenset(s.upper() for s in ctstate) if ctstate is not None else None
        self._ips: dict[str, object] = {}

    def ip(self, addr: str):
        ip = self._ips.get(addr)
        if ip is None:
            ip = self._ips[addr] = ipaddress.ip_address(addr)
        return ip


def _iface_match(pattern: str, name: str) -> bool:
    if pattern.endswith(("+", "*")):
        return name.startswith(pattern[:-1])
    return name == pattern


def family_of(f: Flow) -> int | None:
    """4 or 6: the address family of a flow, None without addresses."""
    a = f.daddr or f.saddr
    return None if not a else 6 if ":" in a else 4


class Match:
    """Conjunction of conditions; evaluate() -> True / False / None (cannot tell)."""

    __slots__ = ("src", "dst", "proto", "dport", "sport", "iif", "oif", "ctstate", "unknown", "not_vip",
                 "family")

    def __init__(self):
        self.src: list[tuple[AddrSet, bool]] = []
        self.dst: list[tuple[AddrSet, bool]] = []
        self.proto: tuple[frozenset, bool] | None = None
        self.dport: tuple[tuple, bool, str] | None = None  # (ranges, negated, text)
        self.sport: tuple[tuple, bool, str] | None = None
        self.iif: tuple[tuple, bool] | None = None
        self.oif: tuple[tuple, bool] | None = None
        self.ctstate: tuple[frozenset, bool] | None = None
        self.unknown: list[str] = []
        # nft cluster-ips-check only sees a ClusterIP packet that no Service DNATed or rejected
        self.not_vip = False
        # 4 or 6 when the rule's table belongs to one family (ip6tables, nft ip6): a packet of
        # the other family never meets it; None for inet tables and unlabelled restore input
        self.family: int | None = None

    def evaluate(self, f: Flow, smap: MapView | None = None) -> bool | None:
        if self.family is not None and family_of(f) not in (None, self.family):
            return False
        maybe = bool(self.unknown)
        local = smap.local_addrs if smap is not None else None
        for conds, addr in ((self.src, f.saddr), (self.dst, f.daddr)):
            for aset, neg in conds:
                if addr is None:
                    maybe = True
                    continue
                r = aset.contains(addr, f.ip(addr) if aset.nets else None, local)
                if r is None:
                    maybe = True
                elif r == neg:
                    return False
        if self.proto is not None:
            names, neg = self.proto
            if f.proto is None:
                maybe = True
            elif (f.proto in names or "all" in names) == neg:
                return False
        for cond, val in ((self.dport, f.dport), (self.sport, f.sport)):
            if cond is not None:
                if val is None:
                    maybe = True
                elif any(lo <= val <= hi for lo, hi in cond[0]) == cond[1]:
                    return False
        for cond, val in ((self.iif, f.iif), (self.oif, f.oif)):
            if cond is not None:
                if val is None:
                    maybe = True
                elif any(_iface_match(p, val) for p in cond[0]) == cond[1]:
                    return False
        if self.ctstate is not None:
            if f.ctstate is None:
                maybe = True
            elif bool(self.ctstate[0] & f.ctstate) == self.ctstate[1]:
                return False
        if self.not_vip:
            if smap is None or f.daddr is None or f.dport is None or f.proto is None:
                maybe = True
            elif smap.is_live_vip(f.daddr, f.dport, f.proto):
                return False
        return None if maybe else True

    def describe(self) -> str:
        parts = []
        for label, conds in (("src", self.src), ("dst", self.dst)):
            for aset, neg in conds:
                parts.append(f"{label} {'!' if neg else ''}{aset.text}")
        if self.proto is not None:
            parts.append(f"proto {'!' if self.proto[1] else ''}{','.join(sorted(self.proto[0]))}")
        for label, cond in (("dport", self.dport), ("sport", self.sport)):
            if cond is not None:
                parts.append(f"{label} {'!' if cond[1] else ''}{cond[2]}")
        for label, cond in (("iif", self.iif), ("oif", self.oif)):
            if cond is not None:
                parts.append(f"{label} {'!' if cond[1] else ''}{','.join(cond[0])}")
        if self.ctstate is not None:
            parts.append(f"ctstate {'!' if self.ctstate[1] else ''}{','.join(sorted(self.ctstate[0]))}")
        if self.not_vip:
            parts.append("dst:port not a live Service")
        text = ", ".join(parts) if parts else "any packet"
        if self.unknown:
            text += "; not evaluated: " + "; ".join(self.unknown)
        return text


def parse_ports(spec: str) -> tuple[tuple[int, int], ...] | None:
    """``80`` ``1000:2000`` ``53,80`` ``1000-2000`` -> ((lo, hi), ...)."""
    out = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.replace("-", ":").partition(":")
        try:
            a = int(lo) if lo else 0
            b = (int(hi) if hi else 65535) if sep else a
        except ValueError:
            return None
        out.append((a, b))
    return tuple(out) or None


def unquote(tok: str) -> str:
    if len(tok) >= 2 and tok[0] == '"' and tok[-1] == '"':
        return tok[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return tok
