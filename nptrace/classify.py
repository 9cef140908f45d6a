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
        if flow.cause and cause in INHERITS:
            # The same connection already showed its cause (the RST the client receives was
            # sent because of it): say so rather than blame the peer.
            cause, conf, hint = flow.cause, flow.confidence, flow.hint
        elif cause not in INHERITS and flow.cause is None:
            flow.cause, flow.confidence, flow.hint = cause, conf, hint
        service = _service(ev, ctx)
        evidence = tuple(_evidence(e, r, ctx) for e, r in history[-8:]) + (_evidence(ev, rname, ctx),)
        return Verdict(ev, KIND.get(ev.type, "drop"), _direction(ev), HOOK_NAMES[ev.hook], rname,
                       cause, conf, hint.format(iface=iface or f"ifindex {ev.ifindex}",
                                                port=ev.dport, sport=ev.sport, daddr=ev.daddr,
                                                saddr=ev.saddr, service=service or "the Service"),
                       iface, service, evidence)


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


def rule_rp_filter(ev, rname, history, ctx):
    if ev.type == EvType.DROP and rname == "IP_RPFILTER":
        return ("rp_filter", 0.95,
                "reverse-path filter dropped a packet from {saddr} arriving on {iface}: the route "
                "back to the source uses another interface. Use loose mode: sysctl -w "
                "net.ipv4.conf.{iface}.rp_filter=2 (and conf.all), or fix the return route")
    return None


def rule_no_listener(ev, rname, history, ctx):
    if (ev.type == EvType.RST_SENT and rname == "NO_SOCKET") or \
       (ev.type == EvType.DROP and rname == "NO_SOCKET"):
        port = ev.sport if ev.type == EvType.RST_SENT else ev.dport
        return ("no_listener", 0.9,
                f"nothing listens on port {port} at the final destination: check the Service's "
                "targetPort against the port the pod's container listens on")
    return None


def rule_app_reset(ev, rname, history, ctx):
    if ev.type == EvType.RST_SENT and ev.flags & F_HAS_SOCK and rname in ("NOT_SPECIFIED", "REASON_0"):
        return ("app_reset", 0.8,
                "the application on {saddr}:{sport} aborted the connection itself (close with "
                "unread data or SO_LINGER 0): not a network fault; look at the app's logs")
    return None


def rule_peer_reset(ev, rname, history, ctx):
    if ev.type == EvType.RST_RECV:
        return ("peer_reset", 0.5,
                "{saddr}:{sport} reset the connection and no local cause was seen on this node")
    return None


RULES: list[Rule] = [rule_rp_filter, rule_no_listener, rule_app_reset, rule_peer_reset]
