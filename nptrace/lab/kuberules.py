"""Render the rules kube-proxy writes for a node, from Service data.

iptables mode follows kubernetes/kubernetes pkg/proxy/iptables/proxier.go @ 531be812
(syncProxyRules, iptablesJumpChains): the restore text kube-proxy feeds to
``iptables-restore --noflush``, laid out as the unit-test fixtures under
/work/shared/kube-proxy print it (chains sorted, rules grouped per chain). The INVALID
drop is written without the nfacct counter, as when the nfacct objects are missing
(the v1.28-era dumps), and localhost NodePorts are off.

nftables mode follows pkg/proxy/nftables/proxier.go (table ``ip kube-proxy``), in the
knftables Fake.Dump() text of TestOverallNFTablesRules @ 81810de6, with declarations
first because ``nft -f`` resolves chain references in file order.

Chain names use kube-proxy's hashes: iptables "KUBE-SVC-" + base32(sha256(
"ns/name:port" + protocol))[:16] (portProtoHash / servicePortEndpointChainName with
the endpoint "ip:port" appended), nftables hashAndTruncate: base32(sha256(name))[:8] + "-" + name.

Lab-only fault switches (what goes wrong on real nodes, not kube-proxy options):
  faults={"no-masquerade-jump"}  the nat POSTROUTING -> KUBE-POSTROUTING jump (nft: the
                                 nat-postrouting -> masquerading jump) is missing, as after a
                                 firewall reload flushed it.
  no_local="reject"              answer eTP=Local traffic on a node without local endpoints
                                 with REJECT instead of kube-proxy's DROP.
"""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field

MASQ_MARK = "0x4000"
FAULTS = frozenset({"no-masquerade-jump"})


@dataclass(frozen=True)
class Endpoint:
    ip: str
    port: int
    node: str
    ready: bool = True

    def __str__(self):   # net.JoinHostPort: "[v6]:port"
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    port_name: str
    port: int
    cluster_ip: str
    node_port: int = 0
    etp: str = "Cluster"
    protocol: str = "tcp"
    health_check_node_port: int = 0
    external_ips: tuple[str, ...] = ()
    lb_ips: tuple[str, ...] = ()
    endpoints: tuple[Endpoint, ...] = field(default=())

    @property
    def port_name_string(self) -> str:
        """proxy.ServicePortName.String(): "ns/name" plus ":port" when the port is named."""
        base = f"{self.namespace}/{self.name}"
        return f"{base}:{self.port_name}" if self.port_name else base

    @property
    def local(self) -> bool:
        return self.etp == "Local"


def _b32(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest()).decode()


def port_proto_hash(svc_port_name: str, protocol: str) -> str:
    return _b32(svc_port_name + protocol)[:16]


def svc_chain(svc: Service) -> str:
    return "KUBE-SVC-" + port_proto_hash(svc.port_name_string, svc.protocol)


def svl_chain(svc: Service) -> str:
    return "KUBE-SVL-" + port_proto_hash(svc.port_name_string, svc.protocol)


def ext_chain(svc: Service) -> str:
    return "KUBE-EXT-" + port_proto_hash(svc.port_name_string, svc.protocol)


def sep_chain(svc: Service, ep: Endpoint) -> str:
    return "KUBE-SEP-" + _b32(svc.port_name_string + svc.protocol + str(ep))[:16]


def hash_and_truncate(name: str) -> str:
    return _b32(name)[:8] + "-" + name


def nft_chain_base(svc: Service) -> str:
    return hash_and_truncate(f"{svc.namespace}/{svc.name}/{svc.protocol}/{svc.port_name}")


def nft_endpoint_chain(svc: Service, ep: Endpoint) -> str:
    # ':' is not valid in an nft identifier: an IPv6 endpoint's colons become '.'
    return "endpoint-" + hash_and_truncate(
        f"{svc.namespace}/{svc.name}/{svc.protocol}/{svc.port_name}__{ep.ip.replace(':', '.')}/{ep.port}")


def _q(arg: str) -> str:
    return f'"{arg}"' if any(c.isspace() for c in arg) else arg


def restore_line(*args: str) -> str:
    """One iptables-restore rule line, arguments with spaces quoted."""
    return " ".join(_q(str(a)) for a in args)


_line = restore_line


