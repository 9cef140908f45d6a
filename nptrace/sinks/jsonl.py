"""One JSON object per line per verdict on stdout: the machine format (`nptrace run --json`).

Every line carries `repeat`: 1 for an incident of its own; N on the summary line of a storm
when a StormCollapse is given (sinks/collapse.py), then with `repeat_since` too."""
from __future__ import annotations

import json
import json.encoder
import sys
from typing import TextIO

from nptrace.classify import HOOKS, MAX_EVIDENCE, Context, Verdict, evidence_dicts
from nptrace.sinks.collapse import StormCollapse
from nptrace.text import hostport

# One encoder for every line: json.dumps(..., separators=...) builds a new one per call.
_encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode
# What that encoder writes for a str (json.encoder: the C string escaper of ensure_ascii).
_esc = json.encoder.encode_basestring_ascii


def epoch_evidence(xs: list[dict], epoch_offset_ns: int) -> list[dict]:
    """Each evidence item with `ts`, its time on the incident's own clock (epoch seconds, as
    the line's `ts`), after `ts_ns` (the kernel's monotonic clock, kept for compatibility)."""
    return [{"ts_ns": x["ts_ns"], "ts": (x["ts_ns"] + epoch_offset_ns) / 1e9, **x} for x in xs]


def verdict_dict(v: Verdict, epoch_offset_ns: int, repeat: int = 1,
                 since_ns: int | None = None, events: int | None = None) -> dict:
    """The stable JSON contract of a labeled event (docs/output.md). `pod`, `client_pod` and
    `endpoint_pod` only where the classifier named one (Verdict.pods)."""
    e = v.event
    d = {
        "ts": (e.ts_ns + epoch_offset_ns) / 1e9,
        "kind": v.kind,
        "direction": v.direction,
        "hook": v.hook,
        "reason": v.reason,
        "cause": v.cause,
        "confidence": v.confidence,
        "service": v.service,
        "saddr": e.saddr, "sport": e.sport, "daddr": e.daddr, "dport": e.dport,
        "netns": e.netns,
        "iface": v.iface,
        "ifindex": e.ifindex,
        "hint": v.hint,
        "events": v.events if events is None else events,
        "evidence": epoch_evidence(evidence_dicts(v), epoch_offset_ns),
    }
    c = e.ct
    if c is not None:
        d["conntrack"] = {
            "orig": [c.orig_src, c.orig_sport, c.orig_dst, c.orig_dport],
            "reply": [c.reply_src, c.reply_sport, c.reply_dst, c.reply_dport],
            "dnat": c.dnat, "snat": c.snat, "seen_reply": c.seen_reply,
        }
    nat = v.nat
    if nat is not None:
        d["client"] = hostport(nat.orig_src, nat.orig_sport)
        d["frontend"] = hostport(nat.orig_dst, nat.orig_dport)
        d["endpoint"] = hostport(nat.reply_src, nat.reply_sport)
    else:
        snat = v.snat   # masquerade only: the client before it; no frontend, no endpoint
        if snat is not None:
            d["client"] = hostport(snat.orig_src, snat.orig_sport)
    pods = v.pods
    if pods:
        d.update(pods)
    if e.outer_saddr is not None:
        d["outer"] = {"saddr": e.outer_saddr, "daddr": e.outer_daddr, "vni": e.vni}
    d["repeat"] = repeat
    if repeat > 1 and since_ns is not None:
        d["repeat_since"] = (since_ns + epoch_offset_ns) / 1e9
    return d


def dumps(d: dict) -> str:
    """Exactly json.dumps(d, separators=(",", ":")), cheaper."""
    return _encode(d)


# Encoded fragments of the values a storm repeats in every line, built once by _encode itself
# (so they are exactly what it writes). Bounded: reason names, hints and interface names are
# few, but a Service name or a label could come from anywhere.
_HEADS: dict[tuple, str] = {}
_EVID: dict[tuple, tuple[str, str]] = {}
_VALS: dict = {}
_HINTS: dict[str, str] = {}      # hint -> its encoded text (a storm's lines share a few hints)
_FRAGS_MAX = 4096


def _remember(cache: dict, key, value):
    """cache[key] = value, the cache emptied first when full; returns value."""
    if len(cache) >= _FRAGS_MAX:
        cache.clear()
    cache[key] = value
    return value


def _val(x) -> str:
    """_encode(x) for a str or None, cached."""
    got = _VALS.get(x)
    return got if got is not None else _remember(_VALS, x, _encode(x))


def _head(v: Verdict) -> str:
    key = (v.kind, v.direction, v.hook, v.reason, v.cause, v.confidence, v.service)
    got = _HEADS.get(key)
    if got is not None:
        return got
    return _remember(_HEADS, key, (
        f',"kind":{_encode(v.kind)},"direction":{_encode(v.direction)},"hook":'
        f'{_encode(v.hook)},"reason":{_encode(v.reason)},"cause":{_encode(v.cause)},'
        f'"confidence":{_encode(v.confidence)},"service":{_encode(v.service)},"saddr":'))


