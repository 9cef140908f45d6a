"""kube-proxy's nft table as a packet walk: what :meth:`ServiceMap.trace` follows on an nft
ruleset, as nat.py's walk does on iptables.

kube-proxy's own test tracer (``tracePacket`` in pkg/proxy/nftables/helpers_test.go) runs
filter-prerouting, nat-prerouting and filter-forward by chain name, reading the rule forms
proxier.go writes. This walk reads the same forms from each rule's tokens and takes the base
chains from their headers, so both kube-proxy layouts of the corpus work (81810de6's
``filter-prerouting-pre-dnat`` / ``service-endpoints-check`` / ``@nodeport-ips``, and the later
``filter-prerouting`` / ``endpoints-check`` / ``fib daddr type local`` of knftables' examples):

  * the hooks, as kube-proxy's tracer and nat.py take them: prerouting (a node's own packet
    too), then input (to a node address after DNAT), forward, or for a node's own packet the
    output chains past DNAT priority; each hook's base chains in priority order, the nat
    chain DNATing the destination for the chains after it. Not walked, as in kube-proxy's
    tracer: the output hook's pre-DNAT chains (the later layout's ``filter-output`` at -110
    jumps the endpoints check, so on a node a local client of an eTP=Local external IP
    without local endpoints meets its drop there), postrouting;
  * matches: ``ip|ip6 saddr|daddr`` (literal, CIDR, ``{ set }``, ``@set``, ``!=``), ``fib
    saddr|daddr type local`` (the map's local addresses), ``meta l4proto``, ``tcp|udp|sctp|th
    dport``, ``ct state`` (the packet is a SYN: NEW, and DNAT once rewritten), and lookups of
    a concatenation (``ip daddr . meta l4proto . th dport [. ip saddr]``) in a named set;
  * verdicts: ``jump``/``goto``/``return``/``accept``/``drop``/``reject``, verdict maps
    (``vmap @service-ips``, ``vmap @no-endpoint-services`` ...), ``numgen random mod N vmap
    { ... }`` (every endpoint it may pick is walked, as kube-proxy's tracer does), ``dnat to``;
    ``jump mark-for-masquerade`` marks the packet for masquerade (the tracer's rule too).

A rule with a match this walk does not read (``mark``, ``meta mark``, ``socket`` ...) does
not match, so a packet is never sent down a path it may not take. A drop or reject is
reported with the Rule the parse made for it (the map element, the firewall rule), else one
made here. Cost: nothing at parse time but a reference to the dump's text (nft.py reads the
table from it again on the first trace, about 0.5 s for 10,000 Services, rather than keep the
parsed table: 19 MiB); each chain is read into tokens on first use.
"""

from __future__ import annotations

import re
from typing import Callable

from .match import Flow, parse_ports, unquote
from .model import AddrSet, Rule, canon, norm_proto
from .nft_rules import NftTable, nft_tokens, parse_element

_MAX_DEPTH = 32
_DNAT_PRIORITY = -100
_PRIORITIES = {"raw": -300, "mangle": -150, "dstnat": -100, "filter": 0, "security": 50, "srcnat": 100}
_RE_HEADER = re.compile(r"\btype\s+(\w+)\s+hook\s+(\w+)\b.*?\bpriority\s+([\w-]+)(?:\s*([+-])\s*(\d+))?")
_L4 = frozenset({"tcp", "udp", "sctp", "th", "udplite", "dccp"})
_OPS_EQ = frozenset({"==", "eq"})
_OPS_NE = frozenset({"!=", "ne"})
_STMTS = frozenset({"masquerade", "snat", "log", "update", "add", "notrack", "queue", "dup", "fwd", "set",
                    "limit", "quota", "redirect", "tproxy", "synproxy"})
_VERBS = frozenset({"accept", "drop", "reject", "return", "jump", "goto", "comment", "counter", "dnat", "vmap"})
MASQ_CHAIN = "mark-for-masquerade"

# walk results
_TERM = "term"      # a DNAT or a drop/reject: the base chain ends
_ACCEPT = "accept"  # accept: this base chain ends, the hook's next base chain runs
_RET = "ret"        # return (or the end of a goto): back to the caller


class NftTraceResult:
    __slots__ = ("dests", "masq", "verdict", "rule")

    def __init__(self):
        self.dests: list[str] = []
        self.masq = False
        self.verdict: str | None = None   # drop / reject
        self.rule: Rule | None = None

    def __repr__(self) -> str:
        return f"NftTraceResult(dests={self.dests}, masq={self.masq}, verdict={self.verdict})"


