"""`--metrics-addr HOST:PORT`: Prometheus metrics of labeled verdicts and exact kernel counts.

Two sources, one registry (always passed in, never prometheus_client's global one):
  * MetricsSink.write(verdict) counts what the classifier labeled:
      nptrace_resets_total{cause,iface,direction}, nptrace_drops_total{cause,iface},
      nptrace_anomalies_total{cause,iface}, and nptrace_service_events_total{service,kind,
      cause} for the Services (by kube-proxy name) behind them.
    These miss events the ring buffer lost (nptrace_events_lost_total says how many).
    The live tracer calls count_exactly(): the same four families then come from the kernel's
    cause keys (sinks/exact.py), every record the kernel saw, and write() counts nothing.
  * KernelCollector reads the in-kernel per-CPU counters at scrape time (client_python
    docs/content/collector/custom.md), so they are exact even under loss:
      nptrace_kernel_events_total{type,hook,reason,iface}, nptrace_events_lost_total,
      nptrace_events_emitted_total, nptrace_events_filtered_total,
      nptrace_events_sampled_total, nptrace_flows_tracked,
      nptrace_probe_up{probe}, nptrace_kernel_counters_up.

Labels are bounded: never addresses, ports or netns inodes. Interface names can grow without
bound on a node whose pods churn (cni-<uuid>/eth0), so at most `max_ifaces` distinct values are
kept; later ones are counted as iface="other". Service names are bounded by the cluster but
capped the same way (service="none" when no Service matched).

The collector runs on the HTTP server's thread: the callables given to it must be safe to call
from there (bcc map reads are syscalls and are). Give it the plain name lookup
(netns.Names.iface), not the session recorder's wrapper, which writes to the session file and
belongs to the main thread.
"""
from __future__ import annotations

import threading
from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nptrace import names
from nptrace.classify import Verdict

MAX_IFACES = 256
MAX_SERVICES = 512
OTHER = "other"
NO_IFACE = "none"         # the event had no interface (ifindex 0)
UNKNOWN_IFACE = "unknown"  # an ifindex whose name could not be found

# Every metric family name this module can expose (the Grafana test checks the dashboard
# against it).
METRIC_NAMES = frozenset({
    "nptrace_resets_total", "nptrace_drops_total", "nptrace_anomalies_total",
    "nptrace_service_events_total", "nptrace_incidents_total",
    "nptrace_kernel_events_total", "nptrace_events_lost_total", "nptrace_events_emitted_total",
    "nptrace_events_filtered_total", "nptrace_events_sampled_total",
    "nptrace_events_count_full_total", "nptrace_events_svc_gated_total", "nptrace_flows_tracked",
    "nptrace_probe_up",
    "nptrace_kernel_counters_up",
})


class BoundedLabels:
    """Bounded set of label values (interfaces are shared by the sink and the collector)."""

    def __init__(self, limit: int = MAX_IFACES):
        self.limit = limit
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, name: str | None) -> str:
        if not name:
            return NO_IFACE
        with self.lock:
            if name in self.seen:
                return name
            if len(self.seen) < self.limit:
                self.seen.add(name)
                return name
        return OTHER


CountersFn = Callable[[], "tuple[Mapping[tuple, int], Mapping[str, int]]"]


class KernelCollector:
    """Reads exact counters at scrape time. `counters()` returns (Probes.counts(),
    Probes.stats()): ({(type, hook, reason, ifindex, netns): n}, {"emitted", "lost",
    "filtered", "sampled"})."""

    def __init__(self, counters: CountersFn, *, iface_name: Callable[[int, int], str | None],
                 drop_name: Callable[[int], str] = lambda v: f"REASON_{v}",
                 rst_name: Callable[[int], str] = lambda v: f"REASON_{v}",
                 flows: Callable[[], int] | None = None,
                 probes: Callable[[], Mapping[str, bool]] | None = None,
                 ifaces: BoundedLabels | None = None):
        self.counters = counters
        self.iface_name = iface_name
        self.drop_name, self.rst_name = drop_name, rst_name
        self.flows, self.probes = flows, probes
        self.ifaces = ifaces or BoundedLabels()

    def describe(self):
        # Declared without reading the maps, so registering never touches the kernel.
        return [CounterMetricFamily("nptrace_kernel_events", "", labels=["type", "hook", "reason", "iface"]),
                CounterMetricFamily("nptrace_events_lost", ""),
                CounterMetricFamily("nptrace_events_emitted", ""),
                CounterMetricFamily("nptrace_events_filtered", ""),
                CounterMetricFamily("nptrace_events_sampled", ""),
                GaugeMetricFamily("nptrace_kernel_counters_up", ""),
                GaugeMetricFamily("nptrace_flows_tracked", ""),
                GaugeMetricFamily("nptrace_probe_up", "", labels=["probe"])]

    def _iface(self, netns: int, ifindex: int) -> str:
        if not ifindex:
            return NO_IFACE
        try:
            name = self.iface_name(netns, ifindex)
        except Exception:
            name = None
        return self.ifaces(name) if name else UNKNOWN_IFACE

    def collect(self):
        up = GaugeMetricFamily("nptrace_kernel_counters_up",
                               "1 when the last scrape read the in-kernel counters")
        try:
            counts, stats = self.counters()
        except Exception:
            counts, stats = None, None
        if counts is not None:
            fam = CounterMetricFamily(
                "nptrace_kernel_events",
                "Events counted in the kernel before the ring buffer (exact, even when records "
                "are lost)", labels=["type", "hook", "reason", "iface"])
            agg: dict[tuple, int] = {}
            for (typ, hook, reason, ifindex, netns), n in counts.items():
                k = (names.type_name(typ), names.hook_name(hook),
                     names.reason_name(typ, reason, self.drop_name, self.rst_name),
                     self._iface(netns, ifindex))
                agg[k] = agg.get(k, 0) + int(n)
            for k in sorted(agg):
                fam.add_metric(list(k), agg[k])
            yield fam
            for key, help_ in (("lost", "Event records the ring buffer had no room for"),
                               ("emitted", "Event records written to the ring buffer"),
                               ("filtered", "Events the in-kernel port/host filters rejected"),
                               ("sampled", "Events counted but not sent to user space: over "
                                           "--max-rate (whole connections are left out)"),
                               ("count_full", "Events the exact per-kind counts map had no "
                                              "room for (more kinds than its 16384 slots): "
                                              "counted only here"),
                               ("svc_gated", "Events counted but not sent to user space: no "
                                             "end at `run --service`'s addresses and ports")):
                c = CounterMetricFamily(f"nptrace_events_{key}", help_)
                c.add_metric([], int(stats.get(key, 0)))
                yield c
            up.add_metric([], 1)
        else:
            up.add_metric([], 0)
        yield up
        if self.flows is not None:
            g = GaugeMetricFamily("nptrace_flows_tracked", "Flows held in the classifier's "
                                  "correlation state")
            try:
                g.add_metric([], int(self.flows()))
                yield g
            except Exception:
                pass
        if self.probes is not None:
            g = GaugeMetricFamily("nptrace_probe_up", "1 when the probe is attached",
                                  labels=["probe"])
            try:
                for name, ok in sorted(self.probes().items()):
                    g.add_metric([str(name)], 1 if ok else 0)
                yield g
            except Exception:
                pass


