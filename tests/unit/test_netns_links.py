"""The in-process RTM_GETLINK dump parser (nptrace.node.netns.parse_links)."""
import struct

import pytest

from nptrace.node import netns


def _link(index: int, name: bytes, seq: int = 1) -> bytes:
    ifname = name + b"\0"
    attr = struct.pack("=HH", 4 + len(ifname), 3) + ifname
    attr += bytes(-len(attr) % 4)
    mtu = struct.pack("=HHI", 8, 4, 1500)                      # IFLA_MTU before the name
    body = struct.pack("=BxHiII", 0, 1, index, 0, 0) + mtu + attr
    return struct.pack("=IHHII", 16 + len(body), 16, 2, seq, 0) + body


def test_links_of_one_recv_and_the_end_of_the_dump():
    data = _link(1, b"lo") + _link(7, b"eth0")
    assert netns.parse_links(data) == ({1: "lo", 7: "eth0"}, False)
    done = struct.pack("=IHHII", 20, 3, 2, 1, 0) + bytes(4)
    assert netns.parse_links(_link(3, b"cni0") + done) == ({3: "cni0"}, True)


def test_a_netlink_error_is_an_oserror():
    err = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -1) + bytes(16)
    with pytest.raises(OSError):
        netns.parse_links(err)
