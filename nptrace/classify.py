"""Attribution: decoded kernel events in, labeled verdicts out.

A pure function of its inputs: no I/O, no clock (time is `event.ts_ns`), no globals. What it
knows about the node (reason names, interface names, kube-proxy services) arrives in a
`Context` built by the caller. The same code runs live and over recorded sessions (`replay`).

Each reset or drop is labeled once, when it is seen, from what the flow showed up to then
(earlier drops, NAT tuples, asymmetric replies) and from what the event itself says. The rules
are ordered, first match wins; add a cause by adding a rule function to RULES.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from nptrace.events import (Dir, Event, EvType, F_HAS_SOCK, HOOK_NAMES, TCP_ACK, TCP_SYN)

CAUSES = (
    "no_local_endpoint", "no_endpoints", "rp_filter", "snat", "wrong_iface", "policy_drop",
    "netfilter_reject", "conntrack_invalid", "no_listener", "proxy", "app_reset", "peer_reset",
    "unknown",
)
# Causes that are not a fault of the network path (a healthy or app-driven flow).
NOT_NETWORK = frozenset({"app_reset"})

KIND = {
    EvType.DROP: "drop", EvType.RST_SENT: "rst", EvType.RST_RECV: "rst",
    EvType.WIRE_RST: "rst", EvType.ICMP_UNREACH: "drop", EvType.WIRE_ICMP: "drop",
    EvType.SYN_RETX: "drop", EvType.ASYM_IFACE: "anomaly", EvType.ASYM_SRC: "anomaly",
}
# Causes that a later event of the same flow replaces with the flow's first real cause.
INHERITS = frozenset({"peer_reset", "unknown"})
# Events that are only evidence for others: never a verdict line of their own.
EVIDENCE_ONLY = frozenset({EvType.SYNACK_RETX, EvType.NF_VIEW})
# Drop reasons that healthy traffic also shows (teardown races, requests killed by a RST):
# labeled only when their flow already has a cause, never reported as unknown on their own.
WEAK_DROPS = frozenset({"NOT_SPECIFIED", "TCP_INVALID_SEQUENCE", "TCP_RESET", "TCP_CLOSE",
                        "SOCKET_CLOSE", "TCP_FLAGS", "TCP_ZEROWINDOW", "TCP_OVERWINDOW",
                        "TCP_OFO_DROP", "TCP_INVALID_ACK_SEQUENCE", "TCP_ACK_UNSENT_DATA"})


@dataclass(frozen=True)
class Evidence:
    ts_ns: int
    hook: str
    what: str          # reason name or event type
    iface: str | None
    detail: str = ""

    def to_dict(self) -> dict:
        return {"ts_ns": self.ts_ns, "hook": self.hook, "what": self.what, "iface": self.iface,
                "detail": self.detail}


@dataclass(frozen=True)
class Verdict:
    event: Event
    kind: str                 # rst | drop | anomaly
    direction: str | None     # sent | received | forwarded (resets)
    hook: str
    reason: str
    cause: str
    confidence: float
    hint: str
    iface: str | None
    service: str | None = None
    evidence: tuple[Evidence, ...] = ()


def _no_names(_netns: int, _ifindex: int) -> str | None:
    return None


@dataclass
class Context:
    """What the classifier may know about the node. Plain data and pure lookups."""
    drop_name: Callable[[int], str] = lambda v: f"REASON_{v}"
    rst_name: Callable[[int], str] = lambda v: f"REASON_{v}"
    iface_name: Callable[[int, int], str | None] = _no_names
    # (addr, port) -> "ns/svc:port" (services.py); None when no rules are known.
    service_of: Callable[[str, int], str | None] = lambda a, p: None
    # netns inode -> services.ServiceMap of that namespace's netfilter rules, or None.
    rules: Callable[[int], object | None] = lambda netns: None
    # (netns inode, address) -> the interface the route to address leaves by, or None.
    route_iface: Callable[[int, str], str | None] = lambda netns, addr: None
    window_ns: int = 30 * 1_000_000_000     # how long a flow's history is kept
    max_flows: int = 65536                  # bound on the correlation state


def reason_name(ev: Event, ctx: Context) -> str:
    t = ev.type
    if t == EvType.DROP:
        return ctx.drop_name(ev.reason)
    if t == EvType.RST_SENT:
        return ctx.rst_name(ev.reason)
    if t in (EvType.ICMP_UNREACH, EvType.WIRE_ICMP):
        return f"ICMP_{ev.reason >> 8}_{ev.reason & 0xff}"
    return t.name


def flow_key(ev: Event) -> tuple:
    """Direction-free 4-tuple, so a request and its reply share a key."""
    a, b = (ev.saddr, ev.sport), (ev.daddr, ev.dport)
    return (a, b) if a <= b else (b, a)


@dataclass
class Flow:
    events: list = field(default_factory=list)   # (Event, reason name) in arrival order
    last_ns: int = 0
    cause: str | None = None                     # first network cause found for this flow
    hint: str = ""
    confidence: float = 0.0


class Classifier:
    """Correlation state over a stream of events; bounded by ctx.max_flows and ctx.window_ns."""

    def __init__(self, ctx: Context | None = None):
        self.ctx = ctx or Context()
        self.flows: OrderedDict[tuple, Flow] = OrderedDict()

    # -- correlation state -------------------------------------------------------------
    def _flow(self, ev: Event) -> Flow:
        keys = [flow_key(ev)]
        if ev.ct is not None:
            c = ev.ct
            keys.append(_pair((c.orig_src, c.orig_sport), (c.orig_dst, c.orig_dport)))
            keys.append(_pair((c.reply_src, c.reply_sport), (c.reply_dst, c.reply_dport)))
        flow = None
        for k in keys:
            flow = self.flows.get(k)
            if flow is not None:
                break
        if flow is None:
            flow = Flow()
        for k in keys:   # NAT: both tuples of one connection point at one Flow
            self.flows[k] = flow
            self.flows.move_to_end(k)
        flow.last_ns = ev.ts_ns
        self._expire(ev.ts_ns)
        return flow

    def _expire(self, now_ns: int) -> None:
        while self.flows:
            k, f = next(iter(self.flows.items()))
            if len(self.flows) > self.ctx.max_flows or now_ns - f.last_ns > self.ctx.window_ns:
                self.flows.popitem(last=False)
            else:
                break

    # -- labeling ----------------------------------------------------------------------
    def feed(self, ev: Event) -> Verdict | None:
        ctx = self.ctx
        flow = self._flow(ev)
        rname = reason_name(ev, ctx)
        history = list(flow.events)
        flow.events.append((ev, rname))
        if len(flow.events) > 32:
            del flow.events[:-32]
        if ev.type in EVIDENCE_ONLY:
            return None
        iface = ctx.iface_name(ev.netns, ev.ifindex) if ev.ifindex else None
        for rule in RULES:
            got = rule(ev, rname, history, ctx)
            if got:
                cause, conf, hint = got
                break
        else:
            cause, conf, hint = "unknown", 0.0, ("no rule explains this event; the evidence "
                                                 "lists what the kernel showed")
        if cause == "unknown" and not flow.cause and self._weak(ev, rname):
            return None
        if flow.cause and cause in INHERITS:
            # The same connection already showed its cause (the RST the client receives was
            # sent because of it): say so rather than blame the peer.
            cause, conf, hint = flow.cause, flow.confidence, flow.hint
        elif cause not in INHERITS and flow.cause is None:
            flow.cause, flow.confidence, flow.hint = cause, conf, hint
        service = _service(ev, ctx)
        evidence = tuple(_evidence(e, r, ctx) for e, r in history[-8:]) + (_evidence(ev, rname, ctx),)
        hint = _fill(hint, iface=iface or f"ifindex {ev.ifindex}", port=str(ev.dport),
                     sport=str(ev.sport), daddr=ev.daddr, saddr=ev.saddr,
                     service=service or "the Service")
        return Verdict(ev, KIND.get(ev.type, "drop"), _direction(ev), HOOK_NAMES[ev.hook], rname,
                       cause, conf, hint, iface, service, evidence)

    @staticmethod
    def _weak(ev: Event, rname: str) -> bool:
        return ev.type == EvType.DROP and rname in WEAK_DROPS


def _fill(text: str, **vals: str) -> str:
    """Fill {name} placeholders; rule texts quoted in hints keep their own braces (nft sets)."""
    for k, v in vals.items():
        text = text.replace("{" + k + "}", v)
    return text


def classify(events: Iterable[Event], ctx: Context | None = None) -> Iterator[Verdict]:
    """The whole attribution as one pure function over an event stream."""
    c = Classifier(ctx)
    for ev in events:
        v = c.feed(ev)
        if v is not None:
            yield v


def _pair(a, b):
    return (a, b) if a <= b else (b, a)


def _direction(ev: Event) -> str | None:
    if ev.type == EvType.RST_SENT:
        return "sent"
    if ev.type == EvType.RST_RECV:
        return "received"
    if ev.type == EvType.WIRE_RST:
        return "forwarded"
    return None


def _service(ev: Event, ctx: Context) -> str | None:
    cands = [(ev.daddr, ev.dport), (ev.saddr, ev.sport)]
    if ev.ct is not None:
        cands[:0] = [(ev.ct.orig_dst, ev.ct.orig_dport), (ev.ct.reply_src, ev.ct.reply_sport)]
    for addr, port in cands:
        s = ctx.service_of(addr, port)
        if s:
            return s
    return None


def _evidence(ev: Event, rname: str, ctx: Context) -> Evidence:
    iface = ctx.iface_name(ev.netns, ev.ifindex) if ev.ifindex else None
    detail = f"{ev.saddr}:{ev.sport} > {ev.daddr}:{ev.dport}"
    if ev.ct is not None and ev.ct.dnat:
        detail += f" (dnat {ev.ct.orig_dst}:{ev.ct.orig_dport} -> {ev.ct.reply_src}:{ev.ct.reply_sport})"
    return Evidence(ev.ts_ns, HOOK_NAMES[ev.hook], rname, iface, detail)


# --- rules: (event, reason name, earlier events of the flow, ctx) -> (cause, confidence, hint)
Rule = Callable[[Event, str, list, Context], "tuple[str, float, str] | None"]

SYNACK = TCP_SYN | TCP_ACK


def _answered(ev: Event) -> int:
    """TCP flags of the packet a NO_SOCKET reset or drop was about."""
    return ev.aux if ev.type == EvType.RST_SENT else ev.tcpflags


def _is_nf_reject(ev: Event, rname: str) -> bool:
    return (ev.type == EvType.DROP and rname == "NETFILTER_DROP") or \
        (ev.type in (EvType.ICMP_UNREACH, EvType.WIRE_ICMP) and ev.reason >> 8 == 3
         and ev.reason & 0xff in (3, 9, 10, 13))


def _orig_dst(ev: Event) -> tuple[str, int]:
    if ev.ct is not None and ev.ct.dnat:
        return ev.ct.orig_dst, ev.ct.orig_dport
    return ev.daddr, ev.dport


def rule_rp_filter(ev, rname, history, ctx):
    if ev.type == EvType.DROP and rname == "IP_RPFILTER":
        back = ctx.route_iface(ev.netns, ev.saddr)
        via = f" while the route back to {{saddr}} leaves by {back}" if back else ""
        return ("rp_filter", 0.95,
                "strict reverse-path filter dropped a packet from {saddr} arriving on {iface}"
                + via + ": use loose mode (sysctl -w net.ipv4.conf.all.rp_filter=2 and "
                "net.ipv4.conf.<iface>.rp_filter=2 for {iface}) or route replies back the way "
                "requests came")
    return None


def rule_unexpected_reply(ev, rname, history, ctx):
    """A SYN-ACK its receiver never asked for: the reply left with the pod's own source."""
    if ev.type == EvType.ASYM_SRC:
        return ("snat", 0.85,
                "the reply from {saddr}:{sport} leaves without being translated back to the "
                "address the client connected to: masquerade the forwarded traffic "
                "(externalTrafficPolicy: Cluster) or keep replies on the node that DNATed them "
                "(externalTrafficPolicy: Local)")
    if rname == "NO_SOCKET" and ev.type in (EvType.RST_SENT, EvType.DROP) \
            and _answered(ev) & SYNACK == SYNACK:
        peer = (ev.daddr, ev.dport) if ev.type == EvType.RST_SENT else (ev.saddr, ev.sport)
        return ("snat", 0.9,
                f"{peer[0]}:{peer[1]} answered a connection the client made to another address: "
                "the reply was not un-NATed (it left by another node or path than the DNAT); "
                "the client reset it. Masquerade forwarded NodePort traffic "
                "(externalTrafficPolicy: Cluster with KUBE-POSTROUTING MASQUERADE) or use "
                "externalTrafficPolicy: Local, or the PROXY protocol to keep the client address")
    return None


