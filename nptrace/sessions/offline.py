"""Offline commands over recorded sessions: `replay`, `report`, `merge`. No root, no bcc.

replay  decodes the raw records and runs TODAY's classifier over them, with the node's facts
        the session recorded (reason tables, interface and Service names), so it prints what
        the live run would have printed with this nptrace (the same JSON with --json).
report  a summary: by cause, by Service, by interface, top flows, a timeline, and the exact
        kernel counts with ring-buffer loss.
merge   sessions of several nodes interleaved by wall time (each node's CLOCK_MONOTONIC
        stamps plus that node's epoch_offset_ns; so only as aligned as the nodes' clocks, NTP
        keeps that in milliseconds). A connection that crossed nodes (client -> NodePort on
        node A, DNAT + SNAT to a pod on node B) is one story: verdicts are joined when they
        share a direction-free 4-tuple or a conntrack tuple within the classifier's window.

Each recorded run (one daemon start) is classified with its own state and its own facts; a
daemon restart starts a new run.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from heapq import merge as heap_merge
from pathlib import Path
from typing import Iterator, NamedTuple

import click

from nptrace import events as ev
from nptrace.classify import Classifier, Context, Verdict, flow_keys
from nptrace.errors import NptraceError
from nptrace.reasons import ReasonTable
from nptrace.sessions.format import Problem, Record, SessionError, read_header, read_session, session_files


class Item(NamedTuple):
    verdict: Verdict
    header: dict        # of the file the event was recorded in
    epoch_ns: int       # event time on the recording node's wall clock

    @property
    def node(self) -> str:
        return self.header.get("node", "?")


@dataclass
class _Run:
    """One daemon start: its classifier and what it knew about the node."""
    run_id: str
    ifnames: dict
    services: dict
    classifier: Classifier
    lookups: dict = field(default_factory=dict)

    def absorb_header(self, h: dict) -> None:
        for ns, m in h.get("ifnames", {}).items():
            self.ifnames.setdefault(int(ns), {}).update({int(i): n for i, n in m.items()})
        for a, p, n in h.get("services", []):
            self.services[(a, int(p))] = n
        for name, rows in h.get("lookups", {}).items():
            tab = self.lookups.setdefault(name, {})
            for k, v in rows:
                tab[tuple(k)] = v


def context_from_header(h: dict, ifnames: dict, services: dict, lookups: dict | None = None) -> Context:
    """The live Context rebuilt from recorded facts; lookups read the (growing) tables."""
    drops = ReasonTable({int(k): v for k, v in h.get("drop_reasons", {}).items()}, "")
    rsts = ReasonTable({int(k): v for k, v in h.get("rst_reasons", {}).items()}, "")
    lookups = {} if lookups is None else lookups

    def recorded(name):
        return lambda *args: lookups.get(name, {}).get(tuple(args))
    return Context(drop_name=drops.name, rst_name=rsts.name,
                   iface_name=lambda ns, i: ifnames.get(ns, {}).get(i),
                   service_of=lambda a, p: services.get((a, p)),
                   endpoint_of=recorded("endpoint_of"), nf_rule=recorded("nf_rule"),
                   route_iface=recorded("route_iface"), nat_peer=recorded("nat_peer"))


class Replay:
    """Verdicts of recorded sessions. Iterate `items()` once; afterwards `problems`,
    `counters` (last cumulative counter record per run), `events` and `undecodable` hold the
    rest of what the files said."""

    def __init__(self, paths):
        self.headers, self._records, self.problems = read_session(paths)
        self.counters: dict[str, dict] = {}
        self.events = 0
        self.undecodable: Counter = Counter()

    def _new_run(self, h: dict) -> _Run:
        ifnames: dict = {}
        services: dict = {}
        lookups: dict = {}
        run = _Run(h.get("run_id", h["_path"]), ifnames, services,
                   Classifier(context_from_header(h, ifnames, services, lookups)), lookups)
        run.absorb_header(h)
        return run

    def items(self) -> Iterator[Item]:
        run: _Run | None = None
        path = None
        last_header: dict = {}
        pending: Record | None = None
        for rec in self._records:
            h = rec.header
            if run is None or h.get("run_id", h["_path"]) != run.run_id:
                if pending is not None:
                    yield from self._feed(run, pending)
                    pending = None
                yield from self._end_run(run, last_header)
                run, path = self._new_run(h), rec.path
            elif rec.path != path:
                run.absorb_header(h)
                path = rec.path
            last_header = h
            if rec.kind == "event":
                # The lookups the live classifier made for an event are recorded right after
                # it: classify an event only once the records up to the next one are applied.
                if pending is not None:
                    yield from self._feed(run, pending)
                pending = rec
            elif rec.kind == "names":
                for ns, m in rec.data.get("ifnames", {}).items():
                    tab = run.ifnames.setdefault(int(ns), {})
                    for i, n in m.items():
                        if n is None:
                            tab.pop(int(i), None)
                        else:
                            tab[int(i)] = n
            elif rec.kind == "services":
                for a, p, n in rec.data.get("services", []):
                    if n is None:
                        run.services.pop((a, int(p)), None)
                    else:
                        run.services[(a, int(p))] = n
            elif rec.kind == "lookup":
                run.lookups.setdefault(rec.data.get("name", ""), {})[
                    tuple(rec.data.get("key", ()))] = rec.data.get("value")
            elif rec.kind == "counters":
                self.counters[run.run_id] = dict(rec.data, _header=h)
        if pending is not None:
            yield from self._feed(run, pending)
        yield from self._end_run(run, last_header)
        if self.undecodable:
            n = sum(self.undecodable.values())
            why = "; ".join(f"{k} ({v})" for k, v in self.undecodable.most_common(3))
            self.problems.append(Problem("", "undecodable", 0, 0,
                                         f"{n} event records could not be decoded: {why}"))

    def _feed(self, run: _Run, rec: Record) -> Iterator[Item]:
        raw = rec.data.get("raw", b"")
        try:
            e = ev.decode(raw)
        except ev.DecodeError as err:
            self.undecodable[str(err)] += 1
            return
        self.events += 1
        yield from self._items(run.classifier.feed(e), rec.header)

    @staticmethod
    def _items(verdicts, header) -> Iterator[Item]:
        off = int(header.get("epoch_offset_ns", 0))
        for v in verdicts:
            yield Item(v, header, v.event.ts_ns + off)

    def _end_run(self, run: _Run | None, header) -> Iterator[Item]:
        """A daemon start ended (next run or end of input): its open incidents are due."""
        if run is not None:
            yield from self._items(run.classifier.flush(), header)


def replay(paths, problems: list | None = None) -> Iterator[Verdict]:
    """Verdicts of the recorded events, classified now. Problems (torn tails, corrupt
    records) are appended to `problems` when given; otherwise a serious one raises
    SessionError after every readable record was yielded."""
    r = Replay(paths)
    for it in r.items():
        yield it.verdict
    _settle(r.problems, problems)


def _settle(found: list, problems: list | None) -> None:
    if problems is not None:
        problems.extend(found)
        return
    bad = [p for p in found if p.serious]
    if bad:
        raise SessionError(str(bad[0]) + (f" (and {len(bad) - 1} more problems)" if len(bad) > 1 else ""))


# --- report ---------------------------------------------------------------------------------

def _utc(ns: float, fmt: str = "%Y-%m-%d %H:%M:%SZ") -> str:
    return time.strftime(fmt, time.gmtime(ns / 1e9))


def _flow_text(v: Verdict) -> str:
    """The client's view when conntrack gives it, else the first packet's own direction."""
    e = v.event
    if e.ct is not None and e.ct.dnat:
        c = e.ct
        return f"{c.orig_src}:{c.orig_sport} -> {c.orig_dst}:{c.orig_dport} -> {c.reply_src}:{c.reply_sport}"
    return f"{e.saddr}:{e.sport} -> {e.daddr}:{e.dport}"


def _flow_id(v: Verdict) -> tuple:
    e = v.event
    if e.ct is not None and e.ct.dnat:
        c = e.ct
        return ("ct", c.orig_src, c.orig_sport, c.orig_dst, c.orig_dport)
    return flow_keys(e)[0]


def _table(title: str, counter: Counter, width: int = 40, limit: int = 20) -> list[str]:
    if not counter:
        return []
    lines = ["", f"{title:<{width}} {'count':>7}"]
    for k, n in counter.most_common(limit):
        lines.append(f"{str(k):<{width}} {n:>7}")
    if len(counter) > limit:
        lines.append(f"... and {len(counter) - limit} more")
    return lines


def _bucket_s(span_s: float, max_rows: int = 120) -> int:
    for b in (60, 300, 900, 3600, 6 * 3600, 86400):
        if span_s / b <= max_rows:
            return b
    return 7 * 86400


def build_report(r: Replay, top: int = 10) -> str:
    by_cause: Counter = Counter()
    by_kind: Counter = Counter()
    by_service: Counter = Counter()
    by_iface: Counter = Counter()
    by_node: Counter = Counter()
    flows: dict[tuple, Counter] = defaultdict(Counter)
    flow_text: dict[tuple, str] = {}
    times: list[tuple[int, str]] = []
    for it in r.items():
        v = it.verdict
        by_cause[v.cause] += 1
        by_kind[v.kind] += 1
        by_service[v.service or "-"] += 1
        by_iface[v.iface or "-"] += 1
        by_node[it.node] += 1
        fid = _flow_id(v)
        flows[fid][v.cause] += 1
        flow_text.setdefault(fid, _flow_text(v))
        times.append((it.epoch_ns, v.cause))

    runs = {h.get("run_id", h["_path"]): h for h in r.headers}
    nodes = sorted({h.get("node", "?") for h in r.headers})
    starts = [h.get("start_ns", 0) for h in r.headers]
    lines = [f"nptrace report: {len(r.headers)} file(s), {len(runs)} run(s), "
             f"node(s) {', '.join(nodes) or '-'}"]
    if starts:
        lines.append(f"recorded from {_utc(min(starts))}"
                     + (f"; events {_utc(times[0][0])} .. {_utc(times[-1][0])}" if times else ""))
    kinds = ", ".join(f"{k} {n}" for k, n in by_kind.most_common())
    lines.append(f"{r.events} events replayed, {sum(by_cause.values())} labeled"
                 + (f" ({kinds})" if kinds else ""))
    if not by_cause:
        lines.append("no resets or drops recorded")
    lines += _table("cause", by_cause)
    if any(k != "-" for k in by_service):
        lines += _table("service", by_service)
    lines += _table("interface", by_iface)
    if len(by_node) > 1:
        lines += _table("node", by_node)
    if flows:
        ranked = sorted(flows.items(), key=lambda kv: (-sum(kv[1].values()), str(kv[0])))[:top]
        lines += ["", f"top flows ({min(top, len(flows))} of {len(flows)})"]
        for fid, causes in ranked:
            lines.append(f"{sum(causes.values()):>7}  {flow_text[fid]}  "
                         + ", ".join(f"{c} {n}" for c, n in causes.most_common()))
    if times:
        times.sort()
        b = _bucket_s((times[-1][0] - times[0][0]) / 1e9)
        per: dict[int, Counter] = defaultdict(Counter)
        for t, cause in times:
            per[int(t // (b * 10**9))][cause] += 1
        label = {60: "minute", 300: "5 minutes", 900: "15 minutes", 3600: "hour",
                 21600: "6 hours", 86400: "day"}.get(b, "week")
        lines += ["", f"timeline (per {label}, UTC)"]
        for k in sorted(per):
            c = per[k]
            lines.append(f"{_utc(k * b * 10**9, '%Y-%m-%d %H:%M')}  {sum(c.values()):>6}  "
                         + ", ".join(f"{cause} {n}" for cause, n in c.most_common()))
    lines += _kernel_lines(r)
    return "\n".join(lines)


def _kernel_lines(r: Replay) -> list[str]:
    if not r.counters:
        return ["", "kernel counts: none recorded"]
    from nptrace.sinks.prometheus import reason_label
    counts: Counter = Counter()
    lost = emitted = filtered = 0
    for snap in r.counters.values():
        h = snap["_header"]
        drops = ReasonTable({int(k): v for k, v in h.get("drop_reasons", {}).items()}, "")
        rsts = ReasonTable({int(k): v for k, v in h.get("rst_reasons", {}).items()}, "")
        for typ, hook, reason, _ifindex, _netns, n in snap.get("counts", []):
            try:
                tname, hname = ev.EvType(typ).name, ev.HOOK_NAMES[ev.Hook(hook)]
            except (ValueError, KeyError):
                tname, hname = f"TYPE_{typ}", f"hook_{hook}"
            counts[(tname, hname, reason_label(typ, reason, drops.name, rsts.name))] += n
        st = snap.get("stats", {})
        lost, emitted = lost + st.get("lost", 0), emitted + st.get("emitted", 0)
        filtered += st.get("filtered", 0)
    lines = ["", "kernel counts (exact, last snapshot of each run)",
             f"{'type':<14} {'hook':<24} {'reason':<28} {'count':>9}"]
    for (t, hk, rs), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"{t:<14} {hk:<24} {rs:<28} {n:>9}")
    lines.append(f"ring buffer: {emitted} records emitted, {lost} lost, {filtered} filtered in kernel")
    if lost:
        lines.append(f"WARNING: {lost} event records were lost live: the labeled counts above "
                     "miss them; the kernel counts are exact")
    return lines


def report(paths, problems: list | None = None, top: int = 10) -> str:
    r = Replay(paths)
    text = build_report(r, top=top)
    _settle(r.problems, problems)
    return text


# --- merge ----------------------------------------------------------------------------------

class Merged(NamedTuple):
    item: Item
    story: int          # the same number for every verdict of one connection, across nodes

    @property
    def verdict(self) -> Verdict:
        return self.item.verdict

    @property
    def node(self) -> str:
        return self.item.node


def _keys(v: Verdict) -> list[tuple]:
    return flow_keys(v.event)


def _by_node(paths) -> dict[str, list[str]]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    groups: dict[str, list[str]] = defaultdict(list)
    for p in map(str, paths):
        if os.path.isdir(p):
            files = [str(f) for f in session_files(Path(p))]
            if not files:
                raise SessionError(f"{p}: no session files (nptrace-*.nps) in this directory")
        elif os.path.exists(p):
            files = [p]
        else:
            raise SessionError(f"{p}: no such file or directory")
        for f in files:
            try:
                node = read_header(f).get("node", "?")
            except SessionError:
                if len(files) == 1 and not os.path.isdir(p):
                    raise
                node = "?"   # read_session reports it
            groups[node].append(f)
    return dict(groups)


def _merged_items(groups: dict[str, list[str]], problems: list) -> Iterator[Item]:
    replays = [Replay(files) for _, files in sorted(groups.items())]
    streams = [r.items() for r in replays]
    yield from heap_merge(*streams, key=lambda it: it.epoch_ns)
    for r in replays:
        problems.extend(r.problems)


def merge(paths, problems: list | None = None, window_s: float = 30.0) -> Iterator[Merged]:
    """Verdicts of several nodes' sessions in wall-clock order, each with a story number.
    Two passes over the files (bounded memory: one int per verdict), because a later verdict
    can join two stories that earlier ones started apart."""
    groups = _by_node(paths)
    window = int(window_s * 1e9)
    parent: list[int] = []

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    seen: dict[tuple, tuple[int, int]] = {}   # key -> (story, last epoch ns)
    ids: list[int] = []
    for it in _merged_items(groups, []):
        roots = set()
        for k in _keys(it.verdict):
            got = seen.get(k)
            if got is not None and it.epoch_ns - got[1] <= window:
                roots.add(find(got[0]))
        if roots:
            sid = min(roots)
            for r_ in roots:
                parent[r_] = sid
        else:
            sid = len(parent)
            parent.append(sid)
        for k in _keys(it.verdict):
            seen[k] = (sid, it.epoch_ns)
        if len(seen) > 1_000_000:   # forget keys older than the window
            seen = {k: s for k, s in seen.items() if it.epoch_ns - s[1] <= window}
        ids.append(sid)
    number: dict[int, int] = {}
    found: list = []
    for it, sid in zip(_merged_items(groups, found), ids):
        root = find(sid)
        n = number.setdefault(root, len(number) + 1)
        yield Merged(it, n)
    _settle(found, problems)


# --- click commands (registered by nptrace.cli) ---------------------------------------------

class _Fail(click.ClickException):
    exit_code = 2


def _warn_and_fail(problems: list[Problem]) -> None:
    serious = [p for p in problems if p.serious]
    for p in problems:
        if not p.serious:
            click.echo(f"nptrace: warning: {p}", err=True)
    for p in serious[:-1]:
        click.echo(f"nptrace: error: {p}", err=True)
    if serious:
        raise _Fail(str(serious[-1]))


def _guard(fn):
    """Expected failures -> one line, exit 2; a closed pipe (| head) -> quiet exit."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except NptraceError as e:
            raise _Fail(str(e)) from None
        except BrokenPipeError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, ValueError, AttributeError):
                pass
            sys.exit(1)
    return wrapper


