"""One incident made a Verdict: its Service, its pods, its hint's placeholders filled, and the
Verdict built slot by slot. The Classifier (correlate.py) decides which events make an incident
and which of them is the primary; this module says what the incident's line then holds. One of
the modules setup.py compiles with Cython where a compiler is present (nptrace/compiled.py)."""
from __future__ import annotations

from nptrace.events import CtTuples, Event

from .verdict import HOOKS, KIND, T_RST_RECV, T_RST_SENT, T_WIRE_RST, Context, Labeled, Verdict

DIRECTIONS = {T_RST_SENT: "sent", T_RST_RECV: "received", T_WIRE_RST: "forwarded"}
_object_new = object.__new__


def one_verdict(primary: Labeled, events: int, ctx: Context, nat: CtTuples | None = None) -> "Verdict":
    """Classifier._report of a one-record incident without an earlier root cause (most of a
    storm): the same Verdict and the same lookups in the same order, service_of and pods_of
    inlined where the event has no conntrack entry."""
    ev = primary[0]
    if ctx.at is not None:
        ctx.at(ev[0])                                             # ts_ns
    iface = ctx.iface_name(ev[6], ev[5]) if ev[5] else None      # netns, ifindex
    ct = ev[23]
    if ct is None:
        so = ctx.service_of
        service = so(ev[10], ev[11])                              # daddr, dport
        if service:
            service = ctx.endpoint_of(ev[8], ev[9]) or service
        else:
            service = so(ev[8], ev[9]) or None
    else:
        service = service_of(ev, ctx)
    if not service and primary[2] == "proxy":
        service = ctx.removed_endpoint(ev[10], ev[11])          # a rollout removed it
    hint = primary[4]
    if "{" in hint:
        hint = fill_hint(hint, ev, iface, service)
    t = ev[1]
    ordered = (primary,)
    if ct is None and nat is None:
        pod_of = ctx.pod_of
        pod = pod_of(ev[10]) or pod_of(ev[8]) or (ctx.pod_of_netns(ev[6]) if ev[6] else None)
        pods = {"pod": pod} if pod is not None else None
    else:
        pods = pods_of(ev, ordered, ctx, nat)
    v = make_verdict(ev, KIND.get(t, "drop"), DIRECTIONS.get(t), HOOKS[ev[2]], primary[1],
                      primary[2], primary[3], hint, iface, service, ordered, events, ctx, pods)
    if nat is not None:
        set_natmap(v, nat)
    return v


def pods_of(ev: Event, labeled, ctx: Context, natmap: CtTuples | None = None) -> dict | None:
    """The incident's pods, asked once when it is made (the lookups a session records): the
    pod at either end of the packet, else the pod whose namespace the event is in; with a DNAT
    mapping (an event's, else the flow's from the NAT map: `natmap`), the client's and the
    endpoint's."""
    pod_of = ctx.pod_of
    out = None
    pod = pod_of(ev.daddr) or pod_of(ev.saddr) or (ctx.pod_of_netns(ev.netns) if ev.netns else None)
    if pod is not None:
        out = {"pod": pod}
    nat = ev.ct if ev.ct is not None and ev.ct.dnat else None
    snat = ev.ct if ev.ct is not None and ev.ct.snat and nat is None else None
    if nat is None:
        for l in labeled:
            c = l.ev.ct
            if c is not None and c.dnat:
                nat = c
                break
            if snat is None and c is not None and c.snat:
                snat = c
        if nat is None and natmap is not None:
            nat, snat = natmap, None
    if nat is None and snat is not None:   # masquerade only: the client's pod, no endpoint
        p = pod_of(snat.orig_src)
        if p is not None:
            out = {**(out or {}), "client_pod": p}
    if nat is not None:
        for key, addr in (("client_pod", nat.orig_src), ("endpoint_pod", nat.reply_src)):
            p = pod_of(addr)
            if p is not None:
                if out is None:
                    out = {}
                out[key] = p
    return out


_VERDICT_FIELDS = ("event", "kind", "direction", "hook", "reason", "cause", "confidence",
                   "hint", "iface", "service", "labeled", "events", "ctx", "pods", "natmap")
# Verdict's slots' setters (member descriptors): frozen, its own __setattr__ refuses
(_SET_EVENT, _SET_KIND, _SET_DIRECTION, _SET_HOOK, _SET_REASON, _SET_CAUSE, _SET_CONFIDENCE,
 _SET_HINT, _SET_IFACE, _SET_SERVICE, _SET_LABELED, _SET_EVENTS, _SET_CTX, _SET_PODS,
 set_natmap) = (Verdict.__dict__[f].__set__ for f in _VERDICT_FIELDS)


