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
    metrics_tls: object | None = None     # sinks/tls.py TlsFiles: HTTPS (client certificates)
    health_addr: str | None = None        # the plain probe listener: health paths only
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
    probe_server: object | None = None  # --health-addr (sinks/health.py serve_probes)
    health: object | None = None       # sinks/health.py Health, with either endpoint


def open_outputs(o: Outputs, *, epoch_offset_ns: int, drops, rsts, features: dict,
                 counters: Callable[[], tuple], log: Callable[[str], None]) -> Opened:
    """`features`: what the session header says was attached ({"tracepoints", "ifaces",
    "kprobes"}); `counters()`: (counts, stats) from the live maps, for the recorder."""
    out = Opened()
    try:
        if o.metrics_addr or o.health_addr:
            from nptrace.sinks import health
            out.health = health.Health()   # /healthz, /livez (sinks/health.py)
        if o.metrics_addr:
            from prometheus_client import CollectorRegistry
            from nptrace.sinks import prometheus
            tls = None
            if o.metrics_tls is not None:
                from nptrace.sinks.tls import ServerTls
                tls = ServerTls(o.metrics_tls, log=log)     # a bad file fails here, fast
            reg = CollectorRegistry()
            out.metrics_server = health.serve(o.metrics_addr, reg, out.health, tls=tls)
            out.metrics = prometheus.MetricsSink(reg)
            from nptrace import __version__
            reg.register(health.build_info_collector(__version__, node=o.node))
            out.sinks.append(out.metrics)
            log(metrics_line(out.metrics_server.url, o.metrics_tls))
        if o.health_addr:
            out.probe_server = health.serve_probes(o.health_addr, out.health)
            log(f"health on {out.probe_server.url} and /livez (plain HTTP, no metrics)")
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
        for srv in (out.metrics_server, out.probe_server):
            if srv is not None:          # the tracer never learns of them: close them here
                srv.close()
        raise
    return out


def metrics_line(url: str, tls) -> str:
    """The start line of the metrics endpoint: where, and who may read it."""
    if tls is not None and tls.client_ca:
        return (f"metrics on {url} (TLS; clients need a certificate signed by "
                f"{tls.client_ca}), health on /healthz and /livez")
    if tls is not None:
        return (f"metrics on {url} (TLS, no client certificate asked: give "
                "--metrics-client-ca to require one), health on /healthz and /livez")
    host = url.split("//", 1)[1].rsplit(":", 1)[0].strip("[]")
    if _loopback(host):
        return f"metrics on {url}, health on /healthz and /livez"
    return (f"metrics on {url}, health on /healthz and /livez; plain HTTP beyond loopback: "
            "whoever reaches this address reads them (--metrics-tls-cert, --metrics-tls-key "
            "and --metrics-client-ca require client certificates)")


def _loopback(host: str) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
