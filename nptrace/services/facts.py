"""What a parse hands to ServiceMap: per-Service facts and the chains the rule walk evaluates.

``Info`` (with ``Scope``, the addresses a NodePort answers on) gathers what a dump says about
one service port; ``Entry``, ``Chain`` and ``Table`` hold the rules of each chain in order,
indexed for the walk of :meth:`ServiceMap.matching_drop_rules`. The parsers fill these and the
map only reads them: kept apart from both so neither side needs the other's code.
"""

from __future__ import annotations

from .match import Flow, MapView, Match
from .model import AddrSet, Rule


class Scope:
    """Destination addresses a NodePort answers on."""

    __slots__ = ("any_local", "addrs", "exclude")

    def __init__(self, any_local=True, addrs: AddrSet | None = None, exclude: AddrSet | None = None):
        self.any_local = any_local
        self.addrs = addrs
        self.exclude = exclude

    def admits(self, addr: str, smap: MapView) -> bool:
        if self.exclude is not None and self.exclude.contains(addr):
            return False
        if self.addrs is not None and self.addrs.contains(addr):
            return True
        if not self.any_local:
            return False
        if smap.local_addrs is not None:
            return addr in smap.local_addrs
        return addr not in smap.cluster_addrs

    def union(self, other: "Scope | None") -> "Scope":
        if other is None or other is self:
            return self
        if self.addrs is None or other.addrs is None:
            addrs = self.addrs or other.addrs
        else:
            addrs = AddrSet([*self.addrs.hosts, *map(str, self.addrs.nets), *other.addrs.hosts,
                              *map(str, other.addrs.nets)], f"{self.addrs.text},{other.addrs.text}")
        same_excl = self.exclude is not None and other.exclude is not None and \
            self.exclude.text == other.exclude.text
        return Scope(self.any_local or other.any_local, addrs, self.exclude if same_excl else None)


ANY_LOCAL = Scope()


class Info:
    """What the dump says about one service port (mutable while parsing, then left alone)."""

    __slots__ = ("name", "proto", "cluster", "external", "lb", "ext_unknown", "node_port",
                 "np_scope", "hc_port", "endpoints", "local_eps", "etp_local", "itp_local",
                 "no_endpoints", "ext_no_local", "int_no_local", "lb_sources", "filter_keys")

    def __init__(self, name: str, proto: str = "tcp"):
        self.name = name
        self.proto = proto
        self.cluster: dict[tuple[str, int], None] = {}
        self.external: dict[tuple[str, int], None] = {}
        self.lb: dict[tuple[str, int], None] = {}
        self.ext_unknown: dict[tuple[str, int], None] = {}  # ExternalIP or LB IP, cannot tell
        self.node_port: int | None = None
        self.np_scope: Scope | None = None
        self.hc_port: int | None = None
        self.endpoints: dict[tuple[str, int], None] = {}
        self.local_eps: dict[tuple[str, int], None] = {}
        self.etp_local = False
        self.itp_local = False
        self.no_endpoints = False
        self.ext_no_local = False
        self.int_no_local = False
        self.lb_sources: list[str] = []
        # frontends known only from a filter rule (a no-endpoints REJECT, a firewall DROP): a
        # nat rule of another Service for the same address:port wins, since nat DNATs first
        self.filter_keys: set[tuple[str, int]] = set()

    def _nat_keys(self) -> set:
        return {k for d in (self.cluster, self.external, self.lb) for k in d} - self.filter_keys

    def absorb(self, o: "Info") -> None:
        nat = self._nat_keys() | o._nat_keys()
        for a in ("cluster", "external", "lb", "ext_unknown", "endpoints", "local_eps"):
            getattr(self, a).update(getattr(o, a))
        if o.node_port is not None:
            self.node_port = o.node_port
            self.np_scope = o.np_scope if self.np_scope is None else self.np_scope.union(o.np_scope)
        self.hc_port = self.hc_port or o.hc_port
        for a in ("etp_local", "itp_local", "no_endpoints", "ext_no_local", "int_no_local"):
            setattr(self, a, getattr(self, a) or getattr(o, a))
        self.lb_sources.extend(s for s in o.lb_sources if s not in self.lb_sources)
        self.filter_keys = (self.filter_keys | o.filter_keys) - nat

    def copy(self) -> "Info":
        c = Info(self.name, self.proto)
        c.absorb(self)
        return c


class Entry:
    """One rule of a chain, kept for the in-chain walk of matching_drop_rules()."""

    __slots__ = ("cond", "action", "rule", "hint_dst", "hint_port", "target")

    def __init__(self, cond, action: str, rule: Rule | None, hint_dst: str | None = None,
                 hint_port: int | None = None, target: str | None = None):
        self.cond = cond
        self.action = action  # accept drop reject return goto jump other
        self.rule = rule
        self.hint_dst = hint_dst  # the rule needs daddr == hint_dst
        self.hint_port = hint_port  # the rule needs dport == hint_port
        self.target = target  # chain of a jump / goto

    @classmethod
    def of(cls, cond: Match, action: str, rule: Rule | None, target: str | None = None) -> "Entry":
        """Entry with hints taken from an already parsed match."""
        dst = [a for a, neg in cond.dst if not neg and not a.local and not a.nets and len(a.hosts) == 1]
        hint_dst = next(iter(dst[0].hosts)) if dst else None
        hint_port = None
        if cond.dport is not None and not cond.dport[1] and len(cond.dport[0]) == 1 \
                and cond.dport[0][0][0] == cond.dport[0][0][1]:
            hint_port = cond.dport[0][0][0]
        return cls(cond, action, rule, hint_dst, hint_port, target)


class Chain:
    """Entries of one chain in order, indexed so a 10k-rule chain is not walked per query."""

    __slots__ = ("table", "name", "entries", "policy", "hook", "origin", "family", "_by_dst", "_by_port",
                 "_rest")

    def __init__(self, table: str, name: str, entries: list[Entry], policy: Rule | None,
                 hook: str | None = None):
        self.table = table
        self.name = name
        self.entries = entries
        self.policy = policy
        self.hook = hook  # netfilter hook of a base chain (input, forward ...), None for others
        self.origin = 0  # which parse made it: chains of two dumps never jump into each other
        self.family: int | None = None   # 4 / 6 for a one-family table (Builder.families)
        self._by_dst = None

    def _build(self) -> None:
        by_dst: dict[str, list[int]] = {}
        by_port: dict[int, list[int]] = {}
        rest: list[int] = []
        for i, e in enumerate(self.entries):
            if e.hint_dst is not None:
                by_dst.setdefault(e.hint_dst, []).append(i)
            elif e.hint_port is not None:
                by_port.setdefault(e.hint_port, []).append(i)
            else:
                rest.append(i)
        self._by_dst, self._by_port, self._rest = by_dst, by_port, rest

    def candidates(self, f: Flow) -> list[Entry]:
        """Entries that can match f, in chain order; the others fail on dst or dport anyway."""
        if len(self.entries) < 32 or f.daddr is None or f.dport is None:
            return self.entries
        if self._by_dst is None:
            self._build()
        idx = [*self._by_dst.get(f.daddr, ()), *self._by_port.get(f.dport, ()), *self._rest]
        idx.sort()
        return [self.entries[i] for i in idx]


class Table:
    """Chains of one table for the walk: base chains first, then chains nothing jumps to."""

    __slots__ = ("chains", "roots", "orphans")

    def __init__(self):
        self.chains: dict[str, Chain] = {}
        self.roots: list[Chain] = []
        self.orphans: list[Chain] = []
