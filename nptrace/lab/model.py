"""Scenario and topology data of the repro lab: load the TOML files, merge, validate.

A scenario file holds: name, story (one line), cause, service ("ns/name:port"), optional
notes, [topology] and [services] tables deep-merged into data/topology.toml, [[trigger]]
entries (who connects where, expected client-visible outcomes), optional [[lb_view]]
health-check probes, optional [kube_proxy] switches (faults, no_local), optional
``backends`` (default: all), optional [[step]] entries, optional ``hint`` (words the hint
of the scenario's incidents must name: the interface, device or numbers at fault), optional
``explain_gap`` (why `nptrace explain` cannot predict the cause from the node's state: its
tests expect it to fail), and optional [variants.NAME] tables deep-merged over the scenario
itself.

Steps change the lab while the trigger's connections are held open (triggers with a
``then`` table: the second exchange comes after every step), in order:
  {kind = "rules", services = {...}}   kube-proxy re-renders every node's rules with these
                                       [services] tables merged in (an endpoint removed)
  {kind = "delete_pod", host = POD}    the pod is deleted: its veth goes first (CNI DEL), so
                                       its sockets die without a FIN reaching anyone
  {kind = "add_pod", host = POD}       the pod (re)appears with its addresses and server; a
                                       host with ``pending = true`` exists only from this step
  {kind = "run", host = H, argv = [...]} one command on a host
  {kind = "wait", seconds = S}         time passing (a pod's termination grace period)
"""
from __future__ import annotations

import copy
import ipaddress
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from . import dualstack, slots
from .errors import UsageError
from .kuberules import FAULTS, Endpoint, Service

DATA = Path(__file__).with_name("data")
CAUSES = ("no_local_endpoint", "no_endpoints", "rp_filter", "snat", "wrong_iface", "policy_drop",
          "netfilter_reject", "conntrack_invalid", "conntrack_full", "checksum", "no_listener",
          "proxy", "app_reset", "peer_reset", "unknown")
OUTCOMES = ("ok", "refused", "reset", "timeout", "unreachable", "closed", "error")
BACKENDS = ("iptables", "iptables-legacy", "nft", "ipvs")
# the backends of a scenario without ``backends``: kube-proxy's rule-writing modes (ipvs
# scenarios name it, their causes take IPVS's own shapes)
DEFAULT_BACKENDS = ("iptables", "iptables-legacy", "nft")
HOST_KINDS = ("client", "router", "node", "pod")
STEP_KINDS = ("rules", "delete_pod", "add_pod", "run", "wait")


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _load(path: Path) -> dict:
    with path.open("rb") as f:
        return tomllib.load(f)


def load_topology() -> dict:
    return _load(DATA / "topology.toml")


def scenario_files() -> list[Path]:
    return sorted((DATA / "scenarios").glob("*.toml"))


@dataclass(frozen=True)
class Scenario:
    name: str
    story: str
    cause: str | None          # None: the healthy baseline, no fault
    service: str
    backends: tuple[str, ...]
    variants: tuple[str, ...]
    expect: tuple[str, ...]    # client-visible outcomes the trigger must show
    path: Path = field(compare=False, repr=False)
    observe: float = 1.0       # seconds a tracer should keep watching after the trigger
    hint: tuple[str, ...] = ()  # words each incident's hint must contain (the yardstick checks)
    explain_gap: str = ""     # why `nptrace explain` cannot predict the cause from the node's state
    real: tuple[str, ...] = ()  # its forms the real tier runs ("" the scenario itself, else variants)


def _variants(raw: dict) -> list[str]:
    """The scenario's [variants] and, with ``families`` naming ipv6, its dual-stack form
    ``ipv6``; a variant whose own ``families`` names ipv6 has one too, ``<variant>+ipv6``."""
    variants = raw.get("variants", {})
    out = sorted(v for v in variants if v != dualstack.VARIANT)
    if "ipv6" in raw.get("families", ()):
        out.append(dualstack.VARIANT)
    out += [f"{v}+{dualstack.VARIANT}" for v in sorted(variants) if "ipv6" in variants[v].get("families", ())]
    return out


