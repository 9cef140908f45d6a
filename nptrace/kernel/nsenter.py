"""Entering network namespaces: the nsfs file of a namespace name, and running a function in
another namespace from a short-lived thread (setns(2) moves only the calling thread). tc, tcx,
netfilter links and the node's netlink readers all work this way."""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path

_CLONE_NEWNET = 0x40000000

RUN_NETNS = Path("/run/netns")


def path_of(netns: str | None) -> str | None:
    """The nsfs file of a --iface namespace: a name under /run/netns, or a path as given
    (/proc/PID/ns/net, a CNI's /var/run/netns/cni-...); None (this namespace) stays None."""
    if netns is None or "/" in netns:
        return netns
    return str(RUN_NETNS / netns)


def inode_of(path: str | os.PathLike) -> int:
    return os.stat(path).st_ino


def host_inode() -> int:
    """The inode of the namespace nptrace runs in (--iface NAME without NETNS/, the node's
    own under the DaemonSet's hostNetwork). Not PID 1's: that may not be ours, and it is
    not always readable (a sandbox whose PID 1 belongs to another user)."""
    return inode_of("/proc/self/ns/net")


def setns_fd(fd: int) -> None:
    """Move the calling thread into the network namespace open at fd."""
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def run_in(path: str | None, fn, name: str = "npt-netns"):
    """fn() run in the namespace at `path` (an nsfs file) by a short-lived thread: setns moves
    only the calling thread (and needs CAP_SYS_ADMIN). None: here. OSError when the namespace
    cannot be entered, or no thread can be started to enter it."""
    if path is None:
        return fn()
    result: list = []

    def worker() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                setns_fd(fd)
            finally:
                os.close(fd)
            result.append((True, fn()))
        except OSError as e:
            result.append((False, e))

    t = threading.Thread(target=worker, name=name, daemon=True)
    try:
        t.start()
    except RuntimeError as e:     # "can't start new thread": at the process's thread limit
        raise OSError(errno.EAGAIN, f"cannot start a thread to enter the network namespace "
                                    f"at {path}: {e}") from None
    t.join(5.0)
    if not result:
        raise OSError(0, f"timed out entering the network namespace at {path}")
    ok, value = result[0]
    if not ok:
        raise value
    return value
