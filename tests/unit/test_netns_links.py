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


def _veth(index: int, name: bytes, peer: int, nsid: int | None) -> bytes:
    """An RTM_NEWLINK of a veth: IFLA_LINK the peer's index, IFLA_LINK_NETNSID its namespace,
    IFLA_LINKINFO { IFLA_INFO_KIND "veth" } (nested, as the kernel sends it)."""
    def attr(t, payload):
        a = struct.pack("=HH", 4 + len(payload), t) + payload
        return a + bytes(-len(a) % 4)
    body = struct.pack("=BxHiII", 0, 1, index, 0, 0) + attr(3, name + b"\0")
    body += attr(5, struct.pack("=i", peer))
    if nsid is not None:
        body += attr(37, struct.pack("=i", nsid))
    body += attr(18 | 0x8000, attr(1, b"veth\0"))
    return struct.pack("=IHHII", 16 + len(body), 16, 2, 1, 0) + body


def test_veths_name_their_peer_and_its_namespace():
    veths: dict = {}
    data = _link(1, b"lo") + _veth(5, b"eth1", 9, 3) + _veth(6, b"v0", 7, None)
    assert netns.parse_links(data, veths) == ({1: "lo", 5: "eth1", 6: "v0"}, False)
    assert veths == {5: (9, 3), 6: (7, None)}
    assert netns.parse_links(data) == ({1: "lo", 5: "eth1", 6: "v0"}, False)   # names alone


def test_nsid_answer_and_request():
    nsid_attr = struct.pack("=HHi", 8, 1, 4)
    msg = struct.pack("=IHHII", 16 + 4 + 8, 88, 0, 1, 0) + bytes(4) + nsid_attr
    assert netns.parse_nsid(msg) == 4
    none = struct.pack("=IHHII", 16 + 4 + 8, 88, 0, 1, 0) + bytes(4) + struct.pack("=HHi", 8, 1, -1)
    assert netns.parse_nsid(none) is None
    req = netns.nsid_request(7, seq=3)
    assert struct.unpack_from("=IHHII", req) == (len(req), 90, 1, 3, 0)
    assert req[-4:] == struct.pack("=I", 7)


def test_a_peers_offload_is_asked_once_a_second_not_once_a_drop(monkeypatch):
    """A storm of checksum drops on one veth costs one namespace switch a second; a second
    later the setting is asked again (the SRE may have turned it off)."""
    from types import SimpleNamespace
    asked = []
    monkeypatch.setattr(netns, "run_in", lambda path, fn, name: asked.append(path) or True)
    now = [100.0]
    monkeypatch.setattr(netns, "time", SimpleNamespace(monotonic=lambda: now[0]))
    n = netns.Names.__new__(netns.Names)
    n._csum, n._links, n._lock = {}, {9: {4: "c0"}}, netns.threading.RLock()
    monkeypatch.setattr(n, "_veth_other_end", lambda ns, i: (9, 4), raising=False)
    monkeypatch.setattr(n, "iface", lambda ns, i: "ns/c0", raising=False)
    monkeypatch.setattr(n, "_path", lambda ns: (True, "/run/netns/ns"), raising=False)
    assert [n.veth_peer_tx_csum(1, 7) for _ in range(50)] == [True] * 50
    assert asked == ["/run/netns/ns"]
    now[0] += 1.5
    assert n.veth_peer_tx_csum(1, 7) is True and len(asked) == 2