class _Packet:
    """The walked packet: its addresses as the current chain sees them, and what happened."""

    __slots__ = ("saddr", "daddr", "dport", "proto", "ctstate", "local", "res")

    def __init__(self, flow: Flow, local: frozenset[str]):
        self.saddr, self.daddr, self.dport, self.proto = flow.saddr, flow.daddr, flow.dport, flow.proto
        self.ctstate = set(flow.ctstate or {"NEW"})
        self.local = local
        self.res = NftTraceResult()

    def value(self, sel: str):
        return {"saddr": self.saddr, "daddr": self.daddr, "dport": self.dport, "proto": self.proto}.get(sel)


def _norm(v: str):
    """An element or literal component as the packet's values compare: address, port, protocol."""
    v = unquote(v)
    a = canon(v)
    if a is not None:
        return a
    if v.isascii() and v.isdigit():
        return int(v)
    return norm_proto(v)


def _interval(v: str) -> bool:
    return "/" in v or ("-" in v and not v.isalpha())


class _Lookup:
    """A named set or map, indexed by its normalised keys (a scan where a key holds a CIDR or
    a range, which kube-proxy writes only in its old ``firewall-allow`` set)."""

    __slots__ = ("exact", "scan")

    def __init__(self, elements: list[str]):
        self.exact: dict[tuple, tuple[str | None, str]] = {}
        self.scan: list[tuple[list, str | None, str]] = []
        for e in elements:
            keys, _, value = parse_element(e)
            if any(_interval(k) for k in keys):
                self.scan.append(([AddrSet([k]) if _interval(k) else _norm(k) for k in keys], value, e))
            else:
                self.exact.setdefault(tuple(_norm(k) for k in keys), (value, e))

    def get(self, key: tuple) -> tuple[str | None, str] | None:
        hit = self.exact.get(key)
        if hit is not None or not self.scan:
            return hit
        for comps, value, e in self.scan:
            if len(comps) == len(key) and all(
                    c.contains(k) if isinstance(c, AddrSet) else c == k for c, k in zip(comps, key)
                    if k is not None):
                return value, e
        return None


