"""Flow keys: the direction-free tuples under which the Classifier (correlate.py) files an
event, so a request, its reply and both sides of a NAT share one flow; and the DNAT mapping
read back from the kernel's NAT map."""
from __future__ import annotations

from nptrace.events import IPS_DST_NAT, IPS_SRC_NAT, CtTuples, Event


def _pair(a, b):
    return (a, b) if a <= b else (b, a)


def flow_key(saddr, sport, daddr, dport) -> tuple:
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


def nat_mapping(s: tuple, a: tuple) -> CtTuples | None:
    """A DNAT mapping (client -> frontend -> endpoint) from the two tuples of a NAT-map slot
    (`s`, the one an event's tuple matched, and `a`, the other; each in its packet direction,
    neither saying which is conntrack's original). The original is the tuple whose source
    port is the reply's destination port (no SNAT, or a masquerade that kept the client's
    port, as it does unless two clients collide) and whose destination DNAT changed; None when
    not exactly one order fits (a masquerade that moved the port: the client is not known)."""
    fits = [(o, r) for o, r in ((s, a), (a, s)) if o[1] == r[3] and (o[2], o[3]) != (r[0], r[1])]
    if len(fits) == 2:   # ports alike both ways (port == targetPort): no SNAT decides it
        fits = [(o, r) for o, r in fits if o[0] == r[2]]
    if len(fits) != 1:
        return None
    o, r = fits[0]
    return CtTuples(o[0], o[1], o[2], o[3], r[0], r[1], r[2], r[3],
                    IPS_DST_NAT | (IPS_SRC_NAT if o[0] != r[2] else 0))


def nat_peer_tuple(got) -> tuple | None:
    """A Context.nat_peer answer as (saddr, sport, daddr, dport), or None. Replayed sessions
    give back whatever the file holds: anything but two (str, int) pairs is no answer."""
    if not got or not isinstance(got, (tuple, list)) or len(got) < 4:
        return None
    a, ap, b, bp = got[0], got[1], got[2], got[3]
    if type(a) is str and type(b) is str and type(ap) is int and type(bp) is int:
        return (a, ap, b, bp)
    return None
