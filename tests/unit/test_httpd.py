"""sinks/httpd.py and the metrics endpoint attacked the way a node's network attacks it: hundreds
of half-open and slow connections, oversize headers, aborted requests, a scrape flood and a
collector that hangs, against a real server on 127.0.0.1. Every attack here is bounded in
count and time and stops by itself."""
from __future__ import annotations

import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from nptrace.errors import NptraceError
from nptrace.sinks import health, httpd

FAST = httpd.Limits(max_conns=64, request_s=1.0, max_request=8 << 10, response_s=2.0)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def get(url, timeout=5.0, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


def raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """What the server answers to `data` sent on one connection, read until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return got
            if not chunk:
                return got
            got += chunk


def closed_within(s: socket.socket, limit: float) -> float | None:
    """Seconds until the server closed `s` (EOF or reset), None if still open after limit."""
    t0 = time.monotonic()
    s.settimeout(0.1)
    while time.monotonic() - t0 < limit:
        try:
            if s.recv(65536) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - t0
    return None


@pytest.fixture
def served():
    """A started server over a registry with one counter; Health ready."""
    reg = CollectorRegistry()
    Counter("npt_test", "x", registry=reg).inc()
    h = health.Health(stale_after=30)
    h.ready("x")
    srvs = []

    def start(registry=reg, limits=FAST, ttl=health.SCRAPE_TTL_S):
        srv = health.serve("127.0.0.1:0", registry, h, limits=limits, ttl=ttl)
        srvs.append(srv)
        return srv
    yield start
    for s in srvs:
        s.close()


class Blocking:
    """A collector that holds every scrape until released (a slow per-CPU map walk)."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def describe(self):
        return []

    def collect(self):
        self.calls += 1
        self.release.wait(10)
        from prometheus_client.core import GaugeMetricFamily
        g = GaugeMetricFamily("npt_slow", "x")
        g.add_metric([], 1)
        yield g


def test_hundreds_of_half_open_connections_keep_threads_and_memory_bounded(served):
    """300 connections that send part of a request and stall (what left 300 threads for ever
    before): no thread each, RSS flat, /livez answers meanwhile, each closed by the deadline."""
    srv = served()
    base = srv.url.rsplit("/", 1)[0]
    assert get(base + "/livez")[0] == 200
    threads0, rss0 = threading.active_count(), rss_kib()
    socks = []
    try:
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            # half a request, a large header begun: what grew the old server per thread
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4000)
            socks.append(s)
        t0 = time.monotonic()
        code, body, _ = get(base + "/livez", timeout=2)
        assert code == 200 and body.startswith("ok"), body
        assert time.monotonic() - t0 < 1.0
        # no thread per connection (a few spare: other threads of a test worker come and go)
        assert threading.active_count() <= threads0 + 3
        grew = rss_kib() - rss0
        assert grew < 16 << 10, f"RSS grew {grew} KiB under 300 half-open connections"
        st = srv.stats
        assert sum(srv.server.connections().values()) <= FAST.max_conns
        # past the cap each was closed: evicted by a newer one, or at its deadline already
        # (a loaded machine takes over request_s to open 300)
        assert st["evicted"] + st["refused"] + st["timed_out"] >= 300 - FAST.max_conns
        # the ones still held are closed at the request deadline, not kept for ever
        for s in socks[-FAST.max_conns:]:
            assert closed_within(s, FAST.request_s + 2.0) is not None
        assert not srv.server.connections()
    finally:
        for s in socks:
            s.close()
    assert get(base + "/livez")[0] == 200


def test_slowloris_trickle_is_closed_at_the_request_deadline(served):
    """A byte every 0.1 s never finishes a request: closed at request_s, whatever it sends."""
    srv = served()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        t0 = time.monotonic()
        closed = None
        for b in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"z" * 100:
            try:
                s.sendall(bytes([b]))
            except OSError:
                closed = time.monotonic() - t0
                break
            if closed_within(s, 0.1) is not None:
                closed = time.monotonic() - t0
                break
        assert closed is not None and FAST.request_s - 0.2 <= closed <= FAST.request_s + 1.5
    assert srv.stats["timed_out"] >= 1


