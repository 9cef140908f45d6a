"""node/ifchoice.py choose and node/ifwatch.py AutoIfaces: the devices `nptrace run` traces
when no --iface is given, and how it follows them."""
from nptrace.config import IfaceSpec
from nptrace.kernel.netlink import Device
from nptrace.node.ifchoice import choose
from nptrace.node.ifwatch import AutoIfaces


def node_devices(*extra):
    """A flannel node: eth0 with the default route, cni0 with two pods' veths, flannel.1,
    kube-ipvs0 (IPVS mode's dummy), the loopback."""
    return [Device("lo", 1, "", 772, addrs=("127.0.0.1",)),
            Device("eth0", 2, "", 1, addrs=("192.168.10.11",), default_route=True),
            Device("cni0", 3, "bridge", 1, addrs=("10.244.0.1",)),
            Device("veth1", 4, "veth", 1, master=3),
            Device("veth2", 5, "veth", 1, master=3),
            Device("flannel.1", 6, "vxlan", 1, addrs=("10.244.0.0",)),
            Device("kube-ipvs0", 7, "dummy", 1, addrs=("10.96.0.1", "10.96.0.10")),
            *extra]


def test_a_node_s_devices_are_its_nic_bridge_and_overlay_not_pods_veths():
    c = choose(node_devices())
    assert c.names() == ("eth0", "cni0", "flannel.1")
    assert c.pod_veths == 2
    assert ("kube-ipvs0", "dummy: holds addresses, carries no packets") in c.left
    line = c.line()
    assert "eth0 (default route, 192.168.10.11)" in line and "2 pod veths" in line
    assert "--iface none" in line


def test_routed_pods_veths_calico_style_are_left_out_and_a_bond_stands_for_its_ports():
    c = choose([Device("bond0", 2, "bond", 1, addrs=("10.0.0.5",), default_route=True),
                Device("ens1", 3, "", 1, master=2), Device("ens2", 4, "", 1, master=2),
                Device("cali1", 5, "veth", 1), Device("cali2", 6, "veth", 1),
                Device("vxlan.calico", 7, "vxlan", 1)])
    assert c.names() == ("bond0", "vxlan.calico") and c.pod_veths == 2


def test_devices_without_an_ethernet_header_are_said_and_left_out():
    c = choose([Device("eth0", 2, "", 1, addrs=("10.0.0.5",), default_route=True),
                Device("tunl0", 3, "ipip", 768, addrs=("10.244.3.1",)),
                Device("wg0", 4, "wireguard", 65534, addrs=("10.9.0.1",))])
    assert c.names() == ("eth0",)
    assert [n for n, _ in c.left] == ["tunl0", "wg0"]
    assert "no Ethernet header" in c.left[0][1]


def test_a_veth_holding_the_node_s_address_is_the_node_s_nic():
    """A lab node (and a node in a container) reaches the world by a veth with its address."""
    c = choose([Device("eth0", 2, "veth", 1, addrs=("192.168.10.11",), default_route=True)])
    assert c.names() == ("eth0",) and c.pod_veths == 0


class FakeTc:
    def __init__(self):
        self.specs, self.at, self.calls = [], {}, []

    def where(self, spec):
        return self.at.get(spec.name)

    def reattach(self, spec, ifindex, inode):
        self.calls.append(("attach", spec.name, ifindex))
        self.at[spec.name] = (inode, ifindex)
        if spec not in self.specs:
            self.specs.append(spec)

    def remove(self, spec):
        self.calls.append(("remove", spec.name))
        self.at.pop(spec.name, None)
        self.specs.remove(spec)


class Events:
    def __init__(self):
        self.pending = False

    def changed(self):
        got, self.pending = self.pending, False
        return got


