"""`report`: a summary of recorded sessions: by cause, by Service, by interface, top flows, a
timeline, and the exact kernel counts with ring-buffer loss."""
from __future__ import annotations

from collections import Counter, defaultdict

from nptrace import names
from nptrace.classify import Verdict, flow_keys
from nptrace.reasons import ReasonTable
from nptrace.sessions.replay import Replay, settle
from nptrace.sinks import fmt
from nptrace.text import hostport


def flow_text(v: Verdict) -> str:
    """The client's view when conntrack gives it, else the first packet's own direction."""
    e = v.event
    if e.ct is not None and e.ct.dnat:
        c = e.ct
        return (f"{hostport(c.orig_src, c.orig_sport)} -> {hostport(c.orig_dst, c.orig_dport)} -> "
                f"{hostport(c.reply_src, c.reply_sport)}")
    return f"{hostport(e.saddr, e.sport)} -> {hostport(e.daddr, e.dport)}"


def _flow_id(v: Verdict) -> tuple:
    e = v.event
    if e.ct is not None and e.ct.dnat:
        c = e.ct
        return ("ct", c.orig_src, c.orig_sport, c.orig_dst, c.orig_dport)
    return flow_keys(e)[0]


def _bucket_s(span_s: float, max_rows: int = 120) -> int:
    for b in (60, 300, 900, 3600, 6 * 3600, 86400):
        if span_s / b <= max_rows:
            return b
    return 7 * 86400


_BUCKET_LABEL = {60: "minute", 300: "5 minutes", 900: "15 minutes", 3600: "hour",
                 21600: "6 hours", 86400: "day"}


def _when(ns: int, local: bool) -> dict:
    """A time in the report's JSON: RFC 3339 text (as the text report prints it) and epoch
    seconds (as the JSON lines' `ts`)."""
    return {"time": fmt.ts(ns, local), "ts": ns / 1e9}