def _evid(hook: int, what: str, iface, label: str) -> tuple[str, str]:
    key = (hook, what, iface, label)
    got = _EVID.get(key)
    if got is not None:
        return got
    return _remember(_EVID, key, (
        f',"hook":{_encode(HOOKS[hook])},"what":{_encode(what)},"iface":{_encode(iface)},'
        '"detail":', f',"label":{_encode(label)}}}'))


def verdict_line(v: Verdict, epoch_offset_ns: int, repeat: int = 1,
                 since_ns: int | None = None, events: int | None = None,
                 prefix: str = "{") -> str:
    """_encode(verdict_dict(...)) for the common incident (no conntrack entry, no NAT mapping,
    no outer header, IPv4), built from cached fragments; the other ones through verdict_dict. The
    same text, and the same Context lookups in the same order. (An f-string writes an int and
    a float as the encoder does: int.__repr__, float.__repr__; events hold no bools.)
    `prefix` replaces the opening brace (JsonLines' '{"node":...,'), so a line is built once,
    not built, sliced and joined again."""
    e = v.event
    labeled = v.labeled
    if events is None:
        events = v.events
    # IPv6 through verdict_dict too: its evidence details write [addr]:port (one `in` here)
    if e.ct is not None or e.outer_saddr is not None or ":" in e.saddr \
            or type(v.confidence) is not float \
            or type(repeat) is not int or type(events) is not int or v.pods or v.natmap is not None:
        return _dict_line(v, epoch_offset_ns, repeat, since_ns, events, prefix)
    for l in labeled:
        if l.ev.ct is not None:
            return _dict_line(v, epoch_offset_ns, repeat, since_ns, events, prefix)
    ctx = v.ctx or _NO_CTX
    iface_name = ctx.iface_name
    if len(labeled) == 1 and labeled[0][0] is e and repeat == 1:
        # A one-event incident (a storm's every line): the line is one template per key, the
        # key being everything it says but the time and the tuple (one f-string of
        # seven values, not a list, a join and three fragment look-ups a line). The same
        # iface_name call as the loop below (a session records what the sinks ask).
        l = labeled[0]
        xiface = iface_name(e.netns, e.ifindex) if e.ifindex else None
        key = (prefix, v.kind, v.direction, v.hook, v.reason, v.cause, v.confidence, v.service,
               e.netns, v.iface, e.ifindex, v.hint, events, e.hook, l.rname, xiface, l.cause)
        try:
            tpl = _LINES.get(key)
        except TypeError:            # a replayed lookup's answer that is not hashable
            tpl = key = None
        if tpl is None:
            tpl = _one_template(v, e, l, xiface, events, prefix)
            if key is not None:
                _remember(_LINES, key, tpl)
        head, fields, mid, pre, post = tpl
        ts = f"{(e.ts_ns + epoch_offset_ns) / 1e9!r}"
        sa, sp, da, dp = e.saddr, e.sport, e.daddr, e.dport
        return (f'{head}{ts}{fields}{_esc(sa)},"sport":{sp},"daddr":{_esc(da)},"dport":{dp}'
                f'{mid}{e.ts_ns},"ts":{ts}{pre}{_esc(f"{sa}:{sp} > {da}:{dp}")}{post}')
    # Writing a float is a third of a line's cost: `!r` (float.__repr__, what the encoder
    # calls) is ~0.2 us cheaper than an f-string's format(); and the primary event's time is
    # written twice (the line's ts, its own evidence item's), formatted once.
    ets = e.ts_ns
    ts = f"{(ets + epoch_offset_ns) / 1e9!r}"
    parts = []
    for l in labeled[:MAX_EVIDENCE]:
        x = l.ev
        pre, post = _evid(x.hook, l.rname, iface_name(x.netns, x.ifindex) if x.ifindex else None,
                          l.cause or "")
        xts = x.ts_ns
        parts.append(f'{{"ts_ns":{xts},"ts":{ts if xts == ets else f"{(xts + epoch_offset_ns) / 1e9!r}"}'
                     f'{pre}{_esc(f"{x.saddr}:{x.sport} > {x.daddr}:{x.dport}")}{post}')
    if repeat > 1 and since_ns is not None:
        tail = f'],"repeat":{repeat},"repeat_since":{(since_ns + epoch_offset_ns) / 1e9!r}}}'
    else:
        tail = f'],"repeat":{repeat}}}'
    hint = v.hint
    h = _HINTS.get(hint)
    if h is None:
        h = _remember(_HINTS, hint, _esc(hint))
    return (f'{prefix}"ts":{ts}{_head(v)}{_esc(e.saddr)},'
            f'"sport":{e.sport},"daddr":{_esc(e.daddr)},"dport":{e.dport},"netns":{e.netns},'
            f'"iface":{_val(v.iface)},"ifindex":{e.ifindex},"hint":{h},'
            f'"events":{events},"evidence":[{",".join(parts)}{tail}')


