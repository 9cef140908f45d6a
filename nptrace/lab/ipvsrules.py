"""Render the state kube-proxy's IPVS mode keeps on a node, from Service data.

Follows kubernetes/kubernetes pkg/proxy/ipvs/proxier.go (syncProxyRules, syncEndpoint,
writeIptablesRules, iptablesJumpChain, ipsetInfo, ipsetWithIptablesChain), IPv4:
  * the dummy device ``kube-ipvs0`` holds every ClusterIP (and ExternalIP / LB IP), so the
    kernel delivers their packets locally, where IPVS's LOCAL_IN hook takes them;
  * one virtual server per ClusterIP:port and per NodePort on each node address (scheduler
    rr, masquerading forward, weight 1), loaded with ``ipvsadm-restore``; its real servers are
    the ready endpoints. eTP=Local NodePorts get only the node's local endpoints, and when
    there are none the cluster's (kubernetes#97081: node-local pods may still use the port;
    an outside client's traffic is forwarded without SNAT and its reply bypasses the node);
  * the ipsets the iptables rules match (``ipset -exist restore``: create, flush, add, so the
    same text is kube-proxy's first and next sync);
  * the iptables rules IPVS mode writes: masquerade marks (KUBE-MARK-MASQ 0x4000 for
    NodePort and off-cluster ClusterIP traffic, none for eTP=Local NodePorts), KUBE-POSTROUTING
    MASQUERADE, the health-check ACCEPT and the KUBE-IPVS-FILTER that rejects other ports of
    a VIP;
  * kube-proxy's IPVS sysctls: net.ipv4.vs.conntrack=1 (IPVS connections get conntrack
    entries, needed for the MASQUERADE), expire_nodest_conn=1 and expire_quiescent_template=1.

Lab-only fault switch: faults={"no-masquerade-jump"} leaves out nat POSTROUTING ->
KUBE-POSTROUTING, as kuberules.py does for the other modes.

``sync_commands`` gives the ipvsadm commands of kube-proxy's next sync after a Service
change (real servers added or deleted, virtual servers added or deleted): the connection
entries of a deleted real server stay, as they do under kube-proxy.
"""
from __future__ import annotations

from .kuberules import MASQ_MARK, Service, restore_line as _line

DUMMY = "kube-ipvs0"
SCHEDULER = "rr"
# proxier.go NewProxier: the sysctls kube-proxy sets in IPVS mode
SYSCTLS = {"net.ipv4.vs.conntrack": 1, "net.ipv4.vs.expire_nodest_conn": 1,
           "net.ipv4.vs.expire_quiescent_template": 1}

# ipsetInfo: (name, type, comment), the TCP/IPv4 ones
IPSETS = (
    ("KUBE-LOOP-BACK", "hash:ip,port,ip", "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose"),
    ("KUBE-CLUSTER-IP", "hash:ip,port", "Kubernetes service cluster ip + port for masquerade purpose"),
    ("KUBE-EXTERNAL-IP", "hash:ip,port", "Kubernetes service external ip + port for masquerade and filter purpose"),
    ("KUBE-EXTERNAL-IP-LOCAL", "hash:ip,port", "Kubernetes service external ip + port with externalTrafficPolicy=local"),
    ("KUBE-LOAD-BALANCER", "hash:ip,port", "Kubernetes service lb portal"),
    ("KUBE-LOAD-BALANCER-LOCAL", "hash:ip,port", "Kubernetes service load balancer ip + port with externalTrafficPolicy=local"),
    ("KUBE-NODE-PORT-TCP", "bitmap:port", "Kubernetes nodeport TCP port for masquerade purpose"),
    ("KUBE-NODE-PORT-LOCAL-TCP", "bitmap:port", "Kubernetes nodeport TCP port with externalTrafficPolicy=local"),
    ("KUBE-HEALTH-CHECK-NODE-PORT", "bitmap:port", "Kubernetes health check node port"),
    ("KUBE-IPVS-IPS", "hash:ip", "IPVS service addresses"),
)
_COMMENT = {n: c for n, _, c in IPSETS}


def _ready(svc: Service):
    return [e for e in svc.endpoints if e.ready]


