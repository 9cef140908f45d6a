"""What each lab host gets, as commands to run on that host: the part a VM provisioner reuses.

``host_steps(spec, host, backend)`` is pure: interfaces it creates itself (bridge, VXLAN),
links up, offloads, addresses, routes, neighbours, kube-proxy's rules (nodes), extra firewall
rules, conntrack entries, sysctls, and long-running servers.
``apply_role(spec, host, run, spawn, backend)`` runs them: ``run(argv, input=None)`` executes
one command on that host, ``spawn(argv)`` starts a daemon there. How hosts are made (namespaces, veth wires) lives in netns.py.

Interfaces named in [networks] and pod veths already exist when these steps run.
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from . import ipvsrules, kuberules
from .errors import UsageError
from .model import Spec, compile_spec

SERVER = str(Path(__file__).with_name("server.py"))


@dataclass(frozen=True)
class Step:
    kind: str            # "run" or "daemon"
    argv: tuple[str, ...]
    input: str | None = None

    def __str__(self):
        s = shlex.join(self.argv)
        return s + (" <<EOF ...EOF" if self.input else "")


def pod_veth(pod: str) -> str:
    """Node-side name of a pod's veth (<=15 chars), like a CNI's vethXXXX."""
    return "veth" + re.sub(r"[^a-z0-9]", "", pod.lower())[:11]


def _ip(*args) -> Step:
    return Step("run", ("ip", *map(str, args)))


def _iface_steps(d: dict, extra_ports: list[str]) -> list[Step]:
    steps = []
    ifaces = d.get("ifaces", {})
    for name, i in ifaces.items():
        t = i.get("type")
        if t == "bridge":
            steps.append(_ip("link", "add", name, "type", "bridge"))
        elif t == "vxlan":
            args = ["link", "add", name]
            if i.get("mac"):
                args += ["address", i["mac"]]
            if i.get("mtu"):
                args += ["mtu", i["mtu"]]
            args += ["type", "vxlan", "id", i["vni"], "local", i["local"]]
            if i.get("remote"):
                args += ["remote", i["remote"]]
            args += ["dev", i["dev"], "dstport", i.get("dstport", 4789), "nolearning"]
            if i.get("udpcsum"):   # outer UDP checksums (off by default for VXLAN over IPv4)
                args.append("udpcsum")
            steps.append(_ip(*args))
    bridges = [n for n, i in ifaces.items() if i.get("type") == "bridge"]
    for port in extra_ports:
        steps.append(_ip("link", "set", port, "master", bridges[0]))
    for name in [*ifaces, *extra_ports]:
        steps.append(_ip("link", "set", name, "up"))
    for name, i in ifaces.items():
        # `offload = {tx = "off"}`: ethtool -K features; tx off makes the stack compute each
        # checksum in software before the packet leaves (CHECKSUM_NONE on the wire), not the
        # device (CHECKSUM_PARTIAL, which a veth peer accepts unverified)
        if i.get("offload"):
            steps.append(Step("run", ("ethtool", "-K", name,
                                      *(str(x) for kv in i["offload"].items() for x in kv))))
    for name, i in ifaces.items():
        for a in i.get("addrs", []):
            # nodad: usable at once (no tentative second), as a CNI sets pod addresses
            steps.append(_ip("addr", "add", a, "dev", name, *(("nodad",) if ":" in a else ())))
    for r in d.get("routes", []):
        steps.append(_ip("route", "add", *r.split()))
    for n in d.get("neigh", []):
        steps.append(_ip("neigh", "add", *n.split()))
    return steps


def kube_proxy_steps(spec: Spec, node: str, backend: str, services=None, services6=None) -> list[Step]:
    """kube-proxy's rules for one node, loaded the way kube-proxy loads them: on a dual-stack
    node (spec.ipv6) one proxier per family, the IPv6 one through ip6tables / table ip6."""
    d = spec.hosts[node]
    fams = [(services if services is not None else spec.services, spec.cluster_cidr, spec.service_cidr, False)]
    if spec.ipv6:
        fams.append((services6 if services6 is not None else spec.services6, spec.cluster_cidr6,
                     spec.service_cidr6, True))
    steps = []
    for svcs, cidr, svc_cidr, six in fams:
        if backend == "ipvs":
            if six:
                raise UsageError("the lab's ipvs backend is IPv4 only")
            steps += ipvs_steps(spec, node, svcs, cidr)
            continue
        if backend == "nft":
            ips = [a.split("/")[0] for i in ("eth0", "eth1") for a in d["ifaces"].get(i, {}).get("addrs", [])
                   if (":" in a) == six]
            text = kuberules.render_nft(svcs, node, cidr, service_cidr=svc_cidr, nodeport_ips=ips,
                                        faults=spec.faults, no_local=spec.no_local)
            steps.append(Step("run", ("nft", "-f", "-"), text))
            continue
        binary = ("ip6tables" if six else "iptables") + ("-legacy" if backend == "iptables-legacy" else "")
        text = kuberules.render_iptables(svcs, node, cidr, faults=spec.faults, no_local=spec.no_local)
        steps.append(Step("run", (f"{binary}-restore", "-w", "--noflush"), text))
        steps += [Step("run", tuple(argv)) for argv in kuberules.iptables_jumps(binary, faults=spec.faults)]
    return steps


def node_ips(spec: Spec, node: str, six: bool = False) -> list[str]:
    """The node's own addresses of one family: where its NodePorts answer (kube-proxy's
    default nodePortAddresses: every local address but kube-ipvs0's)."""
    return [a.split("/")[0] for i in spec.hosts[node]["ifaces"].values() for a in i.get("addrs", [])
            if (":" in a) == six]