_LINES: dict[tuple, tuple[str, str, str, str, str]] = {}


def _one_template(v: Verdict, e, l, xiface, events: int, prefix: str) -> tuple:
    """(head, fields, mid, pre, post) of a one-event line: the fragments the general path of
    verdict_line writes around the time and the tuple, joined once."""
    h = _HINTS.get(v.hint)
    if h is None:
        h = _remember(_HINTS, v.hint, _esc(v.hint))
    pre, post = _evid(e.hook, l.rname, xiface, l.cause or "")
    return (f'{prefix}"ts":', _head(v),
            f',"netns":{e.netns},"iface":{_val(v.iface)},"ifindex":{e.ifindex},"hint":{h},'
            f'"events":{events},"evidence":[{{"ts_ns":', pre, post + '],"repeat":1}')


def _dict_line(v: Verdict, epoch_offset_ns: int, repeat, since_ns, events, prefix: str) -> str:
    text = _encode(verdict_dict(v, epoch_offset_ns, repeat, since_ns, events))
    return text if prefix == "{" else prefix + text[1:]


_NO_CTX = Context()


def loss_line(loss: str, *, records: int | None = None, nbytes: int | None = None,
              path: str | None = None, offset: int | None = None, message: str = "") -> str:
    """The JSON stream's loss marker (docs/output.md), live and in `replay --json` alike:
    {"kind": "loss", "loss": <stage>, "records": n or null, "bytes": n or null,
     "path": file or null, "offset": byte or null, "message": text}"""
    return json.dumps({"kind": "loss", "loss": loss, "records": records, "bytes": nbytes,
                       "path": path, "offset": offset, "message": message},
                      separators=(",", ":"))


class JsonLines:
    def __init__(self, epoch_offset_ns: int, stream: TextIO | None = None,
                 collapse: StormCollapse | None = None, node: str = ""):
        self.stream = stream or sys.stdout
        self.offset = epoch_offset_ns
        self.collapse = collapse
        self.set_node(node)

    def set_node(self, node: str) -> None:
        """The node every following line names (replay: the recording node of each record)."""
        # "node" first on every line: one concatenation a line, not a second encoder
        self.node_prefix = '{"node":' + _esc(node) + "," if node else "{"

    def _line(self, v: Verdict, repeat: int = 1, since: int | None = None,
              events: int | None = None) -> None:
        self.stream.write(verdict_line(v, self.offset, repeat, since, events, self.node_prefix)
                          + "\n")

    def write(self, v: Verdict) -> None:
        if self.collapse is None:
            self.stream.write(verdict_line(v, self.offset, prefix=self.node_prefix) + "\n")
            return
        for item in self.collapse.add(v):
            self._line(*item)

    def write_many(self, verdicts) -> None:
        """write() of each, in order, as one stream write (the same text)."""
        off, pre = self.offset, self.node_prefix
        if self.collapse is None:
            lines = [verdict_line(v, off, 1, None, None, pre) for v in verdicts]
        else:
            add = self.collapse.add
            lines = [verdict_line(item[0], off, *item[1:], pre) for v in verdicts
                     for item in add(v)]
        if lines:
            lines.append("")
            self.stream.write("\n".join(lines))

    def loss(self, stage: str, n: int | None, message: str) -> None:
        """A loss line in the stream, where the loss was noticed (nptrace/daemon/losses.py)."""
        try:
            self.stream.write(loss_line(stage, records=n, message=message) + "\n")
        except (BrokenPipeError, ValueError):
            pass

    def write_summary(self, rows) -> None:
        """Once a second from the live loop: one line per label whose records the kernel
        counted but did not send (sinks/exact.py summary_dict), so that `repeat` summed over
        all lines gives every record."""
        from nptrace.sinks.exact import summary_dict
        if rows:
            pre = self.node_prefix
            self.stream.write("".join(pre + _encode(summary_dict(r, self.offset))[1:] + "\n"
                                      for r in rows))

    def tick(self, now_ns: int) -> None:
        """From the live loop: write the summaries of storm windows that ended."""
        if self.collapse is not None:
            for item in self.collapse.due(now_ns):
                self._line(*item)

    def flush(self) -> None:
        """Once per drained batch (the tracer calls it), not once per line."""
        try:
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass

    def close(self) -> None:
        if self.collapse is not None:
            try:
                for item in self.collapse.drain():
                    self._line(*item)
            except (BrokenPipeError, ValueError):
                pass
        try:
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass
