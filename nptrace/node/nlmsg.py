"""Netlink message framing, shared by every raw netlink reader in nptrace (link names over
rtnetlink, nf_tables generation ids and trace messages over nfnetlink). pyroute2 is kept to
nptrace/kernel/netlink.py (tc); these readers are small, hot (a storm's first drops) or run in
threads inside other namespaces, where a plain socket is cheaper.

Datagrams come from the kernel, but a reader must still never raise on a short or odd one: a
length that runs past the buffer ends the walk (linux/netlink.h NLMSG_OK, uapi NLA_OK).
"""
from __future__ import annotations

import os
import struct
from typing import Iterator

NLMSG = struct.Struct("=IHHII")     # struct nlmsghdr: len, type, flags, seq, pid
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NFGENMSG_LEN = 4                    # struct nfgenmsg after the header of nfnetlink messages
NLA_TYPE_MASK = 0x3FFF              # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
_NLA = struct.Struct("=HH")


def align4(n: int) -> int:
    return (n + 3) & ~3


def request(msg_type: int, flags: int, seq: int, payload: bytes) -> bytes:
    """One netlink request: header + payload."""
    return NLMSG.pack(NLMSG.size + len(payload), msg_type, flags, seq, 0) + payload


def messages(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(type, start, end) of each whole message in one datagram; a truncated or malformed
    header ends the walk."""
    off = 0
    n = len(data)
    while off + NLMSG.size <= n:
        length, mtype, _flags, _seq, _pid = NLMSG.unpack_from(data, off)
        if length < NLMSG.size or off + length > n:
            return
        yield mtype, off, off + length
        off += align4(length)


def error_of(data: bytes, start: int) -> OSError:
    """The OSError an NLMSG_ERROR message at `start` carries (errno 0 on a short message)."""
    if start + NLMSG.size + 4 > len(data):
        return OSError(0, "truncated netlink error message")
    err = -struct.unpack_from("=i", data, start + NLMSG.size)[0]
    return OSError(err, os.strerror(err))


def attrs(data: bytes, off: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each netlink attribute in data[off:end]; one that runs past `end`
    ends the walk."""
    end = min(end, len(data))
    while off + _NLA.size <= end:
        alen, atype = _NLA.unpack_from(data, off)
        if alen < _NLA.size or off + alen > end:
            return
        yield atype & NLA_TYPE_MASK, data[off + _NLA.size:off + alen]
        off += align4(alen)
