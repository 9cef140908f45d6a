"""Attribution: decoded kernel events in, labeled verdicts out.

A pure function of its inputs: no I/O, no clock (time is `event.ts_ns`, or the `now_ns` the
caller passes to `tick`), no globals. What it knows about the node (reason names, interface
names, netfilter rules, routes) arrives in a `Context` of plain lookups built by the caller, so
the same code runs live and over recorded sessions (`replay`).

Events are grouped per connection (flow) across NAT (both conntrack tuples of an event point
at one flow), across interfaces and across namespaces. Each event first gets its own label from
RULES (ordered, first match wins). A flow's events are held until the flow has been quiet for
`hold_ns` (the kernel reports effects before causes: a pod's RST crosses three interfaces
before its tcp_send_reset tracepoint fires) and then reported as ONE incident: the event whose
own label ranks highest in PRIORITY is the primary, its cause labels the incident, every other
event is evidence. Add a cause by adding a rule function to RULES and its name to PRIORITY.

`feed_many(events)` is the live loop's batch entry (the same verdicts as `feed` on each event,
concatenated): a reset storm is ~all new one-record flows, and per event it skips the `tick`
that cannot report anything (see Classifier).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, NamedTuple

from nptrace.events import (Dir, Event, EvType, F_ENCAP, F_HAS_SOCK, HOOK_NAMES, IPS_DST_NAT,
                            TCP_ACK, TCP_SYN)

# Plain-int aliases for the hot path: attribute access on an Enum class costs ~100 ns in
# CPython 3.11, an int module global a tenth of that.
T_DROP, T_RST_SENT, T_RST_RECV, T_ICMP, T_SYNACK_RETX, T_WIRE_RST, T_ASYM_IFACE, T_ASYM_SRC, \
    T_SYN_RETX, T_NF_VIEW, T_WIRE_ICMP = (int(t) for t in (
        EvType.DROP, EvType.RST_SENT, EvType.RST_RECV, EvType.ICMP_UNREACH, EvType.SYNACK_RETX,
        EvType.WIRE_RST, EvType.ASYM_IFACE, EvType.ASYM_SRC, EvType.SYN_RETX, EvType.NF_VIEW,
        EvType.WIRE_ICMP))
D_INGRESS = int(Dir.INGRESS)
HOOKS = {int(h): n for h, n in HOOK_NAMES.items()}

CAUSES = (
    "no_local_endpoint", "no_endpoints", "rp_filter", "snat", "wrong_iface", "policy_drop",
    "netfilter_reject", "conntrack_invalid", "no_listener", "proxy", "app_reset", "peer_reset",
    "unknown",
)
# Which label of a flow names its root cause: the highest here. Specific kernel verdicts come
# before what they cause (an un-NATed reply makes a middlebox or conntrack drop the client's
# answer; a drop makes a peer reset), and "where it surfaced" labels come last.
PRIORITY = ("rp_filter", "no_local_endpoint", "no_endpoints", "policy_drop", "proxy", "snat",
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


@dataclass(frozen=True)
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

    @property
    def nat(self):
        """The connection's NAT mapping, client -> NodePort/Service -> endpoint, from the first
        event of the incident that carried a DNAT conntrack entry (None if none did)."""
        ct = getattr(self.event, "ct", None)
        if ct is not None and ct.dnat:
            return ct
        for x in self.labeled:
            ct = getattr(x.ev, "ct", None)
            if ct is not None and ct.dnat:
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
    # (addr, port) -> "ns/svc:port" (nptrace/services); None when no rules are known.
    service_of: Callable[[str, int], str | None] = lambda a, p: None
    # (addr, port) -> "ns/svc:port" when addr:port is a Service's endpoint (a pod).
    endpoint_of: Callable[[str, int], str | None] = lambda a, p: None
    # knowledge.NodeKnowledge.nf_rule: the rule behind a netfilter drop, as plain data.
    nf_rule: Callable[..., dict | None] = lambda *a: None
    # (saddr, sport, daddr, dport) -> the other side of that NATed connection, in its own
    # packet direction (the kernel's nat_peers map), or None.
    nat_peer: Callable[[str, int, str, int], tuple | None] = lambda *a: None
    # (netns inode, address) -> the interface the route to address leaves by, or None.
    route_iface: Callable[[int, str], str | None] = lambda netns, addr: None
    hold_ns: int = 1_000_000_000            # a flow quiet this long is reported
    max_hold_ns: int = 5_000_000_000        # ...and a weak one at the latest after this
    window_ns: int = 30 * 1_000_000_000     # how long a reported flow's root cause is kept
    max_flows: int = 16384                  # bound on the correlation state (~1.3 KiB a flow):
    # 5 s (max_hold) of 3000 new failing flows a second; the kernel's --max-rate sends fewer


def reason_name(ev: Event, ctx: Context) -> str:
    t = ev.type
    if t == T_DROP:
        return ctx.drop_name(ev.reason)
    if t == T_RST_SENT:
        return ctx.rst_name(ev.reason)
    if t in (T_ICMP, T_WIRE_ICMP):
        return f"ICMP_{ev.reason >> 8}_{ev.reason & 0xff}"
    return t.name


def _pair(a, b):
    return (a, b) if a <= b else (b, a)


def _key(saddr, sport, daddr, dport) -> tuple:
    """The classifier's own flow key: _pair's order, one flat tuple (no nested tuples to
    build and hash per event)."""
    if saddr < daddr or (saddr == daddr and sport <= dport):
        return (saddr, sport, daddr, dport)
    return (daddr, dport, saddr, sport)


def flow_keys(ev: Event) -> list:
    """Direction-free tuples of the event, so a request, its reply and both sides of a NAT
    share a flow."""
    keys = [_pair((ev.saddr, ev.sport), (ev.daddr, ev.dport))]
    if ev.ct is not None and ev.ct.orig_dport:
        c = ev.ct
        keys.append(_pair((c.orig_src, c.orig_sport), (c.orig_dst, c.orig_dport)))
        keys.append(_pair((c.reply_src, c.reply_sport), (c.reply_dst, c.reply_dport)))
    return keys


class Labeled(NamedTuple):
    """One event with its own label. A tuple: a storm makes one per record."""
    ev: Event
    rname: str
    cause: str | None            # None: evidence only
    confidence: float = 0.0
    hint: str = ""


_tuple_new = tuple.__new__


class Flow:
    """One connection's correlation state. __slots__ and a key list, not a set: the classifier
    keeps up to max_flows of these (a set of one key alone is 216 bytes)."""
    __slots__ = ("keys", "pending", "extra", "first_ns", "last_ns", "root", "strong")

    def __init__(self):
        self.keys: list = []          # direction-free tuples naming this connection
        self.pending: list = []       # Labeled of the open incident (<= MAX_KEPT)
        self.extra = 0                # further events of it, counted not kept
        self.first_ns = 0             # of the open incident
        self.last_ns = 0
        self.root: Labeled | None = None   # the cause an earlier incident named
        self.strong = False           # the open incident has a non-weak label


# Events an open incident keeps as evidence; later ones are counted (memory stays bounded by
# flows, not by how often one flow's packets are dropped).
MAX_KEPT = 32


class Classifier:
    """Correlation state over a stream of events; bounded by ctx.max_flows and ctx.window_ns.

    Per event the work is O(1) amortized: flows sit in three queues ordered by time (all flows
    by last event, open strong incidents by last event, open weak ones by first event), and
    `tick` only looks at the heads. The queues are keyed by the Flow itself (identity hash).

    `feed_many` is the hot path (a storm is ~all new one-record flows): it skips `tick` for an
    event before which nothing can be due. After every tick it notes the heads of the three
    queues and the earliest time one of them can be due (`_due_ns`); only a change of a head
    (a head touched, a first flow into an empty queue, a NAT merge) makes it tick again
    earlier. Incidents are still cut exactly where `tick` before every event would cut them."""

    def __init__(self, ctx: Context | None = None):
        self.ctx = ctx or Context()
        self.keys: dict = {}                                   # flow key -> Flow
        self.flows: OrderedDict[Flow, Flow] = OrderedDict()    # by last event, oldest first
        self.strong: OrderedDict[Flow, Flow] = OrderedDict()   # open strong incidents, by last event
        self.weak: OrderedDict[Flow, Flow] = OrderedDict()     # open weak incidents, by first event
        self.now_ns = 0
        self._rules: dict[int, list] = {}      # event type -> the RULES that can match it
        self._due_ns = _NEVER_VALID            # tick before any event at or after this time
        self._hs = self._hw = self._hf = None  # heads of strong, weak, flows at that tick

    # -- correlation state -------------------------------------------------------------
    def _flow_of(self, keys: list) -> tuple[Flow, bool]:
        """The flow of several keys, merging the flows they name; (flow, existed before)."""
        kmap = self.keys
        flows = self.flows
        if len(keys) == 1:
            k0 = keys[0]
            known = kmap.get(k0)
            if known is None:
                flow = Flow()
                flow.keys.append(k0)
                kmap[k0] = flow
                flows[flow] = flow
                return flow, False
            flows.move_to_end(known)
            return known, True
        found: list[Flow] = []
        for k in keys:
            f = kmap.get(k)
            if f is not None and all(f is not g for g in found):
                found.append(f)
        if not found:
            flow = Flow()
        else:
            flow = found[0]
            for other in found[1:]:          # NAT tuples just met: one connection
                self._merge(flow, other)
        fkeys = flow.keys
        for k in keys:
            if k not in fkeys:
                fkeys.append(k)
                kmap[k] = flow
        flows[flow] = flow
        flows.move_to_end(flow)
        return flow, bool(found)

    def _merge(self, into: Flow, other: Flow) -> None:
        self._due_ns = _NEVER_VALID              # queue heads may change
        if other.pending:
            into.first_ns = min(into.first_ns, other.first_ns) if into.pending else other.first_ns
            into.pending = sorted(into.pending + other.pending, key=lambda x: x.ev.ts_ns)
            into.extra += other.extra + max(0, len(into.pending) - MAX_KEPT)
            del into.pending[MAX_KEPT:]
        into.last_ns = max(into.last_ns, other.last_ns)
        into.strong = into.strong or other.strong
        if other.root is not None and (into.root is None or other.root.ev.ts_ns < into.root.ev.ts_ns):
            into.root = other.root
        for k in other.keys:
            self.keys[k] = into
            if k not in into.keys:
                into.keys.append(k)
        for q in (self.flows, self.strong, self.weak):
            q.pop(other, None)
        if into.pending:
            self._queue(into)

    def _queue(self, flow: Flow) -> None:
        """Put a flow with an open incident in the queue its labels call for."""
        if flow.strong or flow.root is not None:
            self.weak.pop(flow, None)
            self.strong[flow] = flow
            self.strong.move_to_end(flow)
        elif flow not in self.weak:
            self.weak[flow] = flow

    def _drop_flow(self, flow: Flow) -> None:
        kmap = self.keys
        for k in flow.keys:
            if kmap.get(k) is flow:
                del kmap[k]
        self.flows.pop(flow, None)
        self.strong.pop(flow, None)
        self.weak.pop(flow, None)

    # -- input -------------------------------------------------------------------------
    def feed(self, ev: Event) -> list[Verdict]:
        """Take one event; return the incidents that are due (possibly none)."""
        return self.feed_many((ev,))

    def feed_many(self, events: Iterable[Event]) -> list[Verdict]:
        """Take events in order; return the incidents due along the way, exactly what
        `feed` on each of them would return, concatenated."""
        out: list[Verdict] = []
        ctx = self.ctx
        kmap, flows, strong, weak = self.keys, self.flows, self.strong, self.weak
        cap = ctx.max_flows
        nat = ctx.nat_peer
        drop_name, rst_name = ctx.drop_name, ctx.rst_name
        rules_of = self._rules
        for ev in events:
            # Report what went quiet BEFORE this event joins its flow: incident boundaries
            # then depend on event times only, so a replay cuts incidents as the live run did.
            ts = ev[0]
            if ts > self.now_ns:
                self.now_ns = ts
            if self.now_ns >= self._due_ns:
                due = self.tick(ts)
                if due:
                    out += due
            elif len(flows) > cap:               # a flood of new flows; nothing else is due
                self._evict(out)
                self._horizon()
            t = ev[1]
            saddr, sport, daddr, dport = ev[8], ev[9], ev[10], ev[11]
            k0 = (saddr, sport, daddr, dport) if saddr < daddr or (
                saddr == daddr and sport <= dport) else (daddr, dport, saddr, sport)
            known = kmap.get(k0)
            c = ev[23]
            keys = None
            if c is None:
                if (known is None or len(known.keys) < 2) and t not in EVIDENCE_ONLY:
                    # No conntrack on this event (a pod's own stack, the client's): ask the
                    # kernel's NAT map for the connection's other tuple, either direction.
                    peer = nat(saddr, sport, daddr, dport) or nat(daddr, dport, saddr, sport)
                    if peer:
                        keys = [k0, _key(peer[0], peer[1], peer[2], peer[3])]
            elif c.orig_dport:
                keys = [k0, _key(c.orig_src, c.orig_sport, c.orig_dst, c.orig_dport),
                        _key(c.reply_src, c.reply_sport, c.reply_dst, c.reply_dport)]
            if keys is not None:
                flow, existed = self._flow_of(keys)
                known = flow if existed else None
            elif known is None:                  # the storm's case: a new one-tuple flow
                flow = Flow()
                flow.keys.append(k0)
                kmap[k0] = flow
                flows[flow] = flow
            else:
                flow = known
                flows.move_to_end(known)
            if t == T_DROP:                      # reason_name, inlined
                rname = drop_name(ev[7])
            elif t == T_RST_SENT:
                rname = rst_name(ev[7])
            else:
                rname = reason_name(ev, ctx)
            pending = flow.pending
            # _label, inlined
            if t in EVIDENCE_ONLY:
                lab = _tuple_new(Labeled, (ev, rname, None, 0.0, ""))
            else:
                rules = rules_of.get(t)
                if rules is None:
                    rules = rules_of[t] = _rules_for(t)
                for rule in rules:
                    got = rule(ev, rname, pending, ctx)
                    if got:
                        lab = _tuple_new(Labeled, (ev, rname, *got)) \
                            if type(got) is tuple and len(got) == 3 else Labeled(ev, rname, *got)
                        break
                else:
                    lab = _tuple_new(Labeled, (ev, rname, None, 0.0, "")) \
                        if t == T_DROP and rname in WEAK_DROPS else \
                        _tuple_new(Labeled, (ev, rname, "unknown", 0.0, UNKNOWN_HINT))
            if not pending:
                flow.first_ns = ts
                flow.strong = False
                flow.extra = 0
            cause = lab[2]
            if len(pending) < MAX_KEPT:
                pending.append(lab)
            elif cause is not None and all(
                    l.cause is None or RANK[cause] < RANK[l.cause] for l in pending):
                pending[-1] = lab      # a better label than any kept: keep it, count the other
                flow.extra += 1
            else:
                flow.extra += 1
            if ts > flow.last_ns:
                flow.last_ns = ts
            if cause is not None and cause not in WEAK_CAUSES:
                flow.strong = True
            # _queue, inlined; a queue's head changing means tick may be due sooner
            if flow.strong or flow.root is not None:
                if known is None:
                    strong[flow] = flow
                    if self._hs is None:
                        self._due_ns = _NEVER_VALID
                else:
                    if weak:
                        weak.pop(flow, None)
                    strong[flow] = flow
                    strong.move_to_end(flow)
                    if self._hs is None or flow is self._hs or flow is self._hw \
                            or flow is self._hf:
                        self._due_ns = _NEVER_VALID
            elif flow not in weak:
                weak[flow] = flow
                if self._hw is None or flow is self._hf or flow is self._hs:
                    self._due_ns = _NEVER_VALID
            elif flow is self._hf or flow is self._hs or flow is self._hw:
                self._due_ns = _NEVER_VALID
            if known is None and self._hf is None:
                self._due_ns = _NEVER_VALID
        return out

    def _horizon(self) -> None:
        """Note the queues' heads and the earliest event time at which tick can act on them:
        a strong head quiet for hold_ns, a weak head open for max_hold_ns, a reported flows
        head past window_ns (a lower bound: tick itself compares exactly)."""
        ctx = self.ctx
        due = _NEVER
        hs = hw = hf = None
        if self.strong:
            hs = next(iter(self.strong))
            due = hs.last_ns + ctx.hold_ns
        if self.weak:
            hw = next(iter(self.weak))
            d = hw.first_ns + ctx.max_hold_ns
            if d < due:
                due = d
        if self.flows:
            hf = next(iter(self.flows))
            if not hf.pending:
                d = hf.last_ns + ctx.window_ns
                if d < due:
                    due = d
        self._hs, self._hw, self._hf, self._due_ns = hs, hw, hf, due

    def _evict(self, out: list) -> None:
        """Past max_flows, oldest first: a flood of distinct flows (tick, and feed_many when
        nothing else is due). The caller recomputes the horizon."""
        flows, cap = self.flows, self.ctx.max_flows
        kmap, strong, weak = self.keys, self.strong, self.weak
        while len(flows) > cap:
            flow = next(iter(flows))
            if flow.pending:
                v = self._report(flow, False)
                if v is not None:
                    out.append(v)
            # _drop_flow, inlined
            for k in flow.keys:
                if kmap.get(k) is flow:
                    del kmap[k]
            del flows[flow]
            if strong:
                strong.pop(flow, None)
            if weak:
                weak.pop(flow, None)

    def _emit_due(self, queue: OrderedDict, before_ns: int, stamp: str, out: list) -> None:
        """Report the flows at the head of a time-ordered queue whose `stamp` is older than
        before_ns (strictly: the same comparison as `now - stamp < hold` keeping a flow)."""
        while queue:
            flow = next(iter(queue))
            if getattr(flow, stamp) > before_ns:
                break
            self._emit(flow, out)

    def tick(self, now_ns: int) -> list[Verdict]:
        """Report the incidents that are due at `now_ns` (monotonic ns, the events' clock)."""
        now = self.now_ns
        if now_ns > now:
            self.now_ns = now = now_ns
        ctx = self.ctx
        out: list[Verdict] = []
        strong, weak, flows = self.strong, self.weak, self.flows
        if strong:                               # quiet for hold_ns: the cause is in
            self._emit_due(strong, now - ctx.hold_ns, "last_ns", out)
        if weak:                                 # weak only: waited max_hold_ns for a cause
            self._emit_due(weak, now - ctx.max_hold_ns, "first_ns", out)
        if flows:                                # reported and past the window: forget
            window = ctx.window_ns
            while flows:
                flow = next(iter(flows))
                if flow.pending or now - flow.last_ns <= window:
                    break
                self._drop_flow(flow)
            if len(flows) > ctx.max_flows:
                self._evict(out)
        self._horizon()
        return out

    def _emit(self, flow: Flow, out: list) -> None:
        v = self._report(flow)
        if v is not None:
            out.append(v)

    def flush(self) -> list[Verdict]:
        """End of input: report every open incident."""
        out: list[Verdict] = []
        for flow in list(self.strong.values()) + list(self.weak.values()):
            self._emit(flow, out)
        self._due_ns = _NEVER_VALID
        return out

    # -- reporting ---------------------------------------------------------------------
    def _report(self, flow: Flow, keep_root: bool = True) -> Verdict | None:
        """The flow's open incident as a Verdict (None if it has no cause). keep_root=False
        when the flow is forgotten right after (evicted): its root cause is then never read."""
        pending, flow.pending = flow.pending, []
        extra, flow.extra = flow.extra, 0
        flow.strong = False
        self.strong.pop(flow, None)
        if self.weak:
            self.weak.pop(flow, None)
        if len(pending) == 1:                    # a flow of one record: most of a storm
            primary = pending[0]
            if primary.cause is None:
                return None                      # evidence only: nothing went wrong here
        else:
            labeled = [l for l in pending if l.cause is not None]
            if not labeled:
                return None
            primary = min(labeled, key=_primary_key)
        root = flow.root
        if root is not None:
            # The flow named its root cause in an earlier incident: what follows on the same
            # connection (a retransmitted SYN-ACK the client now resets, the peer's RST) is
            # its consequence.
            cause, conf, hint = root.cause, root.confidence, root.hint
        else:
            cause, conf, hint = primary.cause, primary.confidence, primary.hint
            if keep_root and cause not in WEAK_CAUSES:
                # kept for window_ns: without its raw record (an incident never prints it)
                pev = primary.ev
                flow.root = primary if not pev.raw else \
                    _tuple_new(Labeled, (_tuple_new(type(pev), pev[:-1] + (b"",)),) + primary[1:])
        ev = primary.ev
        ctx = self.ctx
        iface = ctx.iface_name(ev.netns, ev.ifindex) if ev.ifindex else None
        if ev.ct is None:                        # _service, inlined
            so = ctx.service_of
            service = so(ev.daddr, ev.dport) or so(ev.saddr, ev.sport) or None
        else:
            service = _service(ev, ctx)
        if len(pending) == 1:
            ordered = (primary,) if root is None or root == primary else (root, primary)
        else:
            if not service:
                for l in pending:
                    if l.ev is not ev:
                        service = _service(l.ev, ctx)
                        if service:
                            break
            ordered = sorted(pending, key=_ts_key)
            if root is not None and root not in pending:
                ordered.insert(0, root)
            ordered = tuple(ordered)
        if "{" in hint:
            hint = _fill_hint(hint, ev, iface, service)
        t = ev.type
        return _make_verdict(ev, KIND.get(t, "drop"), _DIRECTIONS.get(t), HOOKS[ev.hook],
                             primary.rname, cause, conf, hint, iface, service, ordered,
                             len(pending) + extra, ctx)


def _primary_key(l: Labeled):
    return (RANK[l.cause], l.ev.ts_ns)


def _ts_key(l: Labeled) -> int:
    return l.ev.ts_ns


_NEVER = float("inf")
_NEVER_VALID = float("-inf")     # _due_ns when the noted queue heads may be stale
_DIRECTIONS = {T_RST_SENT: "sent", T_RST_RECV: "received", T_WIRE_RST: "forwarded"}
_object_new = object.__new__
_object_setattr = object.__setattr__


def _make_verdict(event, kind, direction, hook, reason, cause, confidence, hint, iface, service,
                  labeled, events, ctx) -> "Verdict":
    """Verdict(...) without the frozen dataclass's per-field object.__setattr__ (1.3 us of a
    storm's per-incident budget): the same instance, its __dict__ set in one step."""
    v = _object_new(Verdict)
    _object_setattr(v, "__dict__", {
        "event": event, "kind": kind, "direction": direction, "hook": hook, "reason": reason,
        "cause": cause, "confidence": confidence, "hint": hint, "iface": iface,
        "service": service, "labeled": labeled, "events": events, "ctx": ctx})
    return v


_VERDICT_FIELDS = ("event", "kind", "direction", "hook", "reason", "cause", "confidence",
                   "hint", "iface", "service", "labeled", "events", "ctx")


def _fill_hint(hint: str, ev: Event, iface: str | None, service: str | None) -> str:
    """Fill the {name} placeholders of a rule's hint, in this order, computing only the values
    the text asks for; rule texts quoted in hints keep their own braces (nft sets)."""
    if "{iface}" in hint:
        hint = hint.replace("{iface}", iface or f"ifindex {ev.ifindex}")
    if "{port}" in hint:
        hint = hint.replace("{port}", str(ev.dport))
    if "{sport}" in hint:
        hint = hint.replace("{sport}", str(ev.sport))
    if "{daddr}" in hint:
        hint = hint.replace("{daddr}", ev.daddr)
    if "{saddr}" in hint:
        hint = hint.replace("{saddr}", ev.saddr)
    if "{service}" in hint:
        hint = hint.replace("{service}", service or "the Service")
    return hint


def classify(events: Iterable[Event], ctx: Context | None = None) -> Iterator[Verdict]:
    """The whole attribution as one pure function over an event stream."""
    c = Classifier(ctx)
    for ev in events:
        yield from c.feed(ev)
    yield from c.flush()


def _service(ev: Event, ctx: Context) -> str | None:
    cands = [(ev.daddr, ev.dport), (ev.saddr, ev.sport)]
    if ev.ct is not None:
        cands[:0] = [(ev.ct.orig_dst, ev.ct.orig_dport), (ev.ct.reply_src, ev.ct.reply_sport)]
    for addr, port in cands:
        s = ctx.service_of(addr, port)
        if s:
            return s
    return None


def evidence_dicts(v: Verdict) -> list[dict]:
    """[x.to_dict() for x in v.evidence] without the Evidence objects (the JSON hot path)."""
    ctx = v.ctx or Context()
    iface_name = ctx.iface_name
    out = []
    for l in v.labeled[:MAX_EVIDENCE]:
        ev = l.ev
        detail = f"{ev.saddr}:{ev.sport} > {ev.daddr}:{ev.dport}"
        c = ev.ct
        if c is not None and c.status & IPS_DST_NAT:
            detail += f" (dnat {c.orig_dst}:{c.orig_dport} -> {c.reply_src}:{c.reply_sport})"
        out.append({"ts_ns": ev.ts_ns, "hook": HOOKS[ev.hook], "what": l.rname,
                    "iface": iface_name(ev.netns, ev.ifindex) if ev.ifindex else None,
                    "detail": detail, "label": l.cause or ""})
    return out


def _evidence(l: Labeled, ctx: Context) -> Evidence:
    ev = l.ev
    iface = ctx.iface_name(ev.netns, ev.ifindex) if ev.ifindex else None
    detail = f"{ev.saddr}:{ev.sport} > {ev.daddr}:{ev.dport}"
    if ev.ct is not None and ev.ct.dnat:
        detail += f" (dnat {ev.ct.orig_dst}:{ev.ct.orig_dport} -> {ev.ct.reply_src}:{ev.ct.reply_sport})"
    return Evidence(ev.ts_ns, HOOKS[ev.hook], l.rname, iface, detail, l.cause or "")


# --- rules: (event, reason name, earlier events of the flow, ctx) -> (cause, confidence, hint)
Rule = Callable[[Event, str, list, Context], "tuple[str, float, str] | None"]
UNKNOWN_HINT = "no rule explains this event; the evidence lists what the kernel showed"


def applies_to(*types: int):
    """Declare the event types a rule can match: the classifier then skips it for the others
    (eight Python calls per record add up in a storm). A rule without it sees every event."""
    def mark(rule):
        rule.event_types = frozenset(int(t) for t in types)
        return rule
    return mark


def _rules_for(t: int) -> list:
    return [r for r in RULES if t in getattr(r, "event_types", (t,))]

SYNACK = TCP_SYN | TCP_ACK


def _answered(ev: Event) -> int:
    """TCP flags of the packet a NO_SOCKET reset or drop was about."""
    return ev.aux if ev.type == T_RST_SENT else ev.tcpflags


def _is_nf_reject(ev: Event, rname: str) -> bool:
    return (ev.type == T_DROP and rname == "NETFILTER_DROP") or \
        (ev.type in (T_ICMP, T_WIRE_ICMP) and ev.reason >> 8 == 3
         and ev.reason & 0xff in (3, 9, 10, 13))


def _orig_dst(ev: Event) -> tuple[str, int]:
    if ev.ct is not None and ev.ct.dnat:
        return ev.ct.orig_dst, ev.ct.orig_dport
    return ev.daddr, ev.dport


@applies_to(T_DROP)
def rule_rp_filter(ev, rname, history, ctx):
    if ev.type == T_DROP and rname == "IP_RPFILTER":
        # an encapsulated packet is checked on its outer source (the sending node's VTEP)
        src = ev.outer_saddr if ev.flags & F_ENCAP and ev.outer_saddr else ev.saddr
        back = ctx.route_iface(ev.netns, src)
        via = f" while the route back to {src} leaves by {back}" if back else ""
        what = f"a VXLAN packet from {src} (inner {{saddr}})" if src != ev.saddr else "a packet from {saddr}"
        return ("rp_filter", 0.95,
                f"strict reverse-path filter dropped {what} arriving on {{iface}}"
                + via + ": use loose mode (sysctl -w net.ipv4.conf.all.rp_filter=2 and "
                "net.ipv4.conf.<iface>.rp_filter=2 for {iface}) or route replies back the way "
                "requests came")
    return None


@applies_to(T_ASYM_SRC, T_RST_SENT, T_DROP)
def rule_unexpected_reply(ev, rname, history, ctx):
    """A SYN-ACK its receiver never asked for: the reply left with the pod's own source."""
    if ev.type == T_ASYM_SRC:
        return ("snat", 0.85,
                "the reply from {saddr}:{sport} leaves without being translated back to the "
                "address the client connected to: masquerade the forwarded traffic "
                "(externalTrafficPolicy: Cluster) or keep replies on the node that DNATed them "
                "(externalTrafficPolicy: Local)")
    if rname == "NO_SOCKET" and ev.type in (T_RST_SENT, T_DROP) \
            and _answered(ev) & SYNACK == SYNACK:
        peer = (ev.daddr, ev.dport) if ev.type == T_RST_SENT else (ev.saddr, ev.sport)
        return ("snat", 0.9,
                f"{peer[0]}:{peer[1]} answered a connection the client made to another address: "
                "the reply was not un-NATed (it left by another node or path than the DNAT); "
                "the client reset it. Masquerade forwarded NodePort traffic "
                "(externalTrafficPolicy: Cluster with KUBE-POSTROUTING MASQUERADE) or use "
                "externalTrafficPolicy: Local, or the PROXY protocol to keep the client address")
    return None


@applies_to(T_ASYM_IFACE)
def rule_wrong_iface(ev, rname, history, ctx):
    if ev.type != T_ASYM_IFACE:
        return None
    back = ctx.iface_name(ev.netns, ev.aux) or f"ifindex {ev.aux}"
    if ctx.endpoint_of(ev.saddr, ev.sport):
        # The reply comes from a pod's own address: nothing un-DNATs it here, so the request
        # was DNATed on another node and forwarded without masquerade.
        return ("snat", 0.85,
                f"the pod {{saddr}}:{{sport}} answers a client whose request arrived on {back} "
                "(from another node, not masqueraded) and its reply leaves by {iface} with the "
                "pod's own address: the client never connected to it and resets or drops it. "
                "Masquerade forwarded NodePort traffic (KUBE-POSTROUTING MASQUERADE, "
                "externalTrafficPolicy: Cluster) or use externalTrafficPolicy: Local")
    return ("wrong_iface", 0.85,
            f"the request came in on {back} but the reply leaves by {{iface}}: a stateful "
            "middlebox or the peer on the other path will drop or reset it. Add policy "
            "routing (ip rule from <secondary address> table N) so replies leave by the "
            "interface the request came in on")


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
    "conntrack_invalid": ("conntrack_invalid", 0.85,
                          "conntrack marked a mid-connection packet INVALID (out of window, or "
                          "its connection was already forgotten) and {rule} dropped it. Look for "
                          "asymmetric paths, conntrack timeouts shorter than the app's idle time "
                          "and table pressure; net.netfilter.nf_conntrack_tcp_be_liberal=1 makes "
                          "conntrack accept such packets"),
}


@applies_to(T_DROP, T_ICMP, T_WIRE_ICMP)
def rule_netfilter(ev, rname, history, ctx):
    if not _is_nf_reject(ev, rname):
        return None
    odst, oport = _orig_dst(ev)
    got = ctx.nf_rule(ev.netns, ev.saddr, ev.daddr, ev.dport, odst, oport,
                      bool(ev.tcpflags & TCP_SYN), ev.ct is not None)
    if got is None:
        return ("netfilter_reject", 0.5,
                "a netfilter rule dropped or rejected this packet; the rule could not be named "
                "(no readable ruleset for this namespace): run `iptables-save -c` / "
                "`nft list ruleset` in the namespace")
    tag = got.get("tag")
    rule = f"{got.get('where')}: `{got.get('text')}`"
    if got.get("source"):
        # nftrace_live: whether nf_tables tracing saw this rule drop the flow, or why not
        rule += (", seen by nft trace" if got["source"] == "nft trace"
                 else f", named from the ruleset; {got.get('note') or 'not traced'}")
    if tag in _TAG_CAUSE:
        cause, conf, hint = _TAG_CAUSE[tag]
        return (cause, conf, hint.replace("{rule}", rule)
                .replace("{service}", got.get("service") or "{service}"))
    if tag == "other" and got.get("to_pod"):
        return ("policy_drop", 0.85,
                f"a netfilter rule dropped traffic from {{saddr}} to the pod {{daddr}}:{{port}} "
                f"({rule}). If it is a NetworkPolicy, add an ingress rule with ipBlock "
                f"{ev.saddr}/32 (or the client range) for port {ev.dport}")
    if tag == "other":
        return ("netfilter_reject", 0.75, f"netfilter dropped or rejected the packet at {rule}")
    return ("netfilter_reject", 0.5,
            "netfilter dropped or rejected this packet but no rule in the namespace's ruleset "
            "matches it as far as nptrace evaluates rules, so the rule cannot be known from the "
            "ruleset" + (f"; {got['note']}" if got.get("note") else
                         ": trace it with `nft monitor trace` / `iptables -j TRACE`"))