def _vip(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def virtual_servers(services, node: str, node_ips) -> dict[tuple[str, str], tuple[str, ...]]:
    """{(proto, "vip:port"): ("ep:port", ...)}: each virtual server and its real servers."""
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for svc in sorted(services, key=lambda s: s.port_name_string):
        proto = svc.protocol.upper()
        ready = _ready(svc)
        cluster = tuple(sorted(str(e) for e in ready))
        out[(proto, _vip(svc.cluster_ip, svc.port))] = cluster
        local = tuple(sorted(str(e) for e in ready if e.node == node))
        # syncEndpoint(onlyNodeLocalEndpoints): the local ones, else the cluster's
        external = (local or cluster) if svc.local else cluster
        for a in (*svc.external_ips, *svc.lb_ips):
            out[(proto, _vip(a, svc.port))] = external
        if svc.node_port:
            for ip in node_ips:
                out[(proto, _vip(ip, svc.node_port))] = external
    return out


def bound_addresses(services) -> list[str]:
    """The addresses kube-proxy binds to kube-ipvs0."""
    seen = {}
    for svc in services:
        for a in (svc.cluster_ip, *svc.external_ips, *svc.lb_ips):
            seen.setdefault(a, None)
    return list(seen)


def render_ipvsadm(services, node: str, node_ips) -> str:
    """``ipvsadm-restore`` input: each virtual server, then its real servers."""
    lines = []
    for (proto, vs), rss in virtual_servers(services, node, node_ips).items():
        flag = "-t" if proto == "TCP" else "-u"
        lines.append(f"-A {flag} {vs} -s {SCHEDULER}")
        lines += [f"-a {flag} {vs} -r {rs} -m -w 1" for rs in rss]
    return "\n".join(lines) + "\n"


def render_ipset(services, node: str) -> str:
    """``ipset -exist restore`` input: every kube-proxy set, flushed and filled."""
    entries: dict[str, list[str]] = {n: [] for n, _, _ in IPSETS}
    for svc in sorted(services, key=lambda s: s.port_name_string):
        p = svc.protocol
        entries["KUBE-CLUSTER-IP"].append(f"{svc.cluster_ip},{p}:{svc.port}")
        for a in svc.external_ips:
            entries["KUBE-EXTERNAL-IP-LOCAL" if svc.local else "KUBE-EXTERNAL-IP"].append(f"{a},{p}:{svc.port}")
        for a in svc.lb_ips:
            entries["KUBE-LOAD-BALANCER"].append(f"{a},{p}:{svc.port}")
            if svc.local:
                entries["KUBE-LOAD-BALANCER-LOCAL"].append(f"{a},{p}:{svc.port}")
        if svc.node_port and p == "tcp":
            entries["KUBE-NODE-PORT-TCP"].append(str(svc.node_port))
            if svc.local:
                entries["KUBE-NODE-PORT-LOCAL-TCP"].append(str(svc.node_port))
        if svc.health_check_node_port:
            entries["KUBE-HEALTH-CHECK-NODE-PORT"].append(str(svc.health_check_node_port))
        # endpoints on this node: a pod reaching itself through its Service is masqueraded
        for e in _ready(svc):
            if e.node == node:
                entries["KUBE-LOOP-BACK"].append(f"{e.ip},{p}:{e.port},{e.ip}")
    for a in bound_addresses(services):
        entries["KUBE-IPVS-IPS"].append(a)
    out = []
    for name, typ, comment in IPSETS:
        opts = "range 0-65535" if typ.startswith("bitmap") else "family inet hashsize 1024 maxelem 65536"
        out.append(f"create {name} {typ} {opts}")
        out.append(f"flush {name}")
        out += [f"add {name} {e}" for e in dict.fromkeys(entries[name])]
    return "\n".join(out) + "\n"


NAT_CHAINS = ("KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER", "KUBE-MARK-MASQ")
FILTER_CHAINS = ("KUBE-FORWARD", "KUBE-NODE-PORT", "KUBE-PROXY-FIREWALL", "KUBE-SOURCE-RANGES-FIREWALL",
                 "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER")


def render_iptables(services, cluster_cidr: str) -> str:
    """The iptables-restore input of IPVS mode (writeIptablesRules), for ``--noflush``."""
    svcs = list(services)
    has = {
        "KUBE-LOOP-BACK": any(_ready(s) for s in svcs),
        "KUBE-LOAD-BALANCER": any(s.lb_ips for s in svcs),
        "KUBE-LOAD-BALANCER-LOCAL": any(s.lb_ips and s.local for s in svcs),
        "KUBE-NODE-PORT-LOCAL-TCP": any(s.node_port and s.local for s in svcs),
        "KUBE-NODE-PORT-TCP": any(s.node_port for s in svcs),
        "KUBE-CLUSTER-IP": bool(svcs),
        "KUBE-EXTERNAL-IP": any(s.external_ips and not s.local for s in svcs),
    }
    c = _COMMENT
    nat, filt = [], []
    nat.append(_line("-A", "KUBE-SERVICES", "-s", "127.0.0.0/8", "-j", "RETURN"))
    # ipsetWithIptablesChain, in its order (the -LOCAL sets before the others)
    for name, chain, target, match, proto in (
            ("KUBE-LOOP-BACK", "KUBE-POSTROUTING", "MASQUERADE", "dst,dst,src", ""),
            ("KUBE-LOAD-BALANCER", "KUBE-SERVICES", "KUBE-LOAD-BALANCER", "dst,dst", ""),
            ("KUBE-LOAD-BALANCER-LOCAL", "KUBE-LOAD-BALANCER", "RETURN", "dst,dst", ""),
            ("KUBE-NODE-PORT-LOCAL-TCP", "KUBE-NODE-PORT", "RETURN", "dst", "tcp"),
            ("KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst", "tcp")):
        if has[name]:
            nat.append(_line("-A", chain, *(("-p", proto) if proto else ()), "-m", "comment", "--comment",
                             c[name], "-m", "set", "--match-set", name, match, "-j", target))
    if has["KUBE-CLUSTER-IP"]:
        # off-cluster traffic to a ClusterIP is masqueraded (localDetector.IfNotLocal)
        nat.append(_line("-A", "KUBE-SERVICES", "-m", "comment", "--comment", c["KUBE-CLUSTER-IP"],
                         "-m", "set", "--match-set", "KUBE-CLUSTER-IP", "dst,dst", "!", "-s", cluster_cidr,
                         "-j", "KUBE-MARK-MASQ"))
    if has["KUBE-EXTERNAL-IP"]:
        nat.append(_line("-A", "KUBE-SERVICES", "-m", "comment", "--comment", c["KUBE-EXTERNAL-IP"],
                         "-m", "set", "--match-set", "KUBE-EXTERNAL-IP", "dst,dst", "-j", "KUBE-MARK-MASQ"))
    nat.append(_line("-A", "KUBE-SERVICES", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "KUBE-NODE-PORT"))
    nat.append(_line("-A", "KUBE-LOAD-BALANCER", "-j", "KUBE-MARK-MASQ"))
    filt.append(_line("-A", "KUBE-SOURCE-RANGES-FIREWALL", "-j", "DROP"))
    for name in ("KUBE-CLUSTER-IP", "KUBE-LOAD-BALANCER"):   # acceptIPVSTraffic
        if has[name]:
            nat.append(_line("-A", "KUBE-SERVICES", "-m", "set", "--match-set", name, "dst,dst", "-j", "ACCEPT"))
    filt += [
        _line("-A", "KUBE-FORWARD", "-m", "comment", "--comment", "kubernetes forwarding rules",
              "-m", "mark", "--mark", f"{MASQ_MARK}/{MASQ_MARK}", "-j", "ACCEPT"),
        _line("-A", "KUBE-FORWARD", "-m", "comment", "--comment", "kubernetes forwarding conntrack rule",
              "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"),
        _line("-A", "KUBE-NODE-PORT", "-m", "comment", "--comment", c["KUBE-HEALTH-CHECK-NODE-PORT"],
              "-m", "set", "--match-set", "KUBE-HEALTH-CHECK-NODE-PORT", "dst", "-j", "ACCEPT"),
    ]
    for name, match in (("KUBE-LOAD-BALANCER", "dst,dst"), ("KUBE-CLUSTER-IP", "dst,dst"),
                        ("KUBE-EXTERNAL-IP", "dst,dst"), ("KUBE-EXTERNAL-IP-LOCAL", "dst,dst"),
                        ("KUBE-HEALTH-CHECK-NODE-PORT", "dst")):
        filt.append(_line("-A", "KUBE-IPVS-FILTER", "-m", "set", "--match-set", name, match, "-j", "RETURN"))
    filt.append(_line("-A", "KUBE-IPVS-FILTER", "-m", "conntrack", "--ctstate", "NEW",
                      "-m", "set", "--match-set", "KUBE-IPVS-IPS", "dst", "-j", "REJECT"))
    nat += [
        _line("-A", "KUBE-POSTROUTING", "-m", "mark", "!", "--mark", f"{MASQ_MARK}/{MASQ_MARK}", "-j", "RETURN"),
        _line("-A", "KUBE-POSTROUTING", "-j", "MARK", "--xor-mark", MASQ_MARK),
        _line("-A", "KUBE-POSTROUTING", "-m", "comment", "--comment", "kubernetes service traffic requiring SNAT",
              "-j", "MASQUERADE"),
        _line("-A", "KUBE-MARK-MASQ", "-j", "MARK", "--or-mark", MASQ_MARK),
    ]
    out = ["*nat", *(f":{ch} - [0:0]" for ch in NAT_CHAINS), *nat, "COMMIT",
           "*filter", *(f":{ch} - [0:0]" for ch in FILTER_CHAINS), *filt, "COMMIT"]
    return "\n".join(out) + "\n"


# iptablesJumpChain, each EnsureRule(Prepend, ...)
_JUMPS = (
    ("nat", "OUTPUT", "KUBE-SERVICES", "kubernetes service portals"),
    ("nat", "PREROUTING", "KUBE-SERVICES", "kubernetes service portals"),
    ("nat", "POSTROUTING", "KUBE-POSTROUTING", "kubernetes postrouting rules"),
    ("filter", "FORWARD", "KUBE-FORWARD", "kubernetes forwarding rules"),
    ("filter", "INPUT", "KUBE-NODE-PORT", "kubernetes health check rules"),
    ("filter", "INPUT", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules"),
    ("filter", "FORWARD", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules"),
    ("filter", "INPUT", "KUBE-IPVS-FILTER", "kubernetes ipvs access filter"),
    ("filter", "OUTPUT", "KUBE-IPVS-OUT-FILTER", "kubernetes ipvs access filter"),
)


def iptables_jumps(binary: str = "iptables", *, faults=frozenset()) -> list[list[str]]:
    out = []
    for table, chain, to, comment in _JUMPS:
        if "no-masquerade-jump" in faults and (table, chain) == ("nat", "POSTROUTING"):
            continue
        out.append([binary, "-w", "-t", table, "-I", chain, "-m", "comment", "--comment", comment, "-j", to])
    return out


def service_names(services, node: str, node_ips) -> str:
    """The virtual server -> Service port name table (services.ipvs.parse_names reads it):
    what kube-proxy knows and the kernel does not, one ``PROTO vip:port ns/name:port`` a line."""
    lines = []
    for svc in sorted(services, key=lambda s: s.port_name_string):
        proto = svc.protocol.upper()
        vss = [_vip(svc.cluster_ip, svc.port), *(_vip(a, svc.port) for a in (*svc.external_ips, *svc.lb_ips))]
        if svc.node_port:
            vss += [_vip(ip, svc.node_port) for ip in node_ips]
        kinds = ["clusterip"] + ["externalip"] * len(svc.external_ips) + ["loadbalancer"] * len(svc.lb_ips) \
            + ["nodeport"] * (len(vss) - 1 - len(svc.external_ips) - len(svc.lb_ips))
        flags = ",".join(f for f, on in (("local", svc.local),) if on)
        lines += [f"{proto} {vs} {svc.port_name_string} {kind}{(' ' + flags) if flags else ''}"
                  for vs, kind in zip(vss, kinds)]
    return "\n".join(lines) + "\n"


def sync_commands(before, after, node: str, node_ips) -> list[list[str]]:
    """ipvsadm argv lists that take the node's virtual servers from ``before`` to ``after``
    (lists of Service): new virtual servers and real servers added, gone ones deleted."""
    old = virtual_servers(before, node, node_ips)
    new = virtual_servers(after, node, node_ips)
    out = []
    for (proto, vs), rss in new.items():
        flag = "-t" if proto == "TCP" else "-u"
        if (proto, vs) not in old:
            out.append(["ipvsadm", "-A", flag, vs, "-s", SCHEDULER])
        have = set(old.get((proto, vs), ()))
        out += [["ipvsadm", "-a", flag, vs, "-r", rs, "-m", "-w", "1"] for rs in rss if rs not in have]
        out += [["ipvsadm", "-d", flag, vs, "-r", rs] for rs in sorted(have - set(rss))]
    for (proto, vs) in old:
        if (proto, vs) not in new:
            out.append(["ipvsadm", "-D", "-t" if proto == "TCP" else "-u", vs])
    return out
