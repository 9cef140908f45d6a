"""``ServiceMap``, the immutable index the queries run on, and ``merge`` of several maps.

``lookup`` and ``verdict_rules`` answer from dict indexes built once in ``_index``;
``matching_drop_rules`` walks the chains of facts.py. Nothing here reads rule text: the parsers
(iptables.py, nft.py) make a map through build.py, so this module imports neither.
"""

from __future__ import annotations

from typing import Iterable

from .facts import ANY_LOCAL, Chain, Info, Scope, Table
from .match import Flow
from .model import (EXTERNAL_KINDS, Rule, Service, canon, distinct_addrs, ep_sort_key, fmt_ep,
                    norm_proto)

_STOP = frozenset({"accept", "drop", "reject"})
_MAX_DEPTH = 32  # iptables refuses deeper jump nesting anyway


class ServiceMap:
    """Immutable index of kube-proxy Services and drop/reject rules from one or more dumps.

    Build it with :func:`parse_iptables_save`, :func:`parse_nft` or :func:`merge`. ``lookup``
    is a few dict hits; the rule queries walk only the candidate rules of each chain.
    ``ignored`` counts the lines no parser understood; ``backends`` names the dump kinds.
    """

    def __init__(self, infos: dict[str, Info] | None = None, *, kp_rules=(), chains=(),
                 ignored: int = 0, backends: tuple[str, ...] = (),
                 local_addrs: frozenset[str] | None = None, vip_only=()):
        self._infos: dict[str, Info] = dict(infos or {})
        self._kp_rules: list[tuple[str, object, Rule]] = list(kp_rules)
        self._chains: list[Chain] = list(chains)
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
        self.cluster_addrs = frozenset(cluster_addrs)
        self._kp_dst: dict[tuple[str, int, str], list[Rule]] = {}
        self._kp_port: dict[tuple[int, str], list[tuple[Scope, Rule]]] = {}
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
        tables: dict[tuple[int, str], Table] = {}
        for ch in self._chains:
            tables.setdefault((ch.origin, ch.table), Table()).chains.setdefault(ch.name, ch)
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
        local = frozenset(a for a in (canon(x) for x in addrs) if a)
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
        elif kind in EXTERNAL_KINDS:
            no_local = inf.ext_no_local
        else:
            no_local = inf.ext_no_local or inf.int_no_local
        s = Service(
            name=name, kind=kind, etp_local=inf.etp_local,
            endpoints=tuple(fmt_ep(*e) for e in sorted(inf.endpoints, key=ep_sort_key)),
            local_endpoints=tuple(fmt_ep(*e) for e in sorted(inf.local_eps, key=ep_sort_key)),
            no_endpoints=inf.no_endpoints, no_local_endpoints=no_local,
            health_check_port=inf.hc_port, proto=inf.proto, node_port=inf.node_port,
            cluster_ips=distinct_addrs(inf.cluster),
            external_ips=distinct_addrs({**inf.external, **inf.ext_unknown}),
            lb_ips=distinct_addrs(inf.lb),
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
        a = canon(addr) if addr else None
        if a is None:
            return ()
        port, proto = int(port), norm_proto(proto)
        out: list[Service] = []
        hit = self._vip.get((a, port, proto))
        if hit is not None:
            out.append(self._service(*hit))
            if first:
                return tuple(out)
        for name in self._nodeport.get((port, proto), ()):
            if (self._infos[name].np_scope or ANY_LOCAL).admits(a, self):
                out.append(self._service(name, "nodeport"))
                if first:
                    return tuple(out)
        if proto == "tcp":
            # the health server listens on 0.0.0.0 or on the --nodeport-addresses
            for name in self._hc.get(port, ()):
                if (self._infos[name].np_scope or ANY_LOCAL).admits(a, self):
                    out.append(self._service(name, "healthcheck"))
                    if first:
                        return tuple(out)
        for name in self._ep.get((a, port, proto), ()):
            out.append(self._service(name, "endpoint"))
            if first:
                return tuple(out)
        return tuple(out)

    def is_live_vip(self, addr: str, port: int, proto: str) -> bool:
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
        a = canon(addr) if addr else None
        if a is None:
            return []
        port, proto = int(port), norm_proto(proto)
        flow = Flow(daddr=a, dport=port, proto=proto)
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
                for r in self._kp_ext.get(s.name, ()) if s.kind in EXTERNAL_KINDS else ():
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
        flow = Flow(saddr, daddr, sport, dport, proto, iif, oif, ctstate)
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

    def _walk(self, ch: Chain, t: Table, flow: Flow, out: list[Rule], depth: int) -> str:
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
    infos: dict[str, Info] = {}
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