def make_verdict(event, kind, direction, hook, reason, cause, confidence, hint, iface,
                     service, labeled, events, ctx, pods=None) -> "Verdict":
    """Verdict(...) without the frozen dataclass's per-field object.__setattr__ (1.3 us of a
    storm's per-incident budget): the same instance, each slot set by its descriptor (natmap
    None: the caller sets a NAT map)."""
    v = _object_new(Verdict)
    _SET_EVENT(v, event)
    _SET_KIND(v, kind)
    _SET_DIRECTION(v, direction)
    _SET_HOOK(v, hook)
    _SET_REASON(v, reason)
    _SET_CAUSE(v, cause)
    _SET_CONFIDENCE(v, confidence)
    _SET_HINT(v, hint)
    _SET_IFACE(v, iface)
    _SET_SERVICE(v, service)
    _SET_LABELED(v, labeled)
    _SET_EVENTS(v, events)
    _SET_CTX(v, ctx)
    _SET_PODS(v, pods)
    set_natmap(v, None)
    return v


# Which event values a hint's placeholders read (by hint text), and filled hints by those
# values: a storm's incidents fill one hint with one Service name over and over. Bounded.
_HINT_USES: dict[str, tuple] = {}
_FILLED: dict[tuple, str] = {}
_FILLED_MAX = 4096


def _uses(hint: str) -> tuple:
    """The Event indexes _fill_text reads for this text: ifindex with {iface} (its fallback),
    saddr with {saddr} or {daddr} (the IPv6 test decides how both are written)."""
    got = []
    if "{iface}" in hint:
        got.append(5)
    if "{saddr}" in hint or "{daddr}" in hint:     # saddr: also the IPv6 test
        got.append(8)
    if "{sport}" in hint:
        got.append(9)
    if "{daddr}" in hint:
        got.append(10)
    if "{port}" in hint:
        got.append(11)
    if len(_HINT_USES) >= _FILLED_MAX:
        _HINT_USES.clear()
    got = _HINT_USES[hint] = tuple(got)
    return got


def fill_hint(hint: str, ev: Event, iface: str | None, service: str | None) -> str:
    """_fill_text, remembered by the values the text reads (exactly those: the same text)."""
    uses = _HINT_USES.get(hint)
    if uses is None:
        uses = _uses(hint)
    key = (hint, iface, service, *[ev[i] for i in uses]) if uses else (hint, iface, service)
    try:
        got = _FILLED.get(key)
    except TypeError:                    # a replayed lookup's answer that is not hashable
        return _fill_text(hint, ev, iface, service)
    if got is None:
        if len(_FILLED) >= _FILLED_MAX:
            _FILLED.clear()
        got = _FILLED[key] = _fill_text(hint, ev, iface, service)
    return got


def _fill_text(hint: str, ev: Event, iface: str | None, service: str | None) -> str:
    """Fill the {name} placeholders of a rule's hint, in this order, computing only the values
    the text asks for; rule texts quoted in hints keep their own braces (nft sets)."""
    if "{iface}" in hint:
        hint = hint.replace("{iface}", iface if isinstance(iface, str) and iface
                            else f"ifindex {ev.ifindex}")
    if ":" in ev.saddr:     # IPv6: [addr]:port wherever the text joins the two
        hint = hint.replace("{saddr}:{sport}", f"[{ev.saddr}]:{ev.sport}").replace(
            "{daddr}:{port}", f"[{ev.daddr}]:{ev.dport}")
    if "{port}" in hint:
        hint = hint.replace("{port}", str(ev.dport))
    if "{sport}" in hint:
        hint = hint.replace("{sport}", str(ev.sport))
    if "{daddr}" in hint:
        hint = hint.replace("{daddr}", ev.daddr)
    if "{saddr}" in hint:
        hint = hint.replace("{saddr}", ev.saddr)
    if "{service}" in hint:
        hint = hint.replace("{service}", service if isinstance(service, str) and service
                            else "the Service")
    return hint


def service_of(ev: Event, ctx: Context) -> str | None:
    """The Service of one event's connection.

    With a conntrack entry: its original destination (the frontend the client used), then its
    reply source (the endpoint); the masqueraded side (reply destination, whose port the
    masquerade picks, possibly inside the NodePort range) and the client's own port are never
    matched. Without one: the packet's destination, unless its source is a Service's endpoint
    (exact address and port), which is more specific than a port the destination answers on:
    a pod's reset to the masquerade address:port is named after the pod's Service.
    """
    so = ctx.service_of
    c = ev.ct
    if c is not None and c.orig_dport:
        s = so(c.orig_dst, c.orig_dport) or ctx.endpoint_of(c.reply_src, c.reply_sport)
        if s:
            return s
        masq = ((c.reply_dst, c.reply_dport), (c.orig_src, c.orig_sport))
        for addr, port in ((ev.daddr, ev.dport), (ev.saddr, ev.sport)):
            if (addr, port) not in masq:
                s = so(addr, port)
                if s:
                    return s
        return None
    s = so(ev.daddr, ev.dport)
    if s:
        return ctx.endpoint_of(ev.saddr, ev.sport) or s
    return so(ev.saddr, ev.sport) or None
