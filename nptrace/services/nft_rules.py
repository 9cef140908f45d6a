"""Any nft table as the dump gives it (``NftTable``), its set elements, and what each rule matches.

``parse_nft_rule`` turns one rule's text into a ``Match`` (what it evaluates: match.py);
``generic_nft_table`` keeps the chains of any table that drops. nft.py (the text reader) and
nft_kube_proxy.py (kube-proxy's own table) both use them, so they sit below both.
"""

from __future__ import annotations

import re
from typing import Callable

from .build import Builder
from .facts import Chain, Entry
from .match import Match, parse_ports, unquote
from .model import AddrSet, Rule, norm_proto

_RE_NFT_TOK = re.compile(r'"(?:[^"\\]|\\.)*"|[{},]|[^\s{},]+')
_RE_ELEM_ATTR = re.compile(r'\s+(comment\s+"((?:[^"\\]|\\.)*)"|timeout\s+\S+|expires\s+\S+'
                           r'|counter(?:\s+packets\s+\d+\s+bytes\s+\d+)?)')
_RE_ELEMENT = re.compile(r'(?:"(?:[^"\\]|\\.)*"|\{[^{}]*\}|[^,"{])+')
NFT_DROPISH = re.compile(r"(?:^|\s)(?:drop|reject)(?:\s|$)")


class NftTable:
    __slots__ = ("family", "name", "chains", "headers", "sets", "order")

    def __init__(self, family: str, name: str):
        self.family = family
        self.name = name
        self.chains: dict[str, list[tuple[str, int | None]]] = {}  # name -> [(rule text, handle)]
        self.headers: dict[str, str] = {}  # base chain -> "type filter hook ... policy drop;"
        self.sets: dict[str, list[str]] = {}  # set or map -> raw element texts
        self.order: list[str] = []  # chains in first-seen order

    def chain(self, name: str) -> list:
        lst = self.chains.get(name)
        if lst is None:
            lst = self.chains[name] = []
            self.order.append(name)
        return lst

    def set(self, name: str) -> list:
        lst = self.sets.get(name)
        if lst is None:
            lst = self.sets[name] = []
        return lst


def nft_tokens(text: str) -> list[str]:
    """One rule's tokens: quoted strings whole, braces and commas apart."""
    return _RE_NFT_TOK.findall(text)


def split_elements(body: str) -> list[str]:
    """Top-level comma split, keeping quoted comments and braces whole."""
    parts = body.split(",") if '"' not in body and "{" not in body else _RE_ELEMENT.findall(body)
    return [e for e in (p.strip() for p in parts) if e]


def parse_element(elem: str) -> tuple[list[str], str | None, str | None]:
    """``1.2.3.4 . tcp . 80 comment "x" : drop`` -> (["1.2.3.4", "tcp", "80"], "x", "drop")."""
    key, sep, value = elem.partition(" : ")
    comment = None
    if " " in key and (" comment " in key or " timeout " in key or " expires " in key or " counter" in key):
        def _attr(m):
            nonlocal comment
            if m.group(2) is not None:
                comment = m.group(2)
            return ""
        key = _RE_ELEM_ATTR.sub(_attr, key).strip()
    keys = key.split(" . ") if " . " in key else [key.strip()]
    return keys, comment, (value.strip() if sep else None)


_NFT_OPS = frozenset({"==", "!=", "eq", "ne", "<", ">", "<=", ">=", "lt", "gt", "le", "ge"})
_NFT_STMT = frozenset({"counter", "log", "notrack", "masquerade", "snat", "dnat", "redirect", "dup",
                       "fwd", "update", "add", "queue", "synproxy", "tproxy", "flow", "set"})
_NFT_VERBS = frozenset({"accept", "drop", "reject", "return", "continue", "jump", "goto", "vmap",
                        "counter", "log", "comment", "limit", "quota"}) | _NFT_STMT
_NFT_L4 = frozenset({"tcp", "udp", "sctp", "th", "udplite", "dccp"})
_NFT_OTHER_SEL = frozenset({"fib", "mark", "ether", "vlan", "arp", "icmp", "icmpv6", "socket", "rt",
                            "osf", "numgen", "jhash", "symhash", "ipsec", "exthdr", "tunnel"})


