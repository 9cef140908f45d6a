"""kube-proxy's IPVS mode, read from the node's own state: the virtual servers and their real
servers (``/proc/net/ip_vs`` or ``ipvsadm -Ln``), kube-proxy's ipsets (``ipset save``), the
IPVS sysctls, and the virtual server -> Service names.

The kernel's IPVS table names no Service: a virtual server is an address, port and protocol.
The names come from a table beside it (:func:`parse_names`, one ``PROTO vip:port ns/name:port
KIND [local]`` a line: what kube-proxy was given by the API), read from :func:`names_path`;
the lab writes it for its nodes. Without it the virtual servers still answer nf_cause, with no
Service named.

What IPVS itself does to a packet, and what nf_cause answers for it (kernel
net/netfilter/ipvs/ip_vs_core.c, ip_vs_in_hook at LOCAL_IN):
  * a SYN to a virtual server with no real server: ip_vs_leave() sends ICMP port unreachable
    and returns NF_DROP (tag ``no_endpoints``; ``no_local_endpoint`` for an eTP=Local
    NodePort, whose virtual server kube-proxy fills with the node's local endpoints only);
  * a packet of a connection whose real server was deleted (not just weight 0, which keeps it
    available): with net.ipv4.vs.expire_nodest_conn=0 it is dropped silently (NF_DROP) for as
    long as the connection entry lives; with 1 the entry is expired at that packet (tag
    ``ipvs_nodest``);
  * net.ipv4.vs.conn_reuse_mode decides whether a new SYN from a client port of an old entry
    is scheduled afresh or reuses the entry (and its real server).

Pure: text in, ServiceMap out; nptrace/node/rules_source.py reads the texts.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .build import Builder
from .facts import Scope
from .model import AddrSet, canon, fmt_ep, split_hostport

NAMES_DIR = Path("/run/nptrace/ipvs")
LOCAL_NODEPORT_SETS = {"tcp": "KUBE-NODE-PORT-LOCAL-TCP", "udp": "KUBE-NODE-PORT-LOCAL-UDP"}


def names_path(netns: str | None, base: Path = NAMES_DIR) -> Path:
    """Where the virtual server names of a namespace (None: the host's own) are read from."""
    return base / f"{netns or 'host'}.services"


@dataclass(frozen=True)
class RealServer:
    addr: str
    port: int
    forward: str = "Masq"
    weight: int = 1
    active: int = 0
    inactive: int = 0

    def __str__(self) -> str:
        return fmt_ep(self.addr, self.port)


@dataclass(frozen=True)
class VirtualServer:
    proto: str          # tcp / udp / sctp
    addr: str
    port: int
    scheduler: str = "rr"
    reals: tuple[RealServer, ...] = ()

    def __str__(self) -> str:
        return f"{self.proto.upper()} {fmt_ep(self.addr, self.port)}"

    def live_reals(self) -> tuple[RealServer, ...]:
        """Real servers new connections may go to (weight 0: draining, kept for the old ones)."""
        return tuple(r for r in self.reals if r.weight > 0)


def _hexaddr(text: str) -> str | None:
    """/proc's host-order hex address (``C0A80A0B``, 32 hex digits for IPv6) as text."""
    try:
        if len(text) == 8:
            return socket.inet_ntoa(struct.pack(">I", int(text, 16)))
        if len(text) == 32:
            return str(ipaddress.IPv6Address(bytes.fromhex(text)))
    except ValueError:
        return None
    return None


def _endpoint(text: str) -> tuple[str, int] | None:
    """``C0A80A0B:7590`` (/proc), ``192.168.10.11:30080`` or ``[fd00::1]:80`` (ipvsadm -Ln)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        return None
    if not host.startswith("[") and all(c in "0123456789ABCDEFabcdef" for c in host) and len(host) in (8, 32):
        a = _hexaddr(host)
        try:
            return (a, int(port, 16)) if a else None
        except ValueError:
            return None
    return split_hostport(text)


def parse_ipvs(text: str) -> list[VirtualServer]:
    """Virtual servers of ``/proc/net/ip_vs`` or ``ipvsadm -Ln`` (``-Ln --stats`` not)."""
    out: list[VirtualServer] = []
    cur: dict | None = None

    def close():
        if cur is not None:
            out.append(VirtualServer(cur["proto"], cur["addr"], cur["port"], cur["sched"], tuple(cur["reals"])))

    for line in text.splitlines():
        f = line.split()
        if not f:
            continue
        if f[0] in ("TCP", "UDP", "SCTP") and len(f) >= 2:
            ep = _endpoint(f[1])
            close()
            cur = None
            if ep:
                cur = {"proto": f[0].lower(), "addr": ep[0], "port": ep[1],
                       "sched": f[2] if len(f) > 2 else "", "reals": []}
        elif f[0] == "->" and cur is not None and len(f) >= 3 and f[1] != "RemoteAddress:Port":
            ep = _endpoint(f[1])
            if ep is None:
                continue
            nums = [int(x) for x in f[3:6] if x.isdigit()]
            weight, active, inactive = (nums + [1, 0, 0][len(nums):])[:3]
            cur["reals"].append(RealServer(ep[0], ep[1], f[2], weight, active, inactive))
    close()
    return out


def parse_ipset_save(text: str) -> dict[str, list[str]]:
    """{set name: [entries]} of ``ipset save`` / ``ipset list`` text (members only)."""
    sets: dict[str, list[str]] = {}
    cur, members = None, False
    for line in text.splitlines():
        f = line.split()
        if not f:
            members = False
            continue
        if f[0] == "create" and len(f) > 1:
            sets.setdefault(f[1], [])
        elif f[0] == "add" and len(f) > 2:
            sets.setdefault(f[1], []).append(f[2])
        elif f[0] == "Name:" and len(f) > 1:     # ipset list: a header, then "Members:"
            cur, members = sets.setdefault(f[1], []), False
        elif f[0] == "Members:":
            members = True
        elif members and cur is not None:
            cur.append(f[0])
    return sets


@dataclass(frozen=True)
class Name:
    service: str          # ns/name:port
    kind: str             # clusterip nodeport externalip loadbalancer
    local: bool = False   # externalTrafficPolicy: Local


def parse_names(text: str) -> dict[tuple[str, str, int], Name]:
    """{(proto, addr, port): Name} of the names table (see the module text)."""
    out = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) < 3 or f[0].startswith("#"):
            continue
        ep = ("*", int(f[1][2:])) if f[1].startswith("*:") and f[1][2:].isascii() and f[1][2:].isdigit() \
            else _endpoint(f[1])
        if ep is None:
            continue
        kind = f[3] if len(f) > 3 else "clusterip"
        out[(f[0].lower(), ep[0], ep[1])] = Name(f[2], kind, "local" in f[4:])
    return out


@dataclass
class IpvsState:
    """One namespace's IPVS state, as the classifier's queries want it."""
    servers: dict[tuple[str, str, int], VirtualServer] = field(default_factory=dict)
    names: dict[tuple[str, str, int], Name] = field(default_factory=dict)
    sets: dict[str, list[str]] = field(default_factory=dict)
    sysctl: dict[str, int] = field(default_factory=dict)   # expire_nodest_conn, conn_reuse_mode, ...
    names_from: str = ""       # "table" (beside the namespace), "api" (the Kubernetes API), ""

    def server(self, addr: str, port: int, proto: str = "tcp") -> VirtualServer | None:
        a = canon(addr) if addr else None
        return self.servers.get((proto, a, int(port))) if a else None

    def name_of(self, vs: VirtualServer) -> Name | None:
        """The virtual server's Service; a NodePort named for every address (``*:PORT``, as
        the API gives it) answers for each of the node's."""
        return self.names.get((vs.proto, vs.addr, vs.port)) or self.names.get((vs.proto, "*", vs.port))

    def etp_local(self, vs: VirtualServer) -> bool:
        """An eTP=Local NodePort: the names table says so, or kube-proxy's -LOCAL port set."""
        n = self.name_of(vs)
        if n is not None and n.kind == "nodeport":
            return n.local
        return str(vs.port) in self.sets.get(LOCAL_NODEPORT_SETS.get(vs.proto, ""), ())

    def local_reals(self, vs: VirtualServer) -> list[RealServer]:
        """Real servers on this node: kube-proxy puts each local endpoint in KUBE-LOOP-BACK
        (ip,proto:port,ip) for hairpin masquerade."""
        loop = set(self.sets.get("KUBE-LOOP-BACK", ()))
        return [r for r in vs.reals if f"{r.addr},{vs.proto}:{r.port},{r.addr}" in loop]


def state_of(ipvs_text: str, *, names_text: str = "", ipset_text: str = "",
             sysctl: dict | None = None, names_from: str = "") -> IpvsState:
    servers = {(v.proto, v.addr, v.port): v for v in parse_ipvs(ipvs_text)}
    return IpvsState(servers, parse_names(names_text), parse_ipset_save(ipset_text), dict(sysctl or {}),
                     names_from if names_text else "")


def build_map(state: IpvsState):
    """A ServiceMap of the named virtual servers (lookups name the Service of a VIP, a
    NodePort or a real server) that carries ``state`` for nf_cause."""
    b = Builder("ipvs")
    scopes: dict[str, list[str]] = {}
    for key, vs in state.servers.items():
        n = state.name_of(vs)
        if n is None:
            continue
        inf = b.info(n.service, vs.proto)
        if n.kind == "nodeport":
            inf.node_port = vs.port
            scopes.setdefault(n.service, []).append(vs.addr)
            inf.etp_local = inf.etp_local or state.etp_local(vs)
        elif n.kind == "loadbalancer":
            inf.lb[(vs.addr, vs.port)] = None
        elif n.kind == "externalip":
            inf.external[(vs.addr, vs.port)] = None
        else:
            inf.cluster[(vs.addr, vs.port)] = None
            inf.no_endpoints = not vs.reals
        for r in vs.reals:
            inf.endpoints[(r.addr, r.port)] = None
        for r in state.local_reals(vs):
            inf.local_eps[(r.addr, r.port)] = None
    for name, addrs in scopes.items():
        b.infos[name].np_scope = Scope(any_local=False, addrs=AddrSet(addrs, ",".join(addrs)))
    b.ipvs.append(state)
    return b.finish()


def without_local(state: IpvsState, addr: str, port: int, proto: str = "tcp") -> list[str]:
    """The eTP=Local virtual servers of ``state`` that send to the real server addr:port
    although none of their real servers is local (kube-proxy's fallback to the cluster's
    endpoints, unmasqueraded), as ``TCP vip:port`` texts."""
    a = canon(addr) if addr else None
    return [str(vs) for vs in state.servers.values()
            if vs.proto == proto and state.etp_local(vs) and not state.local_reals(vs)
            and any(r.addr == a and r.port == int(port) for r in vs.reals)]


def ipvs_cause(state: IpvsState, odst: str, oport: int, syn: bool, has_ct: bool,
               proto: str = "tcp") -> dict | None:
    """nf_cause's answer when IPVS itself dropped a packet to odst:oport, else None."""
    vs = state.server(odst, oport, proto)
    if vs is None:
        return None
    n = state.name_of(vs)
    base = {"where": f"ipvs virtual server {vs}", "service": n.service if n else None, "to_pod": False,
            "virtual_server": str(vs), "real_servers": [str(r) for r in vs.reals],
            "text": f"ipvsadm -Ln -t {fmt_ep(vs.addr, vs.port)}: "
                    + (", ".join(f"-> {r} {r.forward} weight {r.weight}" for r in vs.reals) or "no real servers")}
    if syn and not vs.live_reals():
        tag = "no_local_endpoint" if state.etp_local(vs) else "no_endpoints"
        return {"tag": tag, **base}
    # conntrack still knows the connection (an INVALID packet has no entry: another cause)
    if not syn and has_ct and state.sysctl.get("expire_nodest_conn") == 0:
        return {"tag": "ipvs_nodest", **base, "expire_nodest_conn": 0,
                "conn_reuse_mode": state.sysctl.get("conn_reuse_mode")}
    return None
