"""Connections and events counted from incident lines: the summary at exit (console.py) and
`report` (sessions/report.py).

An incident is one connection; its lines share one Incident (Verdict.tally), whose event count
and cause keep growing after its first line (later events join it without a line). So a line
is not counted when it is written: the Incident is remembered, and read when the counts are
asked for (at exit, or at the end of a report's input). Each connection counts once, under the
cause, Service, interface and node of its first line (as nptrace_incidents_total counts it). Bounded: past `cap` remembered incidents the oldest
is counted as it is then (an incident is that old only once its flow stopped joining: the
classifier forgets a flow 130 s after its last event, or sooner under its max_flows cap)."""
from __future__ import annotations

from collections import Counter, OrderedDict

from nptrace.classify.verdict import PRIORITY

OPEN_MAX = 1 << 16


class IncidentTally:
    def __init__(self, cap: int | None = OPEN_MAX):
        self.cap = cap
        self._open: OrderedDict = OrderedDict()       # Incident -> {dim: value} of its first line
        self._conns: dict[str, Counter] = {}          # counted incidents, by dim and value
        self._events: dict[str, Counter] = {}

    def add(self, v, **dims) -> None:
        """One line (a Verdict). `dims`: further keys to count by (interface, node, ...);
        "cause" and "service" are always kept."""
        t = v.tally
        if v.continues and t is not None and t in self._open:
            return              # a later line of a connection counted already
        keys = {"cause": None, "service": v.service or "-", **dims}
        if t is None:           # a line without an incident (not from the classifier)
            self._count(v.cause, v.events, keys)
            return
        self._open[t] = keys
        if self.cap is not None and len(self._open) > self.cap:
            old, okeys = self._open.popitem(last=False)
            self._count(old.cause, old.events, okeys)

    def _count(self, cause: str, events: int, keys: dict) -> None:
        for dim, val in keys.items():
            if dim == "cause":
                val = cause
            self._conns.setdefault(dim, Counter())[val] += 1
            self._events.setdefault(dim, Counter())[val] += events

    def _of(self, table: dict, dim: str, events: bool) -> Counter:
        got = Counter(table.get(dim, ()))
        for t, keys in self._open.items():
            if dim in keys:
                got[t.cause if dim == "cause" else keys[dim]] += t.events if events else 1
        return got

    def connections(self, dim: str = "cause") -> Counter:
        """Connections (incidents) by the value of `dim`."""
        return self._of(self._conns, dim, False)

    def events(self, dim: str = "cause") -> Counter:
        """The kernel events those connections joined, by the value of `dim`."""
        return self._of(self._events, dim, True)

    def summary_text(self, unsent: Counter | None = None) -> str:
        """The summary at exit: connections and events by cause (and by Service), with the
        records the kernel counted and did not send beside them."""
        conns, events = self.connections(), self.events()
        unsent = Counter({c: n for c, n in (unsent or {}).items() if n})
        if not conns and not unsent:
            return "no resets or drops seen"
        rank = {c: i for i, c in enumerate(PRIORITY)}
        causes = sorted(set(conns) | set(unsent), key=lambda c: (-conns[c], rank.get(c, 99), c))
        head = f"{'cause':<18} {'connections':>11} {'events':>8}"
        if unsent:
            head += f" {'not sent':>9}"
        lines = [head]
        for c in causes:
            row = f"{c:<18} {conns[c]:>11} {events[c]:>8}"
            if unsent:
                row += f" {unsent[c]:>9}"
            lines.append(row)
        lines.append("(connections: incidents, one per connection; events: the kernel events "
                     "they joined" + ("; not sent: records the kernel counted under the cause "
                                      "and did not send, of connections not counted here)"
                                      if unsent else ")"))
        by_service = self.connections("service")
        if any(s != "-" for s in by_service):
            svc_events = self.events("service")
            lines += ["", f"{'service':<18} {'connections':>11} {'events':>8}"]
            lines += [f"{s:<18} {n:>11} {svc_events[s]:>8}" for s, n in by_service.most_common()]
        return "\n".join(lines)
