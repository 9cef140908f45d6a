"""Flow correlation: decoded kernel events in, labeled incidents (Verdicts) out.

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
that cannot report anything (see Classifier). This module is one of those setup.py compiles
with Cython where a compiler is present (nptrace/compiled.py); the source is the same.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator

from nptrace import names
from nptrace.events import IPS_DST_NAT, IPS_SRC_NAT, CtTuples, Event
from nptrace.text import hostport

from .flowkey import flow_key, flow_keys, nat_mapping, nat_peer_tuple  # noqa: F401 (flow_keys: the package's)
from .incident import DIRECTIONS, fill_hint, make_verdict, one_verdict, pods_of, service_of, set_natmap
from .labelmemo import LabelMemo
from .rules import GONE_DROPS, rules_for, run_rules
from .verdict import (EVIDENCE_ONLY, HOOKS, KIND, RANK, T_DROP, T_ICMP, T_RST_RECV, T_RST_SENT,
                      T_WIRE_ICMP, T_WIRE_RST, WEAK_CAUSES, Context, Labeled,
                      Verdict, reason_name)


_NAT = IPS_DST_NAT | IPS_SRC_NAT


_tuple_new = tuple.__new__


class Flow:
    """One connection's correlation state. __slots__ and a key list, not a set: the classifier
    keeps up to max_flows of these (a set of one key alone is 216 bytes)."""
    __slots__ = ("keys", "pending", "extra", "first_ns", "last_ns", "root", "strong", "nat")

    def __init__(self):
        self.keys: list = []          # direction-free tuples naming this connection
        self.pending: list = []       # Labeled of the open incident (<= MAX_KEPT)
        self.extra = 0                # further events of it, counted not kept
        self.first_ns = 0             # of the open incident
        self.last_ns = 0
        self.root: Labeled | None = None   # the cause an earlier incident named
        self.strong = False           # the open incident has a non-weak label
        self.nat: CtTuples | None = None   # the NAT mapping the kernel's NAT map gave (nat_mapping)


# Events an open incident keeps as evidence; later ones are counted (memory stays bounded by
# flows, not by how often one flow's packets are dropped).
MAX_KEPT = 32
# Keys one flow answers to (see Classifier._add_key): NAT gives three; more is churn.
MAX_KEYS = 8


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

    def __init__(self, ctx: Context | None = None, memo_labels: bool = True):
        self.ctx = ctx or Context()
        self.keys: dict = {}                                   # flow key -> Flow
        self.flows: OrderedDict[Flow, Flow] = OrderedDict()    # by last event, oldest first
        self.strong: OrderedDict[Flow, Flow] = OrderedDict()   # open strong incidents, by last event
        self.weak: OrderedDict[Flow, Flow] = OrderedDict()     # open weak incidents, by first event
        self.now_ns = 0
        self._rules: dict[tuple, list] = {}    # (type, reason name) -> the RULES that can match
        # labels by the values their rules read (None: the rules every time; tests compare)
        self.memo: LabelMemo | None = LabelMemo() if memo_labels else None
        self._due_ns = _NEVER_VALID            # tick before any event at or after this time
        self._hs = self._hw = self._hf = None  # heads of strong, weak, flows at that tick
        self.gone: dict[tuple, int] = {}       # endpoints a proxy incident found gone -> when

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
                self._add_key(flow, k)
            else:
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
        if into.nat is None:
            into.nat = other.nat
        if other.root is not None and (into.root is None or other.root.ev.ts_ns < into.root.ev.ts_ns):
            into.root = other.root
        for k in other.keys:
            if k not in into.keys:
                self._add_key(into, k)
            else:
                self.keys[k] = into
        for q in (self.flows, self.strong, self.weak):
            q.pop(other, None)
        if into.pending:
            self._queue(into)

    def _add_key(self, flow: Flow, k) -> None:
        """Name `flow` by one more key. A connection has at most three tuples (its own and
        conntrack's two); one whose conntrack tuples keep changing (a port scan through one
        NAT entry, a hostile stream) must not grow its key list, whose `in` scan is then per
        event: past MAX_KEYS the oldest key after the first (the flow's own tuple) goes."""
        fkeys = flow.keys
        fkeys.append(k)
        self.keys[k] = flow
        if len(fkeys) > MAX_KEYS:
            old = fkeys.pop(1)
            if self.keys.get(old) is flow:
                del self.keys[old]

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
        memo = self.memo
        roots = memo.roots if memo is not None else _NO_ROOTS
        at = ctx.at
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
            keys = mapped = None
            if c is None or not c.status & _NAT:
                if (known is None or c is None and len(known.keys) < 2) and t not in EVIDENCE_ONLY:
                    # No conntrack on this event (a pod's own stack, the client's), or, on a
                    # new flow, one that did no NAT here (a pod's node, when another node
                    # DNATed to it: one daemon traces both): ask the kernel's NAT map for the
                    # connection's other tuple, either direction.
                    # (nat_peer_tuple only on an answer: a storm's records have none, two calls fewer)
                    s = (saddr, sport, daddr, dport)
                    got = nat(saddr, sport, daddr, dport)
                    peer = nat_peer_tuple(got) if got else None
                    if peer is None:
                        s = (daddr, dport, saddr, sport)
                        got = nat(daddr, dport, saddr, sport)
                        peer = nat_peer_tuple(got) if got else None
                    if peer:
                        keys = [k0, flow_key(*peer)]
                        if known is None or known.nat is None:
                            mapped = nat_mapping(s, peer)
                # An entry without NAT names no other tuple: its own are the event's, or it is
                # another connection's (a VXLAN packet's outer UDP entry, which every flow
                # over that tunnel shares), whose tuples must not join flows.
            elif c.orig_dport:
                keys = [k0, flow_key(c.orig_src, c.orig_sport, c.orig_dst, c.orig_dport),
                        flow_key(c.reply_src, c.reply_sport, c.reply_dst, c.reply_dport)]
            if keys is not None:
                flow, existed = self._flow_of(keys)
                known = flow if existed else None
                if mapped is not None and flow.nat is None:
                    flow.nat = mapped
            elif known is None:                  # the storm's case: a new one-tuple flow
                # Flow(), its __init__ inlined (first_ns, strong and extra are set below)
                flow = _object_new(Flow)
                flow.keys = [k0]
                flow.pending = []
                flow.last_ns = 0
                flow.root = None
                flow.nat = None
                kmap[k0] = flow
                flows[flow] = flow
            else:
                flow = known
                flows.move_to_end(known)
            if t == T_DROP:                      # reason_name, inlined
                rname = drop_name(ev[7])
            elif t == T_RST_SENT:
                rname = rst_name(ev[7])
            else:                                # a type named by its type: a constant
                rname = _TYPE_RNAMES.get(t) or reason_name(ev, ctx)
            pending = flow.pending
            # _label, inlined
            if t in EVIDENCE_ONLY:
                lab = _tuple_new(Labeled, (ev, rname, None, 0.0, ""))
            else:
                # the label kept for the values its rules read (labelmemo.py), else the rules
                node = roots.get((t, rname))
                key = val = None
                while node is not None:
                    key = node[0](ev)
                    val = node[2].get(key)
                    if type(val) is list:        # a node below: another branch of the rules
                        node = val
                        continue
                    if val is None:
                        for getter, _fields, table in node[3]:     # a branch that read fewer fields
                            val = table.get(getter(ev))
                            if val is not None:
                                break
                    break
                if type(val) is tuple:
                    lab = _tuple_new(Labeled, (ev, rname, *val))
                else:
                    rules = rules_of.get((t, rname))
                    if rules is None:
                        rules = _rules_of(rules_of, t, rname)
                    if at is not None:           # the rules as they were at the packet
                        at(ts)
                    got = memo.label(ev, rname, pending, ctx, rules, t, node, key, val) \
                        if memo is not None else run_rules(ev, rname, pending, ctx, rules, t)
                    lab = _tuple_new(Labeled, (ev, rname, *got))
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
        ctx = self.ctx
        popitem = flows.popitem
        while len(flows) > cap:
            flow = popitem(False)[0]         # the oldest, out of flows in the same call
            pending = flow.pending
            if pending:
                if len(pending) == 1 and flow.root is None:    # a storm's flow: _report's case
                    if pending[0][2] is not None:
                        out.append(one_verdict(pending[0], 1 + flow.extra, ctx, flow.nat))
                else:
                    v = self._report(flow, False)
                    if v is not None:
                        out.append(v)
            # _drop_flow, inlined
            for k in flow.keys:
                if kmap.get(k) is flow:
                    del kmap[k]
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
    def _gone_endpoint(self, primary: Labeled, nat) -> Labeled:
        """Across connections: an endpoint that a proxy incident found gone (host unreachable,
        a neighbour failure) is remembered for GONE_NS; another connection DNATed to it whose
        incident names no cause (its SYN sent again and never answered, the endpoint's node
        rate-limiting its host-unreachable answers) is labeled by it. Returns the primary,
        relabeled or not."""
        ev = primary.ev
        c = ev.ct if ev.ct is not None and ev.ct.dnat else nat
        if c is not None and c.reply_src:
            end = (c.reply_src, c.reply_sport)
        elif primary.cause == "proxy":
            end = (ev.daddr, ev.dport)           # a drop or host unreachable at the endpoint
        else:
            # a retransmitted SYN seen before the DNAT (the NodePort's own device): the NAT
            # map names where it goes
            got = nat_peer_tuple(self.ctx.nat_peer(ev.saddr, ev.sport, ev.daddr, ev.dport))
            if got is None or (got[0], got[1]) == (ev.daddr, ev.dport):
                return primary
            end = (got[0], got[1])
        gone = self.gone
        if primary.cause == "proxy":
            if not (ev.type == T_DROP and primary.rname in GONE_DROPS) \
                    and ev.type != T_ICMP and ev.type != T_WIRE_ICMP:
                return primary                   # not a finding that nobody has the address
            gone.pop(end, None)
            gone[end] = ev.ts_ns
            if len(gone) > 1024:
                del gone[next(iter(gone))]
            return primary
        seen = gone.get(end)
        if seen is None or not 0 <= ev.ts_ns - seen <= GONE_NS and not 0 <= seen - ev.ts_ns <= GONE_NS:
            return primary
        ep = hostport(end[0], end[1])
        return Labeled(ev, primary.rname, "proxy", 0.6,
                       f"nothing answered this connection, which this node DNATs to {ep}; "
                       f"other connections to {ep} found no host having that address (host "
                       "unreachable, a neighbour failure) moments before or after: the endpoint "
                       "is gone and the rules still steer to it. Check kube-proxy's sync and "
                       "the Service's EndpointSlice; `nptrace run` on the endpoint's node shows "
                       "its drops")

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
            if flow.root is None:
                if primary.cause == "unknown" or primary.cause == "proxy":
                    primary = self._gone_endpoint(primary, flow.nat)
                if keep_root and primary.cause not in WEAK_CAUSES:
                    flow.root = _rootless(primary)
                return one_verdict(primary, 1 + extra, self.ctx, flow.nat)
        else:
            # the labeled event of the best RANK, then the surest (a pod's own reset over
            # what the wire shows of it), then the earliest (the first of equals), in one pass
            # without a key call per event
            primary = None
            for l in pending:
                c = l[2]
                if c is not None:
                    r = RANK[c]
                    if primary is None or r < best or (r == best and (
                            l[3] > primary[3] or (l[3] == primary[3] and l[0][0] < primary[0][0]))):
                        primary, best = l, r
            if primary is None:
                return None
            if flow.root is None and (primary.cause == "unknown" or primary.cause == "proxy"):
                primary = self._gone_endpoint(primary, flow.nat)
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
                flow.root = _rootless(primary)
        ev = primary.ev
        ctx = self.ctx
        if ctx.at is not None:
            ctx.at(ev.ts_ns)
        iface = ctx.iface_name(ev.netns, ev.ifindex) if ev.ifindex else None
        if len(pending) == 1 or ev.ct is not None and ev.ct.dnat:
            service = service_of(ev, ctx)
        else:
            # the connection's NAT mapping names the Service by its frontend, whichever event
            # of the incident carried it, before any port of this event is matched
            service = None
            for l in pending:
                c = l.ev.ct
                if c is not None and c.dnat:
                    service = service_of(l.ev, ctx)
                    break
            if not service:
                service = service_of(ev, ctx)
        if not service and cause == "proxy":
            service = ctx.removed_endpoint(ev.daddr, ev.dport)     # a rollout removed it
        if len(pending) == 1:
            ordered = (primary,) if root is None or root == primary else (root, primary)
        else:
            if not service:
                for l in pending:
                    if l.ev is not ev:
                        service = service_of(l.ev, ctx)
                        if service:
                            break
            # sorted(pending, key=_ts_key); pending is mostly in time order already
            prev = -1
            for l in pending:
                x = l[0][0]
                if x < prev:
                    ordered = sorted(pending, key=_ts_key)
                    break
                prev = x
            else:
                ordered = pending
            if root is not None and root not in pending:
                ordered = (root, *ordered)
            else:
                ordered = tuple(ordered)
        if "{" in hint:
            if root is not None and root.ev is not ev:
                # the root's hint speaks of the root's packet (its addresses, its interface),
                # not of the consequence this incident's primary is
                rev = root.ev
                hint = fill_hint(hint, rev, ctx.iface_name(rev.netns, rev.ifindex)
                                 if rev.ifindex else None, service)
            else:
                hint = fill_hint(hint, ev, iface, service)
        t = ev.type
        nat = flow.nat
        v = make_verdict(ev, KIND.get(t, "drop"), DIRECTIONS.get(t), HOOKS[ev.hook],
                          primary.rname, cause, conf, hint, iface, service, ordered,
                          len(pending) + extra, ctx, pods_of(ev, ordered, ctx, nat))
        if nat is not None:
            set_natmap(v, nat)
        return v


def _rules_of(cache: dict, t: int, rname: str) -> list:
    """rules_for(t, rname), remembered in cache (bounded: reason names come from the record)."""
    if len(cache) >= 1024:
        cache.clear()
    got = cache[(t, rname)] = rules_for(t, rname)
    return got


def _rootless(primary: Labeled) -> Labeled:
    """A root cause kept for window_ns: without its raw record (an incident never prints it)."""
    pev = primary.ev
    return primary if not pev.raw else \
        _tuple_new(Labeled, (_tuple_new(type(pev), pev[:-1] + (b"",)),) + primary[1:])


def _ts_key(l: Labeled) -> int:
    return l.ev.ts_ns


# reason_name of the types whose reason is their type's name (not a drop, reset or ICMP one)
_TYPE_RNAMES = {t: names.type_name(t) for t in names.TYPES
                if t not in (T_DROP, T_RST_SENT, T_ICMP, T_WIRE_ICMP)}
_NO_ROOTS: dict = {}
_NEVER = float("inf")
_NEVER_VALID = float("-inf")     # _due_ns when the noted queue heads may be stale
# How near in time an endpoint found gone labels another connection's silence (_gone_endpoint)
GONE_NS = 10 * 10**9
DIRECTIONS = {T_RST_SENT: "sent", T_RST_RECV: "received", T_WIRE_RST: "forwarded"}
_object_new = object.__new__


def classify(events: Iterable[Event], ctx: Context | None = None) -> Iterator[Verdict]:
    """The whole attribution as one pure function over an event stream."""
    c = Classifier(ctx)
    for ev in events:
        yield from c.feed(ev)
    yield from c.flush()