def ipvs_steps(spec: Spec, node: str, services, cluster_cidr: str) -> list[Step]:
    """kube-proxy's IPVS mode on one node (ipvsrules.py): the dummy device and its
    addresses, the ipsets, the virtual and real servers, the iptables rules and its sysctls.
    Loading ip_vs creates the net.ipv4.vs sysctls, so they come after the first ipvsadm."""
    ips = node_ips(spec, node)
    steps = [_ip("link", "add", ipvsrules.DUMMY, "type", "dummy")]
    steps += [_ip("addr", "add", f"{a}/32", "dev", ipvsrules.DUMMY) for a in ipvsrules.bound_addresses(services)]
    steps.append(Step("run", ("ipset", "-exist", "restore"), ipvsrules.render_ipset(services, node)))
    steps.append(Step("run", ("ipvsadm", "-R"), ipvsrules.render_ipvsadm(services, node, ips)))
    steps.append(Step("run", ("sysctl", "-q", "-w", *(f"{k}={v}" for k, v in ipvsrules.SYSCTLS.items()))))
    steps.append(Step("run", ("iptables-restore", "-w", "--noflush"), ipvsrules.render_iptables(services, cluster_cidr)))
    steps += [Step("run", tuple(argv)) for argv in ipvsrules.iptables_jumps("iptables", faults=spec.faults)]
    return steps


def firewall_steps(spec: Spec, host: str, backend: str) -> list[Step]:
    """Non-kube-proxy rules the scenario gives a host (NetworkPolicy, middlebox)."""
    d = spec.hosts[host]
    steps = []
    node = d["kind"] == "node"
    for key, tool in (("iptables_restore", "iptables"), ("ip6tables_restore", "ip6tables")):
        if d.get(key) and (not node or backend != "nft"):   # ipvs mode's nodes use iptables too
            binary = f"{tool}-legacy" if node and backend == "iptables-legacy" else tool
            steps.append(Step("run", (f"{binary}-restore", "-w", "--noflush"), d[key]))
    if d.get("nft") and (not node or backend == "nft"):
        steps.append(Step("run", ("nft", "-f", "-"), d["nft"]))
    # `nic_nft`: a netdev-family table standing in for what a NIC or the wire does to packets
    # (a rewrite after the checksum), whatever the node's kube-proxy backend
    if d.get("nic_nft"):
        steps.append(Step("run", ("nft", "-f", "-"), d["nic_nft"]))
    return steps


