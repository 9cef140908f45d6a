"""Has a namespace's iptables-legacy ruleset changed? Asked of the kernel in milliseconds.

iptables-legacy (x_tables) announces nothing, and its dump (`iptables-legacy-save`) takes
0.4 s for 10,000 Services, so a check by dump can only run every few seconds. The kernel hands
out each table's rule blob itself: IPT_SO_GET_INFO gives its size and entry count, and
IPT_SO_GET_ENTRIES the entries (what iptables-legacy-save reads before printing). Size and
count alone would miss a DNAT rewritten to another endpoint (same size, same count), so the
digest is over the whole blob with each entry's packet and byte counters zeroed: those move
with traffic, nothing else in it does (match and target data that the kernel keeps to itself,
such as `statistic`'s nth counter, are not copied out).

Only the tables listed in /proc/net/ip{,6}_tables_names are asked: asking for another would
make the kernel create it in that namespace. Must run in the namespace (the caller enters it)
and with CAP_NET_ADMIN there.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import socket
import struct

# <linux/netfilter_ipv4/ip_tables.h>, <linux/netfilter_ipv6/ip6_tables.h>: the UAPI layouts
# (tests/unit/test_xtables.py checks them against the kernel's BTF where there is one)
SO_GET_INFO, SO_GET_ENTRIES = 64, 65          # IPT_BASE_CTL + 0, + 1 (the same for IPv6)
NAME_LEN = 32                                  # XT_TABLE_MAXNAMELEN
GETINFO_SIZE = 84                              # struct ipt_getinfo == struct ip6t_getinfo
ENTRIES_HEADER = 40                            # offsetof(struct ipt_get_entries, entrytable)
# family: (socket family, getsockopt level, /proc file, offsetof(entry, next_offset),
#          offsetof(entry, counters))
FAMILIES = {
    "ip": (socket.AF_INET, socket.IPPROTO_IP, "ip_tables_names", 90, 96),
    "ip6": (socket.AF_INET6, socket.IPPROTO_IPV6, "ip6_tables_names", 142, 152),
}
COUNTERS_LEN = 16                              # struct xt_counters: pcnt, bcnt

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.getsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_uint32)]


def _getsockopt(fd: int, level: int, opt: int, buf: ctypes.Array) -> int:
    """getsockopt with an input buffer (the table's name): Python's socket.getsockopt sends none."""
    n = ctypes.c_uint32(len(buf))
    if _libc.getsockopt(fd, level, opt, buf, ctypes.byref(n)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return n.value


def table_names(family: str) -> list[str]:
    """The legacy tables that exist in this thread's namespace (reading creates none)."""
    try:
        with open(f"/proc/thread-self/net/{FAMILIES[family][2]}") as f:
            return sorted(f.read().split())
    except OSError:
        return []          # x_tables not loaded: no legacy tables anywhere


def _info(s: socket.socket, level: int, name: str) -> ctypes.Array:
    info = ctypes.create_string_buffer(name.encode(), GETINFO_SIZE)
    _getsockopt(s.fileno(), level, SO_GET_INFO, info)
    return info


def info_here() -> tuple:
    """Each legacy table's hooks, entry count and size (IPT_SO_GET_INFO): microseconds, and
    it moves with every rule added or removed, though not with a rule rewritten in place."""
    out = []
    for family, (af, level, *_) in FAMILIES.items():
        names = table_names(family)
        if names:
            with socket.socket(af, socket.SOCK_RAW, socket.IPPROTO_RAW) as s:
                out.extend((family, name, _info(s, level, name).raw[NAME_LEN:]) for name in names)
    return tuple(out)


def table_blob(family: str, name: str) -> bytes:
    """The table's getinfo header fields and its entries with every entry's counters zeroed
    (2,000 Services' nat table: ~9 MB, 28,000 entries, ~40 ms)."""
    af, level, _, next_at, counters_at = FAMILIES[family]
    with socket.socket(af, socket.SOCK_RAW, socket.IPPROTO_RAW) as s:
        info = _info(s, level, name)
        size = struct.unpack_from("=I", info, GETINFO_SIZE - 4)[0]
        # the table may grow between the two calls: the kernel then refuses (EAGAIN) and the
        # caller's next turn asks again
        entries = ctypes.create_string_buffer(ENTRIES_HEADER + size)
        entries[:NAME_LEN] = name.encode().ljust(NAME_LEN, b"\0")
        struct.pack_into("=I", entries, NAME_LEN, size)
        _getsockopt(s.fileno(), level, SO_GET_ENTRIES, entries)
    blob = bytearray(entries.raw[ENTRIES_HEADER:])
    zero, step_of = bytes(COUNTERS_LEN), struct.Struct("=H").unpack_from
    off = 0
    while off + counters_at + COUNTERS_LEN <= len(blob):
        blob[off + counters_at:off + counters_at + COUNTERS_LEN] = zero
        step = step_of(blob, off + next_at)[0]
        if step == 0:
            break
        off += step
    return info.raw[NAME_LEN:] + bytes(blob)


def digest_here() -> str | None:
    """One digest of every legacy table of this thread's namespace; None when it has none.
    OSError when the kernel will not answer (no CAP_NET_ADMIN here)."""
    h, any_table = hashlib.blake2b(digest_size=16), False
    for family in FAMILIES:
        for name in table_names(family):
            any_table = True
            h.update(f"{family} {name}\n".encode())
            h.update(table_blob(family, name))
    return h.hexdigest() if any_table else None
