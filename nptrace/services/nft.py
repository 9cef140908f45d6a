"""Parse ``nft [-a] list ruleset`` text and the knftables ``add table/chain/set/map/rule/element``
dump form (kube-proxy's nftables mode, alpha in v1.29): :func:`parse_nft`.

One pass reads the text into ``NftTable`` objects (blocks, one-line commands, statements
wrapped over several lines); then kube-proxy's table goes to nft_kube_proxy.py and every other
table to ``generic_nft_table`` (nft_rules.py).
"""

from __future__ import annotations

import re
from typing import Iterable

from .build import Builder, gc_paused
from .nft_kube_proxy import kp_nft_table
from .nft_rules import NFT_DROPISH, NftTable, generic_nft_table, split_elements
from .nft_trace import NftTracer
from .servicemap import ServiceMap

_FAMILIES = frozenset({"ip", "ip6", "inet", "arp", "bridge", "netdev"})
_RE_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_RE_TABLE = re.compile(r"^table\s+(?:(\w+)\s+)?(\S+)\s*\{$")
_RE_BLOCK = re.compile(r"^(chain|set|map|flowtable|counter|quota|limit|ct\s+\w+|secmark|synproxy)\s+(\S+)\s*\{$")


_CHAIN_ATTRS = ("type ", "policy ", "comment ", "devices ", "device ")


def _cut_handle(s: str) -> tuple[str, int | None]:
    """Split ``nft -a``'s trailing ``# handle N`` off a line."""
    pos = s.rfind("# handle ")
    if pos < 0:
        return s, None
    tail = s[pos + 9:].strip()
    if not (tail.isascii() and tail.isdigit()):     # "²".isdigit(), int("²") raises
        return s, None
    return s[:pos].rstrip(), int(tail)


def _braces(s: str) -> int:
    """Open minus closed braces outside quoted strings."""
    if "{" not in s and "}" not in s:
        return 0
    if '"' in s:
        s = _RE_QUOTED.sub("", s)
    return s.count("{") - s.count("}")


def _brace_body(s: str) -> str:
    i, j = s.find("{"), s.rfind("}")
    return s[i + 1:j] if 0 <= i < j else ""


def parse_nft(text: str, *, skip_tables: Iterable[str] = (), backend: str = "nft") -> ServiceMap:
    """Parse ``nft [-a] list ruleset`` text or a knftables ``add ...`` dump.

    ``skip_tables``: ``"<family> <name>"`` strings to leave out, e.g. the ``ip filter`` /
    ``ip nat`` tables iptables-nft owns when the caller parses ``iptables-save`` as well.
    """
    with gc_paused():
        return _parse_nft(text, frozenset(skip_tables), backend)


def _parse_nft(text: str, skip: frozenset[str], backend: str) -> ServiceMap:
    b = Builder(backend)
    tables = _read(text, b)
    for t in tables.values():
        if f"{t.family} {t.name}" in skip:
            continue
        if t.family in ("ip", "ip6"):   # inet (both families) and the others: no label
            b.families[f"{t.family} {t.name}"] = 6 if t.family == "ip6" else 4
        if t.name == "kube-proxy" and t.family in ("ip", "ip6"):
            start = len(b.kp)
            kp_nft_table(t, b)
            # ServiceMap.trace's walk; it reads the table again from the text on first use
            # rather than keep these objects (19 MiB for 10,000 Services)
            b.traces.append(NftTracer(_reader(text, t.family, t.name), t.family, t.name,
                                      [r for _, _, r in b.kp[start:]], backend))
        else:
            generic_nft_table(t, b)
    return b.finish()


def _reader(text: str, family: str, name: str):
    return lambda: _read(text, Builder("nft")).get((family, name))


def _read(text: str, b: Builder) -> dict[tuple[str, str], NftTable]:
    """The tables of a dump, their chains' rule texts and their sets' elements."""
    tables: dict[tuple[str, str], NftTable] = {}

    def tab(fam: str, name: str) -> NftTable:
        t = tables.get((fam, name))
        if t is None:
            t = tables[(fam, name)] = NftTable(fam, name)
        return t

    lines = text.splitlines()
    i, n = 0, len(lines)
    cur_t: NftTable | None = None
    block: tuple[str, str] | None = None  # (kind, name) of the block open inside cur_t
    rules: list | None = None  # the rule list of the open chain block
    while i < n:
        s = lines[i].strip()
        i += 1
        if not s or s[0] == "#":
            continue
        handle = None
        if "# handle " in s:
            s, handle = _cut_handle(s)
        # fast path: a one-line rule inside a chain block (most lines of a listing)
        if rules is not None and s[0] != "}" and not s.startswith(_CHAIN_ATTRS) and (
                ("{" not in s and "}" not in s) or _braces(s) == 0):
            rules.append((s, handle))
            continue
        command = s.startswith(("add ", "insert ", "create "))
        depth = _braces(s)
        if depth > 0 and (command or block is not None):
            # one statement wrapped over several lines (long anonymous sets, element lists)
            while depth > 0 and i < n:
                nxt, h = _cut_handle(lines[i].strip())
                i += 1
                handle = h if h is not None else handle
                s = f"{s} {nxt}"
                depth += _braces(nxt)
        if command:
            _nft_command(s, handle, tab, b)
            continue
        if s.startswith(("flush ", "delete ", "destroy ", "replace ", "reset ", "list ")):
            b.ignored += 1  # understood, but a dump does not need them
            continue
        if cur_t is None:
            m = _RE_TABLE.match(s)
            if m is None:
                b.ignored += 1
                continue
            cur_t = tab(m.group(1) or "ip", m.group(2).strip('"'))
            block = None
            continue
        if block is None:
            if s == "}":
                cur_t = None
                continue
            m = _RE_BLOCK.match(s)
            if m is not None:
                block = (m.group(1), m.group(2).strip('"'))
                if block[0] == "chain":
                    rules = cur_t.chain(block[1])
                elif block[0] in ("set", "map"):
                    cur_t.set(block[1])
            elif not s.startswith(("comment ", "flags ")):
                b.ignored += 1
            continue
        kind, name = block
        if s == "}":
            block = rules = None
        elif kind == "chain":
            if (s.startswith("type ") and " hook " in s) or s.startswith("policy "):
                cur_t.headers[name] = s
            elif s.startswith(("comment ", "devices ", "device ")) and "{" not in s \
                    and not NFT_DROPISH.search(s):
                pass  # chain attributes, not rules
            else:
                cur_t.chain(name).append((s, handle))
        elif kind in ("set", "map") and s.startswith("elements"):
            cur_t.set(name).extend(split_elements(_brace_body(s)))
        # other block kinds hold no rules
    return tables


def _nft_command(s: str, handle, tab, b: Builder) -> None:
    """One ``add|insert|create <what> [family] <table> [<object> <rest>]`` command."""
    parts = s.split(None, 5)
    if len(parts) < 3:
        b.ignored += 1
        return
    what = parts[1]
    if parts[2] in _FAMILIES:
        parts = parts[2:]
    else:  # nft's default family
        parts = ["ip", *s.split(None, 4)[2:]]
    if len(parts) < 2:
        b.ignored += 1
        return
    t = tab(parts[0], parts[1].strip('"'))
    if what == "table":
        return
    if len(parts) < 3:
        b.ignored += 1
        return
    obj = parts[2].strip('"')
    rest = parts[3] if len(parts) > 3 else ""
    if what == "rule":
        rest = rest.strip()
        if rest.startswith(("position ", "handle ", "index ")):
            p = rest.split(None, 2)
            rest = p[2] if len(p) == 3 else ""
        if rest:
            lst = t.chain(obj)
            if s.startswith("insert "):
                lst.insert(0, (rest, handle))
            else:
                lst.append((rest, handle))
    elif what == "element":
        t.set(obj).extend(split_elements(_brace_body(rest)))
    elif what == "chain":
        t.chain(obj)
        body = _brace_body(rest)
        if " hook " in f" {body}" or "policy" in body:
            t.headers[obj] = body.strip().rstrip(";").strip()
    elif what in ("set", "map"):
        lst = t.set(obj)
        m = re.search(r"elements\s*=\s*\{(.*)\}", rest)
        if m is not None:
            lst.extend(split_elements(m.group(1)))
    elif what not in ("flowtable", "counter", "quota", "limit", "ct", "secmark", "synproxy"):
        b.ignored += 1
