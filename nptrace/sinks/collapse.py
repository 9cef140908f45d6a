"""Storm collapsing for the line sinks (JSON, console): a reset storm is one story, not 100,000
lines. Off unless a sink is given a StormCollapse.

Two incidents are alike when kind, direction, cause, Service, hook, reason, interface and the
connection's server end (`server_end`) agree; the client address and port may differ. Per key,
a window opens at the first incident (event time) and lasts `window_ns`. Its first `burst`
incidents are written as usual; the rest are only counted, and when the window ends one
summary line is written: the last of them, with `repeat` = how many incidents it stands for,
`repeat_since` = the first one's time, and `events` = their kernel events together. So the sum
of `repeat` over all lines is the number of incidents, and the sum of `events` the number of
kernel events, collapsed or not. Counters (the Prometheus sink) see every incident: collapsing
only changes what is printed.

The clock is the incidents' own time (`event.ts_ns`) and what `tick(now_ns)` passes (the live
loop's monotonic clock, the events' clock too): a quiet key's summary is written within a loop
turn of its window's end, not at the next incident.
"""
from __future__ import annotations

from collections import OrderedDict

from nptrace.classify import Verdict
from nptrace.events import TCP_ACK, TCP_SYN

BURST = 20                       # lines per key and window before counting starts
WINDOW_NS = 1_000_000_000
_RST_SENT, _DROP = 2, 1          # EvType values (ints: this runs once per incident)


def server_end(v: Verdict) -> tuple[str, int]:
    """The end of the connection that was connected to: the NodePort/Service the client asked
    for when conntrack says so; else the receiver of a SYN (the flags of the packet the event
    is about: a reset's `aux`, a drop's own); else the end with the lower port (clients use
    ephemeral ports, 32768-60999 by default)."""
    e = v.event
    ct = e.ct
    if ct is not None and ct.dnat:
        return ct.orig_dst, ct.orig_dport
    flags = e.aux if e.type == _RST_SENT else e.tcpflags if e.type == _DROP else 0
    if flags & (TCP_SYN | TCP_ACK) == TCP_SYN:          # about a SYN: its receiver
        return (e.saddr, e.sport) if e.type == _RST_SENT else (e.daddr, e.dport)
    if flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK:    # about a SYN-ACK: its sender
        return (e.daddr, e.dport) if e.type == _RST_SENT else (e.saddr, e.sport)
    if e.sport < e.dport:
        return e.saddr, e.sport
    return e.daddr, e.dport


def key_of(v: Verdict) -> tuple:
    return (v.kind, v.direction, v.cause, v.service, server_end(v), v.hook, v.reason, v.iface)


class _Window:
    __slots__ = ("opened", "written", "held", "events", "since", "last")

    def __init__(self, opened: int):
        self.opened = opened
        self.written = 0
        self.held = 0           # incidents counted, not written
        self.events = 0         # their kernel events
        self.since = 0          # ts_ns of the first of them
        self.last: Verdict | None = None


class StormCollapse:
    """add(verdict) and due(now_ns)/drain() give what to write: (verdict, repeat, since_ns,
    events) tuples, repeat 1 for an ordinary line."""

    def __init__(self, burst: int = BURST, window_ns: int = WINDOW_NS):
        if burst < 1 or window_ns <= 0:
            raise ValueError("burst must be >= 1 and window_ns > 0")
        self.burst, self.window_ns = burst, window_ns
        self.windows: OrderedDict[tuple, _Window] = OrderedDict()   # by opening time
        self.now = 0
        self.incidents = 0      # every incident given to add()
        self.lines = 0          # lines it let through (ordinary and summaries)

    def add(self, v: Verdict) -> list:
        self.incidents += 1
        out = self.due(v.event.ts_ns)
        key = key_of(v)
        w = self.windows.get(key)
        if w is None:
            w = self.windows[key] = _Window(self.now)
        if w.written < self.burst:
            w.written += 1
            self.lines += 1
            out.append((v, 1, v.event.ts_ns, v.events))
        else:
            if not w.held:
                w.since = v.event.ts_ns
            w.held += 1
            w.events += v.events
            w.last = v
        return out

    def due(self, now_ns: int) -> list:
        """Summaries of the windows that ended by now_ns (and forget those windows)."""
        if now_ns > self.now:
            self.now = now_ns
        out = []
        windows, end = self.windows, self.now - self.window_ns
        while windows:
            key = next(iter(windows))
            w = windows[key]
            if w.opened > end:
                break
            del windows[key]
            if w.held:
                self.lines += 1
                out.append((w.last, w.held, w.since, w.events))
        return out

    def drain(self) -> list:
        """End of output: every pending summary."""
        out = [(w.last, w.held, w.since, w.events) for w in self.windows.values() if w.held]
        self.lines += len(out)
        self.windows.clear()
        return out


def storm_collapse(burst: int | None, as_json: bool):
    """The StormCollapse for --collapse: a person reads the console, a program reads JSON."""
    if burst is None:
        burst = 0 if as_json else BURST
    return StormCollapse(burst) if burst else None
