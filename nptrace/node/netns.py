"""Names for what the kernel reports as numbers: network namespace inodes and ifindexes.

Events carry the netns inode and the ifindex; a person wants `npt-node1` and `eth1`. Named
namespaces are the bind mounts under /run/netns (ip netns, CNI plugins); unnamed ones (container
runtimes) are found through /proc/<pid>/ns/net. Lookups are cached and refreshed on a miss at
most once per `refresh_s`, so a flood of events from an unknown netns costs one scan.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
import time
from pathlib import Path

from nptrace.kernel.nsenter import RUN_NETNS, host_inode, inode_of, run_in
from nptrace.node.nlmsg import (NLM_F_DUMP, NLM_F_REQUEST, NLMSG, NLMSG_DONE, NLMSG_ERROR, align4,
                                attrs, error_of, messages, request)

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
_IFLA_IFNAME, _IFLA_LINK, _IFLA_LINKINFO, _IFLA_LINK_NETNSID = 3, 5, 18, 37
_IFLA_INFO_KIND = 1
_IFINFO_LEN = 16                        # struct ifinfomsg
_RTM_NEWNSID, _RTM_GETNSID = 88, 90
_NETNSA_NSID, _NETNSA_FD = 1, 3
_RTGENMSG_LEN = 4                       # struct rtgenmsg, padded
_NLA_HDR = struct.Struct("=HH")


def parse_links(data: bytes, veths: dict | None = None) -> tuple[dict[int, str], bool]:
    """({ifindex: name} of the RTM_NEWLINK messages in one recv, dump finished). With `veths`,
    also fills {ifindex: (peer ifindex, peer netnsid or None)} for each veth: IFLA_LINK is the
    peer's index in the namespace IFLA_LINK_NETNSID names (absent: this one)."""
    out: dict[int, str] = {}
    for mtype, start, end in messages(data):
        if mtype == NLMSG_DONE:
            return out, True
        if mtype == NLMSG_ERROR:
            raise error_of(data, start)
        if mtype == _RTM_NEWLINK and end - start >= NLMSG.size + _IFINFO_LEN:
            index = struct.unpack_from("=i", data, start + NLMSG.size + 4)[0]
            link = nsid = kind = None
            for atype, payload in attrs(data, start + NLMSG.size + _IFINFO_LEN, end):
                if atype == _IFLA_IFNAME:
                    out[index] = payload.split(b"\0", 1)[0].decode(errors="replace")
                    if veths is None:
                        break
                elif atype == _IFLA_LINK and len(payload) >= 4:
                    link = struct.unpack_from("=i", payload)[0]
                elif atype == _IFLA_LINK_NETNSID and len(payload) >= 4:
                    nsid = struct.unpack_from("=i", payload)[0]
                elif atype == _IFLA_LINKINFO:
                    for itype, ipayload in attrs(payload, 0, len(payload)):
                        if itype == _IFLA_INFO_KIND:
                            kind = ipayload.split(b"\0", 1)[0]
            if veths is not None and kind == b"veth" and link:
                veths[index] = (link, nsid)
    return out, False


def _rtnl_in(path: str | None) -> socket.socket:
    sock = run_in(path, lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW,
                                              socket.NETLINK_ROUTE), "npt-links")
    sock.settimeout(5)
    return sock


def link_names(path: str | None, veths: dict | None = None) -> dict[int, str]:
    """{ifindex: name} of the namespace at `path` (None: ours), by an RTM_GETLINK dump over a
    netlink socket opened in it (and its veths' peers into `veths`, see parse_links).
    In-process, not `ip -j link show`: that would cost a storm's first events from a namespace
    a fork of a 100 MB process, then ip itself."""
    with _rtnl_in(path) as sock:
        req = request(_RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 1, bytes(_IFINFO_LEN))
        sock.send(req)
        out: dict[int, str] = {}
        done = False
        while not done:
            got, done = parse_links(sock.recv(1 << 16), veths)
            out.update(got)
        return out


def link_names_or_none(path: str | None, veths: dict | None = None) -> dict[int, str]:
    """link_names(), or {} when the namespace cannot be read (gone, no permission)."""
    try:
        return link_names(path, veths)
    except OSError:
        return {}