class MetricsSink:
    """Counts verdicts. `registry` is the caller's CollectorRegistry."""

    def __init__(self, registry: CollectorRegistry, max_ifaces: int = MAX_IFACES,
                 max_services: int = MAX_SERVICES):
        self.registry = registry
        self.ifaces = BoundedLabels(max_ifaces)
        self.services = BoundedLabels(max_services)
        self.resets = Counter("nptrace_resets", "TCP resets by attributed cause",
                              ["cause", "iface", "direction"], registry=registry)
        self.drops = Counter("nptrace_drops", "Drops behind a failed connection, by cause",
                             ["cause", "iface"], registry=registry)
        self.anomalies = Counter("nptrace_anomalies", "Asymmetric replies and similar anomalies",
                                 ["cause", "iface"], registry=registry)
        self.by_service = Counter("nptrace_service_events",
                                  "Labeled resets, drops and anomalies by kube-proxy Service",
                                  ["service", "kind", "cause"], registry=registry)
        # Incidents (one per line `run` prints before collapsing: the events of one connection),
        # beside the record counters above, which count every kernel record under its cause
        # once count_exactly() is on: `report`'s cause table and alerting on failed
        # connections use this one.
        self.incidents = Counter("nptrace_incidents", "Incidents (failed connections) by kind "
                                 "and cause", ["kind", "cause", "iface"], registry=registry)
        self.collector: KernelCollector | None = None
        self._children: dict[tuple, tuple] = {}
        self._incident_children: dict[tuple, object] = {}
        # user-space losses (nptrace/daemon/losses.py stages; the ring's is nptrace_events_lost_total)
        self.losses = Counter("nptrace_user_losses", "Records or messages lost or skipped in "
                              "user space, by stage", ["stage"], registry=registry)
        self.exact = None

    def loss(self, stage: str, n: int | None, _message: str = "") -> None:
        if stage != "ring_lost":      # the kernel's own counter, read at scrape time
            self.losses.labels(stage).inc(n or 1)

    def count_exactly(self, counts) -> None:
        """Export the four labeled families from the kernel's cause keys (sinks/exact.py
        ExactCounts): every record, not only the incidents the sample reached. write() then
        counts nothing."""
        from nptrace.sinks.exact import ExactCollector
        for c in (self.resets, self.drops, self.anomalies, self.by_service):
            self.registry.unregister(c)
        self.exact = ExactCollector(counts, self.ifaces, self._service)
        self.registry.register(self.exact)

    def _service(self, name: str | None) -> str:
        return self.services(name) if name else "none"

    def watch_kernel(self, counters: CountersFn, **kw) -> KernelCollector:
        """Register the scrape-time collector of exact kernel counters (KernelCollector's
        keyword arguments: iface_name, drop_name, rst_name, flows, probes)."""
        self.collector = KernelCollector(counters, ifaces=self.ifaces, **kw)
        self.registry.register(self.collector)
        return self.collector

    def write(self, v: Verdict) -> None:
        # labels() validates and locks on every call (a few us each, twice per verdict): the
        # children are kept here by their label values, bounded like the labels themselves
        iface = self.ifaces(v.iface)
        kind = v.kind
        ik = (kind, v.cause, iface)
        child = self._incident_children.get(ik)
        if child is None:
            child = self._incident_children[ik] = self.incidents.labels(*ik)
        child.inc()
        if self.exact is not None:
            return       # the record families come from the kernel's cause keys
        key = (kind, v.cause, iface, v.direction, self.services(v.service))
        pair = self._children.get(key)
        if pair is None:
            if kind == "rst":
                first = self.resets.labels(v.cause, iface, v.direction or "none")
            elif kind == "anomaly":
                first = self.anomalies.labels(v.cause, iface)
            else:
                first = self.drops.labels(v.cause, iface)
            pair = self._children[key] = (first, self.by_service.labels(key[4], kind, v.cause))
        pair[0].inc()
        pair[1].inc()

    def close(self) -> None:
        pass


# --- HTTP -----------------------------------------------------------------------------------

