"""Every loss the live pipeline knows of, as deltas since the last look.

Records are lost or skipped at several stages: the kernel ring had no room (Probes.stats()
"lost"), a record could not be decoded (Tracer.bad_records), the session writer could not
write (SessionWriter.dropped), nf_tables trace datagrams were malformed or the trace reader
failed (TracedRules), a watched interface was gone for a while (node/ifwatch.py). Each source
is a callable returning its cumulative count; `Ledger.poll()` gives what grew, and the tracer
hands that to the status line, the metrics and the JSON stream's loss lines (the same shape
`nptrace replay --json` writes: sinks/jsonl.py loss_line).
"""
from __future__ import annotations

from typing import Callable

# stage -> what a loss line says about it (the "loss" key names the stage; replay's names
# where replay has the same stage: ring_lost, undecodable, recorder_dropped)
MESSAGES = {
    "ring_lost": "records the kernel ring buffer had no room for (counters stay exact)",
    "undecodable": "records that could not be decoded were skipped",
    "recorder_dropped": "records the session writer could not write",
    "nft_trace_malformed": "nf_tables trace messages that could not be decoded were skipped",
    "nft_trace_reader": "the nf_tables trace reader failed and retried",
    "nft_trace_overruns": "times the kernel dropped nf_tables trace messages (socket full)",
    "rules_late": "record batches labeled before the rules view had applied an nf_tables "
                  "commit, or looked at the legacy tables, after them (the labeling barrier's "
                  "bound passed)",
    "stop_unread": "records were still in the kernel ring when the stop's drain bound (2 s) "
                   "passed: not labeled (about: records of packet bytes are counted as events)",
    "rules_bad_names": "nf_tables tables left out of the rules view: their names are not nft "
                       "identifiers, so nft is never given them (each said once)",
}
# stages that count event records (the others count messages or failures)
RECORD_STAGES = frozenset({"ring_lost", "undecodable", "recorder_dropped", "stop_unread"})


class Ledger:
    def __init__(self):
        self.sources: dict[str, Callable[[], int]] = {}
        self.seen: dict[str, int] = {}
        self.total: dict[str, int] = {}

    def watch(self, stage: str, fn: Callable[[], int]) -> None:
        self.sources[stage] = fn
        self.seen.setdefault(stage, 0)

    def poll(self) -> dict[str, int]:
        """{stage: n} of what grew since the last poll; a source that fails reads as
        unchanged (a loss report must not stop the tracer)."""
        out = {}
        for stage, fn in self.sources.items():
            try:
                now = int(fn() or 0)
            except Exception:
                continue
            d = now - self.seen.get(stage, 0)
            if d > 0:
                out[stage] = d
                self.total[stage] = self.total.get(stage, 0) + d
            self.seen[stage] = max(now, self.seen.get(stage, 0))
        return out

    def summary(self) -> str:
        """`3 undecodable, 10 recorder_dropped` of the totals so far ('' when none)."""
        return ", ".join(f"{n} {stage}" for stage, n in sorted(self.total.items()) if n)


def stop_lines(stats: dict, knowledge=None) -> list[str]:
    """What the stop says after its count: the kernel's losses and sampling (Probes.stats()),
    and how long the labeling waited for the rules view (node/knowledge.py barrier)."""
    out = []
    kn = knowledge
    if kn is not None and kn.barrier_waits:
        out.append(f"rules barrier: {kn.barrier_waits} batches waited for the rules view to "
                   f"apply an nf_tables commit or look at the legacy tables (max {kn.barrier_max_s * 1000:.0f} ms, mean "
                   f"{kn.barrier_wait_s / kn.barrier_waits * 1000:.0f} ms), {kn.barrier_late} "
                   "past the bound")
    lost = stats.get("lost", 0)
    if lost:
        out.append(f"WARNING: {lost} events were lost to a full ring buffer; counters stay exact "
                   "(raise --ring-pages, or set --max-rate to sample storms in the kernel)")
    if stats.get("count_full"):
        out.append(f"WARNING: {stats['count_full']} events found the exact counts map full (more "
                   "kinds of record than its slots): counted in nptrace_events_count_full_total "
                   "only, not per kind")
    if stats.get("sampled"):
        out.append(f"{stats['sampled']} events over --max-rate were counted in the kernel, not sent")
    if stats.get("svc_gated"):
        out.append(f"{stats['svc_gated']} events of other flows than --service's were counted in "
                   "the kernel, not sent")
    return out