def _scenario(raw: dict, path: Path) -> Scenario:
    expect = tuple(dict.fromkeys(o for t in raw.get("trigger", []) for o in t.get("expect", [])))
    return Scenario(name=raw["name"], story=raw["story"], cause=raw.get("cause") or None,
                    service=raw["service"], backends=tuple(raw.get("backends", DEFAULT_BACKENDS)),
                    variants=tuple(_variants(raw)), expect=expect, path=path,
                    observe=float(raw.get("observe", 1.0)), hint=tuple(raw.get("hint", ())),
                    explain_gap=raw.get("explain_gap", ""),
                    real=(("",) if raw.get("real") else ())
                    + tuple(v for v, d in sorted(raw.get("variants", {}).items()) if d.get("real")))


def load_scenarios() -> list[Scenario]:
    return [_scenario(_load(p), p) for p in scenario_files()]


def get(name: str) -> Scenario:
    for s in load_scenarios():
        if s.name == name:
            return s
    known = ", ".join(s.name for s in load_scenarios())
    raise UsageError(f"unknown scenario {name!r} (known: {known})")


@dataclass
class Spec:
    """One scenario (and variant) merged with the base topology: everything the runner applies."""
    name: str
    variant: str | None
    story: str
    cause: str | None
    service: str
    notes: str
    cluster_cidr: str
    service_cidr: str
    hosts: dict
    networks: dict
    services: list[Service]
    trigger: list[dict]
    lb_view: list[dict]
    faults: frozenset
    no_local: str
    backends: tuple[str, ...]
    steps: list = field(default_factory=list)
    ipv6: bool = False             # dual-stack (variant ipv6): services6 rendered too, trigger over IPv6
    services6: list = field(default_factory=list)
    cluster_cidr6: str = ""
    service_cidr6: str = ""
    hint: tuple[str, ...] = ()
    slot: int = 0                  # where its address plan sits (slots.py)

    def host_ns(self, host: str, prefix: str) -> str:
        return f"{prefix}{host}"

    def pods(self, node: str | None = None, pending: bool = False) -> list[str]:
        """Pod hosts (on ``node``); those that only appear in a step (``pending``) with pending=True."""
        return [h for h, d in self.hosts.items() if d["kind"] == "pod" and (node is None or d["node"] == node)
                and (pending or not d.get("pending"))]

    def nodes(self) -> list[str]:
        return [h for h, d in self.hosts.items() if d["kind"] == "node"]

    def first_addr(self, host: str, iface: str) -> str:
        return self.hosts[host]["ifaces"][iface]["addrs"][0].split("/")[0]


