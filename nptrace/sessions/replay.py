"""`replay`: decode recorded raw records and run TODAY's classifier over them, with the node's
facts the session recorded (reason tables, interface and Service names, every lookup the live
classifier made), so it gives what the live run would have given with this nptrace.

Each recorded run (one daemon start) is classified with its own state and its own facts; a
daemon restart starts a new run. No root, no bcc.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Iterator, NamedTuple

from nptrace import events as ev
from nptrace.classify import Classifier, Context, Verdict
from nptrace.reasons import ReasonTable
from nptrace.sessions.header import SessionError
from nptrace.sessions.lookups import IFACE, REPLAY_FACTOR, SERVICE, LookupTables, ifnames_rows
from nptrace.sessions.reader import Problem, Record, read_session
from nptrace.sessions.schema import LOOKUPS


class Item(NamedTuple):
    verdict: Verdict
    header: dict        # of the file the event was recorded in
    epoch_ns: int       # event time on the recording node's wall clock

    @property
    def node(self) -> str:
        return self.header.get("node", "?")


@dataclass
class _Run:
    """One daemon start: its classifier and what it knew about the node (the recorder's
    bounded tables, mirrored: format.LookupTables)."""
    run_id: str
    known: LookupTables
    classifier: Classifier | None = None

    @classmethod
    def of(cls, h: dict) -> "_Run":
        cap = h.get("lookup_cache")
        # Sessions of older writers kept every answer: so does their replay.
        run = cls(h.get("run_id", h["_path"]), LookupTables(cap * REPLAY_FACTOR if cap else None))
        run.classifier = Classifier(context_from_header(h, run.known))
        run.absorb_header(h)
        return run

    def absorb_header(self, h: dict) -> None:
        """A file's header: what the recorder held when it opened that file. Bounded
        sessions replace the tables with it (the same entries in the same order); older ones
        add to them."""
        k = self.known
        put = k.replace if h.get("lookup_cache") else k.merge
        put(IFACE, ifnames_rows(h.get("ifnames", {})))
        put(SERVICE, [((a, p), n) for a, p, n in h.get("services", [])])
        for name, rows in h.get("lookups", {}).items():
            put(name, rows)


_CONTEXT_FIELDS = frozenset(f.name for f in fields(Context))


def context_from_header(h: dict, known: LookupTables) -> Context:
    """The live Context rebuilt from recorded facts: each lookup of the schema's table
    (schema.LOOKUPS, every answer checked against it when read) reads the (changing) tables."""
    drops = ReasonTable(h.get("drop_reasons", {}), "")
    rsts = ReasonTable(h.get("rst_reasons", {}), "")
    get = known.get

    def recorded(name):
        return lambda *args: get(name, args)
    return Context(drop_name=drops.name, rst_name=rsts.name,
                   **{name: recorded(name) for name in LOOKUPS if name in _CONTEXT_FIELDS})


class Replay:
    """Verdicts of recorded sessions. Iterate `items()` once; afterwards `problems`,
    `counters` (last cumulative counter record per run), `events` and `undecodable` hold the
    rest of what the files said."""

    def __init__(self, paths):
        self.headers, self._records, self.problems = read_session(paths)
        self.counters: dict[str, dict] = {}
        self.summaries: list = []      # the live run's summary rows (sinks/exact.py SummaryRow)
        self.events = 0
        self.packets = 0               # packet-bytes records (format 2) handed to on_packet
        self.on_packet = None          # (events.Packet) -> None: `replay -w`'s pcapng sink
        self.undecodable: Counter = Counter()

    def items(self) -> Iterator[Item]:
        run: _Run | None = None
        path = None
        last_header: dict = {}
        pending: Record | None = None
        for rec in self._records:
            h = rec.header
            if rec.kind == "event" and pending is not None:
                # The lookups the live classifier made for an event are recorded right after
                # it: classify an event only once the records up to the next one are applied
                # (and before the next file's header, written after those lookups).
                yield from self._feed(run, pending)
                pending = None
            if run is None or h.get("run_id", h["_path"]) != run.run_id:
                if pending is not None:
                    yield from self._feed(run, pending)
                    pending = None
                yield from self._end_run(run, last_header)
                run, path = _Run.of(h), rec.path
            elif rec.path != path:
                run.absorb_header(h)
                path = rec.path
            last_header = h
            d = rec.data
            if rec.kind == "event":
                run.known.trim()      # where the recorder trimmed: before writing this event
                pending = rec
            elif rec.kind == "packet":
                self._packet(d["raw"])
            elif rec.kind == "names":
                for k, n in ifnames_rows(d["ifnames"]):
                    run.known.put(IFACE, k, n)
            elif rec.kind == "services":
                for a, p, n in d["services"]:
                    run.known.put(SERVICE, (a, p), n)
            elif rec.kind == "lookup":
                run.known.put(d["name"], d["key"], d["value"])
            elif rec.kind == "counters":
                self.counters[run.run_id] = dict(d, _header=h)
            elif rec.kind == "summary":
                self.summaries.append(summary_row(d, h))
        if pending is not None:
            yield from self._feed(run, pending)
        yield from self._end_run(run, last_header)
        if self.undecodable:
            n = sum(self.undecodable.values())
            why = "; ".join(f"{k} ({v})" for k, v in self.undecodable.most_common(3))
            self.problems.append(Problem("", "undecodable", 0, n,
                                         f"{n} records could not be decoded: {why}"))
        lost = sum(c.get("stats", {}).get("lost", 0) for c in self.counters.values())
        if lost:
            self.problems.append(Problem("", "ring_lost", 0, lost,
                                         f"{lost} event records were lost live to a full ring "
                                         "buffer (the kernel counts stay exact)"))

    def _feed(self, run: _Run, rec: Record) -> Iterator[Item]:
        raw = rec.data["raw"]          # bytes: the schema checked it
        try:
            e = ev.decode(raw)
        except ev.DecodeError as err:
            self.undecodable[str(err)] += 1
            return
        except (ValueError, TypeError, OverflowError, IndexError) as err:
            # events.decode should raise DecodeError for every bad record; count what it
            # does not instead of stopping the replay (a root cause for events.py)
            self.undecodable[f"{type(err).__name__}: {err}"] += 1
            return
        self.events += 1
        yield from self._items(run.classifier.feed(e), rec.header)

    def _packet(self, raw: bytes) -> None:
        """A recorded packet-bytes record: to on_packet, which pairs it with its event by
        (ts_ns, skb) as the live pcapng sink does. A damaged one is counted as undecodable."""
        try:
            p = ev.decode_packet(raw)
        except ev.DecodeError as err:
            self.undecodable[f"packet: {err}"] += 1
            return
        self.packets += 1
        if self.on_packet is not None:
            self.on_packet(p)

    @staticmethod
    def _items(verdicts, header) -> Iterator[Item]:
        off = int(header.get("epoch_offset_ns", 0))
        for v in verdicts:
            yield Item(v, header, v.event.ts_ns + off)

    def _end_run(self, run: _Run | None, header) -> Iterator[Item]:
        """A daemon start ended (next run or end of input): its open incidents are due."""
        if run is not None:
            yield from self._items(run.classifier.flush(), header)


def summary_row(d: dict, header: dict):
    """A recorded summary record as the live run's SummaryRow: counted, not sent, labeled as
    the live run labeled it (a count of records has no events to label again)."""
    from nptrace.classify.keylabel import KeyLabel
    from nptrace.sinks.exact import SummaryRow
    lab = KeyLabel(d["kind"], d["cause"], d.get("direction"), d.get("iface"), d.get("service"),
                   d.get("hook", ""), d.get("reason", ""))
    return SummaryRow(lab, int(d["repeat"]), int(d.get("since_ns", 0)), int(d.get("ts_ns", 0)))


def replay(paths, problems: list | None = None) -> Iterator[Verdict]:
    """Verdicts of the recorded events, classified now. Problems (torn tails, corrupt
    records) are appended to `problems` when given; otherwise a serious one raises
    SessionError after every readable record was yielded."""
    r = Replay(paths)
    for it in r.items():
        yield it.verdict
    settle(r.problems, problems)


def settle(found: list, problems: list | None) -> None:
    if problems is not None:
        problems.extend(found)
        return
    bad = [p for p in found if p.serious]
    if bad:
        raise SessionError(str(bad[0]) + (f" (and {len(bad) - 1} more problems)" if len(bad) > 1 else ""))
