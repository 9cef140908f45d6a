"""``ServiceMap``, the immutable index the queries run on, and ``merge`` of several maps.

``lookup`` and ``verdict_rules`` answer from dict indexes built once in ``_index``;
``matching_drop_rules`` walks the chains of facts.py. Nothing here reads rule text: the parsers
(iptables.py, nft.py) make a map through build.py, so this module imports neither.
"""

from __future__ import annotations

from typing import Iterable

from .facts import ANY_LOCAL, Chain, Info, Scope, Table
from .match import Flow, family_of
from .nat import NatResult, nat_walk
from .model import (EXTERNAL_KINDS, Rule, Service, canon, distinct_addrs, ep_sort_key, fmt_ep,
                    norm_proto)

_STOP = frozenset({"accept", "drop", "reject"})
# the filter chains kube-proxy's test tracer runs, in its order (restore input has no base chains)
_KP_FILTER = ("KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-NODEPORTS", "KUBE-PROXY-FIREWALL")


class Trace:
    """What :meth:`ServiceMap.trace` found: ``output`` in kube-proxy's tracer form (DNAT
    targets, then the filter verdict, joined by ", "), ``masq`` (KUBE-MARK-MASQ), the DNAT
    targets, the filter ``verdict`` (accept/drop/reject or None) and its ``rule``."""

    __slots__ = ("output", "masq", "dests", "verdict", "rule")

    def __init__(self, output, masq, dests, verdict, rule):
        self.output, self.masq, self.dests, self.verdict, self.rule = output, masq, dests, verdict, rule

    def __repr__(self) -> str:
        return f"Trace(output={self.output!r}, masq={self.masq}, rule={self.rule and self.rule.where()})"
_MAX_DEPTH = 32  # iptables refuses deeper jump nesting anyway


