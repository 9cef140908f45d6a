"""What `explain` knows about the node, as plain data: gather.py fills it in from the node,
unit tests from fixtures, and `explain -o json` prints it beside the prediction."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Route:
    """One `ip route get` answer: the command, the interface, the gateway, or the error."""
    cmd: str
    dev: str | None = None
    via: str | None = None
    type: str = "unicast"      # unicast | local | error
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.type != "error"


@dataclass
class Facts:
    client: str                          # the client's address, as the node sees it
    dst: str                             # the address the client connects to
    port: int
    netns: str | None = None             # the node's namespace (None: this one)
    iif: str | None = None               # the interface the SYN arrives on
    iif_source: str = ""                 # given | address (it holds dst) | route (toward client)
    addrs: dict = field(default_factory=dict)          # iface -> [address, ...]
    rp_filter: dict = field(default_factory=dict)      # "all" and iface -> 0/1/2
    route_to_client: Route | None = None               # the reply's route back
    syn_routes: dict = field(default_factory=dict)     # endpoint address -> Route (iif iif)
    sysctl: dict = field(default_factory=dict)         # nf_conntrack_tcp_* -> int
    local_pods: dict = field(default_factory=dict)     # address -> {"netns", "listen": [port]}
    probes: dict = field(default_factory=dict)         # "ip:port" -> {"outcome", "error"}
    rules: list = field(default_factory=list)          # [(backend, dump text)]
    # the client's open connections to dst:port in conntrack (gather.inflight): [{"sport",
    # "state", "ep" (the DNATed endpoint, its reply source), "peer" (the endpoint's view of
    # the client: the reply destination), "socket" (a local pod holds that connection:
    # true/false; null: not a local pod)}]; None: not looked (older fixtures)
    inflight: list | None = None
    # the namespace's own counters (gather.counters), read before the probes: nf_conntrack_count
    # and _max, conntrack's drop / insert_failed / early_drop (`conntrack -S`), TcpInCsumErrors
    # and UdpInCsumErrors (/proc/net/snmp, as nstat names them); {}: none readable
    counters: dict = field(default_factory=dict)
    # their increase over a window: gather's own run (the probes), and with --confirm the trace
    # too: {"seconds": s, name: increase}; None: read once (older fixtures)
    moved: dict | None = None

    def local_addrs(self) -> set[str]:
        return {a for lst in self.addrs.values() for a in lst}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rules"] = [{"backend": b, "lines": len(t.splitlines())} for b, t in self.rules]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Facts":
        d = dict(d)
        if d.get("route_to_client") is not None:
            d["route_to_client"] = Route(**d["route_to_client"])
        d["syn_routes"] = {k: Route(**v) for k, v in d.get("syn_routes", {}).items()}
        d["rules"] = [tuple(r) for r in d.get("rules", [])]
        return cls(**d)
