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
