"""The metrics endpoint with health that means something: /metrics, /healthz (= /readyz) and
/livez on the --metrics-addr port, for the DaemonSet's probes and a unit's checks; with
--health-addr, /healthz, /readyz and /livez alone on a second, plain port as well.

  /healthz, /readyz  200 only once every probe is attached and the main loop turned within
                     LIVENESS_S; 503 with the reason before (compiling) and after (stuck).
                     The DaemonSet's readinessProbe: a pod is ready when it traces.
  /livez             200 while starting and while the main loop turns; 503 once it has not
                     turned for LIVENESS_S (stuck in a sink, a wedged poll). The livenessProbe:
                     restarting cannot fix a slow compile, so starting counts as alive.
  /metrics           prometheus_client's exposition of the caller's registry (text or
                     OpenMetrics, by the Accept header), plus nptrace_build_info.

prometheus_client's start_http_server answers every path with the metrics, so it cannot say
"not ready", and starts a thread per connection with no timeout. This is served by
sinks/httpd.py instead: a bounded selector loop (connection cap, request and response
deadlines, an 8 KiB request cap), the health paths answered on its thread while a scrape runs
on its worker, and one registry read reused for SCRAPE_TTL_S (MetricsCache). Model: the
Kubernetes components' /livez, /readyz, /healthz.

The probe listener (serve_probes, --health-addr) exists for the DaemonSet, whose metrics port
is TLS with client certificates (sinks/tls.py): the kubelet's httpGet probes present no client
certificate, so they are answered on a plain port that serves the health paths and nothing
else (/metrics there is 404). It has its own loop thread and connection cap, and no scrape
worker: a flood on one port does not take the other's connections.

Also here, pure: probe_states(), the nptrace_probe_up{probe} table: 1 for each attached hook,
0 for every hook of the hook table that is not (missing on this kernel, refused, failed),
tc ones per --iface included.
"""
from __future__ import annotations

import errno
import os
import threading
import time

from nptrace.config import parse_metrics_addr
from nptrace.errors import NptraceError
from nptrace.sinks import httpd

__all__ = ["Health", "HealthServer", "MetricsCache", "ProbeServer", "Scrapes",
           "build_info_collector", "health_answer", "probe_answer", "probe_states", "serve",
           "serve_probes"]

# Seconds without a main-loop turn after which the tracer is not live: the unit's WatchdogSec.
LIVENESS_S = float(os.environ.get("NPTRACE_LIVENESS_S", "30"))
# Seconds one read of the registry answers /metrics for (MetricsCache).
SCRAPE_TTL_S = 1.0


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
    """Which /metrics answers were read whole: an answer's counts are those of when its
    registry read began (MetricsCache), so wait_after() waits for one that began after the
    call."""

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


class MetricsCache:
    """One read of the registry answers every /metrics request for `ttl` seconds: a scrape
    walks the per-CPU kernel maps (KernelCollector), so a flood of scrapes, or Prometheus
    servers scraping side by side, cost one walk a second. Each encoding (text, OpenMetrics)
    is made once per read. `scrapes` numbers each read when it begins; expire() makes the next
    request read anew (the stop's final counts)."""

    def __init__(self, registry, scrapes: Scrapes, ttl: float = SCRAPE_TTL_S,
                 clock=time.monotonic):
        self.registry, self.scrapes, self.ttl, self.clock = registry, scrapes, ttl, clock
        self.lock = threading.Lock()
        self.read_at: float | None = None
        self.seq = -1
        self.families: list | None = None
        self.error = ""
        self.bodies: dict[str, bytes] = {}

    def expire(self) -> None:
        # not under the lock: a stop must not wait for a scrape stuck in a collector; a read
        # under way keeps its answer, the next one reads anew
        self.read_at = None

    def answer(self, accept: str) -> tuple[int, bytes, str, int]:
        """(status, body, content type, the number of the read it comes from)."""
        from prometheus_client.exposition import choose_encoder
        encoder, ctype = choose_encoder(accept)
        with self.lock:
            now = self.clock()
            if self.read_at is None or now - self.read_at >= self.ttl:
                self.seq = self.scrapes.begin()
                self.bodies, self.read_at = {}, now
                try:
                    self.families, self.error = list(self.registry.collect()), ""
                except Exception as e:    # a collector failing must not take the port down
                    self.families, self.error = None, f"metrics: {type(e).__name__}: {e}\n"
            if self.families is None:
                return 500, self.error.encode(), "text/plain; charset=utf-8", self.seq
            body = self.bodies.get(ctype)
            if body is None:
                try:
                    body = self.bodies[ctype] = encoder(_Read(self.families))
                except Exception as e:
                    return 500, f"metrics: {type(e).__name__}: {e}\n".encode(), \
                        "text/plain; charset=utf-8", self.seq
            return 200, body, ctype, self.seq


