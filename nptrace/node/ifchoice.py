"""Which devices `nptrace run` attaches its tc programs to when no --iface is given.

The tc programs see what the tracepoints cannot: a packet's tuple before and after NAT on the
wire, and so the tie between a NodePort's DNAT on one node and a drop on another. They belong
on the devices that carry the node's traffic, and nowhere else:
- a device holding one of the node's addresses (wider than link scope), or one a default
  route leaves by: the NIC, a bond or VLAN over it, the node's end of a lab's veth;
- an overlay device (VXLAN, Geneve): flannel.1, vxlan.calico, cilium_vxlan, genev_sys_6081;
- a bridge: a CNI's pod bridge (cni0, docker0), where a node's pods meet.
Left out, and said so: the loopback; ports of a bridge or bond (the bridge or bond is chosen);
pods' veths (no address, no default route: their number grows with the pods, and every packet
of theirs crosses a chosen bridge or the node's routing anyway; name one with --iface);
dummy devices (kube-ipvs0 holds every ClusterIP and carries no packets); and devices whose
packets do not start with an Ethernet header (IPIP, GRE, WireGuard), which nptrace's tc parser
needs: their packets are seen encapsulated on the underlay device.

`choose` is pure (tests give it devices); node/netns.py node_devices reads them.
"""
from __future__ import annotations

from dataclasses import dataclass

from nptrace.kernel.tc import ETHERNET_LINK_TYPES

OVERLAYS = ("vxlan", "geneve")
ARPHRD_LOOPBACK = 772
NO_PACKETS = ("dummy",)


@dataclass(frozen=True)
class Choice:
    chosen: tuple[tuple[str, int, str], ...]   # (name, ifindex, why)
    left: tuple[tuple[str, str], ...]           # (name, why) worth saying
    pod_veths: int = 0                          # veths left out as pods' ends
    present: frozenset[str] = frozenset()       # every device's name

    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _, _ in self.chosen)

    def line(self) -> str:
        """What the start line says of the choice."""
        got = ", ".join(f"{n} ({why})" for n, _, why in self.chosen) or "none yet"
        out = [f"interfaces chosen automatically: {got}"]
        left = [f"{n} ({why})" for n, why in self.left]
        if self.pod_veths:
            left.append(f"{self.pod_veths} pod veth{'s' if self.pod_veths != 1 else ''}")
        if left:
            out.append("left out: " + ", ".join(left))
        out.append("--iface names them instead, --iface none attaches to none")
        return "; ".join(out)


def _addr_text(addrs: tuple[str, ...]) -> str:
    return addrs[0] + (f" +{len(addrs) - 1}" if len(addrs) > 1 else "")


def choose(devices) -> Choice:
    """The devices (kernel/netlink.py Device) to trace, in their index order."""
    by_index = {d.ifindex: d for d in devices}
    chosen: list[tuple[str, int, str]] = []
    left: list[tuple[str, str]] = []
    pods = 0
    for d in sorted(devices, key=lambda d: d.ifindex):
        if d.arphrd == ARPHRD_LOOPBACK:
            continue
        why = []
        if d.default_route:
            why.append("default route")
        if d.addrs:
            why.append(_addr_text(d.addrs))
        if d.kind in OVERLAYS:
            why.insert(0, f"{d.kind} overlay")
        elif d.kind == "bridge":
            why.insert(0, "bridge")
        if d.kind in NO_PACKETS:
            if d.addrs:
                left.append((d.name, f"{d.kind}: holds addresses, carries no packets"))
            continue
        if d.master and d.master in by_index:
            if d.kind == "veth":
                pods += 1           # a pod's end on the CNI bridge: the bridge is chosen
            continue
        if not why:
            if d.kind == "veth":
                pods += 1
            continue
        if d.arphrd not in ETHERNET_LINK_TYPES:
            left.append((d.name, f"{d.kind or 'link type ' + str(d.arphrd)}: no Ethernet "
                         "header; its packets are seen on the underlay"))
            continue
        chosen.append((d.name, d.ifindex, ", ".join(why)))
    return Choice(tuple(chosen), tuple(left), pods, frozenset(d.name for d in devices))