class NftTracer:
    """The walk over one kube-proxy nft table (``ip`` or ``ip6 kube-proxy``)."""

    __slots__ = ("_load", "_t", "_rules", "_index", "_compiled", "_lookups", "_bases", "family", "label",
                 "backend")

    def __init__(self, load: Callable[[], NftTable | None], family: str, name: str, rules: list[Rule],
                 backend: str):
        self._load = load       # reads the table from the dump's text again, on first use
        self._t: NftTable | None = None
        self._rules = rules     # the Rules the parse made for this table (map elements, firewall)
        self._index: dict[tuple[str, str], Rule] | None = None
        self._compiled: dict[str, list] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._bases: dict[str, list[tuple[int, str, str]]] | None = None
        self.family = 6 if family == "ip6" else 4 if family == "ip" else None
        self.label = f"{family} {name}"
        self.backend = backend

    def table(self) -> NftTable:
        if self._t is None:
            self._t = self._load() or NftTable(*self.label.split(" ", 1))
            self._load = None
        return self._t

    # -- the packet path -----------------------------------------------------------------
    def trace(self, flow: Flow, local: frozenset[str]) -> NftTraceResult:
        """Where ``flow`` (a SYN) goes: DNAT targets, masquerade mark, a drop or reject."""
        pk = _Packet(flow, local)
        if self._hook(pk, "prerouting", None):
            return pk.res
        src_local = pk.saddr in local
        post = "input" if pk.daddr in local else "output" if src_local else "forward"
        self._hook(pk, post, _DNAT_PRIORITY if post == "output" else None)
        return pk.res

    def _hook(self, pk: _Packet, hook: str, after: int | None) -> bool:
        """Run one hook's base chains (those past priority ``after`` only); True when a drop
        or reject ended the walk."""
        for prio, kind, name in self.bases().get(hook, ()):
            if after is not None and prio <= after:
                continue
            if kind == "nat":
                if pk.res.dests or hook != "prerouting":
                    continue     # conntrack NATs a connection once, at its first packet
                self._run(name, pk, 0, None)
                if pk.res.dests:
                    self._rewrite(pk)
            else:
                self._run(name, pk, 0, None)
            if pk.res.verdict is not None:
                return True
        return False

    @staticmethod
    def _rewrite(pk: _Packet) -> None:
        host, _, port = pk.res.dests[0].rpartition(":")
        a = canon(host.strip("[]"))
        if a is not None and port.isdigit():
            pk.daddr, pk.dport = a, int(port)
            pk.ctstate.add("DNAT")

    def bases(self) -> dict[str, list[tuple[int, str, str]]]:
        """{hook: [(priority, type, chain)]} from the chain headers, in priority order."""
        if self._bases is None:
            out: dict[str, list[tuple[int, str, str]]] = {}
            for name, header in self.table().headers.items():
                m = _RE_HEADER.search(header)
                if m is None:
                    continue
                p = m.group(3)
                prio = int(p) if p.lstrip("-").isdigit() else _PRIORITIES.get(p, 0)
                if m.group(5):
                    prio += int(m.group(5)) * (1 if m.group(4) == "+" else -1)
                out.setdefault(m.group(2), []).append((prio, m.group(1), name))
            for lst in out.values():
                lst.sort()
            self._bases = out
        return self._bases

    # -- chains ----------------------------------------------------------------------------
    def _run(self, chain: str, pk: _Packet, depth: int, via: Rule | None) -> str | None:
        """Walk one chain: _TERM / _ACCEPT, _RET (a return), None (the chain ended)."""
        if depth > _MAX_DEPTH:
            return None
        for pos, text, conds, action in self._chain(chain):
            if action is None or not all(self._test(c, pk) for c in conds):
                continue
            got = self._do(action, chain, pos, text, pk, depth, via)
            if got is not None:
                return got
        return None

    def _do(self, action: tuple, chain: str, pos: int, text: str, pk: _Packet, depth: int,
            via: Rule | None) -> str | None:
        kind = action[0]
        if kind == "masq":
            pk.res.masq = True
            return None
        if kind in ("jump", "goto"):
            got = self._run(action[1], pk, depth + 1, via)
            if got in (_TERM, _ACCEPT):
                return got
            return _RET if kind == "goto" else None
        if kind == "vmap":
            hit = self._lookup(action[2], action[1], pk)
            if hit is None or not hit[0]:
                return None
            value, elem = hit
            rule = self.rule_index().get((action[2], f"add element {self.label} {action[2]} {{ {elem} }}"), via)
            return self._verdict(value.split(), chain, pos, text, pk, depth, rule)
        if kind == "numgen":
            got = [self._run(target, pk, depth + 1, via) for target in action[1]]
            return _TERM if _TERM in got else _RET
        if kind in ("dnat", "dnats"):
            for dest in (action[1],) if kind == "dnat" else action[1]:
                if dest not in pk.res.dests:
                    pk.res.dests.append(dest)
            return _TERM
        if kind in ("drop", "reject"):
            pk.res.verdict = kind
            pk.res.rule = self.rule_index().get((chain, text)) or via or Rule(
                self.label, chain, text, kind, "other", None, None, pos, None, None, self.backend)
            return _TERM
        if kind == "accept":
            return _ACCEPT
        if kind == "return":
            return _RET
        return None

    def _verdict(self, words: list[str], chain, pos, text, pk, depth, via) -> str | None:
        """A verdict map element's value: ``goto X``, ``jump X``, ``drop`` ..."""
        if len(words) == 2 and words[0] in ("goto", "jump"):
            got = self._run(words[1], pk, depth + 1, via)
            if got in (_TERM, _ACCEPT):
                return got
            return _RET if words[0] == "goto" else None
        if words and words[0] in ("drop", "reject"):
            pk.res.verdict = words[0]
            pk.res.rule = via or Rule(self.label, chain, text, words[0], "other", None, None, pos, None,
                                      None, self.backend)
            return _TERM
        return {"accept": _ACCEPT, "return": _RET}.get(words[0] if words else "")

    def _chain(self, name: str) -> list:
        lst = self._compiled.get(name)
        if lst is None:
            lst = self._compiled[name] = [(pos, text, *compile_rule(text))
                                          for pos, (text, _) in enumerate(self.table().chains.get(name, ()), 1)]
        return lst

    def rule_index(self) -> dict[tuple[str, str], Rule]:
        if self._index is None:
            self._index = {(r.chain, r.text): r for r in self._rules}
        return self._index

    # -- matches ---------------------------------------------------------------------------
    def _test(self, cond: tuple, pk: _Packet) -> bool:
        kind = cond[0]
        if kind == "cmp":
            _, sel, vals, neg = cond
            v = pk.value(sel)
            if v is None:
                return False
            if sel in ("saddr", "daddr"):
                if isinstance(vals, str):     # a named set
                    hit = self._lookup(vals, (sel,), pk) is not None
                else:
                    hit = bool(vals.contains(v))
            elif sel == "proto":
                hit = v in vals
            else:
                hit = any(lo <= v <= hi for lo, hi in vals)
            return hit != neg
        if kind == "fib":
            v = pk.value(cond[1])
            return (v in pk.local) != cond[2]
        if kind == "ct":
            return bool(cond[1] & pk.ctstate) != cond[2]
        if kind == "lookup":
            return (self._lookup(cond[2], cond[1], pk) is not None) != cond[3]
        return False    # a match this walk does not read

    def _lookup(self, name: str, sels: tuple, pk: _Packet):
        lk = self._lookups.get(name)
        if lk is None:
            lk = self._lookups[name] = _Lookup(self.table().sets.get(name, []))
        key = tuple(pk.value(s) for s in sels)
        if any(k is None for k in key):
            return None
        return lk.get(key)