def _starts_expr(toks: list[str], k: int) -> bool:
    """Does toks[k] begin a new expression (so that an unknown one before it ends there)?"""
    if toks[k - 1] in (".", ",", "{") or toks[k - 1] in _NFT_OPS:
        return False
    tk = toks[k]
    nx = toks[k + 1] if k + 1 < len(toks) else ""
    if tk in _NFT_VERBS or tk in ("iifname", "oifname", "meta", "ct") or tk in _NFT_OTHER_SEL:
        return True
    if tk in ("ip", "ip6"):
        return nx in ("saddr", "daddr", "protocol", "nexthdr", "ttl", "hoplimit", "length", "dscp", "version")
    return tk in _NFT_L4 and nx in ("dport", "sport", "flags")


def _scan(toks: list[str], i: int, stop: Callable[[int], bool]) -> int:
    """The index of the first token from i, outside braces, where stop(index) holds (or the
    end): a braced set or map is one expression's value, never a boundary."""
    depth = 0
    while i < len(toks):
        tk = toks[i]
        if tk == "{":
            depth += 1
        elif tk == "}":
            depth -= 1
        elif depth == 0 and stop(i):
            break
        i += 1
    return i


def _skip_unknown(toks: list[str], i: int, m: Match) -> int:
    """Consume one expression that is not evaluated, and note it in m.unknown."""
    start = i
    i = _scan(toks, i + 1, lambda k: _starts_expr(toks, k))
    words = " ".join(toks[start:i]).replace(" ,", ",")
    if words:
        m.unknown.append(words)
    return i


_STMT_END = frozenset({"accept", "drop", "reject", "return", "jump", "goto", "comment",
                       "counter", "log"})


def _skip_stmt(toks: list[str], i: int) -> int:
    """Consume a statement that does not decide matching (counter, log, nat, mark set ...)."""
    return _scan(toks, i + 1, lambda k: toks[k] in _STMT_END)


