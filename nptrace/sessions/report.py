"""`report`: a summary of recorded sessions: by cause, by Service, by interface, top flows, a
timeline, and the exact kernel counts with ring-buffer loss."""
from __future__ import annotations

import time
from collections import Counter, defaultdict

from nptrace import names
from nptrace.classify import Verdict, flow_keys
from nptrace.reasons import ReasonTable
from nptrace.sessions.replay import Replay, settle


def _utc(ns: float, fmt: str = "%Y-%m-%d %H:%M:%SZ") -> str:
    return time.strftime(fmt, time.gmtime(ns / 1e9))


def flow_text(v: Verdict) -> str:
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
    flow_texts: dict[tuple, str] = {}
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
        flow_texts.setdefault(fid, flow_text(v))
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
    if r.summaries:
        # the records the kernel counted under their cause and did not send (summary lines)
        counted: Counter = Counter()
        for row in r.summaries:
            lab = row.label
            counted[f"{lab.cause} {lab.kind}" + (f"/{lab.direction}" if lab.direction else "")] \
                += row.repeat
        lines += _table("counted, not sent (cause kind)", counted)
    if any(k != "-" for k in by_service):
        lines += _table("service", by_service)
    lines += _table("interface", by_iface)
    if len(by_node) > 1:
        lines += _table("node", by_node)
    if flows:
        ranked = sorted(flows.items(), key=lambda kv: (-sum(kv[1].values()), str(kv[0])))[:top]
        lines += ["", f"top flows ({min(top, len(flows))} of {len(flows)})"]
        for fid, causes in ranked:
            lines.append(f"{sum(causes.values()):>7}  {flow_texts[fid]}  "
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
    counts: Counter = Counter()
    lost = emitted = filtered = 0
    for snap in r.counters.values():
        h = snap["_header"]
        drops = ReasonTable({int(k): v for k, v in h.get("drop_reasons", {}).items()}, "")
        rsts = ReasonTable({int(k): v for k, v in h.get("rst_reasons", {}).items()}, "")
        for typ, hook, reason, _ifindex, _netns, n in snap.get("counts", []):
            counts[(names.type_name(typ), names.hook_name(hook),
                    names.reason_name(typ, reason, drops.name, rsts.name))] += n
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
    settle(r.problems, problems)
    return text