# -- one rule's text -> (conditions, action) ----------------------------------------------------
def _selector(toks: list[str], i: int) -> tuple[str | None, int]:
    """The packet field at toks[i] (``ip daddr``, ``meta l4proto``, ``th dport`` ...), and the
    index after it."""
    tk = toks[i]
    nx = toks[i + 1] if i + 1 < len(toks) else ""
    if tk in ("ip", "ip6") and nx in ("saddr", "daddr"):
        return nx, i + 2
    if (tk == "meta" and nx == "l4proto") or (tk in ("ip", "ip6") and nx in ("protocol", "nexthdr")):
        return "proto", i + 2
    if tk in _L4 and nx in ("dport", "sport"):
        return nx, i + 2
    return None, i


def _values(toks: list[str], i: int) -> tuple[list[str], int]:
    if i < len(toks) and toks[i] == "{":
        vals, k = [], i + 1
        while k < len(toks) and toks[k] != "}":
            if toks[k] != ",":
                vals.append(unquote(toks[k]))
            k += 1
        return vals, k + 1
    vals, k = [unquote(toks[i])] if i < len(toks) else [], i + 1
    while k + 1 < len(toks) and toks[k] == ",":
        vals.append(unquote(toks[k + 1]))
        k += 2
    return vals, k


def _vmap_arms(toks: list[str], i: int) -> tuple[list[list[str]], int]:
    """``{ 0 : goto X , 1 : goto Y }`` at toks[i] -> [["0", ":", "goto", "X"], ...] and the
    index after it."""
    arms: list[list[str]] = [[]]
    k = i + 1 if i < len(toks) and toks[i] == "{" else len(toks)
    while k < len(toks) and toks[k] != "}":
        if toks[k] == ",":
            arms.append([])
        else:
            arms[-1].append(toks[k])
        k += 1
    return [a for a in arms if a], k + 1


MASQ_BIT = 0x4000   # kube-proxy's default --masquerade-bit 14


def _sets_masq_bit(toks: list[str]) -> bool:
    """``meta mark set meta mark | 0x00004000`` (or ``mark set mark or 0x4000``): the
    masquerade bit ORed into the mark."""
    for k, t in enumerate(toks[:-1]):
        if t in ("|", "or"):
            try:
                return int(toks[k + 1], 0) & MASQ_BIT == MASQ_BIT
            except ValueError:
                return False
        if t in _VERBS:
            break
    return False


