"""Node settings that decide whether NodePort traffic survives: rp_filter, conntrack, kube-proxy.

Plain reads under `root` (/proc/sys/net, /proc/net/route, /sys/class/net), so unit tests use
fixture trees. `check(netns=NAME)` runs the same reads inside a named network namespace through
`ip netns exec`, which also remounts /sys so /sys/class/net shows that namespace's devices.

rp_filter (Documentation/networking/ip-sysctl.rst): 0 off, 1 strict, 2 loose; "the max value
from conf/{all,interface}/rp_filter is used". Strict mode drops a packet when the route back to
its source leaves by another interface (kfree_skb reason IP_RPFILTER, in ip_rcv_finish_core).
Multi-homed nodes and overlay nodes route asymmetrically, so there strict mode drops NodePort
traffic that loose mode would pass.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from nptrace.errors import NptraceError
from nptrace.kernel.evidence import parse_int, read_text

__all__ = ["Finding", "Interface", "NodeChecks", "NodeError", "check", "netns_names"]

CONNTRACK_WARN = 0.8
CONNTRACK_FULL = 0.9   # above this, "nearly full"

# ARPHRD_* (uapi/linux/if_arp.h) for tunnels whose DEVTYPE is not set in uevent.
_ARPHRD_LOOPBACK, _ARPHRD_TUNNEL, _ARPHRD_IPGRE = 772, 768, 778
_OVERLAY_DEVTYPES = {"vxlan", "geneve", "wireguard"}
# flannel.1 / flannel-wg, cilium_vxlan / cilium_geneve, Calico's vxlan.calico and IPIP tunl0.
_OVERLAY_NAMES = re.compile(r"^(flannel[.-]|cilium_(vxlan|geneve|wg)|vxlan[.-]calico|tunl0$|weave$)")
# Pod-side veths of Calico (cali*) and Cilium (lxc*): their presence means a CNI that routes
# pod traffic through the node.
_CNI_NAMES = re.compile(r"^(cali|lxc)")
# Node-local bridges of CNI plugins and docker carry pod traffic whose reverse path stays on
# the bridge: neither another uplink nor a reason to warn.
_BRIDGE_NAMES = re.compile(r"^(cni0|cbr0|docker0|kube-bridge)$")

_AUTO = object()

RP_FILTER_REASON = ("strict rp_filter drops packets that arrive on an interface other than the "
                    "one the route back to their source uses (kfree_skb IP_RPFILTER); "
                    "multi-homed and overlay nodes route asymmetrically. Loose mode (2) still "
                    "drops sources with no route at all")


class NodeError(NptraceError):
    """The node could not be inspected (bad netns name, `ip netns exec` failed)."""


@dataclass(frozen=True)
class Interface:
    name: str
    kind: str                 # loopback | uplink (routed) | overlay | cni | bridge | veth | other
    rp_filter: int | None     # conf/<if>/rp_filter
    effective: int | None     # max(conf/all, conf/<if>): what the kernel applies
    routed: bool              # has an IPv4 route in the main table
    default_route: bool


@dataclass(frozen=True)
class Finding:
    check: str
    status: str               # ok | warn | missing | unknown
    detail: str
    remedy: str = ""
    cost: str = ""


@dataclass(frozen=True)
class NodeChecks:
    netns: str | None
    rp_filter_all: int | None
    interfaces: tuple[Interface, ...]
    multi_homed: bool
    overlays: tuple[str, ...]         # overlay and CNI devices seen
    conntrack_count: int | None
    conntrack_max: int | None
    kube_proxy: str                   # nft | iptables-nft | iptables-legacy | none | unknown
    ipvs_services: int | None
    findings: tuple[Finding, ...]

    def finding(self, check: str) -> Finding:
        for f in self.findings:
            if f.check == check:
                return f
        raise KeyError(check)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NodeChecks":
        return cls(**{**d,
                      "interfaces": tuple(Interface(**i) for i in d["interfaces"]),
                      "overlays": tuple(d["overlays"]),
                      "findings": tuple(Finding(**f) for f in d["findings"])})


def _routes(root: Path) -> tuple[set[str], set[str]]:
    """(interfaces with any IPv4 route, interfaces with a default route) from /proc/net/route."""
    routed, default = set(), set()
    text = read_text(root / "proc/net/route") or ""
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 8:
            continue
        routed.add(f[0])
        if f[1] == "00000000" and f[7] == "00000000":
            default.add(f[0])
    return routed, default


def _kind(root: Path, name: str, routed: bool) -> str:
    sysdir = root / "sys/class/net" / name
    dtype = parse_int(read_text(sysdir / "type"))
    uevent = read_text(sysdir / "uevent") or ""
    m = re.search(r"^DEVTYPE=(\S+)", uevent, re.M)
    devtype = m.group(1) if m else ""
    if name == "lo" or dtype == _ARPHRD_LOOPBACK:
        return "loopback"
    if devtype in _OVERLAY_DEVTYPES or dtype in (_ARPHRD_TUNNEL, _ARPHRD_IPGRE) \
            or _OVERLAY_NAMES.match(name):
        return "overlay"
    if _BRIDGE_NAMES.match(name):
        return "bridge"
    if _CNI_NAMES.match(name):
        return "cni"
    if name.startswith("veth"):
        return "veth"
    return "uplink" if routed else "other"


def _sysctl_key(name: str) -> str:
    # procps sysctl swaps '/' and '.' in dotted keys, so a dotted interface name such as
    # flannel.1 is written flannel/1 there.
    return f"net.ipv4.conf.{name.replace('.', '/')}.rp_filter"


def _rp_filter_finding(all_value: int | None, ifaces: list[Interface], multi_homed: bool,
                       overlays: list[str]) -> Finding:
    if all_value is None:
        return Finding("rp_filter", "unknown", "no /proc/sys/net/ipv4/conf/all/rp_filter")
    strict = [i for i in ifaces if i.effective == 1 and i.kind in ("uplink", "overlay")]
    if not strict:
        values = ", ".join(f"{i.name}={i.effective}" for i in ifaces
                           if i.kind in ("uplink", "overlay")) or "no uplinks"
        return Finding("rp_filter", "ok", f"no strict mode (all={all_value}; {values})")
    names = ", ".join(i.name for i in strict)
    why = []
    if multi_homed:
        why.append("multi-homed (" + ", ".join(i.name for i in ifaces if i.kind == "uplink") + ")")
    if overlays:
        why.append("overlay/CNI devices (" + ", ".join(overlays[:4])
                   + (", ..." if len(overlays) > 4 else "") + ")")
    if not why:
        return Finding("rp_filter", "ok", f"strict (1) on {names}; single-homed, no overlay")
    remedy = "sysctl -w " + " ".join(f"{_sysctl_key(i.name)}=2" for i in strict) \
        + "  # loose mode: " + RP_FILTER_REASON
    return Finding("rp_filter", "warn",
                   f"strict (1) on {names} on a node that is {' with '.join(why)}",
                   remedy=remedy, cost="NodePort packets routed asymmetrically are dropped "
                                       "(cause rp_filter)")


def _conntrack_finding(count: int | None, cmax: int | None, drops: int | None = None) -> Finding:
    dropped = (f"; conntrack's drop counter is {drops}: the table was full and new connections "
               f"were dropped (cause conntrack_full)") if drops else ""
    if count is None or cmax is None:
        return Finding("conntrack usage", "missing", "no nf_conntrack_count/_max" + dropped,
                       cost="conntrack table pressure cannot be seen")
    if cmax and (count / cmax > CONNTRACK_WARN or drops):
        full = "nearly full" if count / cmax > CONNTRACK_FULL else "a full table drops new flows"
        return Finding("conntrack usage", "warn",
                       f"{count}/{cmax} entries ({100 * count // cmax}%): {full}" + dropped,
                       remedy=f"sysctl -w net.netfilter.nf_conntrack_max={cmax * 2}",
                       cost="new connections dropped once the table is full")
    pct = f" ({100 * count // cmax}%)" if cmax else ""
    return Finding("conntrack usage", "ok", f"{count}/{cmax} entries{pct}")


def _conntrack_drops(text: str | None) -> int | None:
    """Sum over CPUs of the hex ``drop`` column of /proc/net/stat/nf_conntrack."""
    if not text:
        return None
    head, *rows = text.splitlines()
    cols = head.split()
    if "drop" not in cols:
        return None
    i = cols.index("drop")
    try:
        return sum(int(r.split()[i], 16) for r in rows if len(r.split()) > i)
    except ValueError:
        return None


def _default_backend(netns: str | None) -> str:
    from nptrace.node.rules_source import detect_backend  # written alongside; absent is fine
    return detect_backend(netns)


def _kube_proxy(backend, netns: str | None) -> tuple[str, str]:
    if backend is None:
        return "unknown", "not checked"
    try:
        return str(backend(netns)), ""
    except ImportError:
        return "unknown", "rule reader not available"
    except Exception as e:  # a missing tool or a permission error must not stop the report
        return "unknown", f"{type(e).__name__}: {e}".splitlines()[0]


_MODES = {"nft": "kube-proxy nftables mode", "iptables-nft": "iptables mode (nft backend)",
          "iptables-legacy": "iptables mode (legacy backend)"}


def _kube_proxy_finding(backend: str, why: str, ipvs_services: int | None) -> Finding:
    ipvs = f"; IPVS: {ipvs_services} virtual services (ipvs mode)" if ipvs_services else ""
    if backend in _MODES:
        return Finding("kube-proxy rules", "ok", f"{backend}: {_MODES[backend]}{ipvs}")
    if backend == "none":
        return Finding("kube-proxy rules", "ok" if ipvs else "missing",
                       "no kube-proxy rules in this namespace" + ipvs,
                       cost="no_endpoints and no_local_endpoint cannot be read from rules")
    return Finding("kube-proxy rules", "unknown", (why or backend) + ipvs)


def netns_names(root: Path = Path("/")) -> list[str]:
    """Named network namespaces (`ip netns add` creates /run/netns/<name>)."""
    try:
        return sorted(p.name for p in (Path(root) / "run/netns").iterdir())
    except OSError:
        return []


def check(root: Path = Path("/"), netns: str | None = None,
          detect_backend: Callable[[str | None], str] | None | object = _AUTO) -> NodeChecks:
    """Read the node's rp_filter, routes, devices, conntrack and kube-proxy rules.

    detect_backend(netns) names the kube-proxy rule backend; by default nptrace.node.rules_source is
    used on the real root and nothing on a fixture root.
    """
    root = Path(root)
    if netns is not None:
        if root != Path("/"):
            raise NodeError("--netns works only on the real root")
        return _check_in_netns(netns)
    if detect_backend is _AUTO:
        detect_backend = _default_backend if root == Path("/") else None

    conf = root / "proc/sys/net/ipv4/conf"
    all_value = parse_int(read_text(conf / "all/rp_filter"))
    routed, default = _routes(root)
    try:
        names = sorted(p.name for p in conf.iterdir() if p.name not in ("all", "default"))
    except OSError:
        names = []
    ifaces = []
    for name in names:
        value = parse_int(read_text(conf / name / "rp_filter"))
        eff = max(value, all_value) if value is not None and all_value is not None else value
        ifaces.append(Interface(name, _kind(root, name, name in routed), value, eff,
                                name in routed, name in default))
    uplinks = [i.name for i in ifaces if i.kind == "uplink"]
    multi_homed = len(uplinks) > 1 or len(default) > 1
    overlays = [i.name for i in ifaces if i.kind in ("overlay", "cni")]

    ct = root / "proc/sys/net/netfilter"
    count, cmax = parse_int(read_text(ct / "nf_conntrack_count")), parse_int(read_text(ct / "nf_conntrack_max"))
    drops = _conntrack_drops(read_text(root / "proc/net/stat/nf_conntrack"))

    ipvs_text = read_text(root / "proc/net/ip_vs")
    ipvs_services = None if ipvs_text is None else sum(
        1 for line in ipvs_text.splitlines() if line.startswith(("TCP ", "UDP ", "SCTP ", "FWM ")))
    backend, why = _kube_proxy(detect_backend, None)

    findings = (
        _rp_filter_finding(all_value, ifaces, multi_homed, overlays),
        _conntrack_finding(count, cmax, drops),
        _kube_proxy_finding(backend, why, ipvs_services),
    )
    return NodeChecks(None, all_value, tuple(ifaces), multi_homed, tuple(overlays),
                      count, cmax, backend, ipvs_services, findings)


def _check_in_netns(name: str) -> NodeChecks:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name in (".", ".."):
        raise NodeError(f"bad network namespace name {name!r}")
    if not (Path("/run/netns") / name).exists():
        raise NodeError(f"no network namespace {name!r} (see `ip netns list`)")
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        r = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-m", "nptrace.node.checks"],
                           capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NodeError(f"cannot inspect netns {name}: {e}") from None
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise NodeError(f"cannot inspect netns {name}: {err} (needs root)")
    try:
        checks = NodeChecks.from_dict(json.loads(r.stdout))
    except (ValueError, TypeError, KeyError) as e:
        raise NodeError(f"cannot inspect netns {name}: bad output ({e})") from None
    return NodeChecks(**{**checks.__dict__, "netns": name})


def main() -> int:
    # Child side of check(netns=...): already inside the namespace.
    print(json.dumps(check().to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
