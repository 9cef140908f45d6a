"""The metrics endpoint over TLS with client certificates (sinks/tls.py, sinks/httpd.py), as the
DaemonSet ships it, and the plain probe listener beside it (--health-addr) that serves the
health paths and nothing else. Certificates are made by scripts/metrics-certs.sh, the commands
docs/deploy.md gives, and every client is a real one against a real server on 127.0.0.1."""
from __future__ import annotations

import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Counter, Gauge

from nptrace.config import ConfigError
from nptrace.errors import NptraceError
from nptrace.sinks import health, httpd
from nptrace.sinks.outputs import metrics_line
from nptrace.sinks.tls import ServerTls, TlsFiles, server_context, tls_files

import promscrape   # tests/promscrape.py: the certificates and Prometheus's side of the TLS

FAST = httpd.Limits(max_conns=16, request_s=1.0, max_request=8 << 10, response_s=2.0)


def make_certs(d: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed (apt-get install openssl)")
    return promscrape.make_certs(d)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """Certificates of another CA: a client certificate nptrace's CA did not sign."""
    return make_certs(tmp_path_factory.mktemp("other"))


def files(d: Path, ca: bool = True) -> TlsFiles:
    return TlsFiles(str(d / "tls.crt"), str(d / "tls.key"), str(d / "ca.crt") if ca else None)


client = promscrape.client_context
scrape = promscrape.https_get


def get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def tls_server(certs):
    reg = CollectorRegistry()
    Counter("npt_test", "x", registry=reg).inc()
    h = health.Health(stale_after=30)
    srvs = []

    def start(f: TlsFiles | None = None, registry=reg, limits=FAST, **kw):
        srv = health.serve("127.0.0.1:0", registry, h, limits=limits,
                           tls=ServerTls(f or files(certs), **kw))
        srvs.append(srv)
        return srv
    start.health = h
    yield start
    for s in srvs:
        s.close()


def test_only_a_client_with_the_cas_certificate_gets_metrics(tls_server, certs, other_ca):
    srv = tls_server()
    assert srv.url.startswith("https://127.0.0.1:")
    code, body = scrape(srv.port, client(certs, certs))
    assert code == 200 and "npt_test_total 1.0" in body
    # no certificate: the handshake fails before any HTTP is read
    refused, _ = scrape(srv.port, client(certs, None))
    assert refused in ("SSLError", "SSLEOFError", "ConnectionResetError", "BrokenPipeError",
                       "SSLZeroReturnError")
    # a certificate, but another CA's
    refused, _ = scrape(srv.port, client(certs, other_ca))
    assert refused != 200 and isinstance(refused, str)
    deadline = time.monotonic() + 5
    while srv.stats["tls_refused"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.stats["tls_refused"] == 2 and srv.stats["answered"] == 1


def test_plain_http_on_the_tls_port_is_closed_quietly(tls_server, capfd):
    srv = tls_server()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            got = s.recv(65536)
        except ConnectionResetError:
            got = b""
    assert b"npt_test" not in got and b"200 OK" not in got
    assert "Traceback" not in capfd.readouterr().err


def test_a_stalled_handshake_is_closed_at_the_request_deadline(tls_server, certs):
    srv = tls_server()
    socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(8)]
    try:
        time.sleep(FAST.request_s + 0.8)
        for s in socks:
            s.settimeout(1.0)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        assert scrape(srv.port, client(certs, certs))[0] == 200
        assert srv.stats["timed_out"] >= 8
    finally:
        for s in socks:
            s.close()


def test_a_large_scrape_to_a_slow_reader_is_sent_whole(tls_server, certs):
    """TLS writes that would block (a body far past the socket buffer, a client that reads
    late) are retried with the same buffer until the body is out."""
    reg = CollectorRegistry()
    g = Gauge("npt_big", "x", ["k"], registry=reg)
    for i in range(20000):
        g.labels(f"key-{i:06d}").set(i)
    srv = tls_server(registry=reg)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as raw, \
            client(certs, certs).wrap_socket(raw, server_hostname="nptrace-metrics") as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)                      # the server fills the socket and waits
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length")))
    assert len(body) == length > 500_000 and body.rstrip().endswith(b"19999.0")


def test_the_probe_listener_serves_health_and_never_metrics(tls_server, certs):
    srv = tls_server()
    h = tls_server.health

    def workers():
        return {t for t in threading.enumerate() if t.name == "nptrace-scrape"}
    before = workers()
    probes = health.serve_probes("127.0.0.1:0", h, limits=FAST)
    try:
        base = f"http://127.0.0.1:{probes.port}"
        assert probes.url == base + "/healthz"
        assert get(base + "/livez")[0] == 200
        assert get(base + "/healthz")[0] == 503          # not attached yet
        h.ready("skb:kfree_skb")
        assert get(base + "/healthz")[0] == 200 and get(base + "/readyz")[0] == 200
        for path in ("/metrics", "/", "/metrics/", "/nope"):
            code, body = get(base + path)
            assert code == 404 and "npt_test" not in body, path
        assert "--metrics-addr" in get(base + "/metrics")[1]
        # the probe port is plain HTTP: the kubelet presents no client certificate
        assert scrape(srv.port, client(certs, certs), "/livez")[0] == 200
        assert probes.stats["answered"] >= 8 and not probes.stats["route_errors"]
        assert workers() <= before                       # no scrape worker of its own
    finally:
        probes.close()


