"""Watched --iface devices that disappear and come back: re-attached, and the gap said.

A pod restart re-creates its veth (same name, new ifindex, often a new namespace inode); a
CNI re-creates its VXLAN device. tc filters and tcx links go with the old device, so without
this a long-running tracer silently stops seeing the interface it was asked to watch.

`IfaceWatch.poll()` runs from the tracer's loop about once a second: per namespace of the
watched interfaces (not per interface), one in-process RTM_GETLINK dump (node/netns.py
link_names: a thread and a socket, no fork, no pyroute2) and a stat of the namespace file.
Only on a change does it call the tc attachments (kernel/tc.py, through pyroute2) to attach
again. A gap is reported twice: when the device is seen gone, and when it is back with how
long tracing was off (the upper bound: the device may have come back up to a poll interval
before it was seen).
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

from nptrace.config import IfaceSpec
from nptrace.kernel.nsenter import host_inode, inode_of, path_of
from nptrace.node.netns import link_names, node_devices

POLL_S = 1.0


@dataclass
class Gap:
    iface: str
    since: float            # clock() when the device was first seen gone (or changed)
    ended: float | None = None
    seen_gone: bool = True  # False: replaced between two polls (never seen missing)

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.since


def where_now(spec, seen: dict | None = None) -> tuple[int, int] | None:
    """(netns inode, ifindex) of the interface `spec` names now, None when it is not there.
    `seen` keeps each namespace's inode and links between calls (one poll's interfaces)."""
    path = path_of(spec.netns)
    ns = None if seen is None else seen.get(path)
    if ns is None:
        try:
            inode = host_inode() if path is None else inode_of(path)
            ns = inode, {name: idx for idx, name in link_names(path).items()}
        except OSError:
            ns = 0, {}
        if seen is not None:
            seen[path] = ns
    inode, index = ns
    idx = index.get(spec.name)
    return None if idx is None else (inode, idx)


class IfaceWatch:
    def __init__(self, specs, tc, log: Callable[[str], None], *, clock=time.monotonic,
                 lookup=None, on_gap: Callable[[Gap], None] | None = None,
                 every_s: float = POLL_S):
        self.specs = list(specs)
        self.tc = tc
        self.log = log
        self.clock = clock
        self.lookup = lookup or self._where     # where_now: one link dump per namespace a poll
        self._seen: dict = {}
        self.on_gap = on_gap
        self.every_s = every_s
        self.open: dict[str, Gap] = {}     # str(spec) -> the gap still open
        self.gaps: list[Gap] = []          # closed ones (last 64)
        self.reattached = 0
        self.failures = 0
        self._next = clock() + every_s
        self._pid = os.getpid()

    def poll(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now < self._next:
            return
        self._next = now + self.every_s
        self._seen = {}
        for spec in self.specs:
            key = str(spec)
            try:
                was = self.tc.where(spec)
                cur = self.lookup(spec)
            except Exception as e:     # a watcher must never stop the tracer
                self.failures += 1
                if self.failures == 1:
                    self.log(f"warning: interface watch: {type(e).__name__}: {e}")
                continue
            if cur is None:
                if key not in self.open:
                    self.open[key] = Gap(key, now)
                    self.log(f"interface {key} disappeared: not traced until it is back "
                             "(watching for it)")
                continue
            if cur == was and key not in self.open:
                continue
            gap = self.open.get(key) or Gap(key, now, seen_gone=False)
            try:
                self.tc.reattach(spec, cur[1], cur[0])
            except Exception as e:
                self.open[key] = gap
                self.failures += 1
                self.log(f"warning: interface {key} is back (ifindex {cur[1]}) but re-attaching "
                         f"failed: {type(e).__name__}: {e} (retrying)")
                continue
            self.open.pop(key, None)
            gap.ended = now
            self.reattached += 1
            self.gaps = (self.gaps + [gap])[-64:]
            took = f"{gap.seconds:.1f} s" if gap.seen_gone else f"under {self.every_s:g} s"
            self.log(f"interface {key} is back (ifindex {cur[1]}): tc programs re-attached; "
                     f"not traced for {took}")
            if self.on_gap is not None:
                self.on_gap(gap)
        self._seen = {}

    def _where(self, spec) -> tuple[int, int] | None:
        return where_now(spec, self._seen)


# Announcement groups (RTMGRP_* of rtnetlink.h): links; links, IPv4/IPv6 addresses and
# IPv4/IPv6 routes (what the automatic choice depends on).
RTMGRP_LINK = 0x1
RTMGRP_LINK_ADDR_ROUTE = RTMGRP_LINK | 0x10 | 0x40 | 0x100 | 0x400
RECHECK_S = 30.0


class LinkEvents:
    """The kernel's announcements of `groups` in this namespace (by default link, address and
    route ones), unread until asked: changed() says whether any came (or the socket overran,
    which means some did)."""

    def __init__(self, groups: int = RTMGRP_LINK_ADDR_ROUTE):
        self.sock = socket.socket(socket.AF_NETLINK,
                                  socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                                  socket.NETLINK_ROUTE)
        self.sock.bind((0, groups))

    def changed(self) -> bool:
        got = False
        for _ in range(10_000):          # bounded: a flood of announcements is one change
            try:
                self.sock.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError:              # ENOBUFS: announcements were lost, so some came
                pass
            got = True
        return got

    def close(self) -> None:
        self.sock.close()


def current_choice():
    from nptrace.node.ifchoice import choose
    return choose(node_devices(None))


class AutoIfaces:
    """No --iface: the devices node/ifchoice.py chooses, followed while running. A device
    created after start (a CNI's VXLAN device, a new bridge) is attached at the next poll
    after the kernel announces it (about a second); one that goes has its programs taken off;
    one re-created under its name is attached again and the gap reported as IfaceWatch does.
    The choice is read again only when the kernel announced a link, address or route change,
    and every RECHECK_S besides: a node with hundreds of pod veths costs nothing at rest."""

    def __init__(self, tc, log: Callable[[str], None], *, read=current_choice, events=None,
                 clock=time.monotonic, on_gap: Callable[[Gap], None] | None = None,
                 every_s: float = POLL_S, inode: Callable[[], int] = host_inode):
        self.tc = tc
        self.log = log
        self.read = read
        self.events = events
        self.clock = clock
        self.on_gap = on_gap
        self.every_s = every_s
        self.inode = inode
        self.choice = None
        self.gone: dict[str, float] = {}    # chosen devices seen gone: since when
        self.gaps: list[Gap] = []
        self.reattached = 0
        self.failures = 0
        self._next = 0.0
        self._recheck = 0.0

    @property
    def specs(self) -> list[IfaceSpec]:
        return list(self.tc.specs)

    def start(self) -> None:
        """The first choice, attached at once (quietly: the start line says it)."""
        if self.events is None:
            self.events = LinkEvents()
        self._apply(self.clock(), quiet=True)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()

    def poll(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now < self._next:
            return
        self._next = now + self.every_s
        try:
            changed = self.events is None or self.events.changed()
        except OSError:
            changed = True
        if force or changed or now >= self._recheck:
            self._apply(now)

    def _warn(self, msg: str) -> None:
        self.failures += 1
        if self.failures <= 20:
            self.log(f"warning: automatic interfaces: {msg}")

    def _apply(self, now: float, quiet: bool = False) -> None:
        self._recheck = now + RECHECK_S
        try:
            choice = self.read()
            inode = self.inode()
        except Exception as e:     # a watcher must never stop the tracer
            self._warn(f"{type(e).__name__}: {e}")
            return
        want = {name: (idx, why) for name, idx, why in choice.chosen}
        have = {s.name: self.tc.where(s) for s in self.tc.specs if s.netns is None}
        for name, (idx, why) in want.items():
            was = have.get(name)
            if was == (inode, idx):
                continue
            try:
                self.tc.reattach(IfaceSpec(None, name), idx, inode)
            except Exception as e:
                self._warn(f"attaching to {name} (ifindex {idx}) failed: {type(e).__name__}: "
                           f"{e} (retrying)")
                self._recheck = now + self.every_s
                continue
            since = self.gone.pop(name, None)
            if since is not None or was is not None:
                gap = Gap(name, since if since is not None else now, now,
                          seen_gone=since is not None)
                self.reattached += 1
                self.gaps = (self.gaps + [gap])[-64:]
                if self.on_gap is not None:
                    self.on_gap(gap)
            if not quiet:
                self.log(f"interface {name} ({why}): tc programs attached"
                         + (" again (device re-created)" if since is not None or was else ""))
        for name in have.keys() - want.keys():
            try:
                self.tc.remove(IfaceSpec(None, name))
            except Exception as e:
                self._warn(f"taking the programs off {name} failed: {type(e).__name__}: {e}")
                continue
            gone = name not in choice.present
            if gone:
                self.gone[name] = now
            self.log(f"interface {name} " + ("disappeared: not traced until it is back"
                                             if gone else "is no longer one the node's "
                                             "traffic crosses: tc programs taken off"))
        self.choice = choice
