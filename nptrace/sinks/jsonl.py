"""One JSON object per line per verdict on stdout: the machine format (`nptrace run --json`).

Every line carries `repeat`: 1 for an incident of its own; N on the summary line of a storm
when a StormCollapse is given (sinks/collapse.py), then with `repeat_since` too."""
from __future__ import annotations

import json
import sys
from typing import TextIO

from nptrace.classify import Verdict, evidence_dicts
from nptrace.sinks.collapse import StormCollapse

# One encoder for every line: json.dumps(..., separators=...) builds a new one per call.
_encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


def verdict_dict(v: Verdict, epoch_offset_ns: int, repeat: int = 1,
                 since_ns: int | None = None, events: int | None = None) -> dict:
    """The stable JSON contract of a labeled event (README "Output")."""
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
        "evidence": evidence_dicts(v),
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
        d["client"] = f"{nat.orig_src}:{nat.orig_sport}"
        d["frontend"] = f"{nat.orig_dst}:{nat.orig_dport}"
        d["endpoint"] = f"{nat.reply_src}:{nat.reply_sport}"
    if e.outer_saddr is not None:
        d["outer"] = {"saddr": e.outer_saddr, "daddr": e.outer_daddr, "vni": e.vni}
    d["repeat"] = repeat
    if repeat > 1 and since_ns is not None:
        d["repeat_since"] = (since_ns + epoch_offset_ns) / 1e9
    return d


def dumps(d: dict) -> str:
    """Exactly json.dumps(d, separators=(",", ":")), cheaper."""
    return _encode(d)


class JsonLines:
    def __init__(self, epoch_offset_ns: int, stream: TextIO | None = None,
                 collapse: StormCollapse | None = None):
        self.stream = stream or sys.stdout
        self.offset = epoch_offset_ns
        self.collapse = collapse

    def _line(self, v: Verdict, repeat: int = 1, since: int | None = None,
              events: int | None = None) -> None:
        self.stream.write(_encode(verdict_dict(v, self.offset, repeat, since, events)) + "\n")

    def write(self, v: Verdict) -> None:
        if self.collapse is None:
            self.stream.write(_encode(verdict_dict(v, self.offset)) + "\n")
            return
        for item in self.collapse.add(v):
            self._line(*item)

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