def compile_rule(text: str) -> tuple[list[tuple], tuple | None]:
    """(conditions, action) of one kube-proxy nft rule; action None: the rule decides nothing
    (a counter, a mark, a statement), or holds a match this walk does not read."""
    toks = nft_tokens(text)
    n = len(toks)
    conds: list[tuple] = []
    action: tuple | None = None
    i = 0
    while i < n:
        tk = toks[i]
        nx = toks[i + 1] if i + 1 < n else ""
        sel, j = _selector(toks, i)
        if sel is not None:
            sels = [sel]
            while j < n and toks[j] == ".":
                s2, j2 = _selector(toks, j + 1)
                if s2 is None:
                    return conds, None
                sels.append(s2)
                j = j2
            if j < n and toks[j] == "vmap":
                if j + 1 < n and toks[j + 1].startswith("@"):
                    action = ("vmap", tuple(sels), toks[j + 1][1:])
                    i = j + 2
                    continue
                return conds, None
            neg = False
            if j < n and (toks[j] in _OPS_NE or toks[j] in _OPS_EQ):
                neg = toks[j] in _OPS_NE
                j += 1
            if j < n and toks[j].startswith("@"):
                conds.append(("lookup", tuple(sels), toks[j][1:], neg))
                i = j + 1
                continue
            if len(sels) != 1:
                return conds, None
            vals, i = _values(toks, j)
            if sel in ("saddr", "daddr"):
                conds.append(("cmp", sel, AddrSet(vals, ",".join(vals)), neg))
            elif sel == "proto":
                conds.append(("cmp", sel, frozenset(norm_proto(v) for v in vals), neg))
            else:
                ports = parse_ports(",".join(vals))
                if ports is None:
                    return conds, None
                conds.append(("cmp", sel, ports, neg))
            if tk in _L4 and tk != "th":
                conds.append(("cmp", "proto", frozenset({tk}), False))
            continue
        if tk == "fib" and nx in ("saddr", "daddr") and toks[i + 2:i + 3] == ["type"]:
            neg = toks[i + 3] in _OPS_NE if i + 3 < n else False
            k = i + 4 if neg else i + 3
            if k < n and toks[k] == "local":
                conds.append(("fib", nx, neg))
                i = k + 1
                continue
            return conds, None
        if tk == "ct" and nx == "state":
            j = i + 2
            neg = j < n and toks[j] in _OPS_NE
            if j < n and (toks[j] in _OPS_NE or toks[j] in _OPS_EQ):
                j += 1
            vals, i = _values(toks, j)
            conds.append(("ct", frozenset(v.upper() for v in vals), neg))
            continue
        if tk == "numgen" and "vmap" in toks[i:]:
            j = toks.index("vmap", i)
            arms, i = _vmap_arms(toks, j + 1)
            targets = [a[3] for a in arms if len(a) == 4 and a[1] == ":" and a[2] in ("goto", "jump")]
            action = ("numgen", tuple(targets))
            continue
        if tk in ("jump", "goto"):
            action = ("masq",) if tk == "jump" and nx == MASQ_CHAIN else (tk, nx.strip('"'))
            i += 2
            continue
        if tk in ("drop", "reject", "accept", "return"):
            action = (tk,)
            break
        if tk == "dnat":
            k = i + 1
            if k < n and toks[k] in ("ip", "ip6"):
                k += 1
            if k + 1 < n and toks[k] == "to" and toks[k + 1] == "numgen" and "map" in toks[k:]:
                # kube-proxy >= 1.35: "dnat ip to numgen random mod N map { 0 : A . P, ... }",
                # every endpoint it may pick (as numgen ... vmap's)
                arms, _ = _vmap_arms(toks, toks.index("map", k) + 1)
                action = ("dnats", tuple(f"[{a[2]}]:{a[4]}" if ":" in a[2] else f"{a[2]}:{a[4]}"
                                         for a in arms if len(a) == 5 and a[1] == ":" and a[3] == "."))
            elif k + 1 < n and toks[k] == "to":
                action = ("dnat", toks[k + 1])
            break
        if tk == "comment":
            i += 2
            continue
        if tk == "counter":
            i += 1
            while i + 1 < n and toks[i] in ("packets", "bytes"):
                i += 2
            continue
        if tk in ("meta", "mark") and "set" in toks[i + 1:i + 3] and _sets_masq_bit(toks[i:]):
            # kube-proxy >= 1.35 marks for masquerade in place ("meta mark set meta mark |
            # 0x00004000"), where older ones jump to mark-for-masquerade
            action = ("masq",)
            i += 1
            while i < n and toks[i] not in _VERBS:
                i += 1
            continue
        if tk in _STMTS or (tk in ("meta", "ct", "mark") and "set" in toks[i + 1:i + 3]):
            # a statement that does not decide where the packet goes
            i += 1
            while i < n and toks[i] not in _VERBS:
                i += 1
            continue
        return conds, None    # a match this walk does not read (mark, socket, ...)
    return conds, action
