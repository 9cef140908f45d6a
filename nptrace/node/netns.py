"""Names for what the kernel reports as numbers: network namespace inodes and ifindexes.

Events carry the netns inode and the ifindex; a person wants `npt-node1` and `eth1`. Named
namespaces are the bind mounts under /run/netns (ip netns, CNI plugins); unnamed ones (container
runtimes) are found through /proc/<pid>/ns/net. Lookups are cached and refreshed on a miss at
most once per `refresh_s`, so a flood of events from an unknown netns costs one scan.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from nptrace.kernel.nsenter import RUN_NETNS, host_inode, inode_of, run_in
from nptrace.node.nlmsg import (NLM_F_DUMP, NLM_F_REQUEST, NLMSG, NLMSG_DONE, NLMSG_ERROR, attrs,
                                error_of, messages, request)

def named_namespaces() -> dict[int, str]:
    out = {}
    try:
        for p in RUN_NETNS.iterdir():
            try:
                out[inode_of(p)] = p.name
            except OSError:
                continue
    except OSError:
        pass
    return out


def live_namespaces(proc: Path = Path("/proc")) -> set[int]:
    """Inodes of the network namespaces that exist now and that nptrace could name: every
    /run/netns entry, and the namespace of every process. One stat per process (a few ms
    on a node of a thousand processes): call it every few seconds, not per event. A namespace
    kept alive only by a socket (ours included) is not in it: that is the point."""
    out = set(named_namespaces())
    try:
        out.add(host_inode())
    except OSError:
        pass
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            out.add(os.stat(f"{proc}/{pid}/ns/net").st_ino)
        except OSError:
            continue
    return out


# Namespaces whose names are cached; pods come and go, and every one leaves an inode behind.
MAX_CACHED_NAMESPACES = 1024

_RTM_NEWLINK, _RTM_GETLINK = 16, 18
_IFLA_IFNAME = 3
_IFINFO_LEN = 16                        # struct ifinfomsg


def parse_links(data: bytes) -> tuple[dict[int, str], bool]:
    """({ifindex: name} of the RTM_NEWLINK messages in one recv, dump finished)."""
    out: dict[int, str] = {}
    for mtype, start, end in messages(data):
        if mtype == NLMSG_DONE:
            return out, True
        if mtype == NLMSG_ERROR:
            raise error_of(data, start)
        if mtype == _RTM_NEWLINK and end - start >= NLMSG.size + _IFINFO_LEN:
            index = struct.unpack_from("=i", data, start + NLMSG.size + 4)[0]
            for atype, payload in attrs(data, start + NLMSG.size + _IFINFO_LEN, end):
                if atype == _IFLA_IFNAME:
                    out[index] = payload.split(b"\0", 1)[0].decode(errors="replace")
                    break
    return out, False


def link_names(path: str | None) -> dict[int, str]:
    """{ifindex: name} of the namespace at `path` (None: ours), by an RTM_GETLINK dump over a
    netlink socket opened in it. In-process: a storm's first events from a namespace used to
    fork `ip -j link show` (a fork of a 100 MB process, then ip itself)."""
    sock = run_in(path, lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW,
                                              socket.NETLINK_ROUTE), "npt-links")
    with sock:
        sock.settimeout(5)
        req = request(_RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 1, bytes(_IFINFO_LEN))
        sock.send(req)
        out: dict[int, str] = {}
        done = False
        while not done:
            got, done = parse_links(sock.recv(1 << 16))
            out.update(got)
        return out


def link_names_or_none(path: str | None) -> dict[int, str]:
    """link_names(), or {} when the namespace cannot be read (gone, no permission)."""
    try:
        return link_names(path)
    except OSError:
        return {}


class Names:
    def __init__(self, refresh_s: float = 2.0):
        self.refresh_s = refresh_s
        self._ns: dict[int, str] = {}
        self._links: dict[int, dict[int, str]] = {}
        self._last_scan: dict[int, float] = {}
        try:
            self.host = host_inode()
        except OSError:
            self.host = 0
        self._rescan_ns()

    def _rescan_ns(self) -> None:
        self._ns = named_namespaces()
        if self.host:
            self._ns.setdefault(self.host, "")

    def netns_name(self, inode: int) -> str | None:
        if inode not in self._ns:
            self._rescan_ns()
        name = self._ns.get(inode)
        return "host" if name == "" else name

    def _pid_in(self, inode: int) -> int | None:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.stat(d / "ns/net").st_ino == inode:
                        return int(d.name)
                except OSError:
                    continue
        return None

    def _load_links(self, inode: int) -> dict[int, str]:
        name = self._ns.get(inode)
        if name == "":
            return link_names_or_none(None)    # the host: where nptrace runs
        if name:
            return link_names_or_none(str(RUN_NETNS / name))
        pid = self._pid_in(inode)
        return link_names_or_none(f"/proc/{pid}/ns/net") if pid else {}

    def prune(self, alive) -> int:
        """Forget the namespaces not in `alive` (live_namespaces()); returns how many."""
        gone = [i for i in self._links if i not in alive]
        for i in gone:
            self._links.pop(i, None)
        for i in [i for i in self._last_scan if i not in alive]:
            del self._last_scan[i]
        return len(gone)

    def iface(self, netns: int, ifindex: int) -> str | None:
        links = self._links.get(netns)
        if links is None or ifindex not in links:
            now = time.monotonic()
            if now - self._last_scan.get(netns, 0.0) >= self.refresh_s or links is None:
                while len(self._links) >= MAX_CACHED_NAMESPACES:   # oldest first
                    old = next(iter(self._links))
                    del self._links[old]
                    self._last_scan.pop(old, None)
                while len(self._last_scan) >= 2 * MAX_CACHED_NAMESPACES:
                    del self._last_scan[next(iter(self._last_scan))]
                self._last_scan[netns] = now
                if netns not in self._ns:
                    self._rescan_ns()
                links = self._links[netns] = self._load_links(netns)
        name = links.get(ifindex) if links else None
        if name is None:
            return None
        ns = self._ns.get(netns)
        return f"{ns}/{name}" if ns else name
