"""The classifier's vocabulary and what it hands out: causes and their priority, event kinds,
the drop and reset reasons that are only evidence, the per-event label (Labeled), the incident
(Verdict, Evidence) and the node lookups the classifier may use (Context).

Pure: no I/O, no clock. rules.py decides each event's cause with these words, correlate.py groups
events into incidents; a sink needs only this module (and the names of nptrace.names).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from nptrace import names
from nptrace.events import Dir, Event, EvType, IPS_DST_NAT
from nptrace.names import HOOKS
from nptrace.text import hostport

# Plain-int aliases for the hot path: attribute access on an Enum class costs ~100 ns in
# CPython 3.11, an int module global a tenth of that.
T_DROP, T_RST_SENT, T_RST_RECV, T_ICMP, T_SYNACK_RETX, T_WIRE_RST, T_ASYM_IFACE, T_ASYM_SRC, \
    T_SYN_RETX, T_NF_VIEW, T_WIRE_ICMP = (int(t) for t in (
        EvType.DROP, EvType.RST_SENT, EvType.RST_RECV, EvType.ICMP_UNREACH, EvType.SYNACK_RETX,
        EvType.WIRE_RST, EvType.ASYM_IFACE, EvType.ASYM_SRC, EvType.SYN_RETX, EvType.NF_VIEW,
        EvType.WIRE_ICMP))
D_INGRESS = int(Dir.INGRESS)

CAUSES = (
    "no_local_endpoint", "no_endpoints", "rp_filter", "snat", "wrong_iface", "policy_drop",
    "netfilter_reject", "conntrack_invalid", "conntrack_full", "checksum", "no_listener", "proxy",
    "app_reset", "peer_reset", "unknown",
)
# Which label of a flow names its root cause: the highest here. Specific kernel verdicts come
# before what they cause (an un-NATed reply makes a middlebox or conntrack drop the client's
# answer; a drop makes a peer reset), and "where it surfaced" labels come last.
PRIORITY = ("checksum", "rp_filter", "conntrack_full", "no_local_endpoint", "no_endpoints", "policy_drop", "proxy", "snat",
            "wrong_iface", "no_listener", "conntrack_invalid", "app_reset", "netfilter_reject",
            "peer_reset", "unknown")
RANK = {c: i for i, c in enumerate(PRIORITY)}
# Causes that are not a fault of the network path.
NOT_NETWORK = frozenset({"app_reset"})
# Labels that only say where a problem surfaced: such an incident waits up to max_hold_ns for
# its flow to show a root cause.
WEAK_CAUSES = frozenset({"peer_reset", "unknown"})

KIND = {
    T_DROP: "drop", T_RST_SENT: "rst", T_RST_RECV: "rst",
    T_WIRE_RST: "rst", T_ICMP: "drop", T_WIRE_ICMP: "drop",
    T_SYN_RETX: "drop", T_ASYM_IFACE: "anomaly", T_ASYM_SRC: "anomaly",
}
# Events that are only evidence for others: they never make an incident on their own.
EVIDENCE_ONLY = frozenset({T_SYNACK_RETX, T_NF_VIEW})
# Drop reasons healthy traffic also shows (teardown races, requests killed by a RST): evidence
# when their flow has a cause, never an incident on their own.
WEAK_DROPS = frozenset({"NOT_SPECIFIED", "TCP_INVALID_SEQUENCE", "TCP_RESET", "TCP_CLOSE",
                        "SOCKET_CLOSE", "TCP_FLAGS", "TCP_ZEROWINDOW", "TCP_OVERWINDOW",
                        "TCP_OFO_DROP", "TCP_INVALID_ACK_SEQUENCE", "TCP_ACK_UNSENT_DATA"})
# sk_rst_reason values of a reset the local application caused (close with unread data,
# SO_LINGER 0 -> tcp_disconnect, shutdown under memory pressure is NOT one of them).
APP_RESETS = frozenset({"NOT_SPECIFIED", "TCP_STATE", "TCP_ABORT_ON_CLOSE", "TCP_ABORT_ON_LINGER",
                        "TCP_ABORT_ON_DATA", "TCP_DISCONNECT_WITH_DATA", "REASON_0"})
MAX_EVIDENCE = 16


@dataclass(frozen=True)
class Evidence:
    ts_ns: int
    hook: str
    what: str          # reason name or event type
    iface: str | None
    detail: str = ""
    label: str = ""    # this event's own label

    def to_dict(self) -> dict:
        return {"ts_ns": self.ts_ns, "hook": self.hook, "what": self.what, "iface": self.iface,
                "detail": self.detail, "label": self.label}


# slots: a storm makes a Verdict per reset, and a slot's store and read cost less than an
# instance dict's (incident.make_verdict sets them through their descriptors)
@dataclass(frozen=True, slots=True)
class Verdict:
    event: Event              # the primary event: the one that named the cause
    kind: str                 # rst | drop | anomaly
    direction: str | None     # sent | received | forwarded (resets)
    hook: str
    reason: str
    cause: str
    confidence: float
    hint: str
    iface: str | None
    service: str | None = None
    labeled: tuple = ()       # the incident's Labeled events, oldest first
    events: int = 1           # kernel events this incident gathers
    ctx: "Context | None" = field(default=None, repr=False, compare=False)
    # {"pod", "client_pod", "endpoint_pod"}: the pods named when the incident was made
    # (correlate.py, through the Context's pod lookups, so a session records them whatever
    # the live output was), only the keys that named one; None when none did.
    pods: dict | None = field(default=None, compare=False)
    # The connection's DNAT mapping from the kernel's NAT map (flowkey.nat_mapping), when an
    # event on another node's side of the NAT joined the flow: what `nat` falls back to.
    natmap: object = field(default=None, compare=False, repr=False)

    @property
    def nat(self):
        """The connection's NAT mapping, client -> NodePort/Service -> endpoint, from the first
        event of the incident that carried a DNAT conntrack entry, else the flow's from the
        kernel's NAT map (None if neither knows it)."""
        ct = getattr(self.event, "ct", None)
        if ct is not None and ct.dnat:
            return ct
        for x in self.labeled:
            ct = getattr(x.ev, "ct", None)
            if ct is not None and ct.dnat:
                return ct
        return self.natmap

    @property
    def snat(self):
        """Without a DNAT mapping, the first SNAT-only conntrack entry of the incident (a pod or
        the node masqueraded to a non-Service address): its original source is the client as
        the client saw itself. None otherwise."""
        for ev in (self.event, *(x.ev for x in self.labeled)):
            ct = getattr(ev, "ct", None)
            if ct is not None and ct.snat and not ct.dnat:
                return ct
        return None

    @property
    def evidence(self) -> tuple[Evidence, ...]:
        """Rendered on demand: a sink that does not print evidence does not pay for it."""
        ctx = self.ctx or Context()
        return tuple(_evidence(l, ctx) for l in self.labeled[:MAX_EVIDENCE])