def rule_wrong_iface(ev, rname, history, ctx):
    if ev.type == EvType.ASYM_IFACE:
        back = ctx.iface_name(ev.netns, ev.aux) or f"ifindex {ev.aux}"
        return ("wrong_iface", 0.85,
                f"the request came in on {back} but the reply leaves by {{iface}}: a stateful "
                "middlebox or the peer on the other path will drop or reset it. Add policy "
                "routing (ip rule from <secondary address> table N) so replies leave by the "
                "interface the request came in on")
    return None


def rule_conntrack_invalid(ev, rname, history, ctx):
    if not (ev.type == EvType.DROP and rname == "NETFILTER_DROP"):
        return None
    if ev.ct is not None or ev.tcpflags & TCP_SYN:
        return None
    smap = ctx.rules(ev.netns)
    if smap is None:
        return None
    for r in smap.verdict_rules(ev.daddr, ev.dport):
        if r.reason == "conntrack_invalid":
            return ("conntrack_invalid", 0.85,
                    f"conntrack marked a mid-connection packet INVALID (out of window or for a "
                    f"forgotten connection) and {r.where()} dropped it: `{r.text}`. Check for "
                    "asymmetric paths and conntrack table pressure; "
                    "net.netfilter.nf_conntrack_tcp_be_liberal=1 makes conntrack accept it")
    return None


