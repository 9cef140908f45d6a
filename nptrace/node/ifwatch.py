"""Watched --iface devices that disappear and come back: re-attached, and the gap said.

A pod restart re-creates its veth (same name, new ifindex, often a new namespace inode); a
CNI re-creates its VXLAN device. tc filters and tcx links go with the old device, so without
this a long-running tracer silently stops seeing the interface it was asked to watch.

`IfaceWatch.poll()` runs from the tracer's loop about once a second: per watched interface,
one in-process RTM_GETLINK dump in its namespace (node/netns.py link_names: a thread and a
socket, no fork, no pyroute2) and a stat of the namespace file. Only on a change does it call
the tc attachments (kernel/tc.py, through pyroute2) to attach again. A gap is reported twice:
when the device is seen gone, and when it is back with how long tracing was off (the
upper bound: the device may have come back up to a poll interval before it was seen).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from nptrace.kernel.nsenter import host_inode, inode_of, path_of
from nptrace.node.netns import link_names

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


def where_now(spec) -> tuple[int, int] | None:
    """(netns inode, ifindex) of the interface `spec` names now, None when it is not there."""
    path = path_of(spec.netns)
    try:
        inode = host_inode() if path is None else inode_of(path)
        links = link_names(path)
    except OSError:
        return None
    for idx, name in links.items():
        if name == spec.name:
            return inode, idx
    return None


class IfaceWatch:
    def __init__(self, specs, tc, log: Callable[[str], None], *, clock=time.monotonic,
                 lookup=where_now, on_gap: Callable[[Gap], None] | None = None,
                 every_s: float = POLL_S):
        self.specs = list(specs)
        self.tc = tc
        self.log = log
        self.clock = clock
        self.lookup = lookup
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