class _Read:
    """The families of one registry read, as the encoders ask a registry for them."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


HEALTH_PATHS = ("/healthz", "/readyz", "/livez")
METRICS_PATHS = ("/metrics", "/")


def _route(path: str) -> str:
    return path.rstrip("/") or "/"


def health_answer(health: Health | None, req: httpd.Request) -> httpd.Answer | None:
    """The health paths and 404, answered on the server's loop (never behind a scrape);
    None for /metrics."""
    path = _route(req.path)
    if path in METRICS_PATHS:
        return None
    if path not in HEALTH_PATHS:
        return httpd.Answer(404, b"not found: /metrics, /healthz, /readyz, /livez\n")
    ok, why = (True, "no health source") if health is None else \
        (health.live() if path == "/livez" else health.readiness())
    return httpd.Answer(200 if ok else 503, f"{'ok' if ok else 'unhealthy'}: {why}\n".encode())


def probe_answer(health: Health | None, req: httpd.Request) -> httpd.Answer:
    """The probe listener's routes: the health paths, and 404 for everything else, /metrics
    included (metrics are served on --metrics-addr only)."""
    if _route(req.path) not in HEALTH_PATHS:
        return httpd.Answer(404, b"not found: /healthz, /readyz, /livez (metrics are served on "
                                 b"--metrics-addr)\n")
    return health_answer(health, req)


class HealthServer:
    """The metrics and health server: url, port, host, close, stats (sinks/httpd.py)."""

    def __init__(self, server: httpd.Server | None, host: str, port: int, scrapes: Scrapes,
                 cache: MetricsCache, tls: bool = False):
        self.server, self.host, self.port = server, host, port
        self.scrapes, self.cache, self.tls = scrapes, cache, tls

    @property
    def stats(self):
        return self.server.stats if self.server is not None else {}

    def wait_scrape(self, timeout: float) -> bool:
        """True once a scrape that began after this call was answered, False after timeout."""
        if self.server is None:
            return False
        self.cache.expire()         # the next scrape reads the counts as they are now
        return self.scrapes.wait_after(timeout)

    @property
    def url(self) -> str:
        return _url("https" if self.tls else "http", self.host, self.port, "/metrics")

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


class ProbeServer:
    """The probe listener (serve_probes): url, port, host, close, stats."""

    def __init__(self, server: httpd.Server | None, host: str, port: int):
        self.server, self.host, self.port = server, host, port

    @property
    def stats(self):
        return self.server.stats if self.server is not None else {}

    @property
    def url(self) -> str:
        return _url("http", self.host, self.port, "/healthz")

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def _url(scheme: str, host: str, port: int, path: str) -> str:
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}{path}"


def _bind(addr: str, flag: str, what: str):
    """(host, the listening socket) of addr, or NptraceError in one line."""
    host, port = parse_metrics_addr(addr)
    try:
        return host, httpd.bind(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise NptraceError(f"{what} address {addr} in use: stop the other exporter or "
                               f"choose another {flag}") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise NptraceError(f"{what} address {addr}: no such local address") from None
        raise NptraceError(f"cannot serve {what} on {addr}: {e.strerror or e}") from None
    except (ValueError, UnicodeError) as e:   # unresolvable host name
        raise NptraceError(f"bad {what} address {addr!r}: {e}") from None


def serve(addr: str, registry, health: Health | None = None, *,
          limits: httpd.Limits = httpd.Limits(), ttl: float = SCRAPE_TTL_S,
          tls=None) -> HealthServer:
    """Serve /metrics and the health paths (sinks/httpd.py: one loop thread, one scrape
    worker, bounded connections); port 0 picks a free port. tls: a sinks/tls.py ServerTls
    (HTTPS, with client certificates where it has a client CA), None: plain HTTP."""
    scrapes = Scrapes()
    cache = MetricsCache(registry, scrapes, ttl)

    def metrics(req: httpd.Request) -> httpd.Answer:
        code, body, ctype, seq = cache.answer(req.headers.get("accept", ""))
        return httpd.Answer(code, body, ctype,
                            (lambda: scrapes.served(seq)) if code == 200 else None)
    host, sock = _bind(addr, "--metrics-addr", "metrics")
    server = httpd.Server(sock, lambda req: health_answer(health, req), metrics, limits,
                          tls=tls.context if tls is not None else None).start()
    return HealthServer(server, host, sock.getsockname()[1], scrapes, cache, tls is not None)


def serve_probes(addr: str, health: Health | None, *,
                 limits: httpd.Limits = httpd.Limits()) -> ProbeServer:
    """Serve /healthz, /readyz and /livez alone, plain HTTP, on addr (--health-addr): the
    kubelet's probes where /metrics is TLS. One loop thread, no scrape worker."""
    host, sock = _bind(addr, "--health-addr", "health")
    server = httpd.Server(sock, lambda req: probe_answer(health, req), None, limits).start()
    return ProbeServer(server, host, sock.getsockname()[1])