def _no_names(_netns: int, _ifindex: int) -> str | None:
    return None


@dataclass
class Context:
    """What the classifier may know about the node. Plain data and pure lookups."""
    drop_name: Callable[[int], str] = lambda v: f"REASON_{v}"
    rst_name: Callable[[int], str] = lambda v: f"REASON_{v}"
    iface_name: Callable[[int, int], str | None] = _no_names
    # (netns, ifindex) -> iface_name of the other end when that interface is a veth, or None.
    iface_peer: Callable[[int, int], str | None] = _no_names
    # (netns, ifindex) -> whether that veth's other end offloads TX checksums, or None.
    peer_tx_csum: Callable[[int, int], bool | None] = lambda netns, ifindex: None
    # (addr, port) -> "ns/svc:port" (nptrace/services); None when no rules are known.
    service_of: Callable[[str, int], str | None] = lambda a, p: None
    # (addr, port) -> "ns/svc:port" when addr:port is a Service's endpoint (a pod).
    endpoint_of: Callable[[str, int], str | None] = lambda a, p: None
    # (addr, port) -> the Service whose endpoint addr:port the node's rules stopped listing
    # before the record's time (a rollout), or None (node/knowledge.py removed_endpoint)
    removed_endpoint: Callable[[str, int], str | None] = lambda a, p: None
    # (addr, port) -> {"service", "no_local": [IPVS virtual servers]} when addr:port is an
    # endpoint of an externalTrafficPolicy: Local Service (NodeKnowledge.etp_local), else None.
    etp_local: Callable[[str, int], dict | None] = lambda a, p: None
    # (netns, saddr, daddr, dport, odst, oport, syn, has_ct) -> services.nf_cause's answer on
    # that namespace's rules (live: NodeKnowledge.nf_rule; replay: the recorded answer), None
    # when no ruleset is readable.
    nf_rule: Callable[..., dict | None] = lambda *a: None
    # (saddr, sport, daddr, dport) -> the other side of that NATed connection, in its own
    # packet direction (the kernel's nat_peers map), or None.
    nat_peer: Callable[[str, int, str, int], tuple | None] = lambda *a: None
    # (netns inode, address) -> the interface the route to address leaves by, or None.
    route_iface: Callable[[int, str], str | None] = lambda netns, addr: None
    # address -> "namespace/name" of the pod that has it (node/pods.py: the Kubernetes API's
    # node-scoped watch, else crictl), or None; answered from a cache, never blocking.
    pod_of: Callable[[str], str | None] = lambda addr: None
    # network-namespace inode -> "namespace/name" of the pod whose sandbox it is (crictl
    # inspectp's netns path; via the API, the pod whose address the namespace holds), or None.
    pod_of_netns: Callable[[int], str | None] = lambda netns: None
    # record time (ts_ns, CLOCK_MONOTONIC) -> None: the lookups after it answer with the rules
    # in force at that time (NodeKnowledge.at, live); None where answers are not timed
    # (replay answers what the live run was told).
    at: Callable[[int], None] | None = None
    hold_ns: int = 1_000_000_000            # a flow quiet this long is reported
    max_hold_ns: int = 5_000_000_000        # ...and a weak one at the latest after this
    window_ns: int = 30 * 1_000_000_000     # how long a reported flow's root cause is kept
    max_flows: int = 16384                  # bound on the correlation state (~1.3 KiB a flow):
    # 5 s (max_hold) of 3000 new failing flows a second; the kernel's --max-rate sends fewer