def report_data(r: Replay, top: int = 10, local: bool = False, no_names: bool = False,
                problems: list | None = None) -> dict:
    """Everything the report says, as one JSON-ready document (`report -o json`); the text
    report is render_text() of it, so the two cannot disagree. Counters are ordered most
    common first, as the text lists them; the text shows at most 20 rows of each."""
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
        if no_names:
            v = fmt.unnamed(v)
        by_cause[v.cause] += 1
        by_kind[v.kind] += 1
        by_service[v.service or "-"] += 1
        by_iface[fmt.iface(v)] += 1
        by_node[it.node] += 1
        fid = _flow_id(v)
        flows[fid][v.cause] += 1
        flow_texts.setdefault(fid, flow_text(v))
        times.append((it.epoch_ns, v.cause))

    runs = {h.get("run_id", h["_path"]): h for h in r.headers}
    starts = [h.get("start_ns", 0) for h in r.headers]
    times.sort()
    d: dict = {
        "files": len(r.headers), "runs": len(runs),
        "nodes": sorted({h.get("node", "?") for h in r.headers}),
        "recorded_from": _when(min(starts), local) if starts else None,
        "first_event": _when(times[0][0], local) if times else None,
        "last_event": _when(times[-1][0], local) if times else None,
        "events": r.events, "labeled": sum(by_cause.values()),
        "by_kind": dict(by_kind.most_common()),
        "by_cause": dict(by_cause.most_common()),
        "by_service": dict(by_service.most_common()) if any(k != "-" for k in by_service) else {},
        "by_interface": dict(by_iface.most_common()),
        "by_node": dict(by_node.most_common()),
        # records the kernel counted under their cause and did not send (summary lines)
        "counted_not_sent": dict(_counted_not_sent(r).most_common()),
    }
    ranked = sorted(flows.items(), key=lambda kv: (-sum(kv[1].values()), str(kv[0])))[:top]
    d["top_flows"] = {"shown": len(ranked), "of": len(flows), "flows": [
        {"flow": flow_texts[fid], "count": sum(c.values()), "by_cause": dict(c.most_common())}
        for fid, c in ranked]}
    d["timeline"] = None
    if times:
        b = _bucket_s((times[-1][0] - times[0][0]) / 1e9)
        per: dict[int, Counter] = defaultdict(Counter)
        for t, cause in times:
            per[int(t // (b * 10**9))][cause] += 1
        d["timeline"] = {"bucket_s": b, "per": _BUCKET_LABEL.get(b, "week"),
                         "clock": "local" if local else "UTC", "rows": [
            {**_when(k * b * 10**9, local), "count": sum(per[k].values()),
             "by_cause": dict(per[k].most_common())} for k in sorted(per)]}
    d["kernel"] = _kernel_data(r)
    lost = d["kernel"]["ring"]["lost"] if d["kernel"] else 0
    d["warnings"] = [f"{lost} event records were lost live: the labeled counts above miss "
                     "them; the kernel counts are exact"] if lost else []
    # read problems (the stderr lines: torn tails, corrupt records, ...), once every record
    # was read; the same objects as replay -o json's loss lines
    d["problems"] = [loss_dict(p) for p in (r.problems if problems is None else problems)]
    return d


def loss_dict(p) -> dict:
    """A read problem as the JSON stream's loss marker (docs/output.md):
    {"kind": "loss", "loss": <problem kind>, "records": n or null, "bytes": n or null,
     "path": file or null, "offset": byte or null, "message": text}"""
    in_records = p.kind not in ("torn_tail", "corrupt", "no_stop")
    return {"kind": "loss", "loss": p.kind, "records": p.dropped if in_records else None,
            "bytes": None if in_records else p.dropped, "path": p.path or None,
            "offset": p.offset if p.path else None, "message": p.message}


def _counted_not_sent(r: Replay) -> Counter:
    """Per cause and kind: the records the kernel counted under their cause and did not send
    (the once-a-second summary rows the session recorded)."""
    counted: Counter = Counter()
    for row in getattr(r, "summaries", ()) or ():
        lab = row.label
        counted[f"{lab.cause} {lab.kind}" + (f"/{lab.direction}" if lab.direction else "")] \
            += row.repeat
    return counted


def _table(title: str, counter: dict, width: int = 40, limit: int = 20) -> list[str]:
    if not counter:
        return []
    lines = ["", f"{title:<{width}} {'count':>7}"]
    for k, n in list(counter.items())[:limit]:
        lines.append(f"{str(k):<{width}} {n:>7}")
    if len(counter) > limit:
        lines.append(f"... and {len(counter) - limit} more")
    return lines


def _causes(c: dict) -> str:
    return ", ".join(f"{cause} {n}" for cause, n in c.items())


def render_text(d: dict) -> str:
    lines = [f"nptrace report: {d['files']} file(s), {d['runs']} run(s), "
             f"node(s) {', '.join(d['nodes']) or '-'}"]
    if d["recorded_from"]:
        lines.append(f"recorded from {d['recorded_from']['time']}"
                     + (f"; events {d['first_event']['time']} .. {d['last_event']['time']}"
                        if d["first_event"] else ""))
    kinds = _causes(d["by_kind"])
    lines.append(f"{d['events']} events replayed, {d['labeled']} labeled"
                 + (f" ({kinds})" if kinds else ""))
    if not d["by_cause"]:
        lines.append("no resets or drops recorded")
    lines += _table("cause", d["by_cause"])
    lines += _table("counted, not sent (cause kind)", d.get("counted_not_sent") or {})
    lines += _table("service", d["by_service"])
    lines += _table("interface", d["by_interface"])
    if len(d["by_node"]) > 1:
        lines += _table("node", d["by_node"])
    tf = d["top_flows"]
    if tf["flows"]:
        lines += ["", f"top flows ({tf['shown']} of {tf['of']})"]
        for f in tf["flows"]:
            lines.append(f"{f['count']:>7}  {f['flow']}  {_causes(f['by_cause'])}")
    tl = d["timeline"]
    if tl:
        lines += ["", f"timeline (per {tl['per']}, {tl['clock']})"]
        for row in tl["rows"]:
            lines.append(f"{row['time']}  {row['count']:>6}  {_causes(row['by_cause'])}")
    k = d["kernel"]
    if k is None:
        lines += ["", "kernel counts: none recorded"]
    else:
        lines += ["", "kernel counts (exact, last snapshot of each run)",
                  f"{'type':<14} {'hook':<24} {'reason':<28} {'count':>9}"]
        for c in k["counts"]:
            lines.append(f"{c['type']:<14} {c['hook']:<24} {c['reason']:<28} {c['count']:>9}")
        ring = k["ring"]
        lines.append(f"ring buffer: {ring['emitted']} records emitted, {ring['lost']} lost, "
                     f"{ring['filtered']} filtered in kernel")
    lines += [f"WARNING: {w}" for w in d["warnings"]]
    return "\n".join(lines)


def build_report(r: Replay, top: int = 10, local: bool = False, no_names: bool = False) -> str:
    return render_text(report_data(r, top=top, local=local, no_names=no_names))


def _kernel_data(r: Replay) -> dict | None:
    if not r.counters:
        return None
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
    return {"counts": [{"type": t, "hook": hk, "reason": rs, "count": n} for (t, hk, rs), n
                       in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))],
            "ring": {"emitted": emitted, "lost": lost, "filtered": filtered}}


def report(paths, problems: list | None = None, top: int = 10) -> str:
    r = Replay(paths)
    text = build_report(r, top=top)
    settle(r.problems, problems)
    return text