def test_devices_that_appear_go_and_come_back_are_followed():
    devs = node_devices()
    tc, ev, lines, gaps = FakeTc(), Events(), [], []
    now = [0.0]
    w = AutoIfaces(tc, lines.append, read=lambda: choose(devs), events=ev,
                   clock=lambda: now[0], on_gap=gaps.append, inode=lambda: 42)
    w.start()
    assert [s.name for s in tc.specs] == ["eth0", "cni0", "flannel.1"] and not lines
    # nothing announced: no re-read before the periodic recheck
    devs.append(Device("vxlan.new", 9, "vxlan", 1))
    now[0] = 1.0
    w.poll()
    assert "vxlan.new" not in [s.name for s in tc.specs]
    ev.pending = True
    now[0] = 2.0
    w.poll()
    assert tc.calls[-1] == ("attach", "vxlan.new", 9) and "vxlan overlay" in lines[-1]
    # flannel.1 deleted: its programs off, said; re-created with a new index: attached again
    devs[:] = [d for d in devs if d.name != "flannel.1"]
    ev.pending, now[0] = True, 3.0
    w.poll()
    assert tc.calls[-1] == ("remove", "flannel.1") and "disappeared" in lines[-1]
    devs.append(Device("flannel.1", 12, "vxlan", 1))
    ev.pending, now[0] = True, 5.5
    w.poll()
    assert tc.calls[-1] == ("attach", "flannel.1", 12) and "again" in lines[-1]
    assert gaps and gaps[-1].iface == "flannel.1" and gaps[-1].seconds == 2.5
    assert IfaceSpec(None, "flannel.1") in tc.specs


def test_a_failed_attach_is_retried_and_never_stops_the_tracer():
    tc, lines = FakeTc(), []

    def refuse(spec, ifindex, inode):
        raise OSError("busy")
    tc.reattach = refuse
    now = [0.0]
    w = AutoIfaces(tc, lines.append, read=lambda: choose(node_devices()), events=Events(),
                   clock=lambda: now[0], inode=lambda: 42)
    w.start()
    assert w.failures == 3 and "retrying" in lines[-1]
    now[0] = 1.0
    w.poll()              # retried at the next poll, no announcement needed
    assert w.failures == 6


class V:
    def __init__(self, netns):
        self.event = type("E", (), {"netns": netns})()


def test_node_scope_keeps_its_namespaces_and_sorts_an_unknown_one_once(monkeypatch):
    """node/scope.py NodeScope.keep: this node's and its pods' verdicts stay, the other
    nodes' go; a namespace not sorted yet sorts them again, once."""
    from nptrace.node import scope
    monkeypatch.setattr(scope, "host_inode", lambda: 1)
    world = {"pods": {2: "/run/netns/pod"}, "others": {3}}
    sorts, filled = [], []

    def sort():
        sorts.append(1)
        return dict(world["pods"]), set(world["others"])
    s = scope.NodeScope(filled.append, lambda _: None, sort=sort, events=Events(),
                        clock=lambda: 0.0)
    s.start()
    assert filled[-1] == {3} and len(sorts) == 1
    kept = s.keep([V(1), V(2), V(3), V(0)])
    assert [v.event.netns for v in kept] == [1, 2] and s.dropped == 2 and len(sorts) == 1
    world["others"] = {3, 4}                 # another node's new pod
    assert s.keep([V(4)]) == [] and len(sorts) == 2
    world["pods"] = {2: "/run/netns/pod", 5: "/run/netns/new"}   # this node's new pod
    assert [v.event.netns for v in s.keep([V(5), V(5)])] == [5, 5] and len(sorts) == 3
    assert [v.event.netns for v in s.keep([V(6)])] == [6] and len(sorts) == 4
    assert s.keep([V(6)]) and len(sorts) == 4      # asked once: not sorted again


def test_nft_trace_arms_no_table_in_another_node_s_namespace():
    """One node of several: nft tracing (node/nftrace_live.py) never adds its table where the
    node scope says the namespace is another node's."""
    from nptrace.node.nftrace_live import TracedRules

    class Kn:
        def _netns_arg(self, inode):
            return "npt-other"
    t = TracedRules(Kn(), owns=lambda ns: ns == 1)
    assert t._no_trace_reason(2, None) == "nft trace: not this node's namespace"
    assert t._no_trace_reason(1, None) is None


# --- node/netns.py node_devices: what choose() is given, read by raw rtnetlink dumps --------
import socket as _socket
import struct as _struct

from nptrace.node import netns as _netns
from nptrace.node.nlmsg import NLMSG_DONE as _DONE, NLMSG_ERROR as _ERROR, request as _request

