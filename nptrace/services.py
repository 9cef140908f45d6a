"""Name the kube-proxy Service behind an address:port, and the netfilter rule that drops it.

Input is the node's own rule dump, never the Kubernetes API:
  * ``iptables-save`` / ``ip6tables-save`` (iptables-nft or legacy, ``-c`` too), ``iptables -S``,
    and the ``iptables-restore`` input kube-proxy builds (no built-in chains, no ``/32``,
    kube-proxy's match order, bare ``-j REJECT``): :func:`parse_iptables_save` (alias
    :func:`parse_iptables_restore`);
  * ``nft [-a] list ruleset`` text and the knftables ``add table/chain/set/map/rule/element``
    dump form (kube-proxy's nftables mode, alpha in v1.29): :func:`parse_nft`.

Pure text processing: no subprocess, no root, no bcc. ``nptrace/rules_source.py`` reads the
live dump of a network namespace.

What kube-proxy writes, and what is read from it (pkg/proxy/iptables/proxier.go @ 531be812,
pkg/proxy/nftables/proxier.go @ b0f823e6):
  * iptables nat ``KUBE-SERVICES``: ``"<ns/svc:port> cluster IP|external IP|loadbalancer IP"``
    with ``-d VIP --dport P``; its last rule jumps to ``KUBE-NODEPORTS`` for ``--dst-type
    LOCAL`` or for the ``--nodeport-addresses`` (``-d X``). ``KUBE-NODEPORTS``: ``"<name>"
    --dport NODEPORT``. ``KUBE-SEP-*``: ``-j DNAT --to-destination EP``. ``KUBE-SVL-*``
    (``KUBE-XLB-*`` before v1.24): the local endpoints of an eTP/iTP=Local Service.
    ``KUBE-FW-*``: the ``loadBalancerSourceRanges``.
  * iptables filter: ``"<name> has no endpoints" -j REJECT``, ``"<name> has no local
    endpoints" -j DROP`` (since v1.25; before, a nat ``-j KUBE-MARK-DROP``), the
    ``KUBE-PROXY-FIREWALL`` LB source-range drops, ``"<name> health check node port" -j
    ACCEPT``, ``KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP``.
  * nft table ``ip|ip6 kube-proxy``: maps ``service-ips``, ``service-nodeports``,
    ``no-endpoint-services`` / ``no-endpoint-nodeports`` (``drop`` = no local endpoints,
    ``goto reject-chain`` = no endpoints), ``firewall-ips``; set ``nodeport-ips``; chains
    ``service-|local-|external-|endpoint-|firewall-HASH-ns/svc/proto/port[__ip/port]``.

Limits:
  * nft mode cannot tell an ExternalIP from a LoadBalancer IP (both ``goto external-…``). An
    address in ``firewall-ips`` is reported as ``loadbalancer``, any other as ``externalip``.
    iptables mode says which in its comments, except for a Service with no endpoints at all
    (then ``externalip``).
  * ``local_endpoints`` is known only for eTP/iTP=Local Services (eTP=Cluster chains do not say
    which endpoints are on this node). ``health_check_port`` exists only in iptables mode (nft
    mode writes no ACCEPT rule for it).
  * "Any local address" NodePorts (``--dst-type LOCAL``, ``fib daddr type local``) cannot be
    checked without the node's addresses: give them with :meth:`ServiceMap.with_local_addrs`,
    otherwise every address except a known ClusterIP counts as possibly local.
  * Rule matching (:meth:`ServiceMap.matching_drop_rules`) is best effort, not an iptables or nft
    evaluator. Evaluated: source and destination address/CIDR (negation, nft anonymous and named
    sets, ranges), protocol, ports (multiport, ranges), ``-i``/``-o``/``iifname``/``oifname``
    (``+``/``*`` wildcards), ``ctstate``/``ct state``, and ``addrtype LOCAL`` when the local
    addresses are known. The walk starts at the base chains and follows jump/goto within a
    table; it does not model the packet path between tables and hooks (NAT rewriting the
    destination, which hook a packet takes: pass ``hook``), nor marks set by earlier rules.
    Everything else (marks, ipsets, rpfilter/fib, recent, statistic, limit, string, u32,
    concatenations, vmaps outside kube-proxy's own maps, ...) is not evaluated: such a rule counts
    as a possible match and :attr:`Rule.match` names what was left out.

Cost, measured on the 2-vCPU test VM with 10,000 Services in the fixture pattern: 0.5 s to parse
``iptables-save`` (120k lines) or the knftables dump, 0.65 s for ``nft -a list ruleset``
(176k lines); ``lookup`` under 1 us, ``matching_drop_rules`` about 70 us.
"""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import itertools
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, Iterator

__all__ = [
    "KINDS",
    "REASONS",
    "Rule",
    "Service",
    "ServiceMap",
    "merge",
    "parse_iptables_restore",
    "parse_iptables_save",
    "parse_nft",
]

KINDS = ("nodeport", "clusterip", "externalip", "loadbalancer", "endpoint", "healthcheck")
REASONS = ("no_local_endpoint", "no_endpoints", "lb_source_range", "conntrack_invalid", "other")
_EXTERNAL_KINDS = frozenset({"nodeport", "externalip", "loadbalancer", "healthcheck"})
_PROTO_NUM = {"6": "tcp", "17": "udp", "132": "sctp", "1": "icmp", "58": "ipv6-icmp"}


@dataclass(frozen=True)
class Service:
    """One kube-proxy service port, seen through the frontend that was looked up.

    ``name`` is kube-proxy's ``ServicePortName.String()``, the form of its rule comments:
    ``ns/svc:port``, or ``ns/svc`` when the port has no name. ``endpoints`` and
    ``local_endpoints`` are ``ip:port`` (``[ip6]:port``), sorted.
    """

    name: str
    kind: str
    etp_local: bool = False
    endpoints: tuple[str, ...] = ()
    local_endpoints: tuple[str, ...] = ()
    no_endpoints: bool = False
    no_local_endpoints: bool = False
    health_check_port: int | None = None
    proto: str = "tcp"
    node_port: int | None = None
    cluster_ips: tuple[str, ...] = ()
    external_ips: tuple[str, ...] = ()
    lb_ips: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rule:
    """A rule (or nft map element, or chain policy) that drops or rejects packets.

    ``table``: ``filter``/``nat``/... for iptables, ``<family> <name>`` for nft. ``text``: the
    line as the dump shows it, without an nft ``# handle N`` trailer; an nft map element is shown
    as the ``add element`` command that recreates it, a chain policy as ``-P CHAIN DROP`` or the
    nft chain header. ``position``: 1-based rule number in its chain (0 for map elements and
    policies). ``service``: the kube-proxy service port the rule belongs to, if any.
    ``backend``: the dump it came from (``iptables``, ``iptables-nft``, ``iptables-legacy``, ``nft``).
    """

    table: str
    chain: str
    text: str
    verdict: str
    reason: str
    comment: str | None = None
    handle: int | None = None
    position: int = 0
    service: str | None = None
    cond: object = field(default=None, compare=False, repr=False)
    backend: str = ""

    @property
    def match(self) -> str:
        """Best-effort description of what the rule matches, then what was not evaluated."""
        return self.cond.describe() if self.cond is not None else "any packet"

    def where(self) -> str:
        """``filter/FORWARD rule 3`` style location for messages."""
        if self.position:
            return f"{self.table}/{self.chain} rule {self.position}"
        return f"{self.table}/{self.chain}"


# --------------------------------------------------------------------------------------------
# addresses, ports, protocols

_V4 = re.compile(r"^\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}$")


@lru_cache(maxsize=65536)
def _canon_slow(addr: str) -> str | None:
    host, sep, plen = addr.partition("/")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if sep and plen != str(ip.max_prefixlen):
        return None
    return str(ip)


def _canon(addr: str) -> str | None:
    """Canonical host address, or None when ``addr`` is not one host."""
    if _V4.match(addr):
        return addr
    if addr.endswith("/32") and _V4.match(addr[:-3]):
        return addr[:-3]
    return _canon_slow(addr)


@lru_cache(maxsize=16384)
def _net(text: str):
    try:
        return ipaddress.ip_network(text.strip("[]"), strict=False)
    except ValueError:
        return None


def _proto(p) -> str:
    s = str(p).strip().lower()
    return _PROTO_NUM.get(s, s)


def _split_hostport(s: str) -> tuple[str, int] | None:
    """``10.0.0.1:80`` / ``[fd00::1]:80`` -> (canonical host, port)."""
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = s.rpartition(":")
    h = _canon(host)
    if h is None or not port.isdigit():
        return None
    return h, int(port)