def compile_spec(name: str, variant: str | None = None, slot: int = 0) -> Spec:
    """The scenario (and variant) ready to apply; ``slot``: its address plan moved there
    (slots.py), for a lab up beside others under one tracer."""
    sc = get(name)
    raw = _load(sc.path)
    ipv6 = variant in sc.variants and (variant == dualstack.VARIANT or variant.endswith("+" + dualstack.VARIANT))
    if ipv6:   # the variant it is the dual-stack form of, then [variants.ipv6] (what the form
        # changes besides the addresses), if any
        base = variant[:-len(dualstack.VARIANT) - 1]
        for v in (base, dualstack.VARIANT):
            raw = deep_merge(raw, raw.get("variants", {}).get(v, {})) if v else raw
    elif variant:
        variants = raw.get("variants", {})
        if variant not in variants:
            raise UsageError(f"scenario {name!r} has no variant {variant!r} "
                             f"(variants: {', '.join(sorted(variants)) or 'none'})")
        # `base = "<variant>"`: this variant changes that one (applied first), not the scenario
        chain, v = [], variants[variant]
        while v is not None and v not in chain:
            chain.append(v)
            v = variants.get(v.get("base")) if v.get("base") else None
        for v in reversed(chain):
            raw = deep_merge(raw, {k: x for k, x in v.items() if k != "base"})
    raw.pop("variants", None)
    raw = slots.move(raw, slot)
    topo = deep_merge(slots.move(load_topology(), slot), raw.get("topology", {}))
    services_raw = deep_merge(topo.get("services", {}), raw.get("services", {}))
    hosts, trigger = topo["hosts"], raw.get("trigger", [])
    if ipv6:
        hosts, trigger = dualstack.dual_stack(topo, raw)
    kp = raw.get("kube_proxy", {})
    spec = Spec(
        name=sc.name, variant=variant, story=raw["story"], cause=raw.get("cause") or None,
        service=raw["service"], notes=raw.get("notes", ""),
        cluster_cidr=topo["cluster_cidr"], service_cidr=topo["service_cidr"],
        hosts=hosts, networks=topo["networks"],
        services=_with_scale([_service(k, v, hosts) for k, v in sorted(services_raw.items())],
                             int(kp.get("scale", 0)), topo["service_cidr"], slot),
        trigger=trigger, lb_view=raw.get("lb_view", []),
        faults=frozenset(kp.get("faults", [])), no_local=kp.get("no_local", "drop"),
        backends=tuple(raw.get("backends", DEFAULT_BACKENDS)), hint=tuple(raw.get("hint", ())),
        slot=slot,
    )
    if ipv6:
        m = dualstack.Mapper(topo.get("ipv6", {}))
        spec.ipv6, spec.services6 = True, _services6(m, services_raw, hosts)
        spec.cluster_cidr6 = m.text(topo["cluster_cidr"], "cluster_cidr")
        spec.service_cidr6 = m.text(topo["service_cidr"], "service_cidr")
    steps = raw.get("step", [])
    if ipv6:
        steps = dualstack.twin_steps(m, steps)
    for st in steps:
        st = dict(st)
        if st.get("kind") == "rules":   # the Service tables after the change, compiled now
            after = deep_merge(services_raw, st.get("services", {}))
            st["compiled"] = _with_scale([_service(k, v, hosts) for k, v in sorted(after.items())],
                                         int(kp.get("scale", 0)), topo["service_cidr"], slot)
            if ipv6:
                st["compiled6"] = _services6(m, after, hosts)
        spec.steps.append(st)
    validate(spec)
    return spec


def _with_scale(services: list[Service], n: int, service_cidr: str, slot: int = 0) -> list[Service]:
    """``[kube_proxy] scale = N``: N more ClusterIP+NodePort Services (``scale/svc-NNNN:http``)
    with nodePorts spread over 30000-32767 and one endpoint each outside the lab, so the
    ruleset has a real cluster's size (N=2000: about 26,000 rule lines) and most ports of the
    NodePort range belong to some Service."""
    if n <= 0:
        return services
    import random
    used = {s.node_port for s in services}
    ports = [p for p in range(30000, 32768) if p not in used]
    if n > len(ports):
        raise UsageError(f"kube_proxy.scale = {n}: only {len(ports)} NodePorts are free")
    ports = sorted(random.Random(20).sample(ports, n))
    net = ipaddress.ip_network(service_cidr)
    extra = [Service(namespace="scale", name=f"svc-{i:04d}", port_name="http", port=80,
                     cluster_ip=str(net[4096 + i]), node_port=p,
                     endpoints=(Endpoint(slots.move_text(f"10.200.{i // 250}.{i % 250 + 1}", slot),
                                         8080, "node2"),))
             for i, p in enumerate(ports)]
    return services + extra


def _services6(m: dualstack.Mapper, services_raw: dict, hosts: dict) -> list[Service]:
    """The IPv6 Service ports of a dual-stack form (ClusterIP and endpoints twinned)."""
    return [_service(k, dualstack.twin_service(m, v), hosts, family=6) for k, v in sorted(services_raw.items())]