# Captured with node_devices' own requests in a namespace holding lo and eth0 (a veth, up,
# 192.0.2.10/24, its IPv6 link-local) and routes `default via 192.0.2.1`, 198.51.100.0/24:
# the kernel's address dump (lo 127.0.0.1 and ::1 in host scope, eth0's link-local in link
# scope: left out) and its route dump of every family (the local table's routes, the prefixes
# and IPv6's multicast and link-local routes: left out).
REAL_ADDRS = bytes.fromhex(
    "4c000000140002000100000039500000020880fe01000000080001007f000001080002007f00000107000300"
    "6c6f0000080008008000000014000600ffffffffffffffffa9e21300a9e21300500000001400020001000000"
    "39500000021880000200000008000100c000020a08000200c000020a09000300657468300000000008000800"
    "8000000014000600ffffffffffffffffaae21300aae21300500000001400020001000000395000000a8080fe"
    "01000000140001000000000000000000000000000000000114000600ffffffffffffffffa9e21300a9e21300"
    "080008008000000005000b0001000000500000001400020001000000395000000a4080fd0200000014000100"
    "fe80000000000000c01addfffe66b10114000600ffffffffffffffffaae21300aae213000800080080000000"
    "05000b00030000001400000003000200010000003950000000000000")
REAL_ROUTES = bytes.fromhex(
    "3400000018000200010000003950000002000000fe0300010000000008000f00fe00000008000500c0000201"
    "08000400020000003c00000018000200010000003950000002180000fe02fd010000000008000f00fe000000"
    "08000100c000020008000700c000020a08000400020000003c00000018000200010000003950000002180000"
    "fe0300010000000008000f00fe00000008000100c633640008000500c000020108000400020000003c000000"
    "18000200010000003950000002080000ff02fe020000000008000f00ff000000080001007f00000008000700"
    "7f00000108000400010000003c00000018000200010000003950000002200000ff02fe020000000008000f00"
    "ff000000080001007f000001080007007f00000108000400010000003c000000180002000100000039500000"
    "02200000ff02fd030000000008000f00ff000000080001007fffffff080007007f0000010800040001000000"
    "3c00000018000200010000003950000002200000ff02fe020000000008000f00ff00000008000100c000020a"
    "08000700c000020a08000400020000003c00000018000200010000003950000002200000ff02fd0300000000"
    "08000f00ff00000008000100c00002ff08000700c000020a0800040002000000740000001800020001000000"
    "395000000a400000fe0200010000000008000f00fe00000014000100fe800000000000000000000000000000"
    "0800060000010000080004000200000024000c00000000000000000000000000000000000000000000000000"
    "00000000000000000500140000000000740000001800020001000000395000000a800000ff02000200000000"
    "08000f00ff000000140001000000000000000000000000000000000108000600000000000800040001000000"
    "24000c0000000000000000000000000000000000000000000000000000000000000000000500140000000000"
    "740000001800020001000000395000000a800000ff0200020000000008000f00ff00000014000100fe800000"
    "00000000c01addfffe66b1010800060000000000080004000200000024000c00000000000000000000000000"
    "0000000000000000000000000000000000000000050014000000000074000000180002000100000039500000"
    "0a080000ff0200050000000008000f00ff00000014000100ff00000000000000000000000000000008000600"
    "00010000080004000200000024000c0000000000000000000000000000000000000000000000000000000000"
    "0000000005001400000000001400000003000200010000003950000000000000")


def _nla(atype, payload):
    return _struct.pack("=HH", 4 + len(payload), atype) + payload + bytes(-len(payload) % 4)


def _link(index, name, *, kind=None, master=0, up=True, arphrd=1):
    body = _nla(3, name.encode() + b"\0")                            # IFLA_IFNAME
    body += _nla(7, bytes(64))                                       # IFLA_STATS: skipped
    if master:
        body += _nla(10, _struct.pack("=I", master))                  # IFLA_MASTER
    if kind is not None:                                             # IFLA_LINKINFO
        body += _nla(18, _nla(1, kind.encode() + b"\0") + _nla(2, bytes(8)))
    head = _struct.pack("=BxHiII", 0, arphrd, index, 0x1 if up else 0, 0)
    return _request(16, 2, 1, head + body)                            # RTM_NEWLINK, multi


