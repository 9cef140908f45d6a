"""The on-call filters, the same on `run`, `replay`, `report` and `merge`: which incidents to
show. `--service NS/NAME[:PORT]`, `--pod NS/NAME|ADDR|CIDR`, `--cause CAUSE` (repeatable),
`--node NAME`, and offline `--since` / `--until` (RFC 3339, or relative: `10m` ago).

Pure: parsing and matching take their clock (`now`) and their Service map (a callable that
returns the current nptrace.services.ServiceMap, so `run` follows rule changes) as arguments.
Bad input raises FilterError (one line, exit 2 through errors.one_line_errors).

A Service matches an incident whose Service name is it (the classifier's attribution), or any
of whose events has an end at one of the Service's frontends (ClusterIP, external and LB IPs,
NodePort) or endpoints, before or after DNAT.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from nptrace.config import ConfigError, parse_network
from nptrace.errors import NptraceError

from .verdict import CAUSES, Verdict

_REL = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_NS = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "d": 86400 * 10**9}
_SVC = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)/([a-z0-9]([-a-z0-9.]*[a-z0-9])?)(?::([A-Za-z0-9-]+))?$")


class FilterError(NptraceError):
    pass


def parse_time(text: str, now_ns: int, opt: str = "--since") -> int:
    """RFC 3339 (`2026-01-01T10:40:00Z`, `...10:40:00.250+02:00`; a date and time without
    offset is UTC) or a duration ago (`90s`, `10m`, `2h`, `1d`) -> epoch ns."""
    t = text.strip()
    m = _REL.match(t)
    if m:
        return now_ns - int(float(m.group(1)) * _UNIT_NS[m.group(2)])
    try:
        d = datetime.fromisoformat(t[:-1] + "+00:00" if t[-1:] in "Zz" else t)
    except ValueError:
        raise FilterError(f"bad {opt} {text!r}: want RFC 3339 (2026-01-01T10:40:00Z) or a "
                          f"duration ago (10m, 2h, 1d)") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=timezone.utc)
    return int(d.timestamp()) * 10**9 + d.microsecond * 1000


def parse_causes(values) -> frozenset[str]:
    out = set()
    for v in values:
        for c in v.split(","):
            c = c.strip()
            if c not in CAUSES:
                raise FilterError(f"unknown --cause {c!r} (one of {', '.join(CAUSES)})")
            out.add(c)
    return frozenset(out)


def parse_service(spec: str) -> tuple[str, str | None]:
    """`NS/NAME[:PORT]` -> ("ns/name", port name or number or None)."""
    m = _SVC.match(spec or "")
    if not m:
        raise FilterError(f"bad --service {spec!r}: want NAMESPACE/NAME[:PORT]")
    return f"{m.group(1)}/{m.group(3)}", m.group(5)


def _net(text: str, opt: str):
    try:
        return parse_network(text, opt, "NAMESPACE/NAME, an address or a CIDR")
    except ConfigError as e:
        raise FilterError(str(e)) from None


@dataclass(frozen=True)
class ServiceSel:
    """One resolved --service: its port names and the (addr, port) / addr / port it answers on."""
    spec: str
    names: frozenset[str]                  # port names, and "ns/name" for all its ports
    ends: frozenset[tuple[str, int]]       # endpoints
    addrs: frozenset[str]                  # ClusterIPs, external and LB IPs
    node_ports: frozenset[int]

    def matches(self, v: Verdict) -> bool:
        if v.service is not None and (v.service in self.names or
                                      v.service.split(":", 1)[0] in self.names):
            return True
        for x in (v.labeled or ()):
            if self._ev(x.ev):
                return True
        return self._ev(v.event)

    def kernel_ends(self) -> frozenset[tuple[str, int]]:
        """The kernel's gate (bpf/npt_common.h filter_svc): (addr, port) of the endpoints,
        (addr, 0) of the frontend addresses (any port), ("", port) of the NodePorts (any
        address). A superset of what matches() matches by address; empty: no gate (a Service
        known by name only)."""
        return frozenset(self.ends | {(a, 0) for a in self.addrs} |
                         {("", p) for p in self.node_ports})

    def _ev(self, e) -> bool:
        for a, p in ((e.saddr, e.sport), (e.daddr, e.dport)):
            if (a, p) in self.ends or a in self.addrs or p in self.node_ports:
                return True
        ct = getattr(e, "ct", None)
        if ct is not None and getattr(ct, "dnat", False):
            if ct.orig_dst in self.addrs or ct.orig_dport in self.node_ports or \
                    (ct.reply_src, ct.reply_sport) in self.ends:
                return True
        return False


def _names_of(smap, base: str, port: str | None) -> list[str]:
    names = [n for n in smap.names if n == base or n.startswith(base + ":")]
    if port is not None:
        names = [n for n in names if n == f"{base}:{port}" or _port_is(smap, n, port)]
    return names


def _port_is(smap, name: str, port: str) -> bool:
    s = smap.service(name)
    return s is not None and port.isdigit() and s.node_port == int(port)


def resolve_service(spec: str, smap) -> ServiceSel:
    """--service through a ServiceMap (None or empty: only the name is matched)."""
    base, port = parse_service(spec)
    if not smap:
        names = [base if port is None else f"{base}:{port}"]
        return ServiceSel(spec, frozenset(names), frozenset(), frozenset(), frozenset())
    names = _names_of(smap, base, port)
    if not names:
        known = ", ".join(sorted({n.split(":")[0] for n in smap.names})[:10]) or "none"
        raise FilterError(f"unknown Service {spec!r} in the node's rules (known: {known})")
    ends, addrs, nps = set(), set(), set()
    from nptrace.services.model import split_hostport
    for n in names:
        s = smap.service(n)
        for ep in s.endpoints:
            hp = split_hostport(ep)
            if hp:
                ends.add(hp)
        addrs.update(s.cluster_ips, s.external_ips, s.lb_ips)
        if s.node_port:
            nps.add(s.node_port)
    # every port name of a named port-less spec: "ns/name" also matches "ns/name:http"
    return ServiceSel(spec, frozenset(names), frozenset(ends), frozenset(addrs), frozenset(nps))


def service_from_rows(spec: str, rows) -> ServiceSel:
    """--service offline: through a session's recorded Service lookups [(addr, port, name)]."""
    base, port = parse_service(spec)
    names, ends = set(), set()
    for a, p, n in rows:
        if (n == base or n.startswith(base + ":")) and (port is None or n == f"{base}:{port}"):
            names.add(n)
            ends.add((a, int(p)))
    if port is None:
        names.add(base)
    else:
        names.add(f"{base}:{port}")
    return ServiceSel(spec, frozenset(names), frozenset(ends), frozenset(), frozenset())


