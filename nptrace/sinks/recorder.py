"""`--record DIR`: the live side of a session (nptrace/sessions/format.py holds the format).

The recorder stores what the kernel said (each raw ring-buffer record) and what the live
classifier learned from the node while labeling it (interface and Service names), so that
`nptrace replay` gives the same lines the live run printed, with today's classifier.

Names are recorded by wrapping the Context's lookups: a lookup whose answer differs from what
the session already holds is written at once, i.e. after the event that needed it and before
the next one; replay applies the records that follow an event before classifying it. A None
answer of a key the session never held costs nothing (replay answers None for it), and the
answers held are bounded per lookup (format.LOOKUP_CACHE, oldest written first out), so a
scanner's ever-new client tuples cannot grow the recorder: a forgotten answer is written
again when it is asked again.
"""
from __future__ import annotations

import time
from typing import Callable

from nptrace.sessions.lookups import IFACE, SERVICE
from nptrace.sessions.schema import LOOKUPS
from nptrace.sessions.writer import SessionWriter

CountersFn = Callable[[], "tuple[dict, dict]"]


class Recorder:
    """Sink-shaped (write/close) so it can sit in Tracer.sinks; the work is in on_raw()."""

    def __init__(self, writer: SessionWriter, counters: CountersFn | None = None,
                 counters_interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.writer = writer
        self.counters = counters
        self.counters_interval_s = counters_interval_s
        self.clock = clock
        self.last_counters = clock()

    # -- wrapped lookups (give these to classify.Context) -------------------------------
    # Each answer that differs from what a replay of the session would answer is written at
    # once (sessions/format.py LookupTables: bounded; None answers of unknown keys are free).
    def iface_name(self, lookup: Callable[[int, int], str | None]) -> Callable[[int, int], str | None]:
        needs = self.writer.needs_write

        def recorded(netns: int, ifindex: int) -> str | None:
            name = lookup(netns, ifindex)
            if needs(IFACE, (netns, ifindex), name):
                self.writer.write_names({netns: {ifindex: name}})
            return name
        recorded.recorded_as = IFACE
        return recorded

    def service_of(self, lookup: Callable[[str, int], str | None]) -> Callable[[str, int], str | None]:
        needs = self.writer.needs_write

        def recorded(addr: str, port: int) -> str | None:
            name = lookup(addr, port)
            if needs(SERVICE, (addr, port), name):
                self.writer.write_services([(addr, port, name)])
            return name
        recorded.recorded_as = SERVICE
        return recorded

    def lookup(self, name: str, fn: Callable) -> Callable:
        """Any Context lookup of the session schema's table (sessions/schema.py LOOKUPS),
        recorded in the record kind the table names for it: each answer that differs from what
        the session holds, keyed by the call's arguments. A lookup already recorded is
        returned as it is (so wrapping every lookup of the table records each once)."""
        if getattr(fn, "recorded_as", None) == name:
            return fn
        via = LOOKUPS[name].record
        if via == "names":
            return self.iface_name(fn)
        if via == "services":
            return self.service_of(fn)
        needs = self.writer.needs_write

        def recorded(*args):
            value = fn(*args)
            if needs(name, args, value):
                self.writer.write_lookup(name, args, value)
            return value
        recorded.recorded_as = name
        return recorded

    # -- pipeline ------------------------------------------------------------------------
    def on_raw(self, raw: bytes) -> None:
        """Every ring-buffer record, BEFORE the classifier sees it."""
        self.writer.write_event(raw)

    def on_packet_raw(self, raw: bytes) -> None:
        """A packet-bytes record (bpf/npt_packet.h), as the ring gave it."""
        self.writer.write_packet(raw)

    def snapshot_counters(self) -> None:
        if self.counters is None:
            return
        counts, stats = self.counters()
        self.writer.write_counters(counts, stats)
        self.last_counters = self.clock()

    def tick(self) -> None:
        """From the poll loop (every <= 0.5 s): flush, rotate, periodic counters."""
        if self.counters is not None and self.clock() - self.last_counters >= self.counters_interval_s:
            try:
                self.snapshot_counters()
            except Exception as e:   # a failed map read must not stop the recording
                self.writer.log(f"warning: cannot read kernel counters for the session: {e}")
                self.last_counters = self.clock()
        self.writer.tick()

    def reopen(self) -> None:
        """SIGHUP (safe inside a signal handler: only sets a flag)."""
        self.writer.reopen()

    def write_summary(self, rows) -> None:
        """Summary rows of the exact cause counts (the tracer's once-a-second update)."""
        self.writer.write_summary(rows)

    def write(self, _verdict) -> None:
        """Verdicts are not recorded: replay derives them again from the raw records."""

    def close(self) -> None:
        try:
            self.snapshot_counters()
        except Exception:
            pass   # probes already closed: the last periodic snapshot stands
        self.writer.close()


def snapshot_ifnames(limit: int = 256) -> dict[int, dict[int, str]]:
    """{netns inode: {ifindex: name}} of the host and up to `limit` named namespaces, named
    the way nptrace.node.netns.Names.iface names them ("ns/ifname" in a named namespace). For the
    session header: a person reading it, and `report`; replay itself relies on the recorded
    lookups."""
    from nptrace.kernel import nsenter
    from nptrace.node import netns
    out: dict[int, dict[int, str]] = {}
    try:
        out[nsenter.host_inode()] = netns.link_names_or_none(None)
    except OSError:
        pass
    for i, (inode, name) in enumerate(sorted(netns.named_namespaces().items(), key=lambda x: x[1])):
        if i >= limit:
            break
        if inode in out:
            continue
        out[inode] = {idx: f"{name}/{ifn}" for idx, ifn in netns.link_names_or_none(str(nsenter.RUN_NETNS / name)).items()}
    return out
