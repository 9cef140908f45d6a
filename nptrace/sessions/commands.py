"""The offline commands over recorded sessions, `replay`, `report` and `merge` (registered by
nptrace.cli). No root, no bcc."""
from __future__ import annotations

import json
import sys
from collections import Counter

import click

from nptrace.errors import NptraceError, one_line_errors
from nptrace.flagtypes import Int, Seconds
from nptrace.sessions.filteropts import OnlyMatching, filter_from, filter_options
from nptrace.sessions.header import SessionError
from nptrace.sessions.merge import merge
from nptrace.sessions.reader import Problem
from nptrace.sessions.replay import Replay
from nptrace.sessions.report import flow_text, loss_dict, render_text, report_data
from nptrace.sinks import fmt, jsonl
from nptrace.text import printable


def _warn_and_fail(problems: list[Problem]) -> None:
    """Each problem one line on stderr; the last serious one is the error (exit 2), the others
    warnings before it, so an exit 2 ends with ONE error line."""
    serious = [p for p in problems if p.serious]
    last = serious[-1] if serious else None
    for p in problems:
        if p is not last:
            click.echo(f"nptrace: warning: {printable(p)}", err=True)
    if last is not None:
        more = f" ({len(serious) - 1} more problems above)" if len(serious) > 1 else ""
        raise SessionError(printable(last) + more)


def loss_line(p: Problem) -> str:
    """The JSON stream's loss marker (docs/output.md): a line of kind "loss" says records are
    missing or were skipped there, so a consumer counting verdicts knows its count is short
    (report.loss_dict has its keys)."""
    d = loss_dict(p)
    return jsonl.loss_line(d["loss"], records=d["records"], nbytes=d["bytes"], path=d["path"],
                           offset=d["offset"], message=d["message"])


class _LossLines:
    """Writes a loss line for each problem found since the last call (problems fill while
    the records are read, so the line lands near where the loss is)."""

    def __init__(self, problems: list, out):
        self.problems, self.out, self.seen = problems, out, 0

    def __call__(self) -> None:
        while self.seen < len(self.problems):
            self.out.write(loss_line(self.problems[self.seen]) + "\n")
            self.seen += 1


def _terminal_safe(fn):
    """Messages of expected errors escaped before they reach the terminal (a path or a name
    in them may hold control characters)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except NptraceError as e:
            raise type(e)(printable(e)) if type(e) in (SessionError, NptraceError) else e
    return wrapper


def _output_options(choices: tuple[str, ...], json_help: str):
    """-o/--output (--json its alias), --local and -n, the same on every offline command as
    on `run` (sinks/fmt.py)."""
    opts = [
        click.option("-o", "--output", "output", type=click.Choice(choices), default=None,
                     help="text: readable lines (default); json: " + json_help
                     + ("; table: aligned columns, printed at the end." if "table" in choices
                        else ".")),
        click.option("--json", "as_json", is_flag=True, help="Alias of -o json."),
        click.option("--local", is_flag=True,
                     help="Times in local time with its UTC offset (default: UTC, RFC 3339 "
                          "with milliseconds, 2026-01-01T10:40:00.250Z)."),
        click.option("-n", "no_names", is_flag=True,
                     help="No names the node resolved: addresses and ifindexes, no Service, "
                          "pod or interface names (causes are still decided with them)."),
    ]

    def deco(fn):
        for o in reversed(opts):
            fn = o(fn)
        return fn
    return deco


def _same(v):
    return v


_PATHS = click.argument("paths", nargs=-1, required=True, metavar="FILE|DIR...",
                        type=click.Path(dir_okay=True, file_okay=True))


class _TableRows:
    """replay -o table: the incidents as rows (sinks/fmt.py table_row), printed at the end
    so the columns align; `repeat` says how many incidents a row stands for, shown with
    --collapse (a storm's summary row) or when the session holds summary rows (records the
    kernel counted and did not send)."""

    def __init__(self, collapse, local: bool):
        self.collapse, self.local, self.offset = collapse, local, 0
        self.node, self.rows = "", []
        self.counted = False       # a summary row was written

    def set_node(self, node: str) -> None:
        self.node = node

    def write(self, v) -> None:
        for item in (self.collapse.add(v) if self.collapse is not None else [(v, 1)]):
            self._row(*item[:2])

    def _row(self, v, repeat: int) -> None:
        row = fmt.table_row(v, v.event.ts_ns + self.offset, self.node, self.local)
        row["repeat"] = repeat
        self.rows.append(row)

    def write_summary(self, rows) -> None:
        for r in rows:
            self.rows.append(fmt.summary_row(r, r.until_ns + self.offset, self.node, self.local))
            self.counted = True

    def close(self) -> None:
        if self.collapse is not None:
            for item in self.collapse.drain():
                self._row(*item[:2])

    def text(self) -> str:
        if not self.rows:
            return "no resets or drops recorded"
        cols = fmt.TABLE_COLS + (["repeat"] if self.collapse is not None or self.counted else [])
        return fmt.table(self.rows, cols)


@click.command("replay")
@_PATHS
@_output_options(fmt.OUTPUTS, "one JSON object per line, as `run -o json`")
@click.option("-w", "--output-pcap", "--pcap", "pcap", metavar="FILE",
              help="Also write the packets behind the incidents to a pcapng FILE: the bytes "
                   "the kernel had at the hook where the session recorded them (run with -w "
                   "or --record, format 2), else headers rebuilt from the event's fields.")
@click.option("--collapse", type=Int(0), default=None, metavar="N",
              help="As `run --collapse`: at most N alike incidents a second, the rest as one "
                   "line with `repeat` (default 20 on the console, 0 with --json).")
@filter_options(offline=True)
@one_line_errors
@_terminal_safe
def replay_command(paths, output, as_json, local, no_names, pcap, collapse, **filters):
    """Label a recorded session again with this nptrace's classifier (no root needed).

    \b
    Prints what `nptrace run` would have printed. A torn tail or a missing stop record (the
    recorder was killed or the node lost power) is a warning; a file that is not a session,
    is corrupt in the middle or holds invalid records, is an error (exit 2) after every
    readable record was printed. With --json, each loss is also a line {"kind": "loss", ...}.

    \b
    Examples:
      nptrace replay /var/lib/nptrace
      nptrace replay /var/lib/nptrace -o json | jq -r .cause | sort | uniq -c
      nptrace replay /var/lib/nptrace -o table --cause rp_filter --since 10m
      nptrace replay nptrace-20260101T120000Z-....nps -w resets.pcapng
    """
    from nptrace.sinks.collapse import storm_collapse
    from nptrace.sinks.console import Console
    from nptrace.sinks.jsonl import JsonLines
    mode = fmt.output_mode(output, as_json)
    as_json = mode == "json"
    flt = filter_from(filters)     # bad filter values before the files are read
    rp = Replay(paths)
    r = OnlyMatching(rp, flt)
    out = sys.stdout
    storm = storm_collapse(collapse, mode != "text")
    if mode == "table":
        lines = _TableRows(storm, local)
    else:
        lines = JsonLines(0, out, collapse=storm) if as_json else \
            Console(0, out, collapse=storm, local=local)
    console = lines if mode == "text" else None
    named = fmt.unnamed if no_names else _same
    sink = None
    if pcap:
        from nptrace.sinks.pcapng import PcapngSink
        sink = PcapngSink(pcap, 0)
        rp.on_packet = sink.on_packet     # the recorded packet bytes, before their incident
    loss = _LossLines(r.problems, out) if as_json else (lambda: None)
    try:
        for it in r.items():
            off = int(it.header.get("epoch_offset_ns", 0))
            lines.offset = off
            if mode != "text":     # the recording node's name, as the live line had it
                node = it.header.get("node")
                lines.set_node(node if isinstance(node, str) and node != "?" else "")
            lines.write(named(it.verdict))
            if sink is not None:
                sink.offset = off
                sink.write(it.verdict)
            loss()
        if r.summaries:    # what the live run counted and did not send, as it printed it
            off = int(r.headers[-1].get("epoch_offset_ns", 0)) if r.headers else 0
            lines.offset = off
            lines.write_summary(r.summaries)
        lines.close()      # the summary lines of storm windows still open
        loss()
        if mode == "table":
            out.write(printable(lines.text()) + "\n")
        out.flush()
    finally:
        if sink is not None:
            sink.close()
    if console is not None:
        click.echo("nptrace: summary:\n" + console.summary(), err=True)
    _warn_and_fail(r.problems)


@click.command("report")
@_PATHS
@click.option("--top", type=Int(1, 1000), default=10, show_default=True,
              help="How many flows to list.")
@_output_options(("text", "json"), "one JSON document with every number the text prints")
@filter_options(offline=True)
@one_line_errors
@_terminal_safe
def report_command(paths, top, output, as_json, local, no_names, **filters):
    """Summarize recorded sessions: causes, Services, interfaces, top flows, a timeline, and
    the exact kernel counts with ring-buffer loss.

    \b
    Examples:
      nptrace report /var/lib/nptrace
      nptrace report node-a/ node-b/ --top 20
      nptrace report /var/lib/nptrace -o json | jq .by_cause
    """
    mode = fmt.output_mode(output, as_json)
    flt = filter_from(filters)
    rp = Replay(paths)
    r = OnlyMatching(rp, flt)
    d = report_data(r, top=top, local=local, no_names=no_names)
    if mode == "json":
        click.echo(json.dumps(d, indent=2))
    else:
        click.echo(printable(render_text(d)))
    _warn_and_fail(r.problems)


@click.command("merge")
@_PATHS
@_output_options(fmt.OUTPUTS, "one JSON object per line, `run -o json`'s keys plus node "
                 "and story")
@click.option("--window", type=Seconds(least=0.001), default=30.0, show_default=True,
              metavar="SECONDS", help="How far apart two sightings of a tuple still join.")
@filter_options(offline=True)
@one_line_errors
@_terminal_safe
def merge_command(paths, output, as_json, local, no_names, window, **filters):
    """Interleave several nodes' sessions by wall time; one connection is one story.

    \b
    Copy each node's --record directory (or files) somewhere and name them all. Stories
    that crossed nodes are listed at the end.

    \b
    Examples:
      nptrace merge node-a/ node-b/ node-c/
      nptrace merge node-*/ -o json | jq 'select(.story == 7)'
      nptrace merge node-*/ -o table --service default/web
    """
    from nptrace.sinks.jsonl import verdict_dict
    mode = fmt.output_mode(output, as_json)
    as_json = mode == "json"
    named = fmt.unnamed if no_names else _same
    rows: list[dict] = []
    problems: list = []
    stories: dict[int, dict] = {}
    out = sys.stdout
    flt = filter_from(filters)
    for m in merge(paths, problems, window_s=window):
        v, it = m.verdict, m.item
        if flt and not flt.matches(v, it.epoch_ns, m.node, it.header.get("services", [])):
            continue
        v = named(v)
        off = int(it.header.get("epoch_offset_ns", 0))
        if as_json:
            d = verdict_dict(v, off)
            d["node"], d["story"] = m.node, m.story
            out.write(json.dumps(d, separators=(",", ":")) + "\n")
        elif mode == "table":
            rows.append({**fmt.table_row(v, it.epoch_ns, m.node, local), "story": f"#{m.story}"})
        else:
            what = v.kind + (f"/{v.direction}" if v.direction else "")
            out.write(printable(f"{fmt.ts(it.epoch_ns, local)} {m.node:<14} #{m.story:<5} "
                                f"{v.cause:<18} {what:<14} {fmt.flow(v)}  {fmt.iface(v)}  "
                                f"[{v.hook} {v.reason}]" + (f" svc={v.service}" if v.service else ""))
                      + "\n")
        s = stories.setdefault(m.story, {"nodes": [], "causes": Counter(), "n": 0, "flow": flow_text(v)})
        if m.node not in s["nodes"]:
            s["nodes"].append(m.node)
        s["causes"][v.cause] += 1
        s["n"] += 1
    if mode == "table" and rows:
        out.write(printable(fmt.table(rows, ["time", "node", "story"] + fmt.TABLE_COLS[2:]))
                  + "\n")
    out.flush()
    if not as_json:
        crossed = {k: s for k, s in stories.items() if len(s["nodes"]) > 1}
        if crossed:
            out.write(f"\nstories across nodes ({len(crossed)}):\n")
            for k, s in sorted(crossed.items()):
                out.write(printable(f"  #{k}: {' -> '.join(s['nodes'])}: {s['n']} events, "
                                    + ", ".join(f"{c} {n}" for c, n in s["causes"].most_common())
                                    + f"  ({s['flow']})") + "\n")
        elif not stories:
            out.write("no resets or drops recorded\n")
    else:
        _LossLines(problems, out)()
    _warn_and_fail(problems)