@dataclass
class Filter:
    """What to show. Empty: everything. `matches(v, epoch_ns, node)`."""
    service: str | None = None
    pods: tuple = ()                           # ip_network of --pod
    causes: frozenset = frozenset()
    node: str | None = None
    since_ns: int | None = None
    until_ns: int | None = None
    services: Callable[[], object] | None = None   # current ServiceMap (run: follows changes)
    refresh_ns: int = 10 * 10**9
    clock: Callable[[], int] | None = None
    _sel: ServiceSel | None = field(default=None, repr=False)
    _at: int = field(default=-1, repr=False)

    def __bool__(self) -> bool:
        return bool(self.service or self.pods or self.causes or self.node or
                    self.since_ns is not None or self.until_ns is not None)

    def selector(self, rows=None) -> ServiceSel | None:
        if self.service is None:
            return None
        if rows is not None:
            return service_from_rows(self.service, rows)
        now = self.clock() if self.clock else 0
        if self._sel is None or (self.clock and now - self._at >= self.refresh_ns):
            try:
                self._sel = resolve_service(self.service, self.services() if self.services else None)
            except FilterError:
                if self._sel is None:
                    raise
                # the Service went away from the rules: keep the last answer
            self._at = now
        return self._sel

    def kernel_ends(self) -> frozenset[tuple[str, int]] | None:
        """The --service ends for the kernel's gate now (re-resolved as the rules change), or
        None: no --service, or one known by name only (nothing to gate on)."""
        sel = self.selector()
        ends = sel.kernel_ends() if sel is not None else frozenset()
        return ends or None

    def matches_label(self, lab) -> bool:
        """A summary row's label (sinks/exact.py: records counted in the kernel, not sent):
        by cause and Service name; --pod, --node and times cannot be told from a label."""
        if self.causes and lab.cause not in self.causes:
            return False
        sel = self.selector()
        return sel is None or (lab.service is not None and (
            lab.service in sel.names or lab.service.split(":", 1)[0] in sel.names))

    def matches(self, v: Verdict, epoch_ns: int | None = None, node: str | None = None,
                rows=None) -> bool:
        if self.causes and v.cause not in self.causes:
            return False
        if self.node is not None and node is not None and node != self.node:
            return False
        if epoch_ns is not None:
            if self.since_ns is not None and epoch_ns < self.since_ns:
                return False
            if self.until_ns is not None and epoch_ns > self.until_ns:
                return False
        if self.pods and not self._pod(v):
            return False
        sel = self.selector(rows)
        return sel is None or sel.matches(v)

    def _pod(self, v: Verdict) -> bool:
        for e in (v.event, *(x.ev for x in (v.labeled or ()))):
            for a in (e.saddr, e.daddr):
                try:
                    ip = ipaddress.ip_address(a)
                except ValueError:
                    continue
                ip = getattr(ip, "ipv4_mapped", None) or ip    # as config.parse_network reads --pod
                if any(ip in n for n in self.pods):
                    return True
        return False


