"""The connection map's layout and hash, mirrored from bpf/nptrace_events.h (struct
npt_nat_key, npt_conn_slot, npt_conn_nat, npt_conn_set) and bpf/npt_common.h (npt_conn_set_of).

The netfilter-hook program (bpf/nf_hook.bpf.c) adds both tuples of every NATed connection to
its slot of `conn_slots` (the one tc took at its SYN, else one of its own), a 2-way
set-associative array that user space maps read-only (loader.Probes.nat_peer), in the set of
the connection's client end (and of the SNAT address too when SNAT moved it): a lookup hashes
both ends of the tuple and compares it with the two tuples of up to four slots whose `nat`
byte is set, no syscall.
tests/unit/test_layout.py checks NatKey/ConnSlot/ConnNat/ConnSet against the header with clang;
tests/unit/test_nat_slots.py the hash; tests/privileged/test_nat_tuples.py that user space
finds the slot the kernel wrote.
"""
from __future__ import annotations

import ctypes as ct
import socket
import struct
from functools import lru_cache

from nptrace import events as ev

__all__ = ["LAYOUTS", "NAT_KEY", "CONN_SET", "ConnNat", "ConnSet", "ConnSlot", "NatKey", "find",
           "nat_key", "nat_set"]


class NatKey(ct.Structure):
    """struct npt_nat_key: one side's tuple in its packet direction, ports host order."""
    _fields_ = [
        ("src", ct.c_uint8 * 16),
        ("dst", ct.c_uint8 * 16),
        ("sport", ct.c_uint16),
        ("dport", ct.c_uint16),
    ]


class ConnSlot(ct.Structure):
    """struct npt_conn_slot: one way's tc line (the SYN's tuple as key, ...)."""
    _fields_ = [
        ("key", NatKey),
        ("netns", ct.c_uint32),
        ("syn_ns", ct.c_uint64),
        ("isn", ct.c_uint32),
        ("in_ifindex", ct.c_uint32),
        ("in_ifindex2", ct.c_uint32),
        ("family", ct.c_uint8),
        ("nat", ct.c_uint8),
        ("syns", ct.c_uint8),
        ("reported", ct.c_uint8),
    ]


class ConnNat(ct.Structure):
    """struct npt_conn_nat: one way's reply tuple (the netfilter hook's line)."""
    _fields_ = [("peer", NatKey), ("_pad", ct.c_uint8 * 28)]


class ConnSet(ct.Structure):
    """struct npt_conn_set: the two ways' tc lines, then their reply tuples."""
    _fields_ = [("way", ConnSlot * 2), ("nat", ConnNat * 2)]


LAYOUTS = {"npt_nat_key": NatKey, "npt_conn_slot": ConnSlot, "npt_conn_nat": ConnNat,
           "npt_conn_set": ConnSet}

# The same key as one struct.pack: packing a key per lookup is the hot part, and a Struct is
# several times cheaper than filling a ctypes object. test_layout checks the sizes agree.
NAT_KEY = struct.Struct("=16s16sHH")
CONN_SET = ct.sizeof(ConnSet)            # 256: four cache lines
_WAY = ct.sizeof(ConnSlot)                # 64
_PEER = ConnSet.nat.offset                # 128: way w's reply tuple at _PEER + w * _WAY
_NAT = ConnSlot.nat.offset                # 61: 1 when the way's reply tuple is there
_ADDR_WORDS = struct.Struct("=4I")     # npt_nat_set hashes an end: 4 address words and a port


@lru_cache(maxsize=4096)
def _addr16(addr: str) -> bytes:
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    return socket.inet_pton(fam, addr).ljust(16, b"\0")


def nat_key(saddr: str, sport: int, daddr: str, dport: int) -> bytes:
    return NAT_KEY.pack(_addr16(saddr), _addr16(daddr), sport, dport)


def nat_set(addr: bytes, port: int, sets: int) -> int:
    """The set of the end addr:port (16-byte address) in conn_slots (`sets` of them):
    npt_conn_set_of() in bpf/npt_common.h, exactly."""
    h = port
    for w in _ADDR_WORDS.unpack(addr):
        h = ((h ^ w) * 0x9E3779B1) & 0xFFFFFFFF
    h ^= h >> 16
    return h % sets


def find(mem, size: int, saddr: str, sport: int, daddr: str, dport: int):
    """The other side of a NATed connection from the sets in `mem` (`size` of them), as
    (src, sport, dst, dport) in that side's packet direction, or None: npt_nat_find()."""
    key = nat_key(saddr, sport, daddr, dport)
    n = NAT_KEY.size
    for addr, port in ((key[:16], sport), (key[16:32], dport)):   # the client end is either
        off = nat_set(addr, port, size) * CONN_SET
        for o in (off, off + _WAY):         # the set's two ways
            if not mem[o + _NAT]:
                continue                    # tc's alone: no NAT pair
            r = o + _PEER                   # this way's reply tuple
            if mem[o:o + n] == key:
                other = r
            elif mem[r:r + n] == key:
                other = o
            else:
                continue
            src, dst, sp, dp = NAT_KEY.unpack_from(mem, other)
            fam = socket.AF_INET6 if ":" in saddr else socket.AF_INET
            return (ev.ntop(fam, src), sp, ev.ntop(fam, dst), dp)
    return None
