"""Exact per-cause counts from the kernel's cause keys, and the summary lines of what was
counted but not sent.

The kernel counts every record under a cause key (bpf/npt_common.h npt_count_cause, value
{counted, sent}); classify/keylabel.py labels each key once with the classifier's rules.
ExactCounts turns successive reads of that map (loader.Probes.cause_counts(), once a second
on the live loop's thread) into:
  * totals by (kind, cause, iface, direction, service): every record the kernel saw, what
    nptrace_resets_total / drops_total / anomalies_total / service_events_total export
    (ExactCollector, at scrape time, from the last update);
  * summary rows: for each label whose keys counted records that were not sent to user space
    (over --max-rate, or lost to a full ring) since the last update, one row with `repeat` =
    how many. A sent record reaches the classifier and is part of an incident line; so the
    number of records of a kind and cause is the summary rows' `repeat` plus the records of
    that kind the incident lines carry.
A key that found the kernel map full is counted by type only, under cause "other".

Counts only grow; a read smaller than the last means the maps were recreated: counted from
zero again (counters.py does the same). Relabeling (labeler.clear(), when the node's rules may
have changed) applies to records counted after it: an exported counter never goes down.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable, Mapping, NamedTuple

from prometheus_client.core import CounterMetricFamily

from nptrace.classify.keylabel import DIRECTIONS, KeyLabel, KeyLabeler
from nptrace.classify.verdict import KIND

OTHER = "other"


class SummaryRow(NamedTuple):
    label: KeyLabel
    repeat: int          # records counted, not sent, between since_ns and until_ns
    since_ns: int
    until_ns: int


def _sub(new: int, old: int) -> int:
    return new - old if new >= old else new


class ExactCounts:
    def __init__(self, labeler: KeyLabeler, relabel_ns: int = 10_000_000_000,
                 generation: Callable[[], int] | None = None):
        self.labeler = labeler
        self.relabel_ns = relabel_ns
        # the node's rules moved (node/knowledge.py generation): keys are labeled anew at once,
        # not at the next timed relabel
        self.generation = generation
        self.labeled_gen = generation() if generation is not None else None
        self.prev: dict = {}                     # key -> (counted, sent) at the last update
        self.prev_other: dict = {}
        self.totals: dict[tuple, int] = {}       # (kind, cause, iface, direction, service) -> n
        self.lock = threading.Lock()
        self.last_ns: int | None = None
        self.labeled_at: int | None = None
        self.unsent = 0                          # every record summarized so far
        self.changed: dict = {}                  # key -> when its count last moved

    def update(self, raw: Mapping, now_ns: int) -> list[SummaryRow]:
        """Take a read of the cause map ({key: (counted, sent)}, other under None); return
        the summary rows of what was counted and not sent since the last update."""
        gen = self.generation() if self.generation is not None else None
        if self.labeled_at is None or now_ns - self.labeled_at >= self.relabel_ns \
                or gen != self.labeled_gen:
            self.labeler.clear()
            self.labeled_at = now_ns
            self.labeled_gen = gen
        since = self.last_ns if self.last_ns is not None else now_ns
        self.labeler.register(raw.keys())
        label = self.labeler.label
        add: dict[tuple, int] = {}
        unsent: dict[KeyLabel, int] = {}
        prev = self.prev
        for key, val in raw.items():
            if key is None:
                continue
            counted, sent = val
            old = prev.get(key, (0, 0))
            dc = _sub(counted, old[0])
            if not dc:
                continue
            ds = _sub(sent, old[1]) if counted >= old[0] else sent
            prev[key] = (counted, sent)
            self.changed[key] = now_ns
            lab = label(key)
            if lab is None:
                continue
            t = (lab.kind, lab.cause, lab.iface, lab.direction, lab.service)
            add[t] = add.get(t, 0) + dc
            if dc > ds:
                unsent[lab] = unsent.get(lab, 0) + dc - ds
        for typ, (counted, sent) in (raw.get(None) or {}).items():
            old = self.prev_other.get(typ, (0, 0))
            dc = _sub(counted, old[0])
            if not dc:
                continue
            ds = _sub(sent, old[1]) if counted >= old[0] else sent
            self.prev_other[typ] = (counted, sent)
            kind = KIND.get(typ)
            if kind is None:
                continue
            lab = KeyLabel(kind, OTHER, DIRECTIONS.get(typ), None, None, "", "")
            t = (kind, OTHER, None, lab.direction, None)
            add[t] = add.get(t, 0) + dc
            if dc > ds:
                unsent[lab] = unsent.get(lab, 0) + dc - ds
        if add:
            with self.lock:
                tot = self.totals
                for t, n in add.items():
                    tot[t] = tot.get(t, 0) + n
        self.last_ns = now_ns
        rows = [SummaryRow(lab, n, since, now_ns) for lab, n in unsent.items()]
        self.unsent += sum(r.repeat for r in rows)
        return rows

    def idle(self, now_ns: int, idle_ns: int = 60_000_000_000) -> list:
        """Keys whose count did not move for idle_ns: the caller deletes them from the
        kernel map (loader.Probes.delete_cause_keys) and then calls forget()."""
        return [k for k, t in self.changed.items() if now_ns - t >= idle_ns]

    def forget(self, keys) -> None:
        """Keys deleted from the kernel map: a later record starts them from zero."""
        for k in keys:
            self.prev.pop(k, None)
            self.changed.pop(k, None)
        self.labeler.unregister(keys)

    def snapshot(self) -> dict[tuple, int]:
        with self.lock:
            return dict(self.totals)


class ExactCollector:
    """nptrace_resets_total{cause,iface,direction}, nptrace_drops_total{cause,iface},
    nptrace_anomalies_total{cause,iface}, nptrace_service_events_total{service,kind,cause}
    from ExactCounts (read at scrape time; the main thread updates it once a second).
    `iface` and `service` bound the label values (prometheus.BoundedLabels)."""

    def __init__(self, counts: ExactCounts, iface: Callable[[str | None], str],
                 service: Callable[[str | None], str]):
        self.counts, self.iface, self.service = counts, iface, service

    def describe(self):
        return self._families()

    @staticmethod
    def _families():
        return (CounterMetricFamily("nptrace_resets", "TCP resets by attributed cause (every "
                                    "reset the kernel saw)", labels=["cause", "iface", "direction"]),
                CounterMetricFamily("nptrace_drops", "Drops of failing connections by cause "
                                    "(every record the kernel saw)", labels=["cause", "iface"]),
                CounterMetricFamily("nptrace_anomalies", "Asymmetric replies and similar "
                                    "anomalies by cause", labels=["cause", "iface"]),
                CounterMetricFamily("nptrace_service_events", "Resets, drops and anomalies by "
                                    "kube-proxy Service", labels=["service", "kind", "cause"]))

    def collect(self) -> Iterable:
        resets, drops, anomalies, by_service = self._families()
        agg: dict[tuple, int] = {}
        svc: dict[tuple, int] = {}
        for (kind, cause, iface, direction, service), n in self.counts.snapshot().items():
            i = self.iface(iface)
            k = (kind, cause, i, (direction or "none") if kind == "rst" else None)
            agg[k] = agg.get(k, 0) + n
            s = (self.service(service), kind, cause)
            svc[s] = svc.get(s, 0) + n
        for (kind, cause, i, direction), n in sorted(agg.items(), key=str):
            if kind == "rst":
                resets.add_metric([cause, i, direction], n)
            elif kind == "anomaly":
                anomalies.add_metric([cause, i], n)
            else:
                drops.add_metric([cause, i], n)
        for (s, kind, cause), n in sorted(svc.items()):
            by_service.add_metric([s, kind, cause], n)
        return [resets, drops, anomalies, by_service]


def summary_dict(row: SummaryRow, epoch_offset_ns: int) -> dict:
    """The JSON of a summary row: the shape of a --collapse summary line (docs/output.md)
    without the per-connection fields, which a count of many connections has not."""
    lab = row.label
    return {"ts": (row.until_ns + epoch_offset_ns) / 1e9, "kind": lab.kind,
            "direction": lab.direction, "hook": lab.hook, "reason": lab.reason,
            "cause": lab.cause, "service": lab.service, "iface": lab.iface,
            "summary": True, "events": row.repeat, "repeat": row.repeat,
            "repeat_since": (row.since_ns + epoch_offset_ns) / 1e9}