# What node/ifchoice.py chooses by (rtnetlink.h, if_link.h, if_addr.h, netdevice.h)
_RTM_NEWADDR, _RTM_GETADDR, _RTM_NEWROUTE, _RTM_GETROUTE = 20, 22, 24, 26
_IFLA_MASTER, _IFLA_EXT_MASK = 10, 29
_RTEXT_FILTER_SKIP_STATS = 1 << 3       # no counters; a kernel without it ignores the bit
_IFADDRMSG = struct.Struct("=BBBBI")    # family, prefixlen, flags, scope, index
_IFA_ADDRESS = 1
_RTMSG = struct.Struct("=BBBBBBBBI")    # family, dst_len, src_len, tos, table, protocol, ...
_RTA_OIF, _RTA_MULTIPATH = 4, 9
_RTNEXTHOP = struct.Struct("=HBBi")     # len, flags, hops, ifindex
_RT_SCOPE_LINK, _RT_TABLE_MAIN, _IFF_UP = 253, 254, 1


def parse_devices(data: bytes, links: dict[int, tuple], addrs: dict[int, list[str]],
                  default: set[int]) -> bool:
    """One recv of a link, address or route dump (node_devices' three), added to
    links {ifindex: (name, kind, link type, master, up)}, addrs {ifindex: [address]} (those
    wider than link scope) and default (the ifindexes a default route of the main table leaves
    by, multipath hops included); True at the dump's end.
    What the choice never uses is skipped from the fixed header, before any attribute is
    read: link- and host-scope addresses (every veth's IPv6 link-local), and routes with a
    prefix or outside the main table (rtm_table is the table id when it fits in a byte,
    RT_TABLE_COMPAT otherwise, so 254 there is the main table whatever RTA_TABLE says)."""
    for mtype, start, end in messages(data):
        body = start + NLMSG.size
        if mtype == NLMSG_DONE:
            return True
        if mtype == NLMSG_ERROR:
            raise error_of(data, start)
        if mtype == _RTM_NEWLINK and end - body >= _IFINFO_LEN:
            _, arphrd, index, flags = struct.unpack_from("=HHiI", data, body)
            name, kind, master = "", "", 0
            for atype, payload in attrs(data, body + _IFINFO_LEN, end):
                if atype == _IFLA_IFNAME:
                    name = payload.split(b"\0", 1)[0].decode(errors="replace")
                elif atype == _IFLA_MASTER and len(payload) >= 4:
                    master = struct.unpack_from("=I", payload)[0]
                elif atype == _IFLA_LINKINFO:
                    for itype, ipayload in attrs(payload, 0, len(payload)):
                        if itype == _IFLA_INFO_KIND:
                            kind = ipayload.split(b"\0", 1)[0].decode(errors="replace")
            links[index] = (name, kind, arphrd, master, bool(flags & _IFF_UP))
        elif mtype == _RTM_NEWADDR and end - body >= _IFADDRMSG.size:
            family, _, _, scope, index = _IFADDRMSG.unpack_from(data, body)
            if scope >= _RT_SCOPE_LINK or family not in (socket.AF_INET, socket.AF_INET6):
                continue
            addr = "?"
            for atype, payload in attrs(data, body + _IFADDRMSG.size, end):
                if atype == _IFA_ADDRESS:
                    try:
                        addr = socket.inet_ntop(family, payload)
                    except ValueError:
                        pass
                    break
            addrs.setdefault(index, []).append(addr)
        elif mtype == _RTM_NEWROUTE and end - body >= _RTMSG.size:
            family, dst_len, _, _, table = _RTMSG.unpack_from(data, body)[:5]
            if dst_len or table != _RT_TABLE_MAIN or family not in (socket.AF_INET,
                                                                    socket.AF_INET6):
                continue
            for atype, payload in attrs(data, body + _RTMSG.size, end):
                if atype == _RTA_OIF and len(payload) >= 4:
                    oif = struct.unpack_from("=i", payload)[0]
                    if oif:
                        default.add(oif)
                elif atype == _RTA_MULTIPATH:
                    off = 0
                    while off + _RTNEXTHOP.size <= len(payload):
                        hlen, _, _, oif = _RTNEXTHOP.unpack_from(payload, off)
                        if hlen < _RTNEXTHOP.size:
                            break
                        default.add(oif)
                        off += align4(hlen)
    return False


