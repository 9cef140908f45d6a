"""One JSON object per line per verdict on stdout: the machine format (`nptrace run --json`)."""
from __future__ import annotations

import json
import sys
from typing import TextIO

from nptrace.classify import Verdict


def verdict_dict(v: Verdict, epoch_offset_ns: int) -> dict:
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
        "events": v.events,
        "evidence": [x.to_dict() for x in v.evidence],
    }
    if e.ct is not None:
        c = e.ct
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
    return d


class JsonLines:
    def __init__(self, epoch_offset_ns: int, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.offset = epoch_offset_ns

    def write(self, v: Verdict) -> None:
        self.stream.write(json.dumps(verdict_dict(v, self.offset), separators=(",", ":")) + "\n")

    def flush(self) -> None:
        """Once per drained batch (the tracer calls it), not once per line."""
        try:
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass

    def close(self) -> None:
        try:
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass
