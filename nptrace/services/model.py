"""What the queries answer with, and the address helpers every other module shares.

``Service`` and ``Rule`` are the public result types; ``KINDS`` and ``REASONS`` list the values
of their ``kind`` and ``reason``. The address, port and protocol helpers (``canon``,
``AddrSet`` ...) live here, at the bottom of the package, because the matcher, the map and both
parsers need them and this module imports none of those.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable

KINDS = ("nodeport", "clusterip", "externalip", "loadbalancer", "endpoint", "healthcheck")
REASONS = ("no_local_endpoint", "no_endpoints", "lb_source_range", "conntrack_invalid", "other")
EXTERNAL_KINDS = frozenset({"nodeport", "externalip", "loadbalancer", "healthcheck"})
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

_V4 = re.compile(r"^\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}$", re.ASCII)   # \d is any Unicode digit otherwise


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


def canon(addr: str) -> str | None:
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


def norm_proto(p) -> str:
    s = str(p).strip().lower()
    return _PROTO_NUM.get(s, s)


def split_hostport(s: str) -> tuple[str, int] | None:
    """``10.0.0.1:80`` / ``[fd00::1]:80`` -> (canonical host, port)."""
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = s.rpartition(":")
    h = canon(host)
    if h is None or not (port.isascii() and port.isdigit()):   # "²".isdigit(), int("²") fails
        return None
    return h, int(port)


def fmt_ep(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def ep_sort_key(ep: tuple[str, int]):
    host, port = ep
    try:
        ip = ipaddress.ip_address(host)
        return (ip.version, int(ip), port)
    except ValueError:
        return (9, 0, port)


def distinct_addrs(keys) -> tuple[str, ...]:
    """The distinct addresses of (addr, port) keys, in address order."""
    return tuple(a for a, _ in sorted({(a, 0) for a, _ in keys}, key=ep_sort_key))


class AddrSet:
    """Hosts (O(1)) plus networks; ``local`` stands for addrtype/fib LOCAL."""

    __slots__ = ("hosts", "nets", "text", "local")

    def __init__(self, items: Iterable[str] = (), text: str = "", local: bool = False):
        hosts, nets = set(), []
        for it in items:
            it = it.strip().strip('"')
            if not it:
                continue
            h = canon(it)
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
    def host(cls, addr: str) -> "AddrSet":
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


LOCAL_ADDRS = AddrSet(text="LOCAL", local=True)