def _addr(index, family, text, scope=0, attrs=None):
    raw = _socket.inet_pton(family, text)
    body = attrs if attrs is not None else _nla(2, raw) + _nla(1, raw)   # IFA_LOCAL, IFA_ADDRESS
    head = _struct.pack("=BBBBI", family, 24, 0, scope, index)
    return _request(20, 2, 2, head + body)                            # RTM_NEWADDR


def _route(family, dst_len=0, table=254, body=b""):
    head = _struct.pack("=BBBBBBBBI", family, dst_len, 0, 0, table, 3, 0, 1, 0)
    return _request(24, 2, 3, head + body)                            # RTM_NEWROUTE


def _done():
    return _request(_DONE, 2, 1, _struct.pack("=i", 0))


def _parse(*chunks):
    links, addrs, default = {}, {}, set()
    ends = [_netns.parse_devices(c, links, addrs, default) for c in chunks]
    return links, addrs, default, ends


def test_parse_devices_links_kind_master_type_and_up():
    data = (_link(1, "lo", arphrd=772) + _link(2, "eth0", kind="veth") +
            _link(3, "cni0", kind="bridge") + _link(4, "vethp0", kind="veth", master=3) +
            _link(5, "tunl0", kind="ipip", up=False, arphrd=768))
    links, addrs, default, ends = _parse(data, _done())
    assert ends == [False, True] and not addrs and not default
    assert links == {1: ("lo", "", 772, 0, True), 2: ("eth0", "veth", 1, 0, True),
                     3: ("cni0", "bridge", 1, 0, True), 4: ("vethp0", "veth", 1, 3, True),
                     5: ("tunl0", "ipip", 768, 0, False)}


def test_parse_devices_a_real_address_dump_keeps_what_is_wider_than_link_scope():
    _, addrs, _, ends = _parse(REAL_ADDRS)
    assert addrs == {2: ["192.0.2.10"]} and ends == [True]


def test_parse_devices_link_and_host_scope_addresses_are_left_out():
    data = (_addr(7, _socket.AF_INET6, "fe80::1", scope=253) +
            _addr(7, _socket.AF_INET, "127.0.0.1", scope=254) +
            _addr(7, _socket.AF_INET, "10.0.0.5") + _addr(7, _socket.AF_INET6, "fd00::5") +
            _addr(7, _socket.AF_INET6, "fec0::5", scope=200) +
            _addr(8, _socket.AF_INET, "10.0.0.6", attrs=_nla(2, bytes(4))))   # no IFA_ADDRESS
    _, addrs, _, _ = _parse(data)
    assert addrs == {7: ["10.0.0.5", "fd00::5", "fec0::5"], 8: ["?"]}


def test_parse_devices_a_real_route_dump_finds_the_default_route_s_device():
    _, _, default, ends = _parse(REAL_ROUTES)
    assert default == {2} and ends == [True]


def test_parse_devices_default_routes_main_table_only_multipath_hops_included():
    oif = lambda i: _nla(4, _struct.pack("=i", i))                   # RTA_OIF
    hop = lambda i: _struct.pack("=HBBi", 8, 0, 0, i)                 # struct rtnexthop
    data = (_route(_socket.AF_INET, body=oif(2)) +
            _route(_socket.AF_INET, dst_len=24, body=oif(3)) +          # a prefix
            _route(_socket.AF_INET, table=100, body=oif(4)) +           # another table
            _route(_socket.AF_INET, table=252, body=_nla(15, _struct.pack("=I", 1000)) + oif(5))
            + _route(_socket.AF_INET6, body=_nla(9, hop(6) + hop(7)))   # RTA_MULTIPATH
            + _route(_socket.AF_INET6, table=255, body=oif(8))          # local table
            + _route(128, body=oif(9)))                                 # ipmr: not a route of ours
    _, _, default, _ = _parse(data)
    assert default == {2, 6, 7}


def test_parse_devices_an_error_raises_and_a_truncated_message_ends_the_walk():
    import pytest
    err = _request(_ERROR, 0, 1, _struct.pack("=i", -1) + bytes(16))
    with pytest.raises(OSError):
        _parse(err)
    whole = _link(2, "eth0", kind="veth")
    links, _, _, ends = _parse(whole + whole[:30])
    assert list(links) == [2] and ends == [False]
    links, _, _, _ = _parse(_request(16, 2, 1, bytes(8)))              # shorter than ifinfomsg
    assert links == {}


