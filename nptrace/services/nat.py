"""kube-proxy's nat table as a walk: where a packet is DNATed to, and whether it is marked for
masquerade, before the filter table sees it.

The filter table sees a packet after nat PREROUTING/OUTPUT rewrote its destination, so a
filter rule written for the Service's frontend (``"<svc> has no local endpoints" -d
192.168.99.22 --dport 80 -j DROP``) never meets pod or node traffic that KUBE-EXT-* sends on
to KUBE-SVC-* (TestTracePacket's "LOCAL, KUBE-MARK-MASQ" flow): the matcher must ask this walk
first. iptables only; nft's kube-proxy table reaches its endpoints through vmaps, not walked.

The walk mirrors kube-proxy's own test tracer (``tracePacket`` in
pkg/proxy/iptables/proxier_test.go): start at nat PREROUTING (or ``KUBE-SERVICES`` in the
restore input, which has no base chains), follow jumps, ``KUBE-MARK-MASQ`` sets the mark and
goes on, a DNAT ends the chain; a rule whose match cannot be evaluated (``-m statistic``, ``-m
recent``) is followed but does not end its caller, so every endpoint a random choice may give
is listed. ``certain`` is True when a DNAT was reached through rules that certainly match.
"""

from __future__ import annotations

from .facts import Chain, Table
from .match import Flow, MapView

_MAX_DEPTH = 32


class NatResult:
    __slots__ = ("dests", "masq", "certain")

    def __init__(self):
        self.dests: list[str] = []   # "ip:port" in the order met, no repeats
        self.masq = False
        self.certain = False

    def __repr__(self) -> str:
        return f"NatResult(dests={self.dests}, masq={self.masq}, certain={self.certain})"


def nat_walk(tables: list[Table], flow: Flow, smap: MapView) -> NatResult:
    """The DNAT targets and the masquerade mark of ``flow`` in kube-proxy's nat rules."""
    res = NatResult()
    for t in tables:
        start = t.chains.get("PREROUTING")
        if start is None or not start.entries:
            start = t.chains.get("KUBE-SERVICES")
        if start is None:
            continue
        if _walk(start, t, flow, smap, res, 0):
            res.certain = True
        if res.dests:
            break
    return res


def _walk(ch: Chain, t: Table, flow: Flow, smap: MapView, res: NatResult, depth: int) -> bool:
    """True when the chain certainly ended in a DNAT."""
    if depth > _MAX_DEPTH:
        return False
    for e in ch.candidates(flow):
        r = e.cond.evaluate(flow, smap)
        if r is False:
            continue
        a = e.action
        if a == "masq":
            res.masq = True
        elif a == "dnat":
            if e.target not in res.dests:
                res.dests.append(e.target)
            if r is True:
                return True
        elif a in ("jump", "goto"):
            sub = t.chains.get(e.target)
            done = _walk(sub, t, flow, smap, res, depth + 1) if sub is not None else False
            if r is True and (done or a == "goto"):
                return done
        elif a == "return" and r is True:
            return False
    return False
