"""Which network namespaces are this node's, when the kernel runs more than one node.

On a node, nptrace runs in the node's network namespace (the unit on the host, the DaemonSet
with hostNetwork), and every namespace on the kernel is the node's or one of its pods': it
reports them all. Where one kernel runs several nodes as namespaces (the lab; kind and other
nodes-in-containers), the namespace nptrace runs in is not the initial one (PID 1's), or is
one `ip netns` names, and a tracer there is one node of several: it reports its own namespace and its pods' alone, and
takes the instance lock of its namespace, not the kernel's (daemon/preflight.py).

A pod of this node is a namespace whose veths all lead here: at least one has its peer in
this namespace, and none has it in a third (a neighbour node wired to this one by a veth, as
the lab's underlay is, leads elsewhere too: its NIC's other end). The test reads this
namespace's veths (their peers' namespace ids, IFLA_LINK_NETNSID), names the candidate
namespaces (/run/netns and every process's) by those ids (RTM_GETNSID), and reads each linked
one's own veths. It runs at start and again only when this namespace's veths change.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from nptrace.kernel.nsenter import RUN_NETNS, host_inode, inode_of
from nptrace.node.netns import link_names, nsids_seen_from

SELF = "/proc/thread-self/ns/net"


def init_inode(proc: Path = Path("/proc")) -> int | None:
    """The initial namespace's inode (PID 1's), None where it cannot be read (a pod without
    hostPID: then nptrace takes its namespace for the node's, as on a host)."""
    try:
        return inode_of(proc / "1/ns/net")
    except OSError:
        return None


def is_nested(proc: Path = Path("/proc")) -> bool:
    """Whether nptrace runs as one node of several: in a namespace that is not PID 1's, or
    in one `ip netns` named (a host's own namespace has no name under /run/netns; a lab node's
    has, and PID 1's is not always readable: a sandbox's PID 1 may belong to another user)."""
    here = host_inode()
    init = init_inode(proc)
    if init is not None and init != here:
        return True
    try:
        return any(inode_of(p) == here for p in RUN_NETNS.iterdir())
    except OSError:
        return False


def candidates(proc: Path = Path("/proc")) -> dict[int, str]:
    """{inode: path} of every namespace nptrace could name: /run/netns and every process's."""
    out: dict[int, str] = {}
    try:
        for p in RUN_NETNS.iterdir():
            try:
                out.setdefault(inode_of(p), str(p))
            except OSError:
                continue
    except OSError:
        pass
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        pids = []
    for pid in pids:
        path = f"{proc}/{pid}/ns/net"
        try:
            out.setdefault(os.stat(path).st_ino, path)
        except OSError:
            continue
    return out


def veths(path: str | None) -> dict[int, tuple]:
    """{ifindex: (peer ifindex, peer's namespace id or None)} of the namespace at `path`'s
    veths (node/netns.py parse_links)."""
    out: dict[int, tuple] = {}
    link_names(path, out)
    return out


def veth_peers(path: str | None) -> set[int | None]:
    """The namespace ids (as the namespace at `path` names them) its veths' peers are in;
    None for a peer in the same namespace."""
    return {nsid for _, nsid in veths(path).values()}


def split(proc: Path = Path("/proc")) -> tuple[dict[int, str], set[int]]:
    """({inode: path} of this node's pods, the inodes of every other namespace nptrace can
    name: the other nodes', their pods', the initial one). A pod is a namespace whose veths
    all lead into this one (see the module)."""
    here = host_inode()
    cands = {i: p for i, p in candidates(proc).items() if i != here}
    init = init_inode(proc)
    mine = {n for n in veth_peers(None) if n is not None}
    linked = {} if not mine else {
        inode: cands[inode] for nsid, inode in nsids_seen_from(None, cands).items()
        if nsid in mine and inode != init}
    pods: dict[int, str] = {}
    for inode, path in linked.items():
        try:
            peers = veth_peers(path) - {None}
            me = nsids_seen_from(path, {here: SELF})
        except OSError:
            continue
        here_id = next(iter(me), None)
        if here_id is not None and peers == {here_id}:
            pods[inode] = path
    others = set(cands) - set(pods)
    if init is not None and init != here:
        others.add(init)
    return pods, others


def pods_of_here(proc: Path = Path("/proc")) -> dict[int, str]:
    return split(proc)[0]


RESCAN_S = 60.0
MIN_GAP_S = 0.2


def own_veths() -> dict[int, tuple] | None:
    """veths(None), or None when it cannot be read (then the namespaces are sorted)."""
    try:
        return veths(None)
    except OSError:
        return None


class NodeScope:
    """Keeps the kernel's namespace filter (bpf/npt_common.h filter_netns) at the namespaces
    that are not this node's nor its pods'. A pod's veth appearing or going here is announced
    by the kernel (a link change; addresses and routes are not asked for): poll(), called at
    every turn of the tracer's loop, reads the announcements (one non-blocking recv) and, at
    most every MIN_GAP_S, this namespace's veths (one link dump, 3-4 ms with 200 of them);
    only when those differ from the last sort's are the namespaces sorted again (a sort reads
    /proc and dumps every linked namespace's links: 50-70 ms with 200 pods). A bridge port
    starting to forward, a device going up or down, announce a link change too and sort
    nothing. Other nodes' new namespaces are found by a rescan every RESCAN_S (until then
    they pass: see npt_common.h)."""

    def __init__(self, fill: Callable[[set[int]], int], log: Callable[[str], None], *,
                 sort=split, events=None, clock=time.monotonic, rescan_s: float = RESCAN_S,
                 snapshot: Callable[[], dict | None] = own_veths):
        self.fill = fill
        self.log = log
        self.sort = sort
        self.snapshot = snapshot
        self.events = events
        self.clock = clock
        self.rescan_s = rescan_s
        self.here = host_inode()
        self.pods: dict[int, str] = {}
        self.others: set[int] = set()
        self._next = 0.0
        self._last = 0.0
        self._pending = False
        self._asked: set[int] = set()      # unsorted namespaces keep() sorted for
        self.dropped = 0                   # verdicts of other nodes' namespaces keep() dropped
        self.failures = 0
        self.sorts = 0
        self.unchanged = 0                 # announcements whose veths were the last sort's
        self._veths: dict | None = None    # this namespace's veths when last sorted

    def start(self) -> str:
        if self.events is None:
            from nptrace.node.ifwatch import RTMGRP_LINK, LinkEvents
            self.events = LinkEvents(RTMGRP_LINK)
        self._refresh(quiet=True, seen=self.snapshot())
        names = sorted(os.path.basename(p) if p.startswith(str(RUN_NETNS)) else str(i)
                       for i, p in self.pods.items())
        return (f"node scope: this network namespace ({self.here}) is not the initial one: "
                f"nptrace is one node of several on this kernel and reports its namespace and "
                f"its pods' ({len(self.pods)}: {', '.join(names) or 'none yet'}) alone, not the "
                f"{len(self.others)} other namespaces'")

    def close(self) -> None:
        if self.events is not None:
            self.events.close()

    def _refresh(self, quiet: bool = False, seen: dict | None = None) -> None:
        """Sort the namespaces; `seen`: this namespace's veths, read just before (a veth
        changed during the sort is announced, and differs at the next look)."""
        self._next = self.clock() + self.rescan_s
        if seen is not None:
            self._veths = seen
        try:
            pods, others = self.sort()
        except OSError as e:
            self._veths = None
            self.failures += 1
            if self.failures <= 5:
                self.log(f"warning: node scope: sorting the namespaces: {e}")
            return
        self.sorts += 1
        added = pods.keys() - self.pods.keys()
        gone = self.pods.keys() - pods.keys()
        self.pods, self.others = pods, others
        self.fill(others)
        if (added or gone) and not quiet:
            self.log(f"node scope: {len(pods)} pods' namespaces"
                     + (f", {len(added)} new" if added else "")
                     + (f", {len(gone)} gone" if gone else ""))

    def owns(self, ns: int) -> bool:
        """Whether namespace ``ns`` is this node's or one of its pods'. One not sorted yet (a
        pod made after the last sort, whose records the kernel lets through) sorts them again
        first, once per such namespace. A record that names no namespace (0) may be any
        node's: not this one's."""
        if not ns:
            return False
        if ns == self.here or ns in self.pods:
            return True
        if ns not in self.others and ns not in self._asked:
            if len(self._asked) > 4096:
                self._asked.clear()
            self._asked.add(ns)
            self._refresh()
        return ns == self.here or ns in self.pods or ns not in self.others

    def keep(self, verdicts) -> list:
        """The verdicts of this node's namespaces (owns): another node's new pod and a
        packet freed with neither device nor socket are dropped here, not shown."""
        out = []
        for v in verdicts:
            if self.owns(v.event.netns):
                out.append(v)
            else:
                self.dropped += 1
        return out

    def poll(self) -> None:
        try:
            changed = self.events is not None and self.events.changed()
        except OSError:
            changed = True
        now = self.clock()
        self._pending = self._pending or changed
        if now >= self._next:                  # the rescan: other nodes' new namespaces
            self._pending = False
            self._last = now
            self._refresh()
        # a churn of announcements is looked at at most every MIN_GAP_S
        elif self._pending and now >= self._last + MIN_GAP_S:
            self._pending = False
            self._last = now
            veths = self.snapshot()
            if veths is not None and veths == self._veths:
                self.unchanged += 1
            else:
                self._refresh(seen=veths)
