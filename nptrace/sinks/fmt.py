"""One output vocabulary for every command that prints events or reports: timestamps as
RFC 3339 with milliseconds, in UTC unless --local; endpoints as addr:port, IPv6 as
[addr]:port; -o text|json|table. Pure helpers; the sinks and commands call them."""
from __future__ import annotations

import time

from nptrace.text import hostport

OUTPUTS = ("text", "json", "table")


def ts(epoch_ns: int, local: bool = False) -> str:
    """2026-01-01T10:40:00.250Z (UTC) or 2026-01-01T11:40:00.250+01:00 (--local)."""
    s, ns = divmod(int(epoch_ns), 10**9)
    ms = f"{ns // 1_000_000:03d}"
    if not local:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s)) + f".{ms}Z"
    t = time.localtime(s)
    off = t.tm_gmtoff or 0
    sign = "+" if off >= 0 else "-"
    hh, mm = divmod(abs(off) // 60, 60)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{ms}{sign}{hh:02d}:{mm:02d}"


def endpoint(addr: str, port: int | None) -> str:
    """10.0.0.1:80, [fd00::10]:5000; no port (0/None): the address alone."""
    if not port:
        return addr
    return hostport(addr, port)


def output_mode(output: str | None, as_json: bool) -> str:
    """-o's value, with --json as an alias of -o json."""
    if as_json:
        if output not in (None, "json"):
            from nptrace.errors import NptraceError
            raise NptraceError(f"--json conflicts with -o {output}")
        return "json"
    return output or "text"


def table(rows: list[dict], cols: list[str]) -> str:
    """Aligned columns with a header line (-o table)."""
    cells = [[str(r.get(c, "") if r.get(c) is not None else "-") for c in cols] for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.ljust(w) for x, w in zip(xs, widths)).rstrip()
    return "\n".join([line([c.upper() for c in cols])] + [line(x) for x in cells])


def flow(v) -> str:
    """The client's view when the incident has a NAT mapping (client -> NodePort/Service ->
    endpoint, the way an SRE thinks of it), else the primary packet's own direction."""
    nat = v.nat
    if nat is not None:
        return (f"{hostport(nat.orig_src, nat.orig_sport)} -> {hostport(nat.orig_dst, nat.orig_dport)}"
                f" -> {hostport(nat.reply_src, nat.reply_sport)}")
    e = v.event
    return f"{hostport(e.saddr, e.sport)} -> {hostport(e.daddr, e.dport)}"


def iface(v) -> str:
    """The incident's interface for a person: its name, else (-n, or a name not known)
    `ifindex N`, else -."""
    if v.iface:
        return v.iface
    return f"ifindex {v.event.ifindex}" if v.event.ifindex else "-"


TABLE_COLS = ["time", "node", "cause", "what", "flow", "iface", "service"]


def table_row(v, epoch_ns: int, node: str | None, local: bool = False) -> dict:
    """One -o table row of an incident (replay, merge): TABLE_COLS."""
    return {"time": ts(epoch_ns, local), "node": node or None, "cause": v.cause,
            "what": v.kind + (f"/{v.direction}" if v.direction else ""), "flow": flow(v),
            "iface": iface(v), "service": v.service}


def summary_row(r, epoch_ns: int, node: str | None, local: bool = False) -> dict:
    """One -o table row of a summary row (sinks/exact.py SummaryRow: records the kernel
    counted under their cause and did not send): TABLE_COLS and `repeat`."""
    lab = r.label
    return {"time": ts(epoch_ns, local), "node": node or None, "cause": lab.cause,
            "what": lab.kind + (f"/{lab.direction}" if lab.direction else ""),
            "flow": counted_flow(lab), "iface": lab.iface, "service": lab.service,
            "repeat": r.repeat}


def counted_flow(lab) -> str:
    """A summary row's place in a table's FLOW column: it has no packets, only a count."""
    return f"(counted in the kernel, not sent) [{lab.hook} {lab.reason}]"


def _no_iface(_netns: int, _ifindex: int):
    return None


def _no_pod(_addr: str):
    return None


def unnamed(v):
    """-n: the incident without the names the node resolved: no Service, no interface name
    (the JSON keeps `ifindex`), no pod; the hint's interface names become `ifindex N` and its
    Service name `the Service`. The cause is the classifier's, decided with the names."""
    import dataclasses
    import re
    ctx = v.ctx
    hint = v.hint
    if ctx is not None:
        names = {}
        for ev in (v.event, *(l.ev for l in v.labeled)):
            for idx in (ev.ifindex, ev.in_ifindex):
                if idx:
                    n = ctx.iface_name(ev.netns, idx)
                    if n:
                        names.setdefault(n, f"ifindex {idx}")
        for n in sorted(names, key=len, reverse=True):
            hint = re.sub(rf"(?<![\w.-]){re.escape(n)}(?![\w-])", names[n], hint)
        ctx = dataclasses.replace(ctx, iface_name=_no_iface, pod_of=_no_pod)
    if v.service:
        hint = hint.replace(v.service, "the Service")
    return dataclasses.replace(v, service=None, iface=None, hint=hint, ctx=ctx)


class Unnamed:
    """-n on `run`: a sink that gets every incident through unnamed()."""

    def __init__(self, sink):
        self.sink = sink

    def write(self, v) -> None:
        self.sink.write(unnamed(v))

    def write_many(self, verdicts) -> None:
        for v in verdicts:
            self.sink.write(unnamed(v))

    def __getattr__(self, name):
        return getattr(self.sink, name)
