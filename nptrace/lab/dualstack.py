"""The dual-stack form of a scenario (variant ``ipv6``): every host keeps its IPv4 setup and gets
the IPv6 twin of it, kube-proxy renders both families (iptables + ip6tables, nft ``ip`` + ``ip6``
tables, as kube-proxy does on a dual-stack node), and the trigger connects over IPv6.

A scenario has the variant when it says ``families = ["ipv4", "ipv6"]``. The IPv6 data is not
written per scenario: topology.toml's ``[ipv6] map`` gives each IPv4 prefix its IPv6 prefix,
and an address's twin is the same offset into the mapped prefix, its length grown by as much:
192.168.10.100 in 192.168.10.0/24 -> fd00:10::/120 is fd00:10::64, 10.244.0.16/28 in
10.244.0.0/16 -> fd00:244::/112 is fd00:244::10/124. Addresses outside every mapped prefix (the
VXLAN underlay) stay IPv4 only: the overlay carries IPv6 inside IPv4 VXLAN, as flannel's
dual-stack mode can. ``[ipv6] skip`` lists IPv4 addresses without a twin (flannel.1's own
address: its twin would be the subnet-router anycast of the node's pod prefix); the node then
masquerades over the overlay from its cni0 address.

Rules text a scenario gives a host (``iptables_restore``: a NetworkPolicy) is translated token
by token and loaded with ip6tables-restore too; ``nft`` text of an ``inet`` table covers both
families as it is. sysctls with an IPv6 counterpart (forwarding, the ICMP rate limit) get it.
rp_filter has none: Linux implements reverse-path filtering for IPv6 only as a netfilter
match (``ip6tables -m rpfilter`` / nft ``fib``), so that scenario has no IPv6 form.

A ``run`` step (a command on a host while connections are held) naming an address with a twin
is followed by its IPv6 copy (``ip neigh flush to 10.244.0.10`` then ``to fd00:244::a``); a
``sysctl`` step's IPv4 keys with a counterpart (the neighbour table's ``net.ipv4.neigh.*``)
get it in the same command.
"""
from __future__ import annotations

import copy
import ipaddress
import re

from .errors import UsageError

VARIANT = "ipv6"
_V4 = re.compile(r"(?<![\w.:])(\d{1,3}(?:\.\d{1,3}){3})(/\d{1,2})?(?![\w.])")
# IPv4 sysctl -> its IPv6 counterpart (same value)
_SYSCTL6 = {"net.ipv4.ip_forward": "net.ipv6.conf.all.forwarding",
            "net.ipv4.icmp_ratelimit": "net.ipv6.icmp.ratelimit"}
# IPv4 sysctl prefix -> its IPv6 counterpart (the neighbour tables: same knobs, per device)
_SYSCTL6_PREFIX = {"net.ipv4.neigh.": "net.ipv6.neigh."}


class Mapper:
    """IPv4 address or prefix -> its IPv6 twin under ``[ipv6] map``."""

    def __init__(self, table: dict):
        self.map = [(ipaddress.ip_network(a), ipaddress.ip_network(b)) for a, b in table.get("map", {}).items()]
        self.skip = {ipaddress.ip_interface(a) for a in table.get("skip", [])}
        for a, b in self.map:
            if a.version != 4 or b.version != 6:
                raise UsageError(f"[ipv6] map {a} = {b}: must map an IPv4 prefix to an IPv6 one")

    def addr(self, text: str) -> str | None:
        """The twin of "a.b.c.d" or "a.b.c.d/n", None when it has none."""
        iface = ipaddress.ip_interface(text)
        if iface.version != 4:
            return None
        for v4, v6 in self.map:
            if iface.ip in v4:
                ip = v6.network_address + (int(iface.ip) - int(v4.network_address))
                if "/" not in text:
                    return str(ip)
                return f"{ip}/{iface.network.prefixlen + v6.prefixlen - v4.prefixlen}"
        return None

    def text(self, text: str, where: str) -> str:
        """Every IPv4 token of ``text`` replaced by its twin; one without a twin is an error."""
        def sub(m):
            out = self.addr(m.group(0))
            if out is None:
                raise UsageError(f"{where}: {m.group(0)} has no IPv6 twin (add its prefix to [ipv6] map)")
            return out
        return _V4.sub(sub, text)

    def line(self, text: str) -> str | None:
        """A route or neighbour line with every IPv4 token twinned, None if one has no twin."""
        try:
            out = self.text(text, "")
        except UsageError:
            return None
        return out.replace("default ", "::/0 ", 1) if out.startswith("default ") else out


def dual_stack(topo: dict, raw: dict) -> tuple[dict, dict]:
    """(hosts, trigger list) of the scenario's dual-stack form; the IPv4 data stays as it is."""
    m = Mapper(topo.get("ipv6", {}))
    hosts = copy.deepcopy(topo["hosts"])
    for name, d in hosts.items():
        where = f"host {name}"
        for iface in d.get("ifaces", {}).values():
            six = [m.addr(a) for a in iface.get("addrs", []) if ipaddress.ip_interface(a) not in m.skip]
            iface["addrs"] = [*iface.get("addrs", []), *(a for a in six if a)]
        for key in ("routes", "neigh"):
            six = [m.line(r) for r in d.get(key, [])]
            d[key] = [*d.get(key, []), *(r for r in six if r)]
        sysctl = d.get("sysctl", {})
        for k4, k6 in _SYSCTL6.items():
            if k4 in sysctl:
                sysctl.setdefault(k6, sysctl[k4])
        if d.get("iptables_restore"):
            d["ip6tables_restore"] = m.text(d["iptables_restore"], where)
        srv = d.get("server")
        if srv:
            srv["ipv6"] = True
        d["ipv6"] = True
    trigger = []
    for t in raw.get("trigger", []):
        t = dict(t)
        for k in ("src", "dst"):
            if t.get(k):
                t[k] = m.text(t[k], f"trigger {k}")
        trigger.append(t)
    return hosts, trigger


def twin_service(m: Mapper, d: dict) -> dict:
    """A [services] table with its ClusterIP twinned (endpoints name pods: twinned by the pod)."""
    d = dict(d)
    d["cluster_ip"] = m.text(d["cluster_ip"], f"service {d.get('name')}")
    return d


def _sysctl6(arg: str) -> str | None:
    """A ``key=value`` sysctl argument's IPv6 counterpart, None when it has none."""
    key, eq, value = arg.partition("=")
    six = _SYSCTL6.get(key) or next((p6 + key[len(p4):] for p4, p6 in _SYSCTL6_PREFIX.items()
                                     if key.startswith(p4)), None)
    return f"{six}{eq}{value}" if six else None


def twin_steps(m: Mapper, steps: list[dict]) -> list[dict]:
    """A scenario's [[step]] list for its dual-stack form: a ``run`` step whose argv names
    addresses with twins is followed by its IPv6 copy; a ``sysctl`` step gets the IPv6
    counterparts of its keys. Other steps (rules, pods, waits) are family-free."""
    out = []
    for st in steps:
        out.append(st)
        if st.get("kind") != "run" or not st.get("argv"):
            continue
        argv = [str(a) for a in st["argv"]]
        if argv[0] == "sysctl":
            six = [a for a in (_sysctl6(a) for a in argv[1:] if "=" in a) if a]
            if six:
                out[-1] = {**st, "argv": [*argv, *six]}
            continue
        if any(_V4.fullmatch(a) for a in argv):
            twinned = [m.line(a) if _V4.fullmatch(a) else a for a in argv]
            if None not in twinned:
                out.append({**st, "argv": twinned})
    return out