def _categorize(svc: Service, node: str):
    """proxy.CategorizeEndpoints for the cases the lab uses: ready endpoints only."""
    ready = [e for e in svc.endpoints if e.ready]
    local = [e for e in ready if e.node == node]
    return ready, local


def _probability(n: int) -> str:
    return "%0.10f" % (1.0 / n)


# ----------------------------------------------------------------------------- iptables

FILTER_CHAINS = ("KUBE-NODEPORTS", "KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES",
                 "KUBE-FIREWALL", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL")


def render_iptables(services, node: str, cluster_cidr: str, *, faults=frozenset(),
                    no_local: str = "drop", nodeport_addresses=()) -> str:
    """The iptables-restore input kube-proxy writes on ``node`` for ``services``."""
    del faults  # only the base-chain jumps change; see iptables_jumps()
    filt = {c: [] for c in FILTER_CHAINS}
    nat = {"KUBE-NODEPORTS": [], "KUBE-SERVICES": []}
    nat_other: dict[str, list[str]] = {"KUBE-MARK-MASQ": [], "KUBE-POSTROUTING": []}
    no_local_target = {"drop": "DROP", "reject": "REJECT"}[no_local]

    for svc in sorted(services, key=lambda s: s.port_name_string):
        spn, proto = svc.port_name_string, svc.protocol
        ready, local = _categorize(svc, node)
        has_endpoints = bool(ready)
        has_external = bool(local) if svc.local else has_endpoints
        svcc, extc, svlc = svc_chain(svc), ext_chain(svc), svl_chain(svc)
        externally = bool(svc.node_port or svc.external_ips or svc.lb_ips)

        if svc.health_check_node_port:
            filt["KUBE-NODEPORTS"].append(_line(
                "-A", "KUBE-NODEPORTS", "-m", "comment", "--comment", f"{spn} health check node port",
                "-m", "tcp", "-p", proto, "--dport", svc.health_check_node_port, "-j", "ACCEPT"))

        if has_endpoints:
            nat["KUBE-SERVICES"].append(_line(
                "-A", "KUBE-SERVICES", "-m", "comment", "--comment", f"{spn} cluster IP",
                "-m", proto, "-p", proto, "-d", svc.cluster_ip, "--dport", svc.port, "-j", svcc))
            for ip in svc.external_ips:
                nat["KUBE-SERVICES"].append(_line(
                    "-A", "KUBE-SERVICES", "-m", "comment", "--comment", f"{spn} external IP",
                    "-m", proto, "-p", proto, "-d", ip, "--dport", svc.port, "-j", extc))
            for ip in svc.lb_ips:
                nat["KUBE-SERVICES"].append(_line(
                    "-A", "KUBE-SERVICES", "-m", "comment", "--comment", f"{spn} loadbalancer IP",
                    "-m", proto, "-p", proto, "-d", ip, "--dport", svc.port, "-j", extc))
            if svc.node_port:
                nat["KUBE-NODEPORTS"].append(_line(
                    "-A", "KUBE-NODEPORTS", "-m", "comment", "--comment", spn,
                    "-m", proto, "-p", proto, "--dport", svc.node_port, "-j", extc))
        else:
            filt["KUBE-SERVICES"].append(_line(
                "-A", "KUBE-SERVICES", "-m", "comment", "--comment", f"{spn} has no endpoints",
                "-m", proto, "-p", proto, "-d", svc.cluster_ip, "--dport", svc.port, "-j", "REJECT"))

        if not has_external:
            comment = f"{spn} has no endpoints" if not has_endpoints else f"{spn} has no local endpoints"
            target = "REJECT" if not has_endpoints else no_local_target
            for ip in (*svc.external_ips, *svc.lb_ips):
                filt["KUBE-EXTERNAL-SERVICES"].append(_line(
                    "-A", "KUBE-EXTERNAL-SERVICES", "-m", "comment", "--comment", comment,
                    "-m", proto, "-p", proto, "-d", ip, "--dport", svc.port, "-j", target))
            if svc.node_port:
                filt["KUBE-EXTERNAL-SERVICES"].append(_line(
                    "-A", "KUBE-EXTERNAL-SERVICES", "-m", "comment", "--comment", comment,
                    "-m", "addrtype", "--dst-type", "LOCAL",
                    "-m", proto, "-p", proto, "--dport", svc.node_port, "-j", target))

        if not has_endpoints:
            continue

        # nat chains of a Service with endpoints
        if externally:
            ext = nat_other.setdefault(extc, [])
            if not svc.local:
                ext.append(_line("-A", extc, "-m", "comment", "--comment",
                                 f"masquerade traffic for {spn} external destinations", "-j", "KUBE-MARK-MASQ"))
                ext.append(_line("-A", extc, "-j", svcc))
            else:
                ext.append(_line("-A", extc, "-m", "comment", "--comment",
                                 f"pod traffic for {spn} external destinations", "-s", cluster_cidr, "-j", svcc))
                ext.append(_line("-A", extc, "-m", "comment", "--comment",
                                 f"masquerade LOCAL traffic for {spn} external destinations",
                                 "-m", "addrtype", "--src-type", "LOCAL", "-j", "KUBE-MARK-MASQ"))
                ext.append(_line("-A", extc, "-m", "comment", "--comment",
                                 f"route LOCAL traffic for {spn} external destinations",
                                 "-m", "addrtype", "--src-type", "LOCAL", "-j", svcc))
                if has_external:
                    ext.append(_line("-A", extc, "-j", svlc))

        svcl = nat_other.setdefault(svcc, [])
        svcl.append(_line("-A", svcc, "-m", "comment", "--comment", f"{spn} cluster IP",
                          "-m", proto, "-p", proto, "-d", svc.cluster_ip, "--dport", svc.port,
                          "!", "-s", cluster_cidr, "-j", "KUBE-MARK-MASQ"))
        _endpoint_jumps(svcl, svcc, svc, ready)
        if svc.local and local:
            _endpoint_jumps(nat_other.setdefault(svlc, []), svlc, svc, local)
        for ep in ready:
            sep = sep_chain(svc, ep)
            nat_other[sep] = [
                _line("-A", sep, "-m", "comment", "--comment", spn, "-s", ep.ip, "-j", "KUBE-MARK-MASQ"),
                _line("-A", sep, "-m", "comment", "--comment", spn, "-m", proto, "-p", proto,
                      "-j", "DNAT", "--to-destination", str(ep)),
            ]

    if nodeport_addresses:
        for addr in nodeport_addresses:
            nat["KUBE-SERVICES"].append(_line(
                "-A", "KUBE-SERVICES", "-m", "comment", "--comment",
                "kubernetes service nodeports; NOTE: this must be the last rule in this chain",
                "-d", addr, "-j", "KUBE-NODEPORTS"))
    else:
        nat["KUBE-SERVICES"].append(_line(
            "-A", "KUBE-SERVICES", "-m", "comment", "--comment",
            "kubernetes service nodeports; NOTE: this must be the last rule in this chain",
            "-m", "addrtype", "--dst-type", "LOCAL",
            # IPv6 NodePorts never answer on ::1 (TestEnableLocalhostNodePortsIPv6)
            *(("!", "-d", "::1/128") if ":" in cluster_cidr else ()), "-j", "KUBE-NODEPORTS"))

    if ":" not in cluster_cidr:   # route_localnet exists for IPv4 only
        filt["KUBE-FIREWALL"].append(_line(
            "-A", "KUBE-FIREWALL", "-m", "comment", "--comment", "block incoming localnet connections",
            "-d", "127.0.0.0/8", "!", "-s", "127.0.0.0/8",
            "-m", "conntrack", "!", "--ctstate", "RELATED,ESTABLISHED,DNAT", "-j", "DROP"))
    filt["KUBE-FORWARD"] += [
        _line("-A", "KUBE-FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"),
        _line("-A", "KUBE-FORWARD", "-m", "comment", "--comment", "kubernetes forwarding rules",
              "-m", "mark", "--mark", f"{MASQ_MARK}/{MASQ_MARK}", "-j", "ACCEPT"),
        _line("-A", "KUBE-FORWARD", "-m", "comment", "--comment", "kubernetes forwarding conntrack rule",
              "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"),
    ]
    nat_other["KUBE-MARK-MASQ"].append(_line("-A", "KUBE-MARK-MASQ", "-j", "MARK", "--or-mark", MASQ_MARK))
    nat_other["KUBE-POSTROUTING"] += [
        _line("-A", "KUBE-POSTROUTING", "-m", "mark", "!", "--mark", f"{MASQ_MARK}/{MASQ_MARK}", "-j", "RETURN"),
        _line("-A", "KUBE-POSTROUTING", "-j", "MARK", "--xor-mark", MASQ_MARK),
        _line("-A", "KUBE-POSTROUTING", "-m", "comment", "--comment",
              "kubernetes service traffic requiring SNAT", "-j", "MASQUERADE"),
    ]

    out = ["*filter"]
    out += [f":{c} - [0:0]" for c in FILTER_CHAINS]
    for c in FILTER_CHAINS:
        out += filt[c]
    out += ["COMMIT", "*nat"]
    nat_order = ["KUBE-NODEPORTS", "KUBE-SERVICES", *sorted(nat_other)]
    nat.update(nat_other)
    out += [f":{c} - [0:0]" for c in nat_order]
    for c in nat_order:
        out += nat[c]
    out.append("COMMIT")
    return "\n".join(out) + "\n"


def _endpoint_jumps(lines, chain, svc, eps):
    n = len(eps)
    for i, ep in enumerate(eps):
        args = ["-A", chain, "-m", "comment", "--comment", f"{svc.port_name_string} -> {ep}"]
        if i < n - 1:
            args += ["-m", "statistic", "--mode", "random", "--probability", _probability(n - i)]
        lines.append(_line(*args, "-j", sep_chain(svc, ep)))


# iptablesJumpChains + iptablesKubeletJumpChains (531be812), each EnsureRule(Prepend, ...).
_JUMPS = (
    ("filter", "INPUT", ("-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment",
                         "kubernetes externally-visible service portals", "-j", "KUBE-EXTERNAL-SERVICES")),
    ("filter", "FORWARD", ("-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment",
                           "kubernetes externally-visible service portals", "-j", "KUBE-EXTERNAL-SERVICES")),
    ("filter", "INPUT", ("-m", "comment", "--comment", "kubernetes health check service ports",
                         "-j", "KUBE-NODEPORTS")),
    ("filter", "FORWARD", ("-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment",
                           "kubernetes service portals", "-j", "KUBE-SERVICES")),
    ("filter", "OUTPUT", ("-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment",
                          "kubernetes service portals", "-j", "KUBE-SERVICES")),
    ("filter", "FORWARD", ("-m", "comment", "--comment", "kubernetes forwarding rules", "-j", "KUBE-FORWARD")),
    ("filter", "INPUT", ("-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment",
                         "kubernetes load balancer firewall", "-j", "KUBE-PROXY-FIREWALL")),
    ("filter", "OUTPUT", ("-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment",
                          "kubernetes load balancer firewall", "-j", "KUBE-PROXY-FIREWALL")),
    ("filter", "FORWARD", ("-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment",
                           "kubernetes load balancer firewall", "-j", "KUBE-PROXY-FIREWALL")),
    ("nat", "OUTPUT", ("-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES")),
    ("nat", "PREROUTING", ("-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES")),
    ("nat", "POSTROUTING", ("-m", "comment", "--comment", "kubernetes postrouting rules",
                            "-j", "KUBE-POSTROUTING")),
    ("filter", "INPUT", ("-j", "KUBE-FIREWALL")),
    ("filter", "OUTPUT", ("-j", "KUBE-FIREWALL")),
)


def iptables_jumps(binary: str = "iptables", *, faults=frozenset()) -> list[list[str]]:
    """argv lists that add kube-proxy's base-chain jumps, in kube-proxy's order."""
    out = []
    for table, chain, args in _JUMPS:
        if "no-masquerade-jump" in faults and (table, chain) == ("nat", "POSTROUTING"):
            continue
        out.append([binary, "-w", "-t", table, "-I", chain, *args])
    return out


# ----------------------------------------------------------------------------- nftables

def _nft_family(cidr: str) -> tuple[str, str, str]:
    """(table, address match, set type) of kube-proxy's table for the family of ``cidr``."""
    return ("ip6 kube-proxy", "ip6", "ipv6_addr") if ":" in cidr else ("ip kube-proxy", "ip", "ipv4_addr")


def _nft_base(cluster_cidr: str, service_cidr: str, nodeport_ips, faults) -> tuple[list[str], list[str]]:
    T, ip, addr_t = _nft_family(cluster_cidr)
    decl = [
        f'add table {T} {{ comment "rules for kube-proxy" ; }}',
        f'add set {T} cluster-ips {{ type {addr_t} ; comment "Active ClusterIPs" ; }}',
        f'add set {T} nodeport-ips {{ type {addr_t} ; comment "IPs that accept NodePort traffic" ; }}',
        f'add map {T} firewall-ips {{ type {addr_t} . inet_proto . inet_service : verdict ; '
        f'comment "destinations that are subject to LoadBalancerSourceRanges" ; }}',
        f'add map {T} no-endpoint-nodeports {{ type inet_proto . inet_service : verdict ; '
        f'comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }}',
        f'add map {T} no-endpoint-services {{ type {addr_t} . inet_proto . inet_service : verdict ; '
        f'comment "vmap to drop or reject packets to services with no endpoints" ; }}',
        f'add map {T} service-ips {{ type {addr_t} . inet_proto . inet_service : verdict ; '
        f'comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }}',
        f'add map {T} service-nodeports {{ type inet_proto . inet_service : verdict ; comment "NodePort traffic" ; }}',
        f"add chain {T} cluster-ips-check",
        f"add chain {T} filter-prerouting-pre-dnat {{ type filter hook prerouting priority -110 ; }}",
        f"add chain {T} filter-output-pre-dnat {{ type filter hook output priority -110 ; }}",
        f"add chain {T} filter-forward {{ type filter hook forward priority 0 ; }}",
        f"add chain {T} filter-input {{ type filter hook input priority 0 ; }}",
        f"add chain {T} filter-output {{ type filter hook output priority 0 ; }}",
        f"add chain {T} firewall-check",
        f"add chain {T} mark-for-masquerade",
        f"add chain {T} masquerading",
        f"add chain {T} nat-output {{ type nat hook output priority -100 ; }}",
        f"add chain {T} nat-postrouting {{ type nat hook postrouting priority 100 ; }}",
        f"add chain {T} nat-prerouting {{ type nat hook prerouting priority -100 ; }}",
        f"add chain {T} nodeport-endpoints-check",
        f'add chain {T} reject-chain {{ comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }}',
        f"add chain {T} services",
        f"add chain {T} service-endpoints-check",
    ]
    rules = [
        f'add rule {T} cluster-ips-check {ip} daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"',
        f'add rule {T} cluster-ips-check {ip} daddr {{ {service_cidr} }} drop comment "Drop traffic to unallocated ClusterIPs"',
        f"add rule {T} filter-prerouting-pre-dnat ct state new jump firewall-check",
        f"add rule {T} filter-forward ct state new jump service-endpoints-check",
        f"add rule {T} filter-forward ct state new jump cluster-ips-check",
        f"add rule {T} filter-input ct state new jump nodeport-endpoints-check",
        f"add rule {T} filter-input ct state new jump service-endpoints-check",
        f"add rule {T} filter-output ct state new jump service-endpoints-check",
        f"add rule {T} filter-output-pre-dnat ct state new jump firewall-check",
        f"add rule {T} filter-output ct state new jump cluster-ips-check",
        f"add rule {T} firewall-check {ip} daddr . meta l4proto . th dport vmap @firewall-ips",
        f"add rule {T} mark-for-masquerade mark set mark or {MASQ_MARK}",
        f"add rule {T} masquerading mark and {MASQ_MARK} == 0 return",
        f"add rule {T} masquerading mark set mark xor {MASQ_MARK}",
        f"add rule {T} masquerading masquerade fully-random",
        f"add rule {T} nat-output jump services",
        *([] if "no-masquerade-jump" in faults else [f"add rule {T} nat-postrouting jump masquerading"]),
        f"add rule {T} nat-prerouting jump services",
        f"add rule {T} nodeport-endpoints-check {ip} daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports",
        f"add rule {T} reject-chain reject",
        f"add rule {T} services {ip} daddr . meta l4proto . th dport vmap @service-ips",
        f"add rule {T} services {ip} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
    ]
    if nodeport_ips:
        rules.append(f"add element {T} nodeport-ips {{ {', '.join(nodeport_ips)} }}")
    rules.append(f"add rule {T} service-endpoints-check {ip} daddr . meta l4proto . th dport vmap @no-endpoint-services")
    return decl, rules


def render_nft(services, node: str, cluster_cidr: str, *, service_cidr: str, nodeport_ips=(),
               faults=frozenset(), no_local: str = "drop") -> str:
    """The nft transaction kube-proxy (nftables mode) writes on ``node``, loadable with ``nft -f``."""
    T, ip, _ = _nft_family(cluster_cidr)
    decl, rules = _nft_base(cluster_cidr, service_cidr, nodeport_ips, faults)
    no_local_verdict = {"drop": "drop", "reject": "goto reject-chain"}[no_local]
    for svc in sorted(services, key=lambda s: s.port_name_string):
        spn, proto = svc.port_name_string, svc.protocol
        ready, local = _categorize(svc, node)
        has_endpoints = bool(ready)
        has_external = bool(local) if svc.local else has_endpoints
        base = nft_chain_base(svc)
        cluster_chain, local_chain, ext = f"service-{base}", f"local-{base}", f"external-{base}"
        externally = bool(svc.node_port or svc.external_ips or svc.lb_ips)
        ext_verdict = "goto reject-chain" if not has_endpoints else no_local_verdict
        decl.append(f"# {spn}")
        if has_endpoints:
            decl.append(f"add chain {T} {cluster_chain}")
            rules.append(f"add rule {T} {cluster_chain} {ip} daddr {svc.cluster_ip} {ip} saddr != {cluster_cidr} "
                         f"jump mark-for-masquerade")
            rules.append(f"add rule {T} {cluster_chain} {_numgen(svc, ready)}")
            if svc.local and local:
                decl.append(f"add chain {T} {local_chain}")
                rules.append(f"add rule {T} {local_chain} {_numgen(svc, local)}")
            if externally:
                decl.append(f"add chain {T} {ext}")
                if not svc.local:
                    rules.append(f"add rule {T} {ext} jump mark-for-masquerade")
                    rules.append(f"add rule {T} {ext} goto {cluster_chain}")
                else:
                    rules.append(f'add rule {T} {ext} {ip} saddr {cluster_cidr} goto {cluster_chain} '
                                 f'comment "short-circuit pod traffic"')
                    rules.append(f'add rule {T} {ext} fib saddr type local jump mark-for-masquerade '
                                 f'comment "masquerade local traffic"')
                    rules.append(f'add rule {T} {ext} fib saddr type local goto {cluster_chain} '
                                 f'comment "short-circuit local traffic"')
                    if local:
                        rules.append(f"add rule {T} {ext} goto {local_chain}")
            for ep in ready:
                epc = nft_endpoint_chain(svc, ep)
                decl.append(f"add chain {T} {epc}")
                rules.append(f"add rule {T} {epc} {ip} saddr {ep.ip} jump mark-for-masquerade")
                rules.append(f"add rule {T} {epc} meta l4proto {proto} dnat to {ep}")
        rules.append(f"add element {T} cluster-ips {{ {svc.cluster_ip} }}")
        if has_endpoints:
            rules.append(f"add element {T} service-ips {{ {svc.cluster_ip} . {proto} . {svc.port} : goto {cluster_chain} }}")
            for a in (*svc.external_ips, *svc.lb_ips):
                rules.append(f"add element {T} service-ips {{ {a} . {proto} . {svc.port} : goto {ext} }}")
            if svc.node_port:
                rules.append(f"add element {T} service-nodeports {{ {proto} . {svc.node_port} : goto {ext} }}")
        else:
            rules.append(f'add element {T} no-endpoint-services {{ {svc.cluster_ip} . {proto} . {svc.port} '
                         f'comment "{spn}" : goto reject-chain }}')
        if not has_external:
            if svc.node_port:
                rules.append(f'add element {T} no-endpoint-nodeports {{ {proto} . {svc.node_port} '
                             f'comment "{spn}" : {ext_verdict} }}')
            for a in (*svc.lb_ips, *svc.external_ips):
                rules.append(f'add element {T} no-endpoint-services {{ {a} . {proto} . {svc.port} '
                             f'comment "{spn}" : {ext_verdict} }}')
    return "\n".join(decl + rules) + "\n"


def _numgen(svc, eps) -> str:
    arms = " , ".join(f"{i} : goto {nft_endpoint_chain(svc, ep)}" for i, ep in enumerate(eps))
    return f"numgen random mod {len(eps)} vmap {{ {arms} }}"