def conntrack_fill_steps(spec: Spec, host: str) -> list[Step]:
    """``conntrack_fill = N``: N established, ASSURED TCP entries (idle long-lived connections
    to the host's first address; early drop never evicts ASSURED ones), loaded in one
    ``conntrack -R``. With nf_conntrack_max = N the table is full.

    The table must hold nothing else: early drop evicts an entry that is not ASSURED when one
    sits near the new flow's hash, and the new connection then gets in. A bridge with multicast
    snooping joins 224.0.0.106 and sends IGMP reports (an UNREPLIED entry), so snooping goes off
    on the host's bridges (it leaves the group: no more reports) and the table is flushed before
    the fill."""
    d = spec.hosts[host]
    n = int(d.get("conntrack_fill", 0))
    if n <= 0:
        return []
    dst = next(a.split("/")[0] for i in d["ifaces"].values() for a in i.get("addrs", []) if ":" not in a)
    lines = [f"-I -p tcp -s 198.18.{k // 250}.{k % 250 + 1} -d {dst} --sport {10000 + k} --dport 443 "
             "--state ESTABLISHED -t 86400 -u ASSURED,SEEN_REPLY" for k in range(n)]
    quiet = [_ip("link", "set", name, "type", "bridge", "mcast_snooping", 0)
             for name, i in d["ifaces"].items() if i.get("type") == "bridge"]
    return [*quiet, Step("run", ("conntrack", "-F")),
            Step("run", ("conntrack", "-R", "/dev/stdin"), "\n".join(lines) + "\n")]


def server_steps(spec: Spec, host: str, real: bool = False) -> list[Step]:
    d = spec.hosts[host]
    listens = []
    srv = d.get("server")
    if srv:
        mode = srv.get("mode", "echo")
        if mode == "delay":
            mode = f"delay:{srv['delay']}"
        listens.append(f"{srv['port']}:{mode}")
    if d["kind"] == "node" and not real:   # the real tier: kube-proxy's own servers
        # kube-proxy's service health server: one listener per eTP=Local Service with a
        # healthCheckNodePort, answering with this node's count of local ready endpoints.
        for svc in spec.services:
            if svc.health_check_node_port:
                n = sum(1 for e in svc.endpoints if e.ready and e.node == host)
                listens.append(f"{svc.health_check_node_port}:hc:{svc.namespace}/{svc.name}:{n}")
    if not listens:
        return []
    argv = [sys.executable, SERVER, "--name", host, *(("--ipv6",) if d.get("ipv6") else ())]
    for spec_ in listens:
        argv += ["--listen", spec_]
    return [Step("daemon", tuple(argv))]


def sysctl_steps(spec: Spec, host: str) -> list[Step]:
    sysctls = spec.hosts[host].get("sysctl", {})
    if not sysctls:
        return []
    return [Step("run", ("sysctl", "-q", "-w", *(f"{k}={v}" for k, v in sysctls.items())))]


def host_steps(spec: Spec, host: str, backend: str, real: bool = False) -> list[Step]:
    """``real``: the lab's real tier, where a real kube-proxy writes the node's rules and
    serves its health checks (nptrace/lab/real/), so neither is rendered here."""
    d = spec.hosts[host]
    ports = [pod_veth(p) for p in spec.pods(host)] if d["kind"] == "node" else []
    steps = _iface_steps(d, ports)
    if d["kind"] == "node" and not real:
        steps += kube_proxy_steps(spec, host, backend)
    steps += firewall_steps(spec, host, backend)
    steps += conntrack_fill_steps(spec, host)
    # After the rules: nf_conntrack_* sysctls are per namespace and exist once conntrack is loaded.
    steps += sysctl_steps(spec, host)
    steps += server_steps(spec, host, real)
    return steps


def apply_role(scenario, role: str, run, *, spawn=None, backend: str = "iptables",
               variant: str | None = None) -> list[list[str]]:
    """Apply host ``role``'s share of ``scenario`` (a name or a compiled Spec) through ``run``.

    ``run(argv, input)`` executes one command on that host (ssh, ``ip netns exec``, ...).
    Daemons (the pod's server, kube-proxy's health-check server) go to ``spawn(argv)``;
    without ``spawn`` they are returned for the caller to start its own way (systemd, nohup).
    """
    spec = scenario if isinstance(scenario, Spec) else compile_spec(scenario, variant)
    if role not in spec.hosts:
        raise UsageError(f"scenario {spec.name} has no host {role!r} (hosts: {', '.join(spec.hosts)})")
    daemons = []
    for step in host_steps(spec, role, backend):
        if step.kind == "daemon":
            if spawn is None:
                daemons.append(list(step.argv))
            else:
                spawn(list(step.argv))
        else:
            run(list(step.argv), step.input)
    return daemons
