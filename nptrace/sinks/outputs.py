"""Where labeled events go besides stdout: session files (the recorder), the metrics endpoint
and a pcapng file, opened for `nptrace run` before the slow compile so that a bad path fails
fast (tracer.py)."""
from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["Opened", "Outputs", "open_outputs"]


@dataclasses.dataclass(frozen=True)
class Outputs:
    """Where labeled events go besides stdout."""
    record_dir: str | None = None
    record_max_file_bytes: int = 64 << 20
    record_max_age_s: float = 3600.0
    record_max_total_bytes: int = 1 << 30
    metrics_addr: str | None = None
    metrics_final_scrape_s: float = 0.0   # at stop, serve the final counts until one scrape
    pcap: str | None = None
    pcap_max_file_bytes: int = 0       # -C: rotate past it (0: never)
    pcap_max_files: int = 0            # -W: with -C, reuse FILE0..FILE<N-1>
    node: str = ""          # node/identity.py's name: session header, pcapng, build_info


@dataclasses.dataclass
class Opened:
    """What open_outputs made: sinks to add after the tracer's own (metrics, then pcapng), the
    session recorder (it gets every raw record), the metrics sink and its HTTP server."""
    sinks: list = dataclasses.field(default_factory=list)
    recorder: object | None = None
    metrics: object | None = None
    metrics_server: object | None = None
    health: object | None = None       # sinks/health.py Health, with the metrics endpoint


def open_outputs(o: Outputs, *, epoch_offset_ns: int, drops, rsts, features: dict,
                 counters: Callable[[], tuple], log: Callable[[str], None]) -> Opened:
    """`features`: what the session header says was attached ({"tracepoints", "ifaces",
    "kprobes"}); `counters()`: (counts, stats) from the live maps, for the recorder."""
    out = Opened()
    try:
        if o.metrics_addr:
            from prometheus_client import CollectorRegistry
            from nptrace.sinks import prometheus
            from nptrace.sinks import health
            reg = CollectorRegistry()
            out.health = health.Health()   # /healthz, /livez beside /metrics (sinks/health.py)
            out.metrics_server = health.serve(o.metrics_addr, reg, out.health)
            out.metrics = prometheus.MetricsSink(reg)
            from nptrace import __version__
            reg.register(health.build_info_collector(__version__, node=o.node))
            out.sinks.append(out.metrics)
            log(f"metrics on http://{o.metrics_addr}/metrics, health on /healthz and /livez")
        if o.record_dir:
            from nptrace.sessions import format as session
            from nptrace.sinks.recorder import Recorder, snapshot_ifnames
            hdr = session.make_header(
                epoch_offset_ns=epoch_offset_ns, drops=drops, resets=rsts,
                features=features, ifnames=snapshot_ifnames(), node=o.node or None)
            said: list[str] = []
            writer = session.SessionWriter(o.record_dir, o.record_max_file_bytes,
                                           o.record_max_age_s, o.record_max_total_bytes, hdr,
                                           log=said.append)
            # A header that cannot be written at start (a full disk) is an error now; later a
            # full disk pauses the recording (counted as dropped) while tracing goes on.
            writer.flush()
            if writer.paused_until is not None:
                writer.close()
                from nptrace.errors import output_error
                raise output_error(f"--record {o.record_dir}", writer.last_error)
            writer.log = lambda msg: log(msg)
            out.recorder = Recorder(writer, counters=counters)
        if o.pcap:
            from nptrace.sinks.pcapng import PcapngSink
            out.sinks.append(PcapngSink(o.pcap, epoch_offset_ns, node=o.node,
                                        max_file_bytes=o.pcap_max_file_bytes,
                                        max_files=o.pcap_max_files))
    except BaseException:
        if out.metrics_server is not None:      # the tracer never learns of it: close it here
            out.metrics_server.close()
        raise
    return out