@applies_to(T_DROP, T_ICMP, T_WIRE_ICMP)
def rule_stale_endpoint(ev, rname, history, ctx):
    """DNAT to an address nobody answers for: the endpoint is gone, the rules are not."""
    gone = (ev.type == T_DROP and rname in ("NEIGH_FAILED", "IP_OUTNOROUTES", "IP_INADDRERRORS")) \
        or (ev.type in (T_ICMP, T_WIRE_ICMP) and ev.reason in (3 << 8 | 1, 3 << 8 | 0))
    if gone and (ev.ct is not None and ev.ct.dnat or ctx.service_of(ev.daddr, ev.dport)):
        return ("proxy", 0.8,
                "the service proxy DNATs to {daddr}:{port}, which no longer exists on the "
                "network: kube-proxy's rules are stale (endpoint deleted, sync failed or lagging). "
                "Check kube-proxy's logs and sync metrics, and the EndpointSlice of {service}")
    return None


@applies_to(T_RST_SENT, T_DROP)
def rule_no_listener(ev, rname, history, ctx):
    if rname == "NO_SOCKET" and ev.type in (T_RST_SENT, T_DROP) \
            and _answered(ev) & (TCP_SYN | TCP_ACK) == TCP_SYN:
        host, port = (ev.saddr, ev.sport) if ev.type == T_RST_SENT else (ev.daddr, ev.dport)
        return ("no_listener", 0.9,
                f"nothing listens on {host}:{port}: compare {{service}}'s targetPort with the "
                "port the container really listens on (ss -ltn in the pod)")
    return None


@applies_to(T_RST_SENT)
def rule_app_reset(ev, rname, history, ctx):
    if ev.type == T_RST_SENT and ev.flags & F_HAS_SOCK and rname in APP_RESETS:
        return ("app_reset", 0.8,
                "the application on {saddr}:{sport} aborted the connection itself (close with "
                "unread data or SO_LINGER 0): not a network fault; look at the app's logs")
    return None


@applies_to(T_RST_RECV, T_WIRE_RST)
def rule_peer_reset(ev, rname, history, ctx):
    if ev.type == T_RST_RECV or (ev.type == T_WIRE_RST and ev.dir == D_INGRESS):
        return ("peer_reset", 0.5,
                "{saddr}:{sport} reset the connection and no local cause was seen on this node")
    return None


RULES: list[Rule] = [rule_rp_filter, rule_unexpected_reply, rule_wrong_iface,
                     rule_netfilter, rule_stale_endpoint,
                     rule_no_listener, rule_app_reset, rule_peer_reset]
