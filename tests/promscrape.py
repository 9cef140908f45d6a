"""deploy/prometheus-scrape.yaml's job made runnable by the Prometheus on this machine: the
same scheme, TLS settings and relabeling, with the pod discovery replaced by static targets
that carry the labels the discovery would give (Debian's prometheus is built without
kubernetes_sd_configs) and the certificate files moved to where a test made them
(scripts/metrics-certs.sh). Used by tests/unit/test_deploy.py and
tests/privileged/test_fleet_metrics.py; `prometheus()` runs the server on 127.0.0.1."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRAPE = ROOT / "deploy/prometheus-scrape.yaml"
LABEL = "__meta_kubernetes_pod_label_app_kubernetes_io_name"
PORT_NAME = "__meta_kubernetes_pod_container_port_name"
NODE = "__meta_kubernetes_pod_node_name"


def shipped_jobs() -> list[dict]:
    import yaml
    return yaml.safe_load(SCRAPE.read_text())


def make_certs(d: Path) -> Path:
    subprocess.run([str(ROOT / "scripts/metrics-certs.sh"), str(d)], check=True,
                   capture_output=True, timeout=60)
    return d


def pod_target(addr: str, port_name: str = "metrics", node: str = "node-a",
               app: str = "nptrace") -> dict:
    """A static target with the labels the pod discovery gives a DaemonSet pod's port."""
    return {"targets": [addr], "labels": {LABEL: app, PORT_NAME: port_name, NODE: node}}


def local_job(certs: Path, targets: list[dict], client_cert: bool = True,
              name: str | None = None) -> dict:
    """The shipped job over `targets` (pod_target()s), its files in `certs`."""
    [job] = shipped_jobs()
    job = json.loads(json.dumps(job))
    job.pop("kubernetes_sd_configs")
    job["static_configs"] = targets
    tls = job["tls_config"]
    tls["ca_file"] = str(certs / "ca.crt")
    if client_cert:
        tls["cert_file"], tls["key_file"] = str(certs / "client.crt"), str(certs / "client.key")
    else:
        del tls["cert_file"], tls["key_file"]
    if name:
        job["job_name"] = name
    return job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(base: str, q: str) -> list:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': q})}"
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.load(r)
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


@contextlib.contextmanager
def prometheus(exe: str, jobs: list[dict], tmp: Path, interval: str = "1s"):
    """A Prometheus on 127.0.0.1 scraping `jobs`; yields its base URL."""
    cfg = tmp / "prometheus.yml"
    cfg.write_text(json.dumps({      # JSON is YAML
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": jobs}))
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    p = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=1).close()
                break
            except OSError:
                assert p.poll() is None and time.monotonic() < end, (tmp / "prometheus.log").read_text()
                time.sleep(0.2)
        yield base
    finally:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()


def client_context(certs: Path, cert_dir: Path | None = None):
    """Prometheus's side of the TLS: trusts `certs`' CA, checks the name nptrace-metrics,
    presents cert_dir's client.crt (None: no certificate)."""
    import ssl
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if cert_dir is not None:
        ctx.load_cert_chain(str(cert_dir / "client.crt"), str(cert_dir / "client.key"))
    return ctx


def https_get(port: int, ctx, path: str = "/metrics", host: str = "127.0.0.1",
              timeout: float = 5.0):
    """(status, body) of GET path over TLS to host:port with server name nptrace-metrics; the
    exception's type name and text when the connection is refused."""
    import ssl
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname="nptrace-metrics") as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: nptrace-metrics\r\n\r\n".encode())
            got = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
    except (ssl.SSLError, OSError) as e:
        return type(e).__name__, str(e)
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()
