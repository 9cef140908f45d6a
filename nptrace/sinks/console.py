"""Readable lines for a person at a terminal (stdout), and the summary at exit."""
from __future__ import annotations

import sys
import time
from collections import Counter
from typing import TextIO

from nptrace.classify import Verdict


class Console:
    def __init__(self, epoch_offset_ns: int, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.offset = epoch_offset_ns
        self.by_cause: Counter = Counter()
        self.by_service: Counter = Counter()

    def write(self, v: Verdict) -> None:
        e = v.event
        self.by_cause[v.cause] += 1
        self.by_service[v.service or "-"] += 1
        ts = time.strftime("%H:%M:%S", time.localtime((e.ts_ns + self.offset) / 1e9))
        flow = f"{e.saddr}:{e.sport} -> {e.daddr}:{e.dport}"
        nat = v.nat
        if nat is not None:   # client -> NodePort -> pod, the way an SRE thinks of it
            flow = (f"{nat.orig_src}:{nat.orig_sport} -> {nat.orig_dst}:{nat.orig_dport}"
                    f" -> {nat.reply_src}:{nat.reply_sport}")
        what = f"{v.kind}" + (f"/{v.direction}" if v.direction else "")
        self.stream.write(f"{ts} {v.cause:<18} {what:<14} {flow}  {v.iface or '-'}"
                          f"  [{v.hook} {v.reason}]"
                          + (f" svc={v.service}" if v.service else "") + "\n")
        self.stream.write(f"         hint: {v.hint}\n")
        self.stream.flush()

    def summary(self) -> str:
        if not self.by_cause:
            return "no resets or drops seen"
        lines = ["cause               count"]
        lines += [f"{c:<18} {n:>6}" for c, n in self.by_cause.most_common()]
        if any(s != "-" for s in self.by_service):
            lines += ["", "service             count"]
            lines += [f"{s:<18} {n:>6}" for s, n in self.by_service.most_common()]
        return "\n".join(lines)

    def close(self) -> None:
        self.stream.flush()