_PATHS = click.argument("paths", nargs=-1, required=True, metavar="FILE|DIR...",
                        type=click.Path(dir_okay=True, file_okay=True))


@click.command("replay")
@_PATHS
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line, as `run --json`.")
@click.option("--output-pcap", "--pcap", "pcap", metavar="FILE",
              help="Also write the verdicts as reconstructed packets to a pcapng FILE.")
@click.option("--collapse", type=click.IntRange(0), default=None, metavar="N",
              help="As `run --collapse`: at most N alike incidents a second, the rest as one "
                   "line with `repeat` (default 20 on the console, 0 with --json).")
@_guard
def replay_command(paths, as_json, pcap, collapse):
    """Label a recorded session again with this nptrace's classifier (no root needed).

    \b
    Prints what `nptrace run` would have printed. A torn tail (the recorder was killed or
    the node lost power) is a warning; a file that is not a session, or is corrupt in the
    middle, is an error (exit 2) after every readable record was printed.

    \b
    Examples:
      nptrace replay /var/lib/nptrace
      nptrace replay /var/lib/nptrace --json | jq -r .cause | sort | uniq -c
      nptrace replay nptrace-20260101T120000Z-....nps --pcap resets.pcapng
    """
    from nptrace.cli import storm_collapse
    from nptrace.sinks.console import Console
    from nptrace.sinks.jsonl import JsonLines
    r = Replay(paths)
    out = sys.stdout
    storm = storm_collapse(collapse, as_json)
    lines = JsonLines(0, out, collapse=storm) if as_json else Console(0, out, collapse=storm)
    console = None if as_json else lines
    sink = None
    if pcap:
        from nptrace.sinks.pcapng import PcapngSink
        sink = PcapngSink(pcap, 0)
    try:
        for it in r.items():
            off = int(it.header.get("epoch_offset_ns", 0))
            lines.offset = off
            lines.write(it.verdict)
            if sink is not None:
                sink.offset = off
                sink.write(it.verdict)
        lines.close()      # the summary lines of storm windows still open
        out.flush()
    finally:
        if sink is not None:
            sink.close()
    if console is not None:
        click.echo("nptrace: summary:\n" + console.summary(), err=True)
    _warn_and_fail(r.problems)