_TAG_CAUSE = {
    "no_local_endpoint": ("no_local_endpoint", 0.95,
                          "{service} has externalTrafficPolicy: Local and no ready endpoint on "
                          "this node, so kube-proxy drops NodePort traffic here ({rule}). Let the "
                          "load balancer use the Service's healthCheckNodePort so it skips this "
                          "node, run the backend on every node (DaemonSet), or use "
                          "externalTrafficPolicy: Cluster"),
    "no_endpoints": ("no_endpoints", 0.95,
                     "{service} has no ready endpoints: kube-proxy rejects with ICMP port "
                     "unreachable ({rule}); the client sees connection refused. Check the "
                     "Deployment's replicas and readiness probes (kubectl get endpointslices)"),
    "lb_source_range": ("policy_drop", 0.85,
                        "{saddr} is outside {service}'s loadBalancerSourceRanges ({rule}): add "
                        "the client range to spec.loadBalancerSourceRanges"),
    "conntrack_invalid": ("conntrack_invalid", 0.7,
                          "conntrack deemed the packet INVALID ({rule})"),
}


def rule_netfilter(ev, rname, history, ctx):
    if not _is_nf_reject(ev, rname):
        return None
    smap = ctx.rules(ev.netns)
    service = _service(ev, ctx) or "the Service"
    if smap is not None:
        odst, oport = _orig_dst(ev)
        for r in smap.verdict_rules(odst, oport, include_invalid=False):
            if r.reason in _TAG_CAUSE:
                cause, conf, hint = _TAG_CAUSE[r.reason]
                return (cause, conf, hint.replace("{service}", r.service or service)
                        .replace("{rule}", f"{r.where()}: {r.text}"))
        rules = smap.matching_drop_rules(ev.saddr, ev.daddr, ev.dport,
                                         ctstate="NEW" if ev.tcpflags & TCP_SYN else None)
        rules = [r for r in rules if r.reason == "other"] or rules
        if rules:
            r = rules[0]
            to_pod = ev.ct is not None and ev.ct.dnat or \
                bool(ctx.service_of(ev.daddr, ev.dport)) and (ev.daddr, ev.dport) != _orig_dst(ev)
            if to_pod or _is_endpoint(smap, ev.daddr, ev.dport):
                return ("policy_drop", 0.85,
                        f"a netfilter rule dropped traffic from {{saddr}} to the pod "
                        f"{{daddr}}:{{port}} ({r.where()}: `{r.text}`). If it is a NetworkPolicy, "
                        f"add an ingress rule with ipBlock {ev.saddr}/32 (or the client range) for "
                        f"port {ev.dport}")
            return ("netfilter_reject", 0.75,
                    f"netfilter dropped or rejected the packet at {r.where()}: `{r.text}`")
    return ("netfilter_reject", 0.5,
            "a netfilter rule dropped or rejected this packet; the rule could not be named "
            "(no readable ruleset for this namespace): run `nptrace doctor` and iptables-save "
            "-c / nft list ruleset in the namespace")


