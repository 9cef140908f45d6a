"""nf_tables ruleset changes as the kernel commits them, per watched namespace.

Polling the generation id (rules_source.nft_generation) once a second leaves the rules view up
to a second behind a kube-proxy sync, and a rollout that hands a removed endpoint's address to
a new pod within that second gets its resets labeled against the old rules. The kernel says
every committed transaction to the NFNLGRP_NFTABLES multicast group of NETLINK_NETFILTER (the
table, chain, rule and set messages of the batch, then NFT_MSG_NEWGEN), in the namespace where
it was committed. So one socket per watched namespace, joined to that group, opened inside it
by a short-lived thread (nsenter.run_in: a socket keeps the namespace it was made in), and a
select over all of them: ready() returns the namespaces that committed something, at once.
iptables-nft commits go through nf_tables too; iptables-legacy and IPVS do not, so
node/knowledge.py asks the kernel for those (the legacy tables' sizes every 50 ms, IPVS's
table every second).

Joining the group needs CAP_NET_ADMIN in the namespace. A socket that cannot be opened is
remembered with its error (the poll still covers that namespace). A burst larger than the
socket's buffer ends in ENOBUFS: the messages are lost, not the fact that something changed.
"""
from __future__ import annotations

import errno
import os
import select
import selectors
import socket
import threading
from typing import Callable

from nptrace.kernel.nsenter import run_in

NETLINK_NETFILTER = 12
NFNLGRP_NFTABLES = 7
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
RCVBUF = 1 << 20           # a kube-proxy sync of thousands of Services is one burst


def _listener_here() -> socket.socket:
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK
                      | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
    try:
        s.bind((0, 0))
        s.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTABLES)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        except OSError:
            pass
    except OSError:
        s.close()
        raise
    return s


def open_listener(path: str | None) -> socket.socket:
    """A socket in the namespace at `path` (None: ours) that hears its nf_tables commits."""
    return run_in(path, _listener_here, "npt-nftwatch")


class NftChanges:
    """Listeners for a changing set of namespaces (inode -> path), and a wait for commits."""

    def __init__(self, opener: Callable[[str | None], socket.socket] = open_listener):
        self._open = opener
        self._sel = selectors.DefaultSelector()
        self._socks: dict[int, socket.socket] = {}
        self.failed: dict[int, str] = {}      # inode -> why its listener could not be opened
        self.lost = 0                          # bursts past the socket buffer (ENOBUFS)
        # wake(): a stop ends ready()'s wait at once, not when its timeout runs out; the lock
        # keeps a wake from writing to the fd number after close() gave it back
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)

    def sync(self, wanted: dict[int, str | None]) -> None:
        """Listen in exactly the namespaces of `wanted`; a namespace whose listener failed is
        not tried again until it leaves `wanted` and comes back."""
        for inode in [i for i in self._socks if i not in wanted]:
            self._drop(inode)
        for inode in [i for i in self.failed if i not in wanted]:
            del self.failed[inode]
        for inode, path in wanted.items():
            if inode in self._socks or inode in self.failed:
                continue
            try:
                s = self._open(path)
            except OSError as e:
                self.failed[inode] = e.strerror or str(e)
                continue
            self._socks[inode] = s
            self._sel.register(s, selectors.EVENT_READ, inode)

    def ready(self, timeout: float) -> list[int]:
        """The namespaces whose listener has messages, waiting up to `timeout` s for one."""
        return [key.data for key, _ in self._sel.select(max(0.0, timeout)) if key.data is not None]

    def wake(self) -> None:
        """End a ready() waiting in another thread now (it returns what is ready, maybe
        nothing); the wait after it returns at once too."""
        with self._wake_lock:
            try:
                if self._wake_w >= 0:
                    os.write(self._wake_w, b"x")
            except OSError:    # already awake (a full pipe)
                pass

    def drain(self, inodes) -> list[int]:
        """`inodes` that have a listener, each read until empty."""
        out: list[int] = []
        for inode in inodes:
            s = self._socks.get(inode)
            if s is None:
                continue
            out.append(inode)
            while True:
                try:
                    if not s.recv(1 << 16):     # never from netlink: a broken socket
                        self._drop(inode)
                        break
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno == errno.ENOBUFS:
                        self.lost += 1
                        continue
                    self._drop(inode)      # the namespace went away: sync() opens it again
                    break
        return out

    def pending(self) -> bool:
        """Does a listener hold a commit not yet drained? For another thread than the one
        that waits and drains: a snapshot of the sockets, polled without blocking."""
        socks = list(self._socks.values())
        if not socks:
            return False
        try:
            return bool(select.select(socks, [], [], 0)[0])
        except (OSError, ValueError):    # closed under us by sync(): ask again
            return True

    def watched(self) -> set[int]:
        return set(self._socks)

    def _drop(self, inode: int) -> None:
        s = self._socks.pop(inode, None)
        if s is not None:
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()

    def close(self) -> None:
        for inode in list(self._socks):
            self._drop(inode)
        self._sel.close()
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1