def test_node_devices_reads_our_own_namespace_without_root():
    devs = {d.name: d for d in _netns.node_devices()}
    lo = devs["lo"]
    assert lo.arphrd == 772 and lo.kind == "" and lo.addrs == () and isinstance(lo, Device)
    assert "lo" not in choose(list(devs.values())).names()


# --- node/ifwatch.py IfaceWatch: one link dump per namespace per poll ------------------------
def test_iface_watch_dumps_each_namespace_once_a_poll(monkeypatch):
    from nptrace.node import ifwatch
    dumps = []

    def link_names(path):
        dumps.append(path)
        return {2: "eth0", 3: "cni0", 4: "flannel.1"} if path is None else {9: "eth0"}
    monkeypatch.setattr(ifwatch, "link_names", link_names)
    monkeypatch.setattr(ifwatch, "host_inode", lambda: 42)
    monkeypatch.setattr(ifwatch, "inode_of", lambda path: 77)
    tc = FakeTc()
    specs = [IfaceSpec(None, n) for n in ("eth0", "cni0", "flannel.1", "gone0")] + \
        [IfaceSpec("pod", "eth0")]
    lines = []
    w = ifwatch.IfaceWatch(specs, tc, lines.append, clock=lambda: 0.0)
    w.poll(force=True)
    assert sorted(dumps, key=str) == ["/run/netns/pod", None]
    assert ("attach", "flannel.1", 4) in tc.calls and ("attach", "eth0", 9) in tc.calls
    assert any("gone0 disappeared" in ln for ln in lines)
    w.poll(force=True)
    assert len(dumps) == 4                              # the next poll reads them again
    assert ifwatch.where_now(IfaceSpec(None, "cni0")) == (42, 3) and len(dumps) == 5


# --- node/scope.py NodeScope: link announcements only, sorted when the veths changed --------
def test_node_scope_sorts_again_only_when_this_namespace_s_veths_changed(monkeypatch):
    from nptrace.node import ifwatch, scope
    monkeypatch.setattr(scope, "host_inode", lambda: 1)
    groups = []

    class Ev(Events):
        def __init__(self, g):
            super().__init__()
            groups.append(g)

        def close(self):
            pass
    monkeypatch.setattr(ifwatch, "LinkEvents", Ev)
    sorts, now = [], [0.0]
    mine = {"v": {5: (2, 0)}}

    def sort():
        sorts.append(now[0])
        return {2: "/run/netns/pod"}, {3}
    s = scope.NodeScope(lambda others: None, lambda _: None, sort=sort, clock=lambda: now[0],
                        snapshot=lambda: dict(mine["v"]))
    s.start()
    assert groups == [ifwatch.RTMGRP_LINK] and len(sorts) == 1
    s.events.pending, now[0] = True, 1.0        # a port forwarding, an address: same veths
    s.poll()
    assert len(sorts) == 1 and s.unchanged == 1
    mine["v"] = {6: (2, 1)}                      # a pod re-created: its veth is a new one
    s.events.pending, now[0] = True, 2.0
    s.poll()
    assert len(sorts) == 2
    s.events.pending, now[0] = True, 2.1          # within MIN_GAP_S: held, then looked at
    s.poll()
    assert len(sorts) == 2 and s.unchanged == 1
    now[0] = 2.3
    s.poll()
    assert len(sorts) == 2 and s.unchanged == 2
    now[0] = 2.0 + scope.RESCAN_S + 0.1       # the rescan sorts whatever the veths say
    s.poll()
    assert len(sorts) == 3
    s.snapshot = lambda: None                    # veths unreadable: sorted
    s.events.pending, now[0] = True, 3.0 + scope.RESCAN_S
    s.poll()
    assert len(sorts) == 4


def test_link_events_subscribe_to_the_groups_asked_for():
    from nptrace.node.ifwatch import RTMGRP_LINK, RTMGRP_LINK_ADDR_ROUTE, LinkEvents
    for groups in (RTMGRP_LINK, RTMGRP_LINK_ADDR_ROUTE):
        ev = LinkEvents(groups)
        try:
            assert ev.sock.getsockname()[1] == groups and ev.changed() is False
        finally:
            ev.close()
    assert LinkEvents().sock.getsockname()[1] == RTMGRP_LINK_ADDR_ROUTE