def _fmt_ep(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ep_sort_key(ep: tuple[str, int]):
    host, port = ep
    try:
        ip = ipaddress.ip_address(host)
        return (ip.version, int(ip), port)
    except ValueError:
        return (9, 0, port)


def _addrs(keys) -> tuple[str, ...]:
    """The distinct addresses of (addr, port) keys, in address order."""
    return tuple(a for a, _ in sorted({(a, 0) for a, _ in keys}, key=_ep_sort_key))


class _AddrSet:
    """Hosts (O(1)) plus networks; ``local`` stands for addrtype/fib LOCAL."""

    __slots__ = ("hosts", "nets", "text", "local")

    def __init__(self, items: Iterable[str] = (), text: str = "", local: bool = False):
        hosts, nets = set(), []
        for it in items:
            it = it.strip().strip('"')
            if not it:
                continue
            h = _canon(it)
            if h is not None:
                hosts.add(h)
                continue
            if "-" in it and "/" not in it:  # nft range a-b
                lo, _, hi = it.partition("-")
                try:
                    nets.extend(ipaddress.summarize_address_range(
                        ipaddress.ip_address(lo.strip()), ipaddress.ip_address(hi.strip())))
                except (ValueError, TypeError):
                    pass
                continue
            n = _net(it)
            if n is not None:
                nets.append(n)
        self.hosts = frozenset(hosts)
        self.nets = tuple(nets)
        self.text = text
        self.local = local

    @classmethod
    def host(cls, addr: str) -> "_AddrSet":
        """Set of one canonical host, without parsing."""
        s = cls.__new__(cls)
        s.hosts, s.nets, s.text, s.local = frozenset((addr,)), (), addr, False
        return s

    def contains(self, addr: str, ip=None, local_addrs=None) -> bool | None:
        if self.local:
            return None if local_addrs is None else addr in local_addrs
        if addr in self.hosts:
            return True
        if self.nets:
            if ip is None:
                ip = ipaddress.ip_address(addr)
            for n in self.nets:
                if ip.version == n.version and ip in n:
                    return True
        return False


_LOCAL = _AddrSet(text="LOCAL", local=True)


# --------------------------------------------------------------------------------------------
# best-effort matcher


class _Flow:
    __slots__ = ("saddr", "daddr", "sport", "dport", "proto", "iif", "oif", "ctstate", "_ips")

    def __init__(self, saddr=None, daddr=None, sport=None, dport=None, proto=None,
                 iif=None, oif=None, ctstate=None):
        self.saddr = _canon(saddr) if saddr else None
        self.daddr = _canon(daddr) if daddr else None
        self.sport = int(sport) if sport is not None else None
        self.dport = int(dport) if dport is not None else None
        self.proto = _proto(proto) if proto is not None else None
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


class _Match:
    """Conjunction of conditions; evaluate() -> True / False / None (cannot tell)."""

    __slots__ = ("src", "dst", "proto", "dport", "sport", "iif", "oif", "ctstate", "unknown", "not_vip")

    def __init__(self):
        self.src: list[tuple[_AddrSet, bool]] = []
        self.dst: list[tuple[_AddrSet, bool]] = []
        self.proto: tuple[frozenset, bool] | None = None
        self.dport: tuple[tuple, bool, str] | None = None  # (ranges, negated, text)
        self.sport: tuple[tuple, bool, str] | None = None
        self.iif: tuple[tuple, bool] | None = None
        self.oif: tuple[tuple, bool] | None = None
        self.ctstate: tuple[frozenset, bool] | None = None
        self.unknown: list[str] = []
        # nft cluster-ips-check only sees a ClusterIP packet that no Service DNATed or rejected
        self.not_vip = False

    def evaluate(self, f: _Flow, smap: "ServiceMap | None" = None) -> bool | None:
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
            elif smap._is_live_vip(f.daddr, f.dport, f.proto):
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


class _LazyIptMatch:
    """An iptables rule's _Match, parsed on first use (a 10k-Service dump has ~10k filter rules)."""

    __slots__ = ("_rest", "_extra_src", "_m", "_suffix")

    def __init__(self, rest: str, extra_src: _AddrSet | None = None, suffix: str = ""):
        self._rest = rest
        self._extra_src = extra_src
        self._m: _Match | None = None
        self._suffix = suffix

    def get(self) -> _Match:
        if self._m is None:
            m = _parse_ipt_match(self._rest)
            if self._extra_src is not None:
                m.src.append((self._extra_src, True))
            self._m = m
        return self._m

    def evaluate(self, f: _Flow, smap: "ServiceMap | None" = None) -> bool | None:
        return self.get().evaluate(f, smap)

    def describe(self) -> str:
        return self.get().describe() + self._suffix


def _ports(spec: str) -> tuple[tuple[int, int], ...] | None:
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


# --------------------------------------------------------------------------------------------
# accumulated facts


class _Scope:
    """Destination addresses a NodePort answers on."""

    __slots__ = ("any_local", "addrs", "exclude")

    def __init__(self, any_local=True, addrs: _AddrSet | None = None, exclude: _AddrSet | None = None):
        self.any_local = any_local
        self.addrs = addrs
        self.exclude = exclude

    def admits(self, addr: str, smap: "ServiceMap") -> bool:
        if self.exclude is not None and self.exclude.contains(addr):
            return False
        if self.addrs is not None and self.addrs.contains(addr):
            return True
        if not self.any_local:
            return False
        if smap.local_addrs is not None:
            return addr in smap.local_addrs
        return addr not in smap._cluster_addrs

    def union(self, other: "_Scope | None") -> "_Scope":
        if other is None or other is self:
            return self
        if self.addrs is None or other.addrs is None:
            addrs = self.addrs or other.addrs
        else:
            addrs = _AddrSet([*self.addrs.hosts, *map(str, self.addrs.nets), *other.addrs.hosts,
                              *map(str, other.addrs.nets)], f"{self.addrs.text},{other.addrs.text}")
        same_excl = self.exclude is not None and other.exclude is not None and \
            self.exclude.text == other.exclude.text
        return _Scope(self.any_local or other.any_local, addrs, self.exclude if same_excl else None)


_ANY_LOCAL = _Scope()


class _Info:
    """What the dump says about one service port (mutable while parsing, then left alone)."""

    __slots__ = ("name", "proto", "cluster", "external", "lb", "ext_unknown", "node_port",
                 "np_scope", "hc_port", "endpoints", "local_eps", "etp_local", "itp_local",
                 "no_endpoints", "ext_no_local", "int_no_local", "lb_sources")

    def __init__(self, name: str, proto: str = "tcp"):
        self.name = name
        self.proto = proto
        self.cluster: dict[tuple[str, int], None] = {}
        self.external: dict[tuple[str, int], None] = {}
        self.lb: dict[tuple[str, int], None] = {}
        self.ext_unknown: dict[tuple[str, int], None] = {}  # ExternalIP or LB IP, cannot tell
        self.node_port: int | None = None
        self.np_scope: _Scope | None = None
        self.hc_port: int | None = None
        self.endpoints: dict[tuple[str, int], None] = {}
        self.local_eps: dict[tuple[str, int], None] = {}
        self.etp_local = False
        self.itp_local = False
        self.no_endpoints = False
        self.ext_no_local = False
        self.int_no_local = False
        self.lb_sources: list[str] = []

    def absorb(self, o: "_Info") -> None:
        for a in ("cluster", "external", "lb", "ext_unknown", "endpoints", "local_eps"):
            getattr(self, a).update(getattr(o, a))
        if o.node_port is not None:
            self.node_port = o.node_port
            self.np_scope = o.np_scope if self.np_scope is None else self.np_scope.union(o.np_scope)
        self.hc_port = self.hc_port or o.hc_port
        for a in ("etp_local", "itp_local", "no_endpoints", "ext_no_local", "int_no_local"):
            setattr(self, a, getattr(self, a) or getattr(o, a))
        self.lb_sources.extend(s for s in o.lb_sources if s not in self.lb_sources)

    def copy(self) -> "_Info":
        c = _Info(self.name, self.proto)
        c.absorb(self)
        return c


class _Entry:
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
    def of(cls, cond: _Match, action: str, rule: Rule | None, target: str | None = None) -> "_Entry":
        """Entry with hints taken from an already parsed match."""
        dst = [a for a, neg in cond.dst if not neg and not a.local and not a.nets and len(a.hosts) == 1]
        hint_dst = next(iter(dst[0].hosts)) if dst else None
        hint_port = None
        if cond.dport is not None and not cond.dport[1] and len(cond.dport[0]) == 1 \
                and cond.dport[0][0][0] == cond.dport[0][0][1]:
            hint_port = cond.dport[0][0][0]
        return cls(cond, action, rule, hint_dst, hint_port, target)


class _Chain:
    """Entries of one chain in order, indexed so a 10k-rule chain is not walked per query."""

    __slots__ = ("table", "name", "entries", "policy", "hook", "origin", "_by_dst", "_by_port", "_rest")

    def __init__(self, table: str, name: str, entries: list[_Entry], policy: Rule | None,
                 hook: str | None = None):
        self.table = table
        self.name = name
        self.entries = entries
        self.policy = policy
        self.hook = hook  # netfilter hook of a base chain (input, forward ...), None for others
        self.origin = 0  # which parse made it: chains of two dumps never jump into each other
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

    def candidates(self, f: _Flow) -> list[_Entry]:
        """Entries that can match f, in chain order; the others fail on dst or dport anyway."""
        if len(self.entries) < 32 or f.daddr is None or f.dport is None:
            return self.entries
        if self._by_dst is None:
            self._build()
        idx = [*self._by_dst.get(f.daddr, ()), *self._by_port.get(f.dport, ()), *self._rest]
        idx.sort()
        return [self.entries[i] for i in idx]


_STOP = frozenset({"accept", "drop", "reject"})
_IPT_HOOKS = {"PREROUTING": "prerouting", "INPUT": "input", "FORWARD": "forward", "OUTPUT": "output",
              "POSTROUTING": "postrouting"}
_MAX_DEPTH = 32  # iptables refuses deeper jump nesting anyway


class _Table:
    """Chains of one table for the walk: base chains first, then chains nothing jumps to."""

    __slots__ = ("chains", "roots", "orphans")

    def __init__(self):
        self.chains: dict[str, _Chain] = {}
        self.roots: list[_Chain] = []
        self.orphans: list[_Chain] = []


# --------------------------------------------------------------------------------------------
# the map


class ServiceMap:
    """Immutable index of kube-proxy Services and drop/reject rules from one or more dumps.

    Build it with :func:`parse_iptables_save`, :func:`parse_nft` or :func:`merge`. ``lookup``
    is a few dict hits; the rule queries walk only the candidate rules of each chain.
    ``ignored`` counts the lines no parser understood; ``backends`` names the dump kinds.
    """

    def __init__(self, infos: dict[str, _Info] | None = None, *, kp_rules=(), chains=(),
                 ignored: int = 0, backends: tuple[str, ...] = (),
                 local_addrs: frozenset[str] | None = None, vip_only=()):
        self._infos: dict[str, _Info] = dict(infos or {})
        self._kp_rules: list[tuple[str, object, Rule]] = list(kp_rules)
        self._chains: list[_Chain] = list(chains)
        self.ignored = ignored
        self.backends = tuple(backends)
        self.local_addrs = local_addrs
        # (addr, port, proto) kube-proxy handles without DNAT (no-endpoint map keys)
        self._vip_only = frozenset(vip_only)
        self._cache: dict[tuple[str, str], Service] = {}
        self._index()

    def _index(self) -> None:
        vip: dict[tuple[str, int, str], tuple[str, str]] = {}
        nodeport: dict[tuple[int, str], list[str]] = {}
        hc: dict[int, list[str]] = {}
        ep: dict[tuple[str, int, str], list[str]] = {}
        cluster_addrs: set[str] = set()
        for name in sorted(self._infos):
            inf = self._infos[name]
            p = inf.proto
            for a, port in inf.cluster:
                vip.setdefault((a, port, p), (name, "clusterip"))
                cluster_addrs.add(a)
            for kind, keys in (("loadbalancer", inf.lb), ("externalip", inf.external),
                               ("externalip", inf.ext_unknown)):
                for a, port in keys:
                    vip.setdefault((a, port, p), (name, kind))
            if inf.node_port is not None:
                nodeport.setdefault((inf.node_port, p), []).append(name)
            if inf.hc_port is not None:
                hc.setdefault(inf.hc_port, []).append(name)
            for host, port in inf.endpoints:
                ep.setdefault((host, port, p), []).append(name)
        self._vip, self._nodeport, self._hc, self._ep = vip, nodeport, hc, ep
        # every port a Service answers on: most lookups are a client's ephemeral port, and a
        # set miss answers those before the address is parsed (a storm asks once a record)
        self._ports = frozenset([k[1] for k in vip] + [k[0] for k in nodeport] + list(hc) +
                                [k[1] for k in ep])
        self._cluster_addrs = frozenset(cluster_addrs)
        self._kp_dst: dict[tuple[str, int, str], list[Rule]] = {}
        self._kp_port: dict[tuple[int, str], list[tuple[_Scope, Rule]]] = {}
        self._kp_ext: dict[str, list[Rule]] = {}
        self._kp_lb: dict[str, list[Rule]] = {}
        glob: list[Rule] = []
        for kind, key, rule in self._kp_rules:
            if kind == "dst":
                self._kp_dst.setdefault(key, []).append(rule)
            elif kind == "port":
                portkey, scope = key
                self._kp_port.setdefault(portkey, []).append((scope, rule))
            elif kind == "ext":
                self._kp_ext.setdefault(key, []).append(rule)
            elif kind == "lb":
                self._kp_lb.setdefault(key, []).append(rule)
            else:
                glob.append(rule)
        glob.sort(key=lambda r: r.reason == "conntrack_invalid")
        self._kp_global = glob
        tables: dict[tuple[int, str], _Table] = {}
        for ch in self._chains:
            tables.setdefault((ch.origin, ch.table), _Table()).chains.setdefault(ch.name, ch)
        for t in tables.values():
            called = {e.target for ch in t.chains.values() for e in ch.entries
                      if e.action in ("jump", "goto") and e.target in t.chains}
            for ch in t.chains.values():
                if ch.hook is not None:
                    t.roots.append(ch)
                elif ch.name not in called:
                    t.orphans.append(ch)
        self._tables = tables

    def with_local_addrs(self, addrs: Iterable[str]) -> "ServiceMap":
        """A copy that knows the node's own addresses (for ``--dst-type LOCAL`` NodePorts)."""
        local = frozenset(a for a in (_canon(x) for x in addrs) if a)
        return ServiceMap(self._infos, kp_rules=self._kp_rules, chains=self._chains,
                          ignored=self.ignored, backends=self.backends, local_addrs=local,
                          vip_only=self._vip_only)

    def __len__(self) -> int:
        return len(self._infos)

    def __bool__(self) -> bool:
        return bool(self._infos or self._chains or self._kp_rules)

    @property
    def names(self) -> tuple[str, ...]:
        """All service port names, sorted."""
        return tuple(sorted(self._infos))

    @property
    def rules(self) -> tuple[Rule, ...]:
        """Every drop/reject Rule collected (kube-proxy's and others), in dump order."""
        seen: set[int] = set()
        out: list[Rule] = []
        for ch in self._chains:
            for e in ch.entries:
                if e.rule is not None and id(e.rule) not in seen:
                    seen.add(id(e.rule))
                    out.append(e.rule)
            if ch.policy is not None:
                out.append(ch.policy)
        for _, _, r in self._kp_rules:
            if id(r) not in seen:
                seen.add(id(r))
                out.append(r)
        return tuple(out)

    def service(self, name: str, kind: str | None = None) -> Service | None:
        """The Service called ``name`` (kube-proxy comment form), seen as ``kind``."""
        inf = self._infos.get(name)
        if inf is None:
            return None
        if kind is None:
            kind = ("clusterip" if inf.cluster else "nodeport" if inf.node_port else
                    "loadbalancer" if inf.lb else
                    "externalip" if (inf.external or inf.ext_unknown) else "endpoint")
        return self._service(name, kind)

    def _service(self, name: str, kind: str) -> Service:
        s = self._cache.get((name, kind))
        if s is not None:
            return s
        inf = self._infos[name]
        if kind == "clusterip":
            no_local = inf.int_no_local
        elif kind in _EXTERNAL_KINDS:
            no_local = inf.ext_no_local
        else:
            no_local = inf.ext_no_local or inf.int_no_local
        s = Service(
            name=name, kind=kind, etp_local=inf.etp_local,
            endpoints=tuple(_fmt_ep(*e) for e in sorted(inf.endpoints, key=_ep_sort_key)),
            local_endpoints=tuple(_fmt_ep(*e) for e in sorted(inf.local_eps, key=_ep_sort_key)),
            no_endpoints=inf.no_endpoints, no_local_endpoints=no_local,
            health_check_port=inf.hc_port, proto=inf.proto, node_port=inf.node_port,
            cluster_ips=_addrs(inf.cluster),
            external_ips=_addrs({**inf.external, **inf.ext_unknown}),
            lb_ips=_addrs(inf.lb),
        )
        self._cache[(name, kind)] = s
        return s

    def lookup(self, addr: str, port: int, proto="tcp") -> Service | None:
        """The Service a packet to ``addr:port`` hits, or None.

        Order follows the packet path: ClusterIP/ExternalIP/LB IP (nat ``KUBE-SERVICES``,
        ``@service-ips``), then NodePort, then healthCheckNodePort, then endpoint (a packet
        already DNATed). An endpoint several Services share gives the first name in sort order;
        :meth:`lookup_all` gives them all.
        """
        found = self.lookup_all(addr, port, proto, first=True)
        return found[0] if found else None

    def lookup_all(self, addr: str, port: int, proto="tcp", *, first: bool = False) -> tuple[Service, ...]:
        """Every Service ``addr:port`` could mean, in :meth:`lookup` order."""
        if port not in self._ports and int(port) not in self._ports:
            return ()
        a = _canon(addr) if addr else None
        if a is None:
            return ()
        port, proto = int(port), _proto(proto)
        out: list[Service] = []
        hit = self._vip.get((a, port, proto))
        if hit is not None:
            out.append(self._service(*hit))
            if first:
                return tuple(out)
        for name in self._nodeport.get((port, proto), ()):
            if (self._infos[name].np_scope or _ANY_LOCAL).admits(a, self):
                out.append(self._service(name, "nodeport"))
                if first:
                    return tuple(out)
        if proto == "tcp":
            # the health server listens on 0.0.0.0 or on the --nodeport-addresses
            for name in self._hc.get(port, ()):
                if (self._infos[name].np_scope or _ANY_LOCAL).admits(a, self):
                    out.append(self._service(name, "healthcheck"))
                    if first:
                        return tuple(out)
        for name in self._ep.get((a, port, proto), ()):
            out.append(self._service(name, "endpoint"))
            if first:
                return tuple(out)
        return tuple(out)

    def _is_live_vip(self, addr: str, port: int, proto: str) -> bool:
        return (addr, port, proto) in self._vip or (addr, port, proto) in self._vip_only

    def verdict_rules(self, addr: str, port: int, proto="tcp", *, include_invalid: bool = True) -> list[Rule]:
        """kube-proxy's rules that drop or reject a packet to ``addr:port``.

        Most specific first: the Service's own ``no_endpoints`` / ``no_local_endpoint`` /
        ``lb_source_range`` rules, then table-wide ones (nft ``cluster-ips-check``, the 127/8
        localnet rule), and last the ``conntrack_invalid`` drop, which applies to any forwarded
        packet conntrack marks INVALID (``include_invalid=False`` leaves it out). Rules that also
        depend on the source (LB source ranges) are included, since no source is given; check
        them with :meth:`matching_drop_rules`.
        """
        a = _canon(addr) if addr else None
        if a is None:
            return []
        port, proto = int(port), _proto(proto)
        flow = _Flow(daddr=a, dport=port, proto=proto)
        out: list[Rule] = []
        seen: set[int] = set()

        def add(r: Rule) -> None:
            if id(r) not in seen and (r.cond is None or r.cond.evaluate(flow, self) is not False):
                seen.add(id(r))
                out.append(r)

        for r in self._kp_dst.get((a, port, proto), ()):
            add(r)
        for scope, r in self._kp_port.get((port, proto), ()):
            if scope.admits(a, self):
                add(r)
        if self._kp_ext or self._kp_lb:
            for s in self.lookup_all(a, port, proto):
                for r in self._kp_ext.get(s.name, ()) if s.kind in _EXTERNAL_KINDS else ():
                    add(r)
                for r in self._kp_lb.get(s.name, ()) if s.kind == "loadbalancer" else ():
                    add(r)
        for r in self._kp_global:
            if r.reason != "conntrack_invalid":
                add(r)
            elif include_invalid and id(r) not in seen:
                seen.add(id(r))
                out.append(r)
        return out

    def matching_drop_rules(self, saddr: str | None, daddr: str | None, dport: int | None, proto="tcp", *,
                            sport: int | None = None, iif: str | None = None, oif: str | None = None,
                            ctstate: str | Iterable[str] | None = "NEW", hook: str | None = None) -> list[Rule]:
        """Every drop/reject rule a packet of this flow may hit, in the order it would meet them.

        Each table is walked from its base chains (iptables built-in chains, nft hook chains;
        only those of ``hook`` -- ``prerouting``/``input``/``forward``/``output``/
        ``postrouting`` -- if given), following jumps and gotos; a chain no rule jumps to
        (kube-proxy's restore input has no base-chain jumps) is walked on its own after them.
        A walk stops at a rule that certainly matches with an ACCEPT, DROP or REJECT, and a
        chain at a certain RETURN; a base chain's DROP policy comes after its rules when nothing
        certain stopped the walk. ``ctstate``: the packet's conntrack state, ``NEW`` (a SYN) by
        default; ``None`` means unknown. ``iif``/``oif``: interface names, None for unknown. An
        unknown value, or a match this module does not evaluate, makes a rule a *possible* match:
        it is included and does not stop the walk.
        """
        flow = _Flow(saddr, daddr, sport, dport, proto, iif, oif, ctstate)
        out: list[Rule] = []
        for t in self._tables.values():
            for root in t.roots:
                if hook is not None and root.hook != hook:
                    continue
                if self._walk(root, t, flow, out, 0) != "stop" and root.policy is not None:
                    out.append(root.policy)
            for ch in t.orphans:
                self._walk(ch, t, flow, out, 0)
        return list({id(r): r for r in out}.values())

    def _walk(self, ch: _Chain, t: _Table, flow: _Flow, out: list[Rule], depth: int) -> str:
        """Walk one chain: "stop" (a certain final verdict), or "end" (return to the caller)."""
        if depth > _MAX_DEPTH:
            return "end"
        for e in ch.candidates(flow):
            r = e.cond.evaluate(flow, self)
            if r is False:
                continue
            if e.rule is not None:
                out.append(e.rule)
            a = e.action
            if a in ("jump", "goto"):
                sub = t.chains.get(e.target)
                res = self._walk(sub, t, flow, out, depth + 1) if sub is not None else "end"
                if r is True and (res == "stop" or a == "goto"):
                    return res
            elif r is True and a in _STOP:
                return "stop"
            elif r is True and a == "return":
                return "end"
        return "end"


def merge(*maps: ServiceMap) -> ServiceMap:
    """One map from several (IPv4 + IPv6 dumps, several backends); the inputs are not changed."""
    infos: dict[str, _Info] = {}
    kp: list = []
    chains: list = []
    backends: list[str] = []
    local: frozenset[str] | None = None
    vip_only: set = set()
    for m in maps:
        for name, inf in m._infos.items():
            if name in infos:
                infos[name].absorb(inf)
            else:
                infos[name] = inf.copy()
        kp.extend(m._kp_rules)
        chains.extend(m._chains)
        backends.extend(b for b in m.backends if b not in backends)
        vip_only |= m._vip_only
        if m.local_addrs is not None:
            local = (local or frozenset()) | m.local_addrs
    return ServiceMap(infos, kp_rules=kp, chains=chains, ignored=sum(m.ignored for m in maps),
                      backends=tuple(backends), local_addrs=local, vip_only=vip_only)


# --------------------------------------------------------------------------------------------
# shared builder


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while parsing.

    A 10k-Service dump allocates ~10^6 small objects and no reference cycles; the collector's
    generation-2 passes over them doubled the parse time here (0.45 s -> 0.9 s for nft).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_origins = itertools.count(1)


class _Builder:
    def __init__(self, backend: str):
        self.backend = backend
        self.infos: dict[str, _Info] = {}
        self.kp: list[tuple[str, object, Rule]] = []
        self.chains: list[_Chain] = []
        self.ignored = 0
        self.vip_only: set = set()

    def info(self, name: str, proto: str | None = None) -> _Info:
        inf = self.infos.get(name)
        if inf is None:
            inf = self.infos[name] = _Info(name, proto or "tcp")
        elif proto and inf.proto != proto:
            inf.proto = proto  # the first facts may come from proto-less rules (SVL arrows)
        return inf

    def finish(self) -> ServiceMap:
        origin = next(_origins)
        for ch in self.chains:
            ch.origin = origin
        return ServiceMap(self.infos, kp_rules=self.kp, chains=self.chains, ignored=self.ignored,
                          backends=(self.backend,), vip_only=self.vip_only)


def _svc_name(comment: str | None) -> str | None:
    """``ns2/svc2:p80 has no local endpoints`` -> ``ns2/svc2:p80``."""
    if not comment:
        return None
    name = comment.split(" ", 1)[0]
    if "/" not in name or name.startswith("/"):
        return None
    return name


# --------------------------------------------------------------------------------------------
# iptables

_RE_COMMENT = re.compile(r'--comment (?:"((?:[^"\\]|\\.)*)"|(\S+))')
_RE_TARGET = re.compile(r"(?:^|\s)-([jg]) (\S+)")
_RE_DST = re.compile(r"(?:^|\s)(!\s+)?(?:-d|--destination) (\S+)")
_RE_SRC = re.compile(r"(?:^|\s)(!\s+)?(?:-s|--source) (\S+)")
_RE_PROTO = re.compile(r"(?:^|\s)(?:-p|--protocol) (\S+)")
_RE_DPORT = re.compile(r"--dport (\d+)")
_RE_DPORT_HINT = re.compile(r"(!\s+)?--dport (\d+)(?:\s|$)")
_RE_TODEST = re.compile(r"--to-destination (\S+)")
_RE_CTSTATE = re.compile(r"(!\s+)?--(?:ct)?state (\S+)")
_RE_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|\S+')
_EXT_COMMENT = re.compile(
    r"^(?:pod traffic for|masquerade LOCAL traffic for|route LOCAL traffic for) (\S+) external destinations$")
_FW_COMMENT = re.compile(r"^(\S+) traffic not accepted by KUBE-FW-")


def _unquote(tok: str) -> str:
    if len(tok) >= 2 and tok[0] == '"' and tok[-1] == '"':
        return tok[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return tok


def _comment_of(rest: str) -> tuple[str | None, str]:
    """(comment, rule body without the comment match)."""
    m = _RE_COMMENT.search(rest)
    if m is None:
        return None, rest
    c = m.group(1)
    c = c.replace('\\"', '"') if c is not None else m.group(2)
    return c, rest[:m.start()] + rest[m.end():]


def _parse_ipt_match(rest: str) -> _Match:
    """Conditions of one rule body (what follows ``-A CHAIN``), up to its ``-j``/``-g``."""
    m = _Match()
    toks = _RE_TOKENS.findall(rest)
    i, n, neg, module = 0, len(toks), False, ""
    while i < n:
        t = toks[i]
        if t == "!":
            neg = True
            i += 1
            continue
        if t in ("-j", "-g", "--jump", "--goto"):
            break
        has_val = i + 1 < n and toks[i + 1] != "!" and not toks[i + 1].startswith("-")
        val = _unquote(toks[i + 1]) if i + 1 < n else ""
        if t in ("-s", "--source", "-d", "--destination"):
            (m.src if t in ("-s", "--source") else m.dst).append((_AddrSet(val.split(","), val), neg))
        elif t in ("-p", "--protocol"):
            m.proto = (frozenset({_proto(val)}), neg)
        elif t in ("-i", "--in-interface"):
            m.iif = ((val,), neg)
        elif t in ("-o", "--out-interface"):
            m.oif = ((val,), neg)
        elif t in ("-m", "--match"):
            module = val
        elif t in ("--dport", "--destination-port", "--dports", "--destination-ports",
                   "--sport", "--source-port", "--sports", "--source-ports"):
            r = _ports(val)
            if r is None:
                m.unknown.append(f"{t} {val}")
            elif t.startswith(("--dport", "--destination")):
                m.dport = (r, neg, val)
            else:
                m.sport = (r, neg, val)
        elif t in ("--ctstate", "--state"):
            m.ctstate = (frozenset(s.upper() for s in val.split(",")), neg)
        elif t in ("--dst-type", "--src-type") and val.upper() == "LOCAL":
            (m.dst if t == "--dst-type" else m.src).append((_LOCAL, neg))
        elif t in ("--comment", "--nfacct-name"):
            pass  # counted or commented, never a condition
        elif t.startswith("-"):
            words = [f"-m {module}" if module else "", "!" if neg else "", t, val if has_val else ""]
            m.unknown.append(" ".join(w for w in words if w))
            if not has_val:
                i -= 1
        i += 2
        neg = False
    return m


class _IptState:
    """Per-parse state: nat lines are digested at once, other tables kept for finish()."""

    def __init__(self, b: _Builder):
        self.b = b
        self.lines: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (table, chain) -> [(text, rest)]
        self.policy: dict[tuple[str, str], str] = {}
        self.np_scopes: list[_Scope] = []
        self.nat_nodeports: list[_Info] = []
        self.markdrops: list[tuple[str, str, str, str, str | None]] = []
        self.kind: dict[str, str] = {}  # table label ("filter", "ip6 filter") -> table name
        self.sections: set[str] = set()

    def open_table(self, name: str, family: str, new: bool = False) -> str:
        """The label of a table section: ``filter``, ``ip6 filter``; a repeated section of the
        same family (two v4 dumps concatenated) becomes ``filter#2`` so chains do not mix."""
        label = name if family == "ip" else f"{family} {name}"
        if new and label in self.sections:
            n = 2
            while f"{label}#{n}" in self.sections:
                n += 1
            label = f"{label}#{n}"
        if new or label not in self.kind:
            self.sections.add(label)
            self.kind[label] = name
        return label

    def nat(self, table: str, chain: str, rest: str, text: str) -> None:
        """One nat rule. About ten per Service, so cheap substring tests come before any regex."""
        if not chain.startswith("KUBE-"):
            return
        b = self.b
        if "KUBE-MARK-DROP" in rest:
            comment, _ = _comment_of(rest)
            self.markdrops.append((table, chain, text, rest, comment))
        if chain == "KUBE-SERVICES":
            comment, body = _comment_of(rest)
            if " KUBE-NODEPORTS" in body:
                d = _RE_DST.search(body)
                if d is not None and not d.group(1):
                    self.np_scopes.append(_Scope(False, _AddrSet([d.group(2)], d.group(2))))
                else:
                    self.np_scopes.append(_ANY_LOCAL)
                return
            name = _svc_name(comment)
            if name is None:
                return
            d = _RE_DST.search(body)
            dp = _RE_DPORT.search(body)
            addr = _canon(d.group(2)) if d is not None else None
            if addr is None or dp is None:
                return
            pm = _RE_PROTO.search(body)
            inf = b.info(name, _proto(pm.group(1)) if pm else None)
            what = comment[len(name) + 1:]
            key = (addr, int(dp.group(1)))
            if what == "cluster IP":
                inf.cluster[key] = None
            elif what == "external IP":
                inf.external[key] = None
            elif what == "loadbalancer IP":
                inf.lb[key] = None
        elif chain == "KUBE-NODEPORTS":
            comment, body = _comment_of(rest)
            name = _svc_name(comment)
            dp = _RE_DPORT.search(body)
            if name is None or dp is None:
                return
            pm = _RE_PROTO.search(body)
            inf = b.info(name, _proto(pm.group(1)) if pm else None)
            if inf.node_port is None:
                inf.node_port = int(dp.group(1))
                self.nat_nodeports.append(inf)
        elif chain.startswith("KUBE-SEP-"):
            if "DNAT" not in rest:
                return
            comment, body = _comment_of(rest)
            name = _svc_name(comment)
            to = _RE_TODEST.search(body)
            hp = _split_hostport(to.group(1)) if to is not None else None
            if name is None or hp is None:
                return
            pm = _RE_PROTO.search(body)
            b.info(name, _proto(pm.group(1)) if pm else None).endpoints[hp] = None
        elif chain.startswith(("KUBE-SVC-", "KUBE-SVL-", "KUBE-XLB-")):
            if " -> " not in rest and not chain.startswith("KUBE-XLB-"):
                return
            comment, _ = _comment_of(rest)
            if comment is None:
                return
            name, arrow, ep = comment.partition(" -> ")
            if arrow:
                hp = _split_hostport(ep.strip())
                if hp is None or "/" not in name:
                    return
                inf = b.info(name)
                inf.endpoints[hp] = None
                if not chain.startswith("KUBE-SVC-"):
                    inf.local_eps[hp] = None
                    inf.etp_local = True
            else:
                n = _svc_name(comment)
                if n is not None:
                    b.info(n).etp_local = True
        elif chain.startswith("KUBE-EXT-"):
            if "external destinations" not in rest:
                return
            comment, _ = _comment_of(rest)
            m = _EXT_COMMENT.match(comment or "")
            if m is not None:
                b.info(m.group(1)).etp_local = True
        elif chain.startswith("KUBE-FW-"):
            comment, body = _comment_of(rest)
            name = _svc_name(comment)
            s = _RE_SRC.search(body)
            if name is not None and s is not None and not s.group(1) and " -j KUBE-" in f" {body}":
                b.info(name).lb_sources.append(s.group(2))

    def finish(self) -> None:
        b = self.b
        scope = None
        for s in self.np_scopes:
            scope = s if scope is None else scope.union(s)
        for inf in self.nat_nodeports:
            inf.np_scope = (scope or _ANY_LOCAL).union(inf.np_scope)
        # before v1.25, "no local endpoints" and LB source-range drops were nat -j KUBE-MARK-DROP
        # and kubelet's KUBE-FIREWALL dropped the 0x8000 mark
        for table, chain, text, rest, comment in self.markdrops:
            name = _svc_name(comment)
            if chain.startswith("KUBE-FW-"):
                reason, where = "lb_source_range", "lb"
            elif comment and comment.endswith("has no local endpoints"):
                reason, where = "no_local_endpoint", "ext"
                if name is not None:
                    b.info(name).ext_no_local = b.info(name).etp_local = True
            else:
                reason, where = "other", None
            cond = _LazyIptMatch(rest, suffix=" (marked for drop; kubelet's KUBE-FIREWALL drops it)")
            rule = Rule(table, chain, text, "drop", reason, comment, None, 0, name, cond, b.backend)
            if name is not None and where is not None:
                b.kp.append((where, name, rule))
        # every chain of the other tables is kept (lazily parsed): the walk needs the jumps
        for (table, chain), lines in self.lines.items():
            if self.kind.get(table) == "filter" and chain == "KUBE-NODEPORTS":
                self._hc_rules(lines)
            pol = self.policy.get((table, chain))
            entries = [self._entry(table, chain, pos, text, rest) for pos, (text, rest) in enumerate(lines, 1)]
            policy = None
            if pol in ("DROP", "REJECT"):
                policy = Rule(table, chain, f"-P {chain} {pol}", pol.lower(), "other", "chain policy",
                              backend=b.backend)
            b.chains.append(_Chain(table, chain, entries, policy, _IPT_HOOKS.get(chain)))

    def _hc_rules(self, lines) -> None:
        for _, rest in lines:
            if " health check node port" not in rest:
                continue
            comment, body = _comment_of(rest)
            name = _svc_name(comment)
            dp = _RE_DPORT.search(body)
            if name and dp and comment.endswith(" health check node port"):
                inf = self.b.info(name)
                inf.hc_port = int(dp.group(1))
                inf.etp_local = True

    def _entry(self, table: str, chain: str, pos: int, text: str, rest: str) -> _Entry:
        comment, body = _comment_of(rest)
        tm = _RE_TARGET.search(body)
        target = tm.group(2) if tm else None
        d = _RE_DST.search(body)
        hint_dst = _canon(d.group(2)) if d is not None and not d.group(1) else None
        dp = _RE_DPORT_HINT.search(body)
        hint_port = int(dp.group(2)) if dp is not None and not dp.group(1) else None
        if target in ("DROP", "REJECT"):
            verdict = target.lower()
            rule = self._drop_rule(table, chain, pos, text, rest, comment, body, verdict, hint_dst, hint_port)
            return _Entry(rule.cond, verdict, rule, hint_dst, hint_port)
        if target == "KUBE-MARK-DROP":  # a mark: the packet goes on through the chain
            rule = self._drop_rule(table, chain, pos, text, rest, comment, body, "drop", hint_dst, hint_port)
            return _Entry(rule.cond, "other", rule, hint_dst, hint_port)
        if target in ("ACCEPT", "RETURN"):
            action = target.lower()
        elif target is None or (table, target) not in self.lines:
            action = "other"  # a target extension (MARK, LOG, DNAT ...): processing goes on
        else:
            action = "goto" if tm.group(1) == "g" else "jump"
        return _Entry(_LazyIptMatch(rest), action, None, hint_dst, hint_port, target)

    def _drop_rule(self, table, chain, pos, text, rest, comment, body, verdict, hint_dst, hint_port) -> Rule:
        b = self.b
        name = _svc_name(comment)
        cs = _RE_CTSTATE.search(body)
        invalid = cs is not None and not cs.group(1) and "INVALID" in cs.group(2).upper().split(",")
        extra_src = None
        if comment and comment.endswith(" has no local endpoints"):
            reason = "no_local_endpoint"
        elif comment and comment.endswith(" has no endpoints"):
            reason = "no_endpoints"
        elif chain == "KUBE-PROXY-FIREWALL" or (comment and _FW_COMMENT.match(comment)):
            reason = "lb_source_range"
            # sources inside loadBalancerSourceRanges were DNATed by nat KUBE-FW-* before filter
            srcs = b.infos[name].lb_sources if name in b.infos else []
            if srcs:
                extra_src = _AddrSet(srcs, ",".join(srcs))
        elif invalid:
            reason = "conntrack_invalid"
        else:
            reason = "other"
        rule = Rule(table, chain, text, verdict, reason, comment, None, pos, name, _LazyIptMatch(rest, extra_src),
                    b.backend)
        if not chain.startswith("KUBE-"):
            return rule
        # kube-proxy's own rules, indexed for verdict_rules()
        pm = _RE_PROTO.search(body)
        proto = _proto(pm.group(1)) if pm else "tcp"
        if hint_port is not None and hint_dst is not None:
            b.kp.append(("dst", (hint_dst, hint_port, proto), rule))
            if name is None or reason not in ("no_endpoints", "no_local_endpoint"):
                return rule
            inf = b.info(name, proto)
            key = (hint_dst, hint_port)
            if chain == "KUBE-SERVICES":  # internal (ClusterIP) traffic
                if key not in inf.external and key not in inf.lb:
                    inf.cluster.setdefault(key, None)
                if reason == "no_local_endpoint":
                    inf.int_no_local = inf.itp_local = True
            else:
                if key not in inf.external and key not in inf.lb and key not in inf.cluster:
                    inf.ext_unknown[key] = None
                if reason == "no_local_endpoint":
                    inf.ext_no_local = inf.etp_local = True
            if reason == "no_endpoints":
                inf.no_endpoints = True
        elif hint_port is not None:
            d = _RE_DST.search(body)
            if d is not None and not d.group(1):
                scope = _Scope(False, _AddrSet([d.group(2)], d.group(2)))
            else:
                scope = _ANY_LOCAL  # -m addrtype --dst-type LOCAL
            b.kp.append(("port", ((hint_port, proto), scope), rule))
            if name is None or reason not in ("no_endpoints", "no_local_endpoint"):
                return rule
            inf = b.info(name, proto)
            if inf.node_port is None:
                inf.node_port = hint_port
            inf.np_scope = scope.union(inf.np_scope)
            if reason == "no_endpoints":
                inf.no_endpoints = True
            else:
                inf.ext_no_local = inf.etp_local = True
        else:
            b.kp.append(("global", None, rule))
        return rule


def parse_iptables_save(text: str, *, backend: str = "iptables") -> ServiceMap:
    """Parse ``iptables-save`` (``-c`` too), ``iptables -S`` or kube-proxy's restore input.

    IPv4 and IPv6 dumps may be concatenated. Lines no form explains are counted in
    ``ServiceMap.ignored``; ``backend`` only labels the result (``ServiceMap.backends``).
    """
    with _gc_paused():
        return _parse_iptables(text, backend)


def _parse_iptables(text: str, backend: str) -> ServiceMap:
    b = _Builder(backend)
    st = _IptState(b)
    table: str | None = None  # label of the open table: "filter", "ip6 filter", "filter#2" ...
    family = "ip"
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            # concatenated v4 + v6 dumps: each starts with "# Generated by ip[6]tables-...-save"
            if line.startswith("# Generated by ip6tables"):
                family = "ip6"
            elif line.startswith("# Generated by iptables"):
                family = "ip"
            continue
        if line[0] == "[":  # iptables-save -c: "[pkts:bytes] -A ..."
            end = line.find("]")
            if end < 0:
                b.ignored += 1
                continue
            line = line[end + 1:].lstrip()
        c = line[:3]
        if c in ("-A ", "-I "):
            parts = line.split(None, 2)
            if len(parts) < 2 or line.count('"') % 2:
                b.ignored += 1
                continue
            chain = parts[1]
            rest = parts[2] if len(parts) > 2 else ""
            tbl = table or st.open_table("filter", family)  # iptables -S: one table, no header
            if c == "-I ":
                head, _, tail = rest.partition(" ")
                if head.isdigit():
                    rest = tail
                line = f"-A {chain} {rest}".rstrip()
            if st.kind[tbl] == "nat":
                st.nat(tbl, chain, rest, line)
            else:
                lst = st.lines.setdefault((tbl, chain), [])
                if c == "-I ":
                    lst.insert(0, (line, rest))
                else:
                    lst.append((line, rest))
        elif line[0] == "*":
            name = line[1:].strip()
            table = st.open_table(name, family, new=True) if name else None
        elif line[0] == ":":
            parts = line[1:].split()
            if table is None or not parts:
                b.ignored += 1
                continue
            if len(parts) > 1 and parts[1] != "-":
                st.policy[(table, parts[0])] = parts[1].upper()
            if st.kind[table] != "nat":
                st.lines.setdefault((table, parts[0]), [])
        elif c in ("-P ", "-N "):  # iptables -S
            parts = line.split()
            if len(parts) < 2 or (c == "-P " and len(parts) < 3):
                b.ignored += 1
                continue
            tbl = table or st.open_table("filter", family)
            if c == "-P ":
                st.policy[(tbl, parts[1])] = parts[2].upper()
            if st.kind[tbl] != "nat":
                st.lines.setdefault((tbl, parts[1]), [])
        elif line == "COMMIT":
            table = None
        else:
            b.ignored += 1
    st.finish()
    return b.finish()


# kube-proxy's restore input is the same language: one parser reads both
parse_iptables_restore = parse_iptables_save


# --------------------------------------------------------------------------------------------
# nftables

_FAMILIES = frozenset({"ip", "ip6", "inet", "arp", "bridge", "netdev"})
_RE_NFT_TOK = re.compile(r'"(?:[^"\\]|\\.)*"|[{},]|[^\s{},]+')
_RE_DNAT = re.compile(r"\bdnat (?:ip6? )?to (\S+)")
_RE_GOTO_EP = re.compile(r"goto (endpoint-[^\s,}]+)")
_RE_KP_CHAIN = re.compile(r"^(service|local|external|endpoint|firewall)-[A-Z2-7]{8}-(.+)$")
_RE_ELEM_ATTR = re.compile(r'\s+(comment\s+"((?:[^"\\]|\\.)*)"|timeout\s+\S+|expires\s+\S+'
                           r'|counter(?:\s+packets\s+\d+\s+bytes\s+\d+)?)')
_RE_ELEMENT = re.compile(r'(?:"(?:[^"\\]|\\.)*"|\{[^{}]*\}|[^,"{])+')
_RE_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_RE_TABLE = re.compile(r"^table\s+(?:(\w+)\s+)?(\S+)\s*\{$")
_RE_BLOCK = re.compile(r"^(chain|set|map|flowtable|counter|quota|limit|ct\s+\w+|secmark|synproxy)\s+(\S+)\s*\{$")
_NFT_DROPISH = re.compile(r"(?:^|\s)(?:drop|reject)(?:\s|$)")


class _NftTable:
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


def _split_elements(body: str) -> list[str]:
    """Top-level comma split, keeping quoted comments and braces whole."""
    parts = body.split(",") if '"' not in body and "{" not in body else _RE_ELEMENT.findall(body)
    return [e for e in (p.strip() for p in parts) if e]


def _parse_element(elem: str) -> tuple[list[str], str | None, str | None]:
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


_CHAIN_ATTRS = ("type ", "policy ", "comment ", "devices ", "device ")


def _cut_handle(s: str) -> tuple[str, int | None]:
    """Split ``nft -a``'s trailing ``# handle N`` off a line."""
    pos = s.rfind("# handle ")
    if pos < 0:
        return s, None
    tail = s[pos + 9:].strip()
    if not tail.isdigit():
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
    with _gc_paused():
        return _parse_nft(text, frozenset(skip_tables), backend)


def _parse_nft(text: str, skip: frozenset[str], backend: str) -> ServiceMap:
    b = _Builder(backend)
    tables: dict[tuple[str, str], _NftTable] = {}

    def tab(fam: str, name: str) -> _NftTable:
        t = tables.get((fam, name))
        if t is None:
            t = tables[(fam, name)] = _NftTable(fam, name)
        return t

    lines = text.splitlines()
    i, n = 0, len(lines)
    cur_t: _NftTable | None = None
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
                    and not _NFT_DROPISH.search(s):
                pass  # chain attributes, not rules
            else:
                cur_t.chain(name).append((s, handle))
        elif kind in ("set", "map") and s.startswith("elements"):
            cur_t.set(name).extend(_split_elements(_brace_body(s)))
        # other block kinds hold no rules
    for t in tables.values():
        if f"{t.family} {t.name}" in skip:
            continue
        if t.name == "kube-proxy" and t.family in ("ip", "ip6"):
            _kp_nft_table(t, b)
        else:
            _generic_nft_table(t, b)
    return b.finish()


def _nft_command(s: str, handle, tab, b: _Builder) -> None:
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
        t.set(obj).extend(_split_elements(_brace_body(rest)))
    elif what == "chain":
        t.chain(obj)
        body = _brace_body(rest)
        if " hook " in f" {body}" or "policy" in body:
            t.headers[obj] = body.strip().rstrip(";").strip()
    elif what in ("set", "map"):
        lst = t.set(obj)
        m = re.search(r"elements\s*=\s*\{(.*)\}", rest)
        if m is not None:
            lst.extend(_split_elements(m.group(1)))
    elif what not in ("flowtable", "counter", "quota", "limit", "ct", "secmark", "synproxy"):
        b.ignored += 1


def _nft_name(base: str) -> tuple[str, str] | None:
    """``ns2/svc2/tcp/p80`` -> (``ns2/svc2:p80``, ``tcp``)."""
    parts = base.split("/")
    if len(parts) != 4:
        return None
    ns, svc, proto, port = parts
    return (f"{ns}/{svc}:{port}" if port else f"{ns}/{svc}"), proto


def _kp_nft_table(t: _NftTable, b: _Builder) -> None:
    """kube-proxy's own nft table: Services from its maps and chains, drops from its vmaps."""
    tname = f"{t.family} {t.name}"

    def elements(name: str):
        for e in t.sets.get(name, ()):
            yield (e, *_parse_element(e))

    def addrset(name: str) -> _AddrSet:
        return _AddrSet([_parse_element(e)[0][0] for e in t.sets.get(name, ())], f"@{name}")

    def np_scope(vmap: str) -> _Scope:
        # "ip daddr @nodeport-ips ... vmap @X" or "fib daddr type local [ip daddr != 127.0.0.0/8] ... vmap @X"
        for cname in ("services", "nodeport-endpoints-check", "endpoints-check", "service-endpoints-check"):
            for text, _ in t.chains.get(cname, ()):
                if f"@{vmap}" not in text:
                    continue
                if "@nodeport-ips" in text:
                    return _Scope(False, addrset("nodeport-ips"))
                excl = re.search(r"daddr != (\S+)", text)
                return _Scope(True, None, _AddrSet([excl.group(1)], excl.group(1)) if excl else None)
        return _ANY_LOCAL

    svc_scope = np_scope("service-nodeports")
    noep_scope = np_scope("no-endpoint-nodeports")
    cluster_set = addrset("cluster-ips")
    svc_cidrs = [m.group(1) for text, _ in t.chains.get("cluster-ips-check", ())
                 for m in [re.search(r"daddr (?:\{ )?([0-9a-fA-F.:]+/\d+)", text)] if m]
    svc_cidr_set = _AddrSet(svc_cidrs)

    fw_keys: dict[tuple[str, int, str], str] = {}
    for _, key, _, value in elements("firewall-ips"):
        a = _canon(key[0]) if len(key) == 3 else None
        if a is not None and key[2].isdigit() and value and value.startswith("goto "):
            fw_keys[(a, int(key[2]), _proto(key[1]))] = value[5:].strip()

    # endpoint chains hold the DNAT targets; service-/local- chains pick among them
    ep_of_chain: dict[str, tuple[str, int]] = {}
    policy_chains = []
    for cname, lst in t.chains.items():
        m = _RE_KP_CHAIN.match(cname)
        if m is None:
            continue
        prefix, base = m.group(1), m.group(2)
        nm = _nft_name(base.split("__", 1)[0])
        if nm is None:
            continue
        inf = b.info(*nm)
        if prefix == "endpoint":
            for text, _ in lst:
                dm = _RE_DNAT.search(text)
                hp = _split_hostport(dm.group(1)) if dm is not None else None
                if hp is not None:
                    inf.endpoints[hp] = None
                    ep_of_chain[cname] = hp
        elif prefix in ("service", "local"):
            policy_chains.append((prefix, inf, lst))
        elif prefix == "external":
            if any("short-circuit" in text or "fib saddr type local" in text or "goto local-" in text
                   for text, _ in lst):
                inf.etp_local = True
    for prefix, inf, lst in policy_chains:
        for text, _ in lst:
            for ep_chain in _RE_GOTO_EP.findall(text):
                hp = ep_of_chain.get(ep_chain)
                if hp is not None:
                    inf.endpoints[hp] = None
                    if prefix == "local":
                        inf.local_eps[hp] = None

    # service dispatch maps
    for _, key, _, value in elements("service-ips"):
        a = _canon(key[0]) if len(key) == 3 else None
        m = _RE_KP_CHAIN.match(value.split()[-1]) if value else None
        nm = _nft_name(m.group(2)) if m else None
        if a is None or nm is None or not key[2].isdigit():
            b.ignored += 1
            continue
        inf = b.info(*nm)
        k = (a, int(key[2]))
        if m.group(1) in ("service", "local"):
            inf.cluster[k] = None
            inf.itp_local = inf.itp_local or m.group(1) == "local"
        elif (a, k[1], _proto(key[1])) in fw_keys:
            inf.lb[k] = None
        else:
            inf.external[k] = None
    for _, key, _, value in elements("service-nodeports"):
        m = _RE_KP_CHAIN.match(value.split()[-1]) if value else None
        nm = _nft_name(m.group(2)) if m else None
        if nm is None or len(key) != 2 or not key[1].isdigit():
            b.ignored += 1
            continue
        inf = b.info(*nm)
        inf.node_port = int(key[1])
        inf.np_scope = svc_scope

    # no-endpoint verdict maps: kube-proxy's drops and rejects
    for mapname in ("no-endpoint-services", "no-endpoint-nodeports"):
        nodeport = mapname == "no-endpoint-nodeports"
        entries: list[_Entry] = []
        for elem, key, comment, value in elements(mapname):
            if len(key) != (2 if nodeport else 3) or not value or not key[-1].isdigit():
                b.ignored += 1
                continue
            verdict = "drop" if value == "drop" else "reject" if "reject" in value else None
            if verdict is None:
                continue
            reason = "no_local_endpoint" if verdict == "drop" else "no_endpoints"
            port, proto = int(key[-1]), _proto(key[-2])
            cond = _Match()
            cond.proto = (frozenset({proto}), False)
            cond.dport = (((port, port),), False, str(port))
            text = f"add element {tname} {mapname} {{ {elem} }}"
            name = comment if comment and "/" in comment else None
            a = None
            if nodeport:
                if noep_scope.addrs is not None:
                    cond.dst.append((noep_scope.addrs, False))
                elif noep_scope.any_local:
                    cond.dst.append((_LOCAL, False))
                    if noep_scope.exclude is not None:
                        cond.dst.append((noep_scope.exclude, True))
                rule = Rule(tname, mapname, text, verdict, reason, comment, None, 0, name, cond, b.backend)
                b.kp.append(("port", ((port, proto), noep_scope), rule))
            else:
                a = _canon(key[0])
                if a is None:
                    b.ignored += 1
                    continue
                cond.dst.append((_AddrSet.host(a), False))
                rule = Rule(tname, mapname, text, verdict, reason, comment, None, 0, name, cond, b.backend)
                b.kp.append(("dst", (a, port, proto), rule))
                b.vip_only.add((a, port, proto))
            entries.append(_Entry(cond, verdict, rule, a, port))
            if name is None:
                continue
            inf = b.info(name, proto)
            inf.no_endpoints = inf.no_endpoints or reason == "no_endpoints"
            if nodeport:
                if inf.node_port is None:
                    inf.node_port = port
                inf.np_scope = inf.np_scope or noep_scope
                if reason == "no_local_endpoint":
                    inf.ext_no_local = inf.etp_local = True
            elif a in cluster_set.hosts or svc_cidr_set.contains(a):
                inf.cluster.setdefault((a, port), None)
                if reason == "no_local_endpoint":
                    inf.int_no_local = inf.itp_local = True
            else:
                if (a, port, proto) in fw_keys:
                    inf.lb.setdefault((a, port), None)
                elif (a, port) not in inf.lb:
                    inf.external.setdefault((a, port), None)
                if reason == "no_local_endpoint":
                    inf.ext_no_local = inf.etp_local = True
        if entries:
            b.chains.append(_Chain(tname, mapname, entries, None))

    # loadBalancerSourceRanges: firewall-ips element -> firewall chain "ip saddr != {...} drop";
    # one pseudo chain for all of them, each entry carries its own destination
    fw_entries: list[_Entry] = []
    for (a, port, proto), fw_chain in fw_keys.items():
        m = _RE_KP_CHAIN.match(fw_chain)
        nm = _nft_name(m.group(2)) if m else None
        name = nm[0] if nm else None
        for pos, (text, handle) in enumerate(t.chains.get(fw_chain, ()), 1):
            cond, action, comment, _ = _parse_nft_rule(text, t)
            cond.dst.append((_AddrSet.host(a), False))
            cond.proto = (frozenset({proto}), False)
            cond.dport = (((port, port),), False, str(port))
            rule = None
            if action in ("drop", "reject"):
                rule = Rule(tname, fw_chain, text, action, "lb_source_range", comment, handle, pos, name, cond,
                            b.backend)
                b.kp.append(("dst", (a, port, proto), rule))
            fw_entries.append(_Entry(cond, action, rule, a, port))
            if name is not None:
                for aset, neg in cond.src:
                    if neg:
                        b.info(name, proto).lb_sources.extend(sorted(aset.hosts) + [str(x) for x in aset.nets])
        if name is not None:
            b.info(name, proto).lb.setdefault((a, port), None)
    if fw_entries:
        b.chains.append(_Chain(tname, "firewall-*", fw_entries, None))

    # cluster-ips-check: reject a wrong port on a live ClusterIP, drop an unallocated ClusterIP
    lst = t.chains.get("cluster-ips-check")
    if lst:
        entries = []
        for pos, (text, handle) in enumerate(lst, 1):
            cond, action, comment, _ = _parse_nft_rule(text, t)
            cond.not_vip = True
            rule = None
            if action in ("drop", "reject"):
                rule = Rule(tname, "cluster-ips-check", text, action, "other", comment, handle, pos, None, cond,
                            b.backend)
                b.kp.append(("global", None, rule))
            entries.append(_Entry.of(cond, action, rule))
        b.chains.append(_Chain(tname, "cluster-ips-check", entries, None))

    # anything else that drops and is not kube-proxy's own plumbing
    plumbing = {"reject-chain", "cluster-ips-check", "services", "masquerading", "mark-for-masquerade",
                "firewall-check", "nodeport-endpoints-check", "service-endpoints-check", "endpoints-check"}
    _generic_nft_table(t, b, [c for c in t.order if not (
        c in plumbing or _RE_KP_CHAIN.match(c) or c.startswith(("filter-", "nat-")))])


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


def _skip_unknown(toks: list[str], i: int, m: _Match) -> int:
    """Consume one expression that is not evaluated, and note it in m.unknown."""
    start, i, depth = i, i + 1, 0
    while i < len(toks):
        tk = toks[i]
        if tk == "{":
            depth += 1
        elif tk == "}":
            depth -= 1
        elif depth == 0 and _starts_expr(toks, i):
            break
        i += 1
    words = " ".join(toks[start:i]).replace(" ,", ",")
    if words:
        m.unknown.append(words)
    return i


def _skip_stmt(toks: list[str], i: int) -> int:
    """Consume a statement that does not decide matching (counter, log, nat, mark set ...)."""
    i, depth = i + 1, 0
    while i < len(toks):
        tk = toks[i]
        if tk == "{":
            depth += 1
        elif tk == "}":
            depth -= 1
        elif depth == 0 and tk in ("accept", "drop", "reject", "return", "jump", "goto", "comment",
                                   "counter", "log"):
            break
        i += 1
    return i


def _parse_nft_rule(text: str, t: _NftTable | None = None) -> tuple[_Match, str, str | None, str | None]:
    """(conditions, action, comment, jump/goto target) of one nft rule; limits in the module docstring."""
    m = _Match()
    toks = _RE_NFT_TOK.findall(text)
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
                    vals.append(_unquote(toks[k]))
                k += 1
            return vals, k + 1, "{ " + ", ".join(vals) + " }"
        if toks[j].startswith("@"):
            nm = toks[j][1:]
            if t is not None and nm in t.sets:
                keys = [_parse_element(e)[0] for e in t.sets[nm]]
                if all(len(k) == 1 for k in keys):
                    return [k[0] for k in keys], j + 1, toks[j]
            return [toks[j]], j + 1, toks[j]  # unresolved: the caller leaves it unevaluated
        vals, k = [_unquote(toks[j])], j + 1
        while k + 1 < n and toks[k] == ",":
            vals.append(_unquote(toks[k + 1]))
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
            (m.src if nxt == "saddr" else m.dst).append((_AddrSet(got[0], got[1]), neg))
            i = k
        elif (tok in ("ip", "ip6") and nxt in ("protocol", "nexthdr")) or (tok == "meta" and nxt == "l4proto"):
            got, neg, k = opval(i + 2)
            if got is None:
                i = _skip_unknown(toks, i, m)
                continue
            m.proto = (frozenset(_proto(v) for v in got[0]), neg)
            i = k
        elif tok in _NFT_L4 and nxt in ("dport", "sport"):
            got, neg, k = opval(i + 2)
            r = _ports(",".join(got[0])) if got is not None else None
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
            comment = _unquote(nxt)
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


def _generic_nft_table(t: _NftTable, b: _Builder, names: list[str] | None = None) -> None:
    """Keep the chains of a table that drops or rejects something (in a rule or a policy), all
    of them, since the walk of matching_drop_rules() follows their jumps."""
    names = t.order if names is None else names
    if not any(_NFT_DROPISH.search(text) for c in names for text, _ in t.chains[c]) and \
            not any(re.search(r"policy\s+drop", t.headers.get(c, "")) for c in names):
        return
    tname = f"{t.family} {t.name}"
    for cname in names:
        header = t.headers.get(cname, "")
        entries = []
        for pos, (text, handle) in enumerate(t.chains[cname], 1):
            cond, action, comment, target = _parse_nft_rule(text, t)
            rule = None
            if action in ("drop", "reject"):
                invalid = cond.ctstate is not None and "INVALID" in cond.ctstate[0] and not cond.ctstate[1]
                rule = Rule(tname, cname, text, action, "conntrack_invalid" if invalid else "other", comment,
                            handle, pos, None, cond, b.backend)
            entries.append(_Entry.of(cond, action, rule, target))
        policy = None
        if re.search(r"policy\s+drop", header):
            policy = Rule(tname, cname, header, "drop", "other", "chain policy", backend=b.backend)
        hook = re.search(r"\bhook\s+(\w+)", header)
        b.chains.append(_Chain(tname, cname, entries, policy, hook.group(1) if hook else None))