def test_changed_certificate_files_are_read_again(certs, other_ca, tmp_path):
    """cert-manager and the kubelet's Secret mount replace the files in place: the next
    connection after CHECK_S uses the new ones; files that do not load keep the old ones."""
    live = tmp_path / "live"
    shutil.copytree(certs, live)
    said = []
    now = [0.0]
    t = ServerTls(files(live), check_s=30, clock=lambda: now[0], log=said.append)
    first = t.context()
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (live / f"{name}.new").write_bytes((other_ca / name).read_bytes())
        (live / f"{name}.new").replace(live / name)
    assert t.context() is first                          # not checked before CHECK_S
    now[0] = 31
    second = t.context()
    assert second is not first and t.reloads == 1 and "reloaded" in said[-1]
    (live / "tls.key").write_text("not a key\n")
    now[0] = 62
    assert t.context() is second and "still serving the previous certificate" in said[-1]
    now[0] = 93
    assert t.context() is second and len(said) == 2      # said once per change


def test_the_reloaded_ca_decides_who_may_scrape(tls_server, certs, other_ca, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(certs, live)
    now = [0.0]
    srv = tls_server(files(live), check_s=1, clock=lambda: now[0])
    assert scrape(srv.port, client(certs, certs))[0] == 200
    for name in ("tls.crt", "tls.key", "ca.crt"):
        shutil.copy(other_ca / name, live / name)
    now[0] = 5
    assert isinstance(scrape(srv.port, client(other_ca, certs))[0], str)   # the old CA's client
    assert scrape(srv.port, client(other_ca, other_ca))[0] == 200


def test_bad_files_are_one_line(certs, other_ca, tmp_path):
    with pytest.raises(NptraceError, match=r"--metrics-tls-cert/--metrics-tls-key .*cannot read"):
        server_context(TlsFiles(str(tmp_path / "none.crt"), str(certs / "tls.key")))
    with pytest.raises(NptraceError, match="not a usable PEM certificate and key"):
        server_context(TlsFiles(str(certs / "tls.crt"), str(other_ca / "tls.key")))
    (tmp_path / "ca.crt").write_text("garbage\n")
    with pytest.raises(NptraceError, match="--metrics-client-ca") as e:
        server_context(TlsFiles(str(certs / "tls.crt"), str(certs / "tls.key"),
                                str(tmp_path / "ca.crt")))
    assert "\n" not in str(e.value)


def test_tls_options_go_together():
    assert tls_files(None, None, None, "127.0.0.1:9464") is None
    assert tls_files("c", "k", None, "1.2.3.4:9464") == TlsFiles("c", "k", None)
    assert tls_files("c", "k", "ca", "1.2.3.4:9464") == TlsFiles("c", "k", "ca")
    for args, msg in [(("c", None, None, "a:1"), "go together"),
                      ((None, "k", "ca", "a:1"), "go together"),
                      ((None, None, "ca", "a:1"), "needs --metrics-tls-cert"),
                      (("c", "k", "ca", None), "give it too")]:
        with pytest.raises(ConfigError, match=msg):
            tls_files(*args)


def test_tls_options_come_from_the_environment_too():
    """click's auto_envvar_prefix: NPTRACE_RUN_METRICS_TLS_CERT etc., refused here before
    anything is loaded because the key is missing."""
    from nptrace.cli import main_group
    r = CliRunner().invoke(main_group, ["run", "--metrics-addr", "9464"],
                           env={"NPTRACE_RUN_METRICS_TLS_CERT": "/nonexistent/tls.crt"})
    assert r.exit_code == 2 and "--metrics-tls-key go together" in r.output, r.output
    assert "Traceback" not in r.output


def test_the_start_line_says_who_may_read_the_metrics():
    assert metrics_line("http://127.0.0.1:9464/metrics", None) == \
        "metrics on http://127.0.0.1:9464/metrics, health on /healthz and /livez"
    assert "plain HTTP beyond loopback" in metrics_line("http://10.0.0.5:9464/metrics", None)
    assert "plain HTTP beyond loopback" in metrics_line("http://[fd00::5]:9464/metrics", None)
    assert "beyond" not in metrics_line("http://[::1]:9464/metrics", None)
    line = metrics_line("https://10.0.0.5:9464/metrics", TlsFiles("c", "k", "/tls/ca.crt"))
    assert "TLS; clients need a certificate signed by /tls/ca.crt" in line
    assert "no client certificate asked" in metrics_line("https://10.0.0.5:9464/metrics",
                                                         TlsFiles("c", "k"))
