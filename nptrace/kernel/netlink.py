"""Interfaces and tc attachments over rtnetlink. The ONLY module that imports pyroute2.

A namespace is named as on the command line: None for the one nptrace runs in, a name for
/run/netns/NAME (what `ip netns add` creates), or a path to an nsfs file (/proc/PID/ns/net,
a CNI's /var/run/netns/cni-...). pyroute2 opens a socket inside another namespace from a
short-lived child process, so the caller's own namespace never changes.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from nptrace.errors import InterfaceError

NETNS_RUN_DIR = "/run/netns"
# clsact's two hooks (include/uapi/linux/pkt_sched.h: TC_H_CLSACT, TC_H_MIN_INGRESS/EGRESS)
PARENT_INGRESS = 0xFFFFFFF2
PARENT_EGRESS = 0xFFFFFFF3
ETH_P_ALL = 0x0003
ARPHRD_ETHER = 1


def netns_path(netns: str | None) -> str:
    if netns is None:
        return "/proc/self/ns/net"
    if "/" in netns:
        return netns
    return f"{NETNS_RUN_DIR}/{netns}"


def netns_label(netns: str | None) -> str:
    return "the current network namespace" if netns is None else f"network namespace {netns!r}"


def netns_inode(netns: str | None) -> int:
    """Inode of a namespace: the value BPF programs read from net->ns.inum."""
    path = netns_path(netns)
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        raise InterfaceError(f"{netns_label(netns)} not found ({path} does not exist; "
                             f"`ip netns list` shows the named ones)") from None
    except OSError as e:
        raise InterfaceError(f"cannot open {netns_label(netns)} at {path}: {e.strerror}") from None


@dataclass(frozen=True)
class Link:
    netns: str | None
    name: str
    ifindex: int
    netns_inode: int
    kind: str            # veth, bridge, vxlan, ... ("" for a physical NIC)
    arphrd: int = ARPHRD_ETHER   # link type (include/uapi/linux/if_arp.h)


@dataclass(frozen=True)
class Device:
    """A link as the automatic interface choice sees it (node/ifchoice.py), read by
    node/netns.py node_devices (raw rtnetlink dumps: pyroute2 parsing every address and
    route of a node with 200 pods took 60-75 ms)."""
    name: str
    ifindex: int
    kind: str                   # veth, bridge, vxlan, ... ("" for a physical NIC)
    arphrd: int = ARPHRD_ETHER
    master: int = 0             # ifindex of the bridge or bond it is a port of
    up: bool = True
    addrs: tuple[str, ...] = () # addresses wider than link scope
    default_route: bool = False


@dataclass(frozen=True)
class FilterRef:
    """One tc filter, as the kernel identifies it for deletion."""
    ifindex: int
    parent: int
    prio: int
    handle: int
    protocol: int        # host order
    name: str

    def to_dict(self) -> dict:
        return {"parent": self.parent, "prio": self.prio, "handle": self.handle,
                "protocol": self.protocol, "name": self.name}


def _attr(msg, name, default=None):
    v = msg.get_attr(name)
    return default if v is None else v


class Rtnl:
    """rtnetlink in one namespace: link lookup, clsact and bpf filters. A context manager."""

    def __init__(self, netns: str | None = None):
        self.netns = netns
        self.inode = netns_inode(netns)
        try:
            if netns is None:
                self.ipr = IPRoute(groups=0)
            else:
                # flags=0: never create the namespace (pyroute2's default is O_CREAT)
                self.ipr = IPRoute(netns=netns_path(netns), flags=0, groups=0)
        except (OSError, NetlinkError) as e:
            raise InterfaceError(f"cannot open rtnetlink in {netns_label(netns)}: {e}") from None

    def close(self) -> None:
        self.ipr.close()

    def __enter__(self) -> "Rtnl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- links --------------------------------------------------------------------------
    def link(self, name: str) -> Link:
        idx = self.ipr.link_lookup(ifname=name)
        if not idx:
            raise InterfaceError(f"interface {name!r} not found in {netns_label(self.netns)}")
        return self.link_by_index(idx[0])

    def link_by_index(self, ifindex: int) -> Link | None:
        try:
            msg = self.ipr.get_links(ifindex)[0]
        except NetlinkError as e:
            if e.code in (errno.ENODEV, errno.ENOENT):
                return None
            raise
        return Link(self.netns, _attr(msg, "IFLA_IFNAME", ""), ifindex, self.inode,
                    _kind(msg), msg["ifi_type"])

    def names(self) -> dict[int, str]:
        return {m["index"]: _attr(m, "IFLA_IFNAME", "") for m in self.ipr.get_links()}

    # --- clsact -------------------------------------------------------------------------
    def has_clsact(self, ifindex: int) -> bool:
        return any(_attr(q, "TCA_KIND") == "clsact" for q in self.ipr.get_qdiscs(ifindex))

    def add_clsact(self, ifindex: int) -> None:
        self.ipr.tc("add", "clsact", ifindex)

    def del_clsact(self, ifindex: int) -> None:
        try:
            self.ipr.tc("del", "clsact", ifindex)
        except NetlinkError as e:
            if e.code not in (errno.ENOENT, errno.EINVAL, errno.ENODEV):
                raise

    # --- filters ------------------------------------------------------------------------
    def filters(self, ifindex: int, parent: int) -> list[FilterRef]:
        out = []
        try:
            msgs = list(self.ipr.get_filters(index=ifindex, parent=parent))
        except NetlinkError as e:
            if e.code in (errno.EINVAL, errno.ENOENT, errno.ENODEV):  # no clsact / no device
                return []
            raise
        for m in msgs:
            if not m["handle"]:
                continue      # the per-priority header the kernel dumps before its filters
            opts = m.get_attr("TCA_OPTIONS")
            name = (opts.get_attr("TCA_BPF_NAME") if opts is not None else None) or ""
            info = m["info"]
            proto = int.from_bytes((info & 0xFFFF).to_bytes(2, "little"), "big")
            out.append(FilterRef(ifindex, parent, info >> 16, m["handle"], proto, name))
        return out

    def add_bpf_filter(self, ifindex: int, parent: int, fd: int, name: str) -> FilterRef:
        """Direct-action bpf filter; the kernel picks the priority (ahead of existing ones)."""
        self.ipr.tc("add-filter", "bpf", ifindex, ":1", fd=fd, name=name, parent=parent,
                    classid=1, direct_action=True)
        for f in self.filters(ifindex, parent):
            if f.name == name:
                return f
        raise InterfaceError(f"tc filter {name} was added on ifindex {ifindex} but is not listed")

    def del_filter(self, ref: FilterRef) -> bool:
        """False when it was already gone."""
        try:
            self.ipr.tc("del-filter", "bpf", ref.ifindex, ref.handle, parent=ref.parent,
                        prio=ref.prio, protocol=ref.protocol)
        except NetlinkError as e:
            if e.code in (errno.ENOENT, errno.EINVAL, errno.ENODEV):
                return False
            raise
        return True


def _kind(msg) -> str:
    info = msg.get_attr("IFLA_LINKINFO")
    if info is None:
        return ""
    return info.get_attr("IFLA_INFO_KIND") or ""


def open_netns(netns: str | None) -> Rtnl:
    return Rtnl(netns)


def named_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_RUN_DIR))
    except OSError:
        return []


def ifname_maps(extra: tuple[str, ...] = ()) -> dict[int, dict[int, str]]:
    """{netns inode: {ifindex: name}} for the current namespace, every /run/netns entry and
    `extra` namespaces (paths); namespaces that vanish meanwhile are skipped."""
    out: dict[int, dict[int, str]] = {}
    for ns in [None, *named_netns(), *extra]:
        try:
            with Rtnl(ns) as r:
                if r.inode not in out:
                    out[r.inode] = r.names()
        except (InterfaceError, NetlinkError, OSError):
            continue
    return out
