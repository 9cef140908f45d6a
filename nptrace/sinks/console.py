"""Readable lines for a person at a terminal (stdout), and the summary at exit. Every line
goes through printable(): names come from the node and may hold terminal escapes. With a
StormCollapse (sinks/collapse.py), a storm's alike incidents past the burst are printed as one
`... and N more like this since TIME` line per window; the summary counts every one."""
from __future__ import annotations

import sys
from collections import Counter
from typing import TextIO

from nptrace.classify import Verdict
from nptrace.sinks import fmt
from nptrace.sinks.collapse import StormCollapse
from nptrace.text import hostport
from nptrace.text import printable  # noqa: F401 (sessions/commands.py and others import it here)

class Console:
    def __init__(self, epoch_offset_ns: int, stream: TextIO | None = None,
                 collapse: StormCollapse | None = None, local: bool = False):
        self.stream = stream or sys.stdout
        self.local = local      # --local: local time with its offset, else UTC (sinks/fmt.py)
        self.offset = epoch_offset_ns
        self.by_cause: Counter = Counter()
        self.by_service: Counter = Counter()
        self.collapse = collapse

    def write(self, v: Verdict) -> None:
        self.by_cause[v.cause] += 1
        self.by_service[v.service or "-"] += 1
        if self.collapse is None:
            self._print(v)
            return
        self._items(self.collapse.add(v))

    def _items(self, items) -> None:
        for v, repeat, since, _events in items:
            if repeat == 1:
                self._print(v)
            else:
                ts = fmt.ts(since + self.offset, self.local)
                e = v.event
                self.stream.write(printable(
                    f"         ... and {repeat} more {v.cause} like this since {ts} (last: "
                    f"{hostport(e.saddr, e.sport)} -> {hostport(e.daddr, e.dport)})") + "\n")
                self.stream.flush()

    def write_summary(self, rows) -> None:
        """Records the kernel counted under their cause but did not send (sinks/exact.py):
        one line per cause, Service, interface and direction a second."""
        for r in rows:
            lab = r.label
            self.by_cause[lab.cause] += r.repeat
            self.by_service[lab.service or "-"] += r.repeat
            ts = fmt.ts(r.until_ns + self.offset, self.local)
            what = lab.kind + (f"/{lab.direction}" if lab.direction else "")
            self.stream.write(printable(
                f"{ts} {lab.cause:<18} {what:<14} x{r.repeat} more, counted in the kernel  "
                f"{lab.iface or '-'}  [{lab.hook} {lab.reason}]"
                + (f" svc={lab.service}" if lab.service else "")) + "\n")
        if rows:
            self.stream.flush()

    def tick(self, now_ns: int) -> None:
        if self.collapse is not None:
            self._items(self.collapse.due(now_ns))

    def _print(self, v: Verdict) -> None:
        e = v.event
        ts = fmt.ts(e.ts_ns + self.offset, self.local)
        flow = fmt.flow(v)
        what = f"{v.kind}" + (f"/{v.direction}" if v.direction else "")
        self.stream.write(printable(f"{ts} {v.cause:<18} {what:<14} {flow}  {fmt.iface(v)}"
                                    f"  [{v.hook} {v.reason}]"
                                    + (f" svc={v.service}" if v.service else "")) + "\n")
        self.stream.write(printable(f"         hint: {v.hint}") + "\n")
        self.stream.flush()

    def summary(self) -> str:
        if not self.by_cause:
            return "no resets or drops seen"
        lines = ["cause               count"]
        lines += [f"{c:<18} {n:>6}" for c, n in self.by_cause.most_common()]
        if any(s != "-" for s in self.by_service):
            lines += ["", "service             count"]
            lines += [f"{s:<18} {n:>6}" for s, n in self.by_service.most_common()]
        return printable("\n".join(lines))

    def close(self) -> None:
        if self.collapse is not None:
            self._items(self.collapse.drain())
        self.stream.flush()


class LiveTable(Console):
    """`run -o table`: one fixed-width row per incident, as `conntrack -L` or
    `hubble observe -o table` print a live stream (a refreshed screen would not survive a pipe
    or `tee`). The header is printed once, before the first row; the columns are
    LIVE_COLS (no NODE: a live run is one node, named on stderr's "attached" line), N is how
    many incidents the row stands for (1, or a storm's collapsed summary, or the records the
    kernel counted and did not send). The hint is not a column: `-o text` and `-o json` have it.
    A value wider than its column pushes the rest of its row right; FLOW, the widest, is last."""

    COLS = (("TIME", 24), ("CAUSE", 18), ("WHAT", 14), ("IFACE", 12), ("SERVICE", 22),
            ("N", 5), ("FLOW", 0))

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._head = False

    def _row(self, *cells) -> None:
        if not self._head:
            self._head = True
            self._row(*(c for c, _w in self.COLS))
            self._head = True
        line = "  ".join(str(x).ljust(w) for x, (_c, w) in zip(cells, self.COLS)).rstrip()
        self.stream.write(printable(line) + "\n")
        self.stream.flush()

    def _print(self, v: Verdict, repeat: int = 1, ts_ns: int | None = None) -> None:
        what = v.kind + (f"/{v.direction}" if v.direction else "")
        self._row(fmt.ts((v.event.ts_ns if ts_ns is None else ts_ns) + self.offset, self.local),
                  v.cause, what, fmt.iface(v), v.service or "-", repeat, fmt.flow(v))

    def _items(self, items) -> None:
        for v, repeat, since, _events in items:
            self._print(v, repeat, None if repeat == 1 else since)

    def write_summary(self, rows) -> None:
        for r in rows:
            lab = r.label
            self.by_cause[lab.cause] += r.repeat
            self.by_service[lab.service or "-"] += r.repeat
            what = lab.kind + (f"/{lab.direction}" if lab.direction else "")
            self._row(fmt.ts(r.until_ns + self.offset, self.local), lab.cause, what,
                      lab.iface or "-", lab.service or "-", r.repeat, fmt.counted_flow(lab))