def test_oversize_headers_get_431_and_memory_stays_flat(served):
    srv = served()
    big = b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000)
                                                 for i in range(16)) + b"\r\n"
    got = raw(srv.port, big)
    assert got == b"" or got.startswith(b"HTTP/1.1 431 "), got[:80]
    # one request line alone past the cap, no header end ever: 431 too, never buffered further
    got = raw(srv.port, b"GET /" + b"a" * (20 << 10))
    assert got == b"" or got.startswith(b"HTTP/1.1 431 "), got[:80]
    assert srv.stats["too_large"] == 2
    # 200 connections sending 64 KiB of header each, side by side
    rss0 = rss_kib()
    socks = []
    try:
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.setblocking(False)
            try:
                s.send(b"GET / HTTP/1.1\r\n" + b"X: " + b"y" * (64 << 10))
            except (BlockingIOError, OSError):
                pass
            socks.append(s)
        time.sleep(0.3)
        assert rss_kib() - rss0 < 16 << 10
    finally:
        for s in socks:
            s.close()
    assert get(srv.url.rsplit("/", 1)[0] + "/livez")[0] == 200


def test_aborted_requests_print_no_traceback(served, capfd):
    """Clients that reset mid-request, close before reading the answer, or send garbage: each
    is that client's loss, counted, and nothing reaches stderr."""
    slow = Blocking()
    reg = CollectorRegistry()
    reg.register(slow)
    srv = served(reg)
    linger0 = struct.pack("ii", 1, 0)        # close() sends RST

    for i in range(30):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger0)
        s.sendall([b"GET /metr", b"GET /metrics HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x00\xa5garbage\r\n\r\n",
                   b"GET /livez HTTP/1.1\r\n\r\n"][i % 4])
        s.close()                                   # reset, mid-request or before the answer
    slow.release.set()                              # the scrapes answer sockets that are gone
    time.sleep(0.5)
    body = raw(srv.port, b"GET /livez HTTP/1.0\r\n\r\n")
    assert body.startswith(b"HTTP/1.1 200 ")
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "Exception" not in err and err == "", err
    assert srv.stats["loop_errors"] == 0


def test_livez_answers_while_a_scrape_is_stuck(served):
    slow = Blocking()
    reg = CollectorRegistry()
    reg.register(slow)
    srv = served(reg)
    base = srv.url.rsplit("/", 1)[0]
    done = []
    t = threading.Thread(target=lambda: done.append(get(srv.url, timeout=8)))
    t.start()
    try:
        while slow.calls == 0:
            time.sleep(0.01)
        t0 = time.monotonic()
        assert get(base + "/livez", timeout=2)[0] == 200
        assert get(base + "/healthz", timeout=2)[0] == 200
        assert time.monotonic() - t0 < 1.0
    finally:
        slow.release.set()
        t.join(10)
    assert done and done[0][0] == 200 and "npt_slow 1.0" in done[0][1]


def test_a_scrape_past_its_deadline_gets_503(served):
    slow = Blocking()
    reg = CollectorRegistry()
    reg.register(slow)
    srv = served(reg, limits=FAST._replace(response_s=0.5))
    try:
        code, body, _ = get(srv.url, timeout=5)
        assert code == 503 and "busy" in body
    finally:
        slow.release.set()
    assert srv.stats["busy"] == 1


def test_scrapes_queued_behind_a_stuck_collector_stay_bounded(served):
    """A collector that never returns: each scrape gets 503 at its deadline, and once
    max_conns requests are queued behind it the next is refused at once (the queue does not
    grow with every scrape of the days it stays stuck)."""
    slow = Blocking()
    reg = CollectorRegistry()
    reg.register(slow)
    srv = served(reg, limits=FAST._replace(max_conns=4, response_s=0.5))
    try:
        answers = [get(srv.url, timeout=5) for _ in range(7)]
        assert all(a[0] == 503 for a in answers)
        assert "still queued" in answers[-1][1]
        t0 = time.monotonic()
        assert get(srv.url, timeout=5)[0] == 503 and time.monotonic() - t0 < 0.4
        assert srv.server._jobs.qsize() <= 4
        assert get(srv.url.rsplit("/", 1)[0] + "/livez")[0] == 200
    finally:
        slow.release.set()
    assert slow.calls == 1