class ServiceMap:
    """Immutable index of kube-proxy Services and drop/reject rules from one or more dumps.

    Build it with :func:`parse_iptables_save`, :func:`parse_nft` or :func:`merge`. ``lookup``
    is a few dict hits; the rule queries walk only the candidate rules of each chain.
    ``ignored`` counts the lines no parser understood; ``backends`` names the dump kinds.
    """

    def __init__(self, infos: dict[str, Info] | None = None, *, kp_rules=(), chains=(),
                 ignored: int = 0, backends: tuple[str, ...] = (),
                 local_addrs: frozenset[str] | None = None, vip_only=(), nat=(), traces=(), ipvs=()):
        self._infos: dict[str, Info] = dict(infos or {})
        self._kp_rules: list[tuple[str, object, Rule]] = list(kp_rules)
        self._chains: list[Chain] = list(chains)
        self.ignored = ignored
        self.backends = tuple(backends)
        self.local_addrs = local_addrs
        # (addr, port, proto) kube-proxy handles without DNAT (no-endpoint map keys)
        self._vip_only = frozenset(vip_only)
        self._nat = tuple(nat)  # iptables.LazyNat per dump: kube-proxy's nat chains, for nat.py
        self._traces = tuple(traces)  # nft_trace.NftTracer per kube-proxy nft table, for trace()
        self.ipvs = tuple(ipvs)  # ipvs.IpvsState per namespace read: IPVS's own drops (nf_cause)
        self._cache: dict[tuple[str, str], Service] = {}
        self._index()

    def _index(self) -> None:
        vip: dict[tuple[str, int, str], tuple[str, str]] = {}
        nodeport: dict[tuple[int, str], list[str]] = {}
        hc: dict[int, list[str]] = {}
        ep: dict[tuple[str, int, str], list[str]] = {}
        cluster_addrs: set[str] = set()
        # two passes: what nat rules name first, then frontends only a filter rule names (two
        # Services on one address:port: the one nat DNATs the packet to, not the sort order)
        late: list[tuple[tuple[str, int, str], tuple[str, str]]] = []
        for name in sorted(self._infos):
            inf = self._infos[name]
            p = inf.proto
            fk = inf.filter_keys
            for kind, keys in (("clusterip", inf.cluster), ("loadbalancer", inf.lb),
                               ("externalip", inf.external), ("externalip", inf.ext_unknown)):
                for key in keys:
                    if kind == "clusterip":
                        cluster_addrs.add(key[0])
                    if key in fk or keys is inf.ext_unknown:
                        late.append(((key[0], key[1], p), (name, kind)))
                    else:
                        vip.setdefault((key[0], key[1], p), (name, kind))
            if inf.node_port is not None:
                nodeport.setdefault((inf.node_port, p), []).append(name)
            if inf.hc_port is not None:
                hc.setdefault(inf.hc_port, []).append(name)
            for host, port in inf.endpoints:
                ep.setdefault((host, port, p), []).append(name)
        for key, hit in late:
            vip.setdefault(key, hit)
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
                          vip_only=self._vip_only, nat=self._nat, traces=self._traces, ipvs=self.ipvs)

    def __len__(self) -> int:
        return len(self._infos)

    def endpoint_ends(self) -> dict[tuple[str, int], str]:
        """{(address, port): the Service (the first of several)} of every endpoint listed."""
        return {(h, p): names[0] for (h, p, _proto), names in self._ep.items()}

    def __bool__(self) -> bool:
        return bool(self._infos or self._chains or self._kp_rules or self.ipvs)

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

    def verdict_rules(self, addr: str, port: int, proto="tcp", *, include_invalid: bool = True,
                      saddr: str | None = None) -> list[Rule]:
        """kube-proxy's rules that drop or reject a packet to ``addr:port``.

        Most specific first: the Service's own ``no_endpoints`` / ``no_local_endpoint`` /
        ``lb_source_range`` rules, then table-wide ones (nft ``cluster-ips-check``, the 127/8
        localnet rule), and last the ``conntrack_invalid`` drop, which applies to any forwarded
        packet conntrack marks INVALID (``include_invalid=False`` leaves it out). Rules that also
        depend on the source (LB source ranges) are included unless ``saddr`` cannot match them
        (check them with :meth:`matching_drop_rules`). ``saddr``: the client; when kube-proxy's nat rules
        certainly DNAT its packets to ``addr:port`` on to an endpoint (pod and node traffic to
        an eTP=Local Service's external IPs and NodePorts), the rules written for that frontend
        cannot meet them and are left out.
        """
        a = canon(addr) if addr else None
        if a is None:
            return []
        port, proto = int(port), norm_proto(proto)
        flow = Flow(saddr=saddr, daddr=a, dport=port, proto=proto)  # a rule the client cannot match is left out
        out: list[Rule] = []
        seen: set[int] = set()
        if saddr and self._nat and self.dnat_of(saddr, a, port, proto).certain:
            for r in self._kp_global:
                if r.reason != "conntrack_invalid" or include_invalid:
                    out.append(r)
            return out

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
        # the filter table meets a packet kube-proxy's nat rules DNATed with the endpoint as
        # its destination (and conntrack state DNAT besides NEW)
        nflow = flow
        if saddr and daddr and dport is not None and (ctstate is None or "NEW" in flow.ctstate):
            dest = self.dnat_dest(saddr, daddr, dport, proto)
            if dest is not None:
                st = None if flow.ctstate is None else flow.ctstate | {"DNAT"}
                nflow = Flow(saddr, dest[0], sport, dest[1], proto, iif, oif, st)
        out: list[Rule] = []
        fam = family_of(flow)
        for (_, label), t in self._tables.items():
            f = nflow if label.split("#")[0].split()[-1] == "filter" else flow
            for root in t.roots:
                if hook is not None and root.hook != hook or not _same_family(root, fam):
                    continue
                if self._walk(root, t, f, out, 0) != "stop" and root.policy is not None:
                    out.append(root.policy)
            for ch in t.orphans:
                if _same_family(ch, fam):
                    self._walk(ch, t, f, out, 0)
        return list({id(r): r for r in out}.values())

    # -- nat: where kube-proxy sends a packet (nat.py) ----------------------------------------
    def dnat_dest(self, saddr: str, daddr: str, dport: int, proto="tcp") -> tuple[str, int] | None:
        """(address, port) kube-proxy's nat rules certainly DNAT ``saddr -> daddr:dport`` to
        (the first endpoint where there are several), else None."""
        if not self._nat:
            return None
        nat = self.dnat_of(saddr, daddr, dport, proto)
        if nat.certain and nat.dests:
            host, sep, p = nat.dests[0].rpartition(":")
            if sep and p.isdigit():
                return host.strip("[]"), int(p)
        return None

    def dnat_of(self, saddr: str, daddr: str, dport: int, proto="tcp") -> NatResult:
        """Where kube-proxy's nat rules DNAT ``saddr -> daddr:dport`` (iptables dumps only)."""
        tables = [t for n in self._nat for t in n.tables()]
        return nat_walk(tables, Flow(saddr, daddr, None, dport, proto), self)

    def trace(self, saddr: str, daddr: str, dport: int, proto="tcp") -> "Trace":
        """kube-proxy's own test tracer (``tracePacket``) over this map: the nat DNAT targets,
        then the filter verdict for the DNATed packet (a SYN: conntrack state NEW).

        iptables: nat.py's walk, then the filter walk of the hook the packet crosses (input to
        a local address, output from one, else forward) or, in restore input without base
        chains, kube-proxy's filter chains. nft: kube-proxy's own table is walked hook by
        hook (nft_trace.py: its vmaps, ``numgen``, service/external/endpoint/firewall
        chains); other tables' filter chains decide when it does not.
        """
        local = self.local_addrs or frozenset()
        first = Flow(saddr, daddr, None, dport, proto, None, None, {"NEW"})
        nft = None
        for tr in self._traces:
            if tr.family in (None, family_of(first)):
                nft = tr.trace(first, local)
                if nft.dests or nft.verdict:
                    break
        nat = self.dnat_of(saddr, daddr, dport, proto)
        dests = list(nat.dests) or (list(nft.dests) if nft else [])
        masq = nat.masq or bool(nft and nft.masq)
        verdict = (nft.verdict, nft.rule) if nft is not None and nft.verdict else None
        d, p, st = canon(daddr) or daddr, int(dport), {"NEW"}
        if dests:
            host, _, port = dests[0].rpartition(":")
            d, p, st = host.strip("[]"), int(port), {"NEW", "DNAT"}
        flow = Flow(saddr, d, None, p, proto, None, None, st)
        hook = "input" if flow.daddr in local else "output" if flow.saddr in local else "forward"
        for (_, label), t in self._tables.items() if verdict is None else ():
            if label.split("#")[0].split()[-1] != "filter":
                continue
            roots = [r for r in t.roots if r.hook == hook and r.entries]
            starts = roots or [t.chains[c] for c in _KP_FILTER if c in t.chains]
            for ch in starts:
                got = self._verdict_walk(ch, t, flow, 0)
                if got is not None and got[0] != "return":
                    verdict = got
                    break
                if roots and ch.policy is not None:   # a base chain's DROP/REJECT policy
                    verdict = (ch.policy.verdict, ch.policy)
                    break
            if verdict is not None:
                break
        outputs = list(dests)
        if verdict is not None:
            outputs.append(verdict[0].upper())
        return Trace(", ".join(outputs), masq, tuple(dests), verdict[0] if verdict else None,
                     verdict[1] if verdict else None)

    def _verdict_walk(self, ch: Chain, t: Table, flow: Flow, depth: int):
        """The first certain ACCEPT/DROP/REJECT of a chain walk: (verdict, Rule or None),
        ("return", None) for a certain RETURN, None when the chain ends."""
        if depth > _MAX_DEPTH:
            return None
        for e in ch.entries:
            r = e.cond.evaluate(flow, self)
            if r is not True:
                continue
            a = e.action
            if a in _STOP:
                return (a, e.rule)
            if a == "return":
                return ("return", None)
            if a in ("jump", "goto"):
                sub = t.chains.get(e.target)
                got = self._verdict_walk(sub, t, flow, depth + 1) if sub is not None else None
                if got is not None and got[0] != "return":
                    return got
                if a == "goto":
                    return ("return", None)
        return None

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


def _same_family(ch, fam: int | None) -> bool:
    """A chain a packet of family ``fam`` (None: unknown) may cross."""
    return fam is None or ch.family is None or ch.family == fam


def merge(*maps: ServiceMap) -> ServiceMap:
    """One map from several (IPv4 + IPv6 dumps, several backends); the inputs are not changed."""
    infos: dict[str, Info] = {}
    kp: list = []
    chains: list = []
    backends: list[str] = []
    local: frozenset[str] | None = None
    vip_only: set = set()
    nat: list = []
    traces: list = []
    ipvs: list = []
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
        nat.extend(m._nat)
        traces.extend(m._traces)
        ipvs.extend(m.ipvs)
        if m.local_addrs is not None:
            local = (local or frozenset()) | m.local_addrs
    return ServiceMap(infos, kp_rules=kp, chains=chains, ignored=sum(m.ignored for m in maps),
                      backends=tuple(backends), local_addrs=local, vip_only=vip_only,
                      nat=nat, traces=traces, ipvs=ipvs)
