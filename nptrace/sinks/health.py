"""The metrics endpoint with health that means something: /metrics, /healthz (= /readyz) and
/livez on the one --metrics-addr port, for the DaemonSet's probes and a unit's checks.

  /healthz, /readyz  200 only once every probe is attached and the main loop turned within
                     LIVENESS_S; 503 with the reason before (compiling) and after (stuck).
                     The DaemonSet's readinessProbe: a pod is ready when it traces.
  /livez             200 while starting and while the main loop turns; 503 once it has not
                     turned for LIVENESS_S (stuck in a sink, a wedged poll). The livenessProbe:
                     restarting cannot fix a slow compile, so starting counts as alive.
  /metrics           prometheus_client's exposition of the caller's registry (text or
                     OpenMetrics, by the Accept header), plus nptrace_build_info.

prometheus_client's start_http_server answers every path with the metrics, so it cannot say
"not ready"; this is the same thing (a threading http.server, one daemon thread) with the
health paths routed first. Model: the Kubernetes components' /livez, /readyz, /healthz.

Also here, pure: probe_states(), the nptrace_probe_up{probe} table: 1 for each attached hook,
0 for every hook of the hook table that is not (missing on this kernel, refused, failed),
tc ones per --iface included.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from nptrace.config import parse_metrics_addr
from nptrace.errors import NptraceError

__all__ = ["Health", "HealthServer", "Scrapes", "build_info_collector", "probe_states", "serve"]

# Seconds without a main-loop turn after which the tracer is not live: the unit's WatchdogSec.
LIVENESS_S = float(os.environ.get("NPTRACE_LIVENESS_S", "30"))


class Health:
    """What the tracer tells the health paths: ready() once attached, beat() every loop turn."""

    def __init__(self, stale_after: float = LIVENESS_S, clock=time.monotonic):
        self.stale_after = stale_after
        self.clock = clock
        self.started = clock()
        self.attached: str = ""
        self.ready_at: float | None = None
        self.last_beat: float | None = None
        self.stopping = False

    def ready(self, what: str = "") -> None:
        self.attached = what
        self.ready_at = self.last_beat = self.clock()

    def beat(self) -> None:
        self.last_beat = self.clock()

    def stop(self) -> None:
        self.stopping = True

    def live(self) -> tuple[bool, str]:
        now = self.clock()
        if self.stopping:
            return True, "stopping"
        if self.ready_at is None:
            return True, f"starting for {now - self.started:.1f}s (compiling and attaching)"
        idle = now - (self.last_beat or self.ready_at)
        if idle > self.stale_after:
            return False, f"main loop stuck: no turn for {idle:.1f}s (limit {self.stale_after:g}s)"
        return True, f"main loop turned {idle:.1f}s ago"

    def readiness(self) -> tuple[bool, str]:
        if self.stopping:
            return False, "stopping"
        if self.ready_at is None:
            return False, f"not attached yet: starting for {self.clock() - self.started:.1f}s"
        ok, why = self.live()
        return ok, (f"attached {self.attached}; {why}" if ok else why)


def probe_states(tracepoints, attached, ifaces=(), tc=None, nf_planned: bool = True) -> dict[str, int]:
    """nptrace_probe_up's values. `tracepoints`: the hook table's names (kernel/hooks.py
    TRACEPOINTS), `attached`: Probes.attached, `ifaces`: the run's --iface specs, `tc`: the
    TcAttachments (kernel/tc.py: its clsact .attached and tcx .links name netns and ifname)
    or None."""
    def label(name: str) -> str:          # the hook table's tracefs path, as the hook's name
        return name.replace("/", ":", 1) if "/" in name and ":" not in name else name
    got = {label(a) for a in attached}
    out = {label(tp): int(label(tp) in got) for tp in tracepoints}
    out["netfilter:post_routing"] = int(any(a.startswith("netfilter:") for a in got))
    if not nf_planned and not out["netfilter:post_routing"]:
        out.pop("netfilter:post_routing")
    kp = [a for a in got if a.startswith("kprobe:")]
    for a in kp:
        out[a] = 1
    # clsact filters are in .attached, tcx links in .links as (entry, fds)
    on = {(e.netns, e.ifname) for e in getattr(tc, "attached", ())}
    on |= {(e.netns, e.ifname) for e, _ in getattr(tc, "links", ())}
    for spec in ifaces:
        out[f"tc:{spec}"] = int((spec.netns, spec.name) in on)
    return out


def build_info_collector(version: str, node: str = "", **extra: str):
    """nptrace_build_info{version, kernel, node, ...} 1: which build runs where."""
    from prometheus_client.core import GaugeMetricFamily

    labels = {"version": version, "kernel": os.uname().release, "node": node, **extra}

    class BuildInfo:
        def describe(self):
            return [GaugeMetricFamily("nptrace_build_info", "", labels=sorted(labels))]

        def collect(self):
            g = GaugeMetricFamily("nptrace_build_info", "nptrace version, kernel and node",
                                  labels=sorted(labels))
            g.add_metric([labels[k] for k in sorted(labels)], 1)
            yield g
    return BuildInfo()


class Scrapes:
    """Which /metrics answers were read whole: a scrape's counts are those of when its
    encoding began, so wait_after() waits for one that began after the call."""

    def __init__(self):
        self.cond = threading.Condition()
        self.next_seq = 0          # the next scrape's number
        self.last_served = -1      # the newest scrape answered in full

    def begin(self) -> int:
        with self.cond:
            seq, self.next_seq = self.next_seq, self.next_seq + 1
            return seq

    def served(self, seq: int) -> None:
        with self.cond:
            self.last_served = max(self.last_served, seq)
            self.cond.notify_all()

    def wait_after(self, timeout: float) -> bool:
        with self.cond:
            first = self.next_seq
            return self.cond.wait_for(lambda: self.last_served >= first, timeout)


class _Handler(BaseHTTPRequestHandler):
    server_version = "nptrace"
    registry = None          # set per server (a subclass)
    health: Health | None = None
    scrapes: Scrapes | None = None

    def do_GET(self):        # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if path in ("/healthz", "/readyz", "/livez"):
            h = self.health
            ok, why = (True, "no health source") if h is None else \
                (h.live() if path == "/livez" else h.readiness())
            self._send(200 if ok else 503, f"{'ok' if ok else 'unhealthy'}: {why}\n".encode(),
                       "text/plain; charset=utf-8")
        elif path in ("/metrics", "/"):
            from prometheus_client.exposition import choose_encoder
            encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
            seq = self.scrapes.begin()
            try:
                body = encoder(self.registry)
            except Exception as e:       # a collector failing must not take the port down
                self._send(500, f"metrics: {e}\n".encode(), "text/plain; charset=utf-8")
                return
            self._send(200, body, ctype)
            self.scrapes.served(seq)
        else:
            self._send(404, b"not found: /metrics, /healthz, /readyz, /livez\n", "text/plain")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):    # no access log on stderr (that is the status lines')
        pass


class HealthServer:
    """The metrics and health server: url, port, host, close."""

    def __init__(self, httpd, thread, host: str, port: int, scrapes: Scrapes | None = None):
        self.httpd, self.thread, self.host, self.port = httpd, thread, host, port
        self.scrapes = scrapes or Scrapes()

    def wait_scrape(self, timeout: float) -> bool:
        """True once a scrape that began after this call was answered, False after timeout."""
        return self.httpd is not None and self.scrapes.wait_after(timeout)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None


def serve(addr: str, registry, health: Health | None = None) -> HealthServer:
    """Serve /metrics and the health paths on a daemon thread; port 0 picks a free port."""
    import socket
    host, port = parse_metrics_addr(addr)
    scrapes = Scrapes()
    handler = type("Handler", (_Handler,), {"registry": registry, "health": health,
                                            "scrapes": scrapes})

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        httpd = Server((host, port), handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise NptraceError(f"metrics address {addr} in use: stop the other exporter or "
                               "choose another --metrics-addr") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise NptraceError(f"metrics address {addr}: no such local address") from None
        raise NptraceError(f"cannot serve metrics on {addr}: {e.strerror or e}") from None
    except (ValueError, UnicodeError) as e:   # unresolvable host name
        raise NptraceError(f"bad metrics address {addr!r}: {e}") from None
    t = threading.Thread(target=httpd.serve_forever, name="nptrace-metrics", daemon=True)
    t.start()
    return HealthServer(httpd, t, host, httpd.server_address[1], scrapes)