def test_concurrent_scrapes_share_one_read(served):
    """A scrape flood walks the kernel maps once per second, not once per request."""
    calls = []

    class Counting:
        def describe(self):
            return []

        def collect(self):
            calls.append(time.monotonic())
            time.sleep(0.2)                      # a slow map walk
            from prometheus_client.core import CounterMetricFamily
            c = CounterMetricFamily("npt_walks", "x")
            c.add_metric([], len(calls))
            yield c
    reg = CollectorRegistry()
    reg.register(Counting())
    srv = served(reg, ttl=30)       # the flood's requests all inside one read's life, however slow
    got = []
    threads = [threading.Thread(target=lambda: got.append(get(srv.url, timeout=8)))
               for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 40 and all(g[0] == 200 and "npt_walks_total 1.0" in g[1] for g in got)
    assert len(calls) == 1
    # OpenMetrics from the same read: encoded once more, not read again
    code, body, hdrs = get(srv.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert code == 200 and "openmetrics" in hdrs["Content-Type"] and body.endswith("# EOF\n")
    assert len(calls) == 1


def test_a_read_is_reused_for_its_ttl_then_read_anew():
    reads = []

    class Reg:
        def collect(self):
            reads.append(1)
            from prometheus_client.core import CounterMetricFamily
            c = CounterMetricFamily("npt_reads", "x")
            c.add_metric([], len(reads))
            yield c
    now = [100.0]
    scrapes = health.Scrapes()
    cache = health.MetricsCache(Reg(), scrapes, ttl=1.0, clock=lambda: now[0])
    first = cache.answer("")
    assert first[0] == 200 and b"npt_reads_total 1.0" in first[1]
    now[0] += 0.9
    assert cache.answer("") == first                     # same read, same bytes, same number
    now[0] += 0.2
    again = cache.answer("")
    assert b"npt_reads_total 2.0" in again[1] and again[3] == first[3] + 1
    cache.expire()                                       # the stop's final scrape: read anew
    assert b"npt_reads_total 3.0" in cache.answer("")[1]


def test_a_failing_collector_answers_500_and_is_not_read_per_request():
    class Broken:
        calls = 0

        def collect(self):
            Broken.calls += 1
            raise RuntimeError("map gone")
    cache = health.MetricsCache(Broken(), health.Scrapes(), ttl=60)
    assert cache.answer("")[:2] == (500, b"metrics: RuntimeError: map gone\n")
    cache.answer("")
    assert Broken.calls == 1


def test_connection_cap_refuses_extra_ones_quickly(served):
    """When every slot holds a complete request (waiting for a stuck scrape), a new
    connection is closed at once; it never waits for a slot or gets a thread."""
    slow = Blocking()
    reg = CollectorRegistry()
    reg.register(slow)
    limits = FAST._replace(max_conns=8, response_s=5.0)
    srv = served(reg, limits=limits)
    socks = []
    try:
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            socks.append(s)
        deadline = time.monotonic() + 3
        while srv.server.connections()["waiting"] < 8:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        threads0 = threading.active_count()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as extra:
            took = closed_within(extra, 2.0)
        assert took is not None and took < 1.0          # not at response_s (5 s), not a slot later
        assert srv.stats["refused"] >= 1 and threading.active_count() <= threads0 + 3
    finally:
        slow.release.set()
        for s in socks:
            s.close()


def test_bad_requests_are_answered_and_closed(served):
    srv = served()
    assert raw(srv.port, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert raw(srv.port, b"hello\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(srv.port, b"GET /livez HTTP/1.1\r\nbad header\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    head = raw(srv.port, b"HEAD /livez HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
    # a bare-LF client and a query string
    assert raw(srv.port, b"GET /livez?x=1 HTTP/1.0\n\n").startswith(b"HTTP/1.1 200 ")
    assert raw(srv.port, b"GET /nope HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 404 ")


def test_a_thread_that_cannot_start_is_one_line(monkeypatch):
    def refuse(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(NptraceError, match="thread limit") as ex:
        health.serve("127.0.0.1:0", CollectorRegistry())
    assert "\n" not in str(ex.value)