def build(service=None, pods=(), causes=(), node=None, since=None, until=None, *,
          now_ns: int = 0, services=None, pod_resolver=None, clock=None) -> Filter:
    """A Filter from the command-line values. `pod_resolver(ns, name) -> [addr]` resolves
    `--pod NS/NAME` (None: only addresses and CIDRs are accepted)."""
    if service is not None:
        parse_service(service)
    nets = []
    for p in pods:
        if "/" in p and not p.split("/", 1)[1].isdigit() and ":" not in p:
            ns, name = p.split("/", 1)
            if pod_resolver is None:
                raise FilterError(f"cannot resolve --pod {p!r} here: give the pod's address")
            addrs = pod_resolver(ns, name)
            if not addrs:
                raise FilterError(f"unknown pod {p!r} on this node")
            nets += [_net(a, "--pod") for a in addrs]
        else:
            nets.append(_net(p, "--pod"))
    s = parse_time(since, now_ns, "--since") if since else None
    u = parse_time(until, now_ns, "--until") if until else None
    if s is not None and u is not None and s > u:
        raise FilterError(f"--since {since!r} is after --until {until!r}")
    f = Filter(service=service, pods=tuple(nets), causes=parse_causes(causes), node=node,
               since_ns=s, until_ns=u, services=services, clock=clock)
    if service is not None and services is not None:
        f.selector()          # an unknown Service is an error now, not at the first incident
    return f


class FilteredSink:
    """A sink that passes only the verdicts the filter matches (live: no epoch, no node)."""

    def __init__(self, sink, flt: Filter):
        self.sink, self.flt = sink, flt

    def write(self, v) -> None:
        if self.flt.matches(v):
            self.sink.write(v)

    def write_many(self, verdicts) -> None:
        for v in verdicts:
            self.write(v)

    def write_summary(self, rows) -> None:
        w = getattr(self.sink, "write_summary", None)
        if w is not None:
            w([r for r in rows if self.flt.matches_label(r.label)])

    def __getattr__(self, name):
        return getattr(self.sink, name)


class StopAfter:
    """`run -c N`: the last sink; after N incidents it asks the tracer to stop."""

    def __init__(self, n: int, tracer):
        self.left, self.tracer = int(n), tracer

    def write(self, v) -> None:
        self.left -= 1
        if self.left <= 0:
            self.tracer.stop_requested = True

    def close(self) -> None:
        pass