def node_devices(path: str | None = None) -> list:
    """kernel/netlink.py Device for every link of the namespace at `path` (None: ours): its
    kind, link type, master, addresses wider than link scope, and whether a default route of
    the main table leaves by it (either family). Three dumps over one rtnetlink socket (links
    without their counters, addresses, routes of both families), parsed by parse_devices:
    3-4 ms on a node with 200 pod veths, where pyroute2 parsing everything took 60-75 ms
    (docs/benchmarks.md, auto_ifaces)."""
    from nptrace.kernel.netlink import Device    # its module holds pyroute2: loaded on use
    links: dict[int, tuple] = {}
    addrs: dict[int, list[str]] = {}
    default: set[int] = set()
    ext = _NLA_HDR.pack(8, _IFLA_EXT_MASK) + struct.pack("=I", _RTEXT_FILTER_SKIP_STATS)
    dumps = ((_RTM_GETLINK, bytes(_IFINFO_LEN) + ext), (_RTM_GETADDR, bytes(_IFADDRMSG.size)),
             (_RTM_GETROUTE, bytes(_RTMSG.size)))      # family 0: every family, one dump
    with _rtnl_in(path) as sock:
        for seq, (mtype, payload) in enumerate(dumps, 1):
            sock.send(request(mtype, NLM_F_REQUEST | NLM_F_DUMP, seq, payload))
            while not parse_devices(sock.recv(1 << 16), links, addrs, default):
                pass
    return [Device(name, index, kind, arphrd, master, up, tuple(addrs.get(index, ())),
                   index in default)
            for index, (name, kind, arphrd, master, up) in links.items()]


_SIOCETHTOOL, _ETHTOOL_GTXCSUM = 0x8946, 0x16


def tx_csum_offload(dev: str) -> bool:
    """Whether `dev` (in the calling thread's namespace) has any TX checksum offload on: the
    kernel's ETHTOOL_GTXCSUM, what `ethtool -k` shows as tx-checksumming. OSError when the
    device is gone or the ioctl is refused."""
    value = bytearray(struct.pack("=II", _ETHTOOL_GTXCSUM, 0))
    buf = (ctypes.c_char * len(value)).from_buffer(value)
    ifreq = struct.pack("16sP", dev.encode()[:15], ctypes.addressof(buf))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), _SIOCETHTOOL, ifreq)
    return struct.unpack_from("=II", value)[1] != 0


def nsid_request(fd: int, seq: int = 1) -> bytes:
    """RTM_GETNSID for the namespace open at `fd`: its id as the asking namespace names it."""
    attr = _NLA_HDR.pack(8, _NETNSA_FD) + struct.pack("=I", fd)
    return request(_RTM_GETNSID, NLM_F_REQUEST, seq, bytes(_RTGENMSG_LEN) + attr)


def parse_nsid(data: bytes) -> int | None:
    """NETNSA_NSID of an RTM_NEWNSID answer (None: the namespace has no id here)."""
    for mtype, start, end in messages(data):
        if mtype == NLMSG_ERROR:
            raise error_of(data, start)
        if mtype == _RTM_NEWNSID:
            for atype, payload in attrs(data, start + NLMSG.size + _RTGENMSG_LEN, end):
                if atype == _NETNSA_NSID and len(payload) >= 4:
                    nsid = struct.unpack_from("=i", payload)[0]
                    return None if nsid < 0 else nsid
    return None