@click.command("report")
@_PATHS
@click.option("--top", type=click.IntRange(1, 1000), default=10, show_default=True,
              help="How many flows to list.")
@_guard
def report_command(paths, top):
    """Summarize recorded sessions: causes, Services, interfaces, top flows, a timeline, and
    the exact kernel counts with ring-buffer loss.

    \b
    Examples:
      nptrace report /var/lib/nptrace
      nptrace report node-a/ node-b/ --top 20
    """
    r = Replay(paths)
    click.echo(build_report(r, top=top))
    _warn_and_fail(r.problems)


@click.command("merge")
@_PATHS
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per line: `run --json`'s keys plus node and story.")
@click.option("--window", type=click.FloatRange(min=0.001), default=30.0, show_default=True,
              metavar="SECONDS", help="How far apart two sightings of a tuple still join.")
@_guard
def merge_command(paths, as_json, window):
    """Interleave several nodes' sessions by wall time; one connection is one story.

    \b
    Copy each node's --record directory (or files) somewhere and name them all. Stories
    that crossed nodes are listed at the end.

    \b
    Examples:
      nptrace merge node-a/ node-b/ node-c/
      nptrace merge node-*/ --json | jq 'select(.story == 7)'
    """
    from nptrace.sinks.jsonl import verdict_dict
    problems: list = []
    stories: dict[int, dict] = {}
    out = sys.stdout
    for m in merge(paths, problems, window_s=window):
        v, it = m.verdict, m.item
        off = int(it.header.get("epoch_offset_ns", 0))
        if as_json:
            d = verdict_dict(v, off)
            d["node"], d["story"] = m.node, m.story
            out.write(json.dumps(d, separators=(",", ":")) + "\n")
        else:
            e = v.event
            ts = time.strftime("%H:%M:%S", time.gmtime(it.epoch_ns / 1e9)) + f".{it.epoch_ns // 1_000_000 % 1000:03d}"
            what = v.kind + (f"/{v.direction}" if v.direction else "")
            out.write(f"{ts} {m.node:<14} #{m.story:<5} {v.cause:<18} {what:<14} "
                      f"{e.saddr}:{e.sport} -> {e.daddr}:{e.dport}  {v.iface or '-'}  "
                      f"[{v.hook} {v.reason}]" + (f" svc={v.service}" if v.service else "") + "\n")
        s = stories.setdefault(m.story, {"nodes": [], "causes": Counter(), "n": 0, "flow": _flow_text(v)})
        if m.node not in s["nodes"]:
            s["nodes"].append(m.node)
        s["causes"][v.cause] += 1
        s["n"] += 1
    out.flush()
    if not as_json:
        crossed = {k: s for k, s in stories.items() if len(s["nodes"]) > 1}
        if crossed:
            out.write(f"\nstories across nodes ({len(crossed)}):\n")
            for k, s in sorted(crossed.items()):
                out.write(f"  #{k}: {' -> '.join(s['nodes'])}: {s['n']} events, "
                          + ", ".join(f"{c} {n}" for c, n in s["causes"].most_common())
                          + f"  ({s['flow']})\n")
        elif not stories:
            out.write("no resets or drops recorded\n")
    _warn_and_fail(problems)