def _is_endpoint(smap, addr: str, port: int) -> bool:
    try:
        s = smap.lookup(addr, port)
    except Exception:
        return False
    return s is not None and s.kind == "endpoint"


def rule_stale_endpoint(ev, rname, history, ctx):
    """DNAT to an address nobody answers for: the endpoint is gone, the rules are not."""
    gone = (ev.type == EvType.DROP and rname in ("NEIGH_FAILED", "IP_OUTNOROUTES", "IP_INADDRERRORS")) \
        or (ev.type in (EvType.ICMP_UNREACH, EvType.WIRE_ICMP) and ev.reason in (3 << 8 | 1, 3 << 8 | 0))
    if gone and (ev.ct is not None and ev.ct.dnat or ctx.service_of(ev.daddr, ev.dport)):
        return ("proxy", 0.8,
                "the service proxy DNATs to {daddr}:{port}, which no longer exists on the "
                "network: kube-proxy's rules are stale (endpoint deleted, sync failed or lagging). "
                "Check kube-proxy's logs and sync metrics, and the EndpointSlice of {service}")
    return None


def rule_no_listener(ev, rname, history, ctx):
    if rname == "NO_SOCKET" and ev.type in (EvType.RST_SENT, EvType.DROP) \
            and _answered(ev) & (TCP_SYN | TCP_ACK) == TCP_SYN:
        host, port = (ev.saddr, ev.sport) if ev.type == EvType.RST_SENT else (ev.daddr, ev.dport)
        return ("no_listener", 0.9,
                f"nothing listens on {host}:{port}: compare {{service}}'s targetPort with the "
                "port the container really listens on (ss -ltn in the pod)")
    return None


def rule_app_reset(ev, rname, history, ctx):
    if ev.type == EvType.RST_SENT and ev.flags & F_HAS_SOCK and rname in ("NOT_SPECIFIED", "REASON_0"):
        return ("app_reset", 0.8,
                "the application on {saddr}:{sport} aborted the connection itself (close with "
                "unread data or SO_LINGER 0): not a network fault; look at the app's logs")
    return None


def rule_peer_reset(ev, rname, history, ctx):
    if ev.type == EvType.RST_RECV or (ev.type == EvType.WIRE_RST and ev.dir == Dir.INGRESS):
        return ("peer_reset", 0.5,
                "{saddr}:{sport} reset the connection and no local cause was seen on this node")
    return None


RULES: list[Rule] = [rule_rp_filter, rule_unexpected_reply, rule_wrong_iface,
                     rule_conntrack_invalid, rule_netfilter, rule_stale_endpoint,
                     rule_no_listener, rule_app_reset, rule_peer_reset]