def _service(key: str, d: dict, hosts: dict, family: int = 4) -> Service:
    not_ready = set(d.get("not_ready", []))
    eps = []
    for pod in d.get("endpoints", []):
        if pod not in hosts or hosts[pod]["kind"] != "pod":
            raise UsageError(f"service {key}: endpoint {pod!r} is not a pod host")
        ip = next(a.split("/")[0] for a in hosts[pod]["ifaces"]["eth0"]["addrs"]
                  if (":" in a) == (family == 6))
        eps.append(Endpoint(ip, int(d["target_port"]), hosts[pod]["node"], ready=pod not in not_ready))
    return Service(namespace=d["namespace"], name=d["name"], port_name=d.get("port_name", ""),
                   port=int(d["port"]), cluster_ip=d["cluster_ip"], node_port=int(d.get("node_port", 0)),
                   etp=d.get("etp", "Cluster"), protocol=d.get("protocol", "tcp"),
                   health_check_node_port=int(d.get("health_check_node_port", 0)),
                   endpoints=tuple(eps))


def validate(spec: Spec) -> None:
    """Reject data mistakes early, with the file's words."""
    where = f"scenario {spec.name}" + (f" variant {spec.variant}" if spec.variant else "")
    if spec.cause is not None and spec.cause not in CAUSES:
        raise UsageError(f"{where}: cause {spec.cause!r} is not one of {', '.join(CAUSES)}")
    if not spec.trigger:
        raise UsageError(f"{where}: no [[trigger]] entry")
    for t in spec.trigger:
        if t["from"] not in spec.hosts:
            raise UsageError(f"{where}: trigger from unknown host {t['from']!r}")
        bad = [o for o in t.get("expect", []) if o not in OUTCOMES]
        if bad or not t.get("expect"):
            raise UsageError(f"{where}: trigger expect must list outcomes from {OUTCOMES}, got {t.get('expect')}")
        ipaddress.ip_address(t["dst"])
    for st in spec.steps:
        kind = st.get("kind")
        if kind not in STEP_KINDS:
            raise UsageError(f"{where}: step kind {kind!r} is not one of {', '.join(STEP_KINDS)}")
        if kind not in ("rules", "wait") and st.get("host") not in spec.hosts:
            raise UsageError(f"{where}: {kind} step on unknown host {st.get('host')!r}")
        if kind in ("delete_pod", "add_pod") and spec.hosts[st["host"]]["kind"] != "pod":
            raise UsageError(f"{where}: {kind} step on {st['host']}, which is not a pod")
        if kind == "run" and not st.get("argv"):
            raise UsageError(f"{where}: run step without argv")
    if spec.steps and not any(t.get("then") for t in spec.trigger):
        raise UsageError(f"{where}: [[step]] entries need a trigger with a `then` table (held connections)")
    for b in spec.backends:
        if b not in BACKENDS:
            raise UsageError(f"{where}: backend {b!r} is not one of {', '.join(BACKENDS)}")
    if not spec.faults <= FAULTS:
        raise UsageError(f"{where}: unknown kube_proxy fault(s) {sorted(spec.faults - FAULTS)}")
    if spec.no_local not in ("drop", "reject"):
        raise UsageError(f"{where}: kube_proxy.no_local must be drop or reject")
    for h, d in spec.hosts.items():
        if d.get("kind") not in HOST_KINDS:
            raise UsageError(f"{where}: host {h} kind must be one of {HOST_KINDS}")
        for ifname in d.get("ifaces", {}):
            if len(ifname) > 15:
                raise UsageError(f"{where}: interface name {ifname!r} on {h} is longer than 15")
        for ifname, i in d.get("ifaces", {}).items():
            if not isinstance(i.get("offload", {}), dict):
                raise UsageError(f"{where}: {h} {ifname} offload must be a table of ethtool -K features")
        if not isinstance(d.get("conntrack_fill", 0), int) or d.get("conntrack_fill", 0) < 0:
            raise UsageError(f"{where}: {h} conntrack_fill must be a number of entries")
        if d["kind"] == "pod" and d.get("node") not in spec.hosts:
            raise UsageError(f"{where}: pod {h} sits on unknown node {d.get('node')!r}")
    for net, members in spec.networks.items():
        for m in members:
            host, _, ifname = m.partition(":")
            if host not in spec.hosts or ifname not in spec.hosts[host].get("ifaces", {}):
                raise UsageError(f"{where}: network {net} member {m!r} is not a host interface")