def parse_nft_rule(text: str, t: NftTable | None = None) -> tuple[Match, str, str | None, str | None]:
    """(conditions, action, comment, jump/goto target) of one nft rule; limits in match.py's docstring."""
    m = Match()
    toks = nft_tokens(text)
    n = len(toks)
    action, comment, target = "other", None, None

    def value(j: int) -> tuple[list[str], int, str]:
        """One value at j: single, ``{ a, b }``, ``@set`` or an unbraced ``a,b`` list."""
        if j >= n:
            return [], j, ""
        if toks[j] == "{":
            vals, k = [], j + 1
            while k < n and toks[k] != "}":
                if toks[k] != ",":
                    vals.append(unquote(toks[k]))
                k += 1
            return vals, k + 1, "{ " + ", ".join(vals) + " }"
        if toks[j].startswith("@"):
            nm = toks[j][1:]
            if t is not None and nm in t.sets:
                keys = [parse_element(e)[0] for e in t.sets[nm]]
                if all(len(k) == 1 for k in keys):
                    return [k[0] for k in keys], j + 1, toks[j]
            return [toks[j]], j + 1, toks[j]  # unresolved: the caller leaves it unevaluated
        vals, k = [unquote(toks[j])], j + 1
        while k + 1 < n and toks[k] == ",":
            vals.append(unquote(toks[k + 1]))
            k += 2
        return vals, k, ",".join(vals)

    def opval(j: int):
        """(values or None if the operator is not ==/!=, negated, next index)."""
        neg = False
        if j < n and toks[j] in _NFT_OPS:
            if toks[j] not in ("==", "eq", "!=", "ne"):
                return None, False, j
            neg = toks[j] in ("!=", "ne")
            j += 1
        if j < n and toks[j] == ".":
            return None, False, j
        vals, k, txt = value(j)
        if k < n and toks[k] == ".":  # a concatenation, e.g. "ip daddr . th dport"
            return None, False, j
        if any(v.startswith("@") for v in vals):
            return None, False, j
        return (vals, txt), neg, k

    i = 0
    while i < n:
        tok = toks[i]
        nxt = toks[i + 1] if i + 1 < n else ""
        if tok in ("ip", "ip6") and nxt in ("saddr", "daddr"):
            got, neg, k = opval(i + 2)
            if got is None or any(" . " in v for v in got[0]):
                i = _skip_unknown(toks, i, m)
                continue
            (m.src if nxt == "saddr" else m.dst).append((AddrSet(got[0], got[1]), neg))
            i = k
        elif (tok in ("ip", "ip6") and nxt in ("protocol", "nexthdr")) or (tok == "meta" and nxt == "l4proto"):
            got, neg, k = opval(i + 2)
            if got is None:
                i = _skip_unknown(toks, i, m)
                continue
            m.proto = (frozenset(norm_proto(v) for v in got[0]), neg)
            i = k
        elif tok in _NFT_L4 and nxt in ("dport", "sport"):
            got, neg, k = opval(i + 2)
            r = parse_ports(",".join(got[0])) if got is not None else None
            if r is None:
                i = _skip_unknown(toks, i, m)
                continue
            if nxt == "dport":
                m.dport = (r, neg, got[1])
            else:
                m.sport = (r, neg, got[1])
            if tok != "th" and m.proto is None:
                m.proto = (frozenset({tok}), False)
            i = k
        elif tok in ("iifname", "oifname") or (tok == "meta" and nxt in ("iifname", "oifname")):
            j = i + 2 if tok == "meta" else i + 1
            which = nxt if tok == "meta" else tok
            got, neg, k = opval(j)
            if got is None:
                i = _skip_unknown(toks, i, m)
                continue
            cond = (tuple(got[0]), neg)
            if which == "iifname":
                m.iif = cond
            else:
                m.oif = cond
            i = k
        elif tok == "ct" and nxt == "state":
            got, neg, k = opval(i + 2)
            if got is None:
                i = _skip_unknown(toks, i, m)
                continue
            m.ctstate = (frozenset(v.upper() for v in got[0]), neg)
            i = k
        elif tok == "meta" and nxt == "nfproto":
            i += 3  # the address family: the flow's addresses already decide it
        elif tok == "comment":
            comment = unquote(nxt)
            i += 2
        elif tok in ("accept", "drop", "return"):
            action = tok
            i += 1
        elif tok == "continue":
            i += 1
        elif tok == "reject":
            action = "reject"
            i += 1
            if i < n and toks[i] == "with":
                i = _skip_stmt(toks, i)
        elif tok in ("jump", "goto"):
            action, target = tok, nxt.strip('"')
            i += 2
        elif tok in ("vmap", "map"):
            # the verdict is decided per element: not a plain drop
            m.unknown.append(f"{tok} lookup")
            i = value(i + 1)[1]
        elif tok == "counter":
            i += 1
            while i + 1 < n and toks[i] in ("packets", "bytes"):
                i += 2
        elif tok == "log":
            i += 1
            while i + 1 < n and toks[i] in ("prefix", "level", "group", "snaplen", "queue-threshold", "flags"):
                i += 2
        elif tok in _NFT_STMT or (tok in ("meta", "ct", "mark") and "set" in (nxt, toks[i + 2] if i + 2 < n else "")):
            i = _skip_stmt(toks, i)
        else:
            i = _skip_unknown(toks, i, m)
    return m, action, comment, target


def generic_nft_table(t: NftTable, b: Builder, names: list[str] | None = None) -> None:
    """Keep the chains of a table that drops or rejects something (in a rule or a policy), all
    of them, since the walk of matching_drop_rules() follows their jumps."""
    names = t.order if names is None else names
    if not any(NFT_DROPISH.search(text) for c in names for text, _ in t.chains[c]) and \
            not any(re.search(r"policy\s+drop", t.headers.get(c, "")) for c in names):
        return
    tname = f"{t.family} {t.name}"
    for cname in names:
        header = t.headers.get(cname, "")
        entries = []
        for pos, (text, handle) in enumerate(t.chains[cname], 1):
            cond, action, comment, target = parse_nft_rule(text, t)
            rule = None
            if action in ("drop", "reject"):
                invalid = cond.ctstate is not None and "INVALID" in cond.ctstate[0] and not cond.ctstate[1]
                rule = Rule(tname, cname, text, action, "conntrack_invalid" if invalid else "other", comment,
                            handle, pos, None, cond, b.backend)
            entries.append(Entry.of(cond, action, rule, target))
        policy = None
        if re.search(r"policy\s+drop", header):
            policy = Rule(tname, cname, header, "drop", "other", "chain policy", backend=b.backend)
        hook = re.search(r"\bhook\s+(\w+)", header)
        b.chains.append(Chain(tname, cname, entries, policy, hook.group(1) if hook else None))