def nsids_seen_from(path: str | None, candidates: dict[int, str]) -> dict[int, int]:
    """{nsid: inode} of the `candidates` ({inode: path}) as the namespace at `path` names
    them (the ids IFLA_LINK_NETNSID carries there); {} when it cannot be asked."""
    out: dict[int, int] = {}
    try:
        sock = _rtnl_in(path)
    except OSError:
        return out
    with sock:
        for seq, (inode, cpath) in enumerate(candidates.items(), 1):
            try:
                fd = os.open(cpath, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                sock.send(nsid_request(fd, seq))
                nsid = parse_nsid(sock.recv(1 << 12))
            except OSError:
                continue
            finally:
                os.close(fd)
            if nsid is not None:
                out[nsid] = inode
    return out


class Names:
    """Interface and namespace names by (netns inode, ifindex), cached. Shared by the main
    loop (the classifier's lookups) and the metrics server's scrape worker (the collectors'
    iface labels): every public method holds one lock, since both evict from the same dicts
    (two evictions of one oldest entry raised KeyError in the main loop). Only the namespace
    switch of veth_peer_tx_csum runs outside it."""

    def __init__(self, refresh_s: float = 2.0):
        self.refresh_s = refresh_s
        self._lock = threading.RLock()      # re-entered: iface() runs inside veth_peer()
        self._ns: dict[int, str] = {}
        self._links: dict[int, dict[int, str]] = {}
        self._veths: dict[int, dict[int, tuple]] = {}     # inode -> parse_links' veths
        self._nsids: dict[int, tuple[float, dict[int, int]]] = {}   # inode -> (when, nsid map)
        self._csum: dict[tuple[int, int], tuple[float, bool | None]] = {}  # veth_peer_tx_csum's
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
        with self._lock:
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

    def _path(self, inode: int) -> tuple[bool, str | None]:
        """(found, path to open it; None for the host: where nptrace runs)."""
        name = self._ns.get(inode)
        if name == "":
            return True, None
        if name:
            return True, str(RUN_NETNS / name)
        pid = self._pid_in(inode)
        return (True, f"/proc/{pid}/ns/net") if pid else (False, None)

    def _load_links(self, inode: int) -> dict[int, str]:
        found, path = self._path(inode)
        veths: dict[int, tuple] = {}
        links = link_names_or_none(path, veths) if found else {}
        self._veths[inode] = veths
        return links

    def _veth_other_end(self, netns: int, ifindex: int) -> tuple[int, int] | None:
        """(netns inode, ifindex) of the other end of the veth `ifindex` in `netns`, or None
        (not a veth, or its peer's namespace is not one nptrace can name)."""
        if self.iface(netns, ifindex) is None:      # loads the namespace's links and veths
            return None
        v = self._veths.get(netns, {}).get(ifindex)
        if v is None:
            return None
        link, nsid = v
        if nsid is None:                            # both ends in one namespace
            return netns, link
        peer_ns = self._nsid_map(netns).get(nsid)
        return (peer_ns, link) if peer_ns else None

    def veth_peer(self, netns: int, ifindex: int) -> str | None:
        """The name (as iface() gives it) of the other end of the veth `ifindex` in `netns`,
        or None (not a veth, or its peer's namespace is not one nptrace can name)."""
        with self._lock:
            end = self._veth_other_end(netns, ifindex)
            return self.iface(*end) if end else None

    def veth_peer_tx_csum(self, netns: int, ifindex: int) -> bool | None:
        """Whether the other end of the veth `ifindex` in `netns` offloads its TX checksums
        (`ethtool -k`'s tx-checksumming), asked of the kernel in that end's namespace; None
        when that end cannot be named or asked. Asked on checksum drops only, and again after
        a second at most: the SRE may have just turned it off, and a storm of drops must not
        cost a namespace switch each."""
        now = time.monotonic()
        found = name = path = None
        with self._lock:
            hit = self._csum.get((netns, ifindex))
            if hit is not None and now - hit[0] < 1.0:
                return hit[1]
            end = self._veth_other_end(netns, ifindex)
            if end is not None and self.iface(*end) is not None:
                found, path = self._path(end[0])
                name = self._links.get(end[0], {}).get(end[1])
        got = None
        if found and name is not None:       # a thread in that namespace: not under the lock
            try:
                got = run_in(path, lambda: tx_csum_offload(name), "npt-ethtool")
            except OSError:
                pass
        with self._lock:
            if len(self._csum) >= 4096:
                self._csum.clear()
            self._csum[(netns, ifindex)] = (now, got)
        return got

    def _nsid_map(self, netns: int) -> dict[int, int]:
        """{nsid: inode} of the namable namespaces as `netns` numbers them, refreshed at most
        every refresh_s (a veth's peer namespace is asked for only on a rare drop)."""
        now = time.monotonic()
        hit = self._nsids.get(netns)
        if hit is not None and now - hit[0] < self.refresh_s:
            return hit[1]
        self._rescan_ns()
        found, path = self._path(netns)
        cands = {i: ("/proc/self/ns/net" if n == "" else str(RUN_NETNS / n))
                 for i, n in self._ns.items() if i != netns}
        got = nsids_seen_from(path, cands) if found else {}
        while len(self._nsids) >= MAX_CACHED_NAMESPACES:
            del self._nsids[next(iter(self._nsids))]
        self._nsids[netns] = (now, got)
        return got

    def prune(self, alive) -> int:
        """Forget the namespaces not in `alive` (live_namespaces()); returns how many."""
        with self._lock:
            return self._prune(alive)

    def _prune(self, alive) -> int:
        gone = [i for i in self._links if i not in alive]
        for i in gone:
            self._links.pop(i, None)
        for cache in (self._veths, self._nsids):
            for i in [i for i in cache if i not in alive]:
                del cache[i]
        for i in [i for i in self._last_scan if i not in alive]:
            del self._last_scan[i]
        return len(gone)

    def iface(self, netns: int, ifindex: int) -> str | None:
        with self._lock:
            return self._iface(netns, ifindex)

    def _iface(self, netns: int, ifindex: int) -> str | None:
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