def reason_name(ev: Event, ctx: Context) -> str:
    return names.reason_name(ev.type, ev.reason, ctx.drop_name, ctx.rst_name)

class Labeled(NamedTuple):
    """One event with its own label. A tuple: a storm makes one per record."""
    ev: Event
    rname: str
    cause: str | None            # None: evidence only
    confidence: float = 0.0
    hint: str = ""


def _detail(ev) -> str:
    """"saddr:sport > daddr:dport", IPv6 as [addr]:port (one test of the address for IPv4)."""
    if ":" in ev.saddr:
        return f"[{ev.saddr}]:{ev.sport} > [{ev.daddr}]:{ev.dport}"
    return f"{ev.saddr}:{ev.sport} > {ev.daddr}:{ev.dport}"


def evidence_dicts(v: Verdict) -> list[dict]:
    """[x.to_dict() for x in v.evidence] without the Evidence objects (the JSON hot path)."""
    ctx = v.ctx or Context()
    iface_name = ctx.iface_name
    out = []
    for l in v.labeled[:MAX_EVIDENCE]:
        ev = l.ev
        # inline, not _detail(): one `in` per evidence item on this path, no extra call
        detail = f"{ev.saddr}:{ev.sport} > {ev.daddr}:{ev.dport}" if ":" not in ev.saddr \
            else f"[{ev.saddr}]:{ev.sport} > [{ev.daddr}]:{ev.dport}"
        c = ev.ct
        if c is not None and c.status & IPS_DST_NAT:
            detail += f" (dnat {hostport(c.orig_dst, c.orig_dport)} -> {hostport(c.reply_src, c.reply_sport)})"
        out.append({"ts_ns": ev.ts_ns, "hook": HOOKS[ev.hook], "what": l.rname,
                    "iface": iface_name(ev.netns, ev.ifindex) if ev.ifindex else None,
                    "detail": detail, "label": l.cause or ""})
    return out


def _evidence(l: Labeled, ctx: Context) -> Evidence:
    ev = l.ev
    iface = ctx.iface_name(ev.netns, ev.ifindex) if ev.ifindex else None
    detail = _detail(ev)
    if ev.ct is not None and ev.ct.dnat:
        detail += f" (dnat {hostport(ev.ct.orig_dst, ev.ct.orig_dport)} -> {hostport(ev.ct.reply_src, ev.ct.reply_sport)})"
    return Evidence(ev.ts_ns, HOOKS[ev.hook], l.rname, iface, detail, l.cause or "")
