"""Fleet metrics for real: Debian's Prometheus server (run directly, with a temporary config
and storage on 127.0.0.1, not the system service) scrapes `nptrace run --metrics-addr` over
HTTPS with the client certificate, with deploy/prometheus-scrape.yaml's job (its pod
discovery replaced by a static target with the same labels: tests/promscrape.py), during a
traced lab run; every query of deploy/grafana-dashboard.json, with Grafana's variables
substituted, returns data through the HTTP API, and the per-cause numbers equal `nptrace
report` over the same run's session."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import promscrape   # tests/promscrape.py: the shipped scrape job, run locally
from promscrape import query

pytestmark = pytest.mark.privileged
ROOT = Path(__file__).resolve().parents[2]
PREFIX = f"npt-pm{os.getpid() % 1000}"      # one lab per prefix: + the scenario's index
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
# Between them every panel has data: wrong_iface resets and drops with their Service, and the
# asymmetric replies of rp-filter-asymmetric (nptrace_anomalies_total).
SCENARIOS = ("wrong-interface", "rp-filter-asymmetric")
# Grafana's variables: $__rate_interval covers the whole short run; every node.
VARS = {"$__rate_interval": "1m", "$instance": ".*"}


def dashboard_queries() -> list[tuple[str, str]]:
    d = json.loads((ROOT / "deploy/grafana-dashboard.json").read_text())
    out = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            q = t["expr"]
            for k, v in VARS.items():
                q = q.replace(k, v)
            out.append((p.get("title", "?"), q))
    return out


@pytest.fixture
def prometheus(tmp_path):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("Debian's prometheus is not installed (scripts/setup.sh: apt-get install prometheus)")
    certs = promscrape.make_certs(tmp_path / "certs")
    target = f"127.0.0.1:{promscrape.free_port()}"
    job = promscrape.local_job(certs, [promscrape.pod_target(target)])
    with promscrape.prometheus(exe, [job], tmp_path) as base:
        yield base, target, certs


def report_causes(sessions: Path) -> Counter:
    """`nptrace report`'s cause table (its text: `-o json` is not there yet)."""
    r = subprocess.run([sys.executable, "-m", "nptrace.cli", "report", str(sessions)],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    start = next(i for i, l in enumerate(lines) if re.match(r"cause\s+count$", l.strip()))
    out = Counter()
    for l in lines[start + 1:]:
        m = re.match(r"(\S+)\s+(\d+)$", l.strip())
        if not m:
            break
        out[m.group(1)] = int(m.group(2))
    return out, r.stdout


def test_prometheus_scrapes_a_traced_run_and_every_dashboard_query_has_data(
        prometheus, tmp_path, root_and_bcc):
    from nptrace import lab
    base, target, certs = prometheus
    sessions = tmp_path / "sessions"
    ready = tmp_path / "ready"
    ifaces, up = [], []
    try:
        for i, sc in enumerate(SCENARIOS):
            ifaces += [a for w in lab.up(sc, prefix=f"{PREFIX}{i}-").watch for a in ("--iface", w)]
            up.append((sc, f"{PREFIX}{i}-"))
        # --metrics-final-scrape: the stop serves the final counts until Prometheus scraped
        # them once, so it sees what the session saw (the wrong-interface flows keep
        # resetting with every SYN-ACK retransmission, 1, 3, 7, 15 s after the SYN: a scrape
        # before the stop misses those that come after it, and the flush's).
        p = subprocess.Popen([sys.executable, "-m", "nptrace.cli", "run", "--metrics-addr", target,
                              "--metrics-tls-cert", str(certs / "tls.crt"),
                              "--metrics-tls-key", str(certs / "tls.key"),
                              "--metrics-client-ca", str(certs / "ca.crt"),
                              "--metrics-final-scrape", "10",
                              "--record", str(sessions), "--ready-file", str(ready), *ifaces],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            end = time.monotonic() + 60
            while not ready.exists():
                assert p.poll() is None and time.monotonic() < end, p.stderr.read()
                time.sleep(0.05)
            time.sleep(2)                       # scrapes before any incident
            for _ in range(2):
                for sc, prefix in up:
                    lab.trigger(sc, count=5, prefix=prefix)
                time.sleep(3)
            time.sleep(2)
            results = {q: query(base, q) for _, q in dashboard_queries()}
        finally:
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=60)
    finally:
        for sc, prefix in up:
            lab.down(sc, prefix=prefix)
            lab.down_all(prefix=prefix)    # and whatever of the prefix a step left behind
    assert p.returncode == 0, err[-3000:]
    assert "final counts on" in err and "not scraped" not in err, err[-3000:]
    # Incidents per cause, as of the last scrape (report's cause table counts incidents; the
    # nptrace_resets/drops/anomalies families count every kernel record under its cause).
    # The target is gone, so its series are stale now and an instant selector returns
    # nothing; a range keeps the samples.
    live = Counter()
    for s in query(base, 'sum by (cause) (max_over_time(nptrace_incidents_total'
                         '{instance=~".*"}[5m]))'):
        live[s["metric"]["cause"]] += int(float(s["value"][1]))
    # every record the incidents gather is in the record families, under some cause
    records = Counter()
    for m in ("nptrace_resets_total", "nptrace_drops_total", "nptrace_anomalies_total"):
        for s in query(base, f'sum by (cause) (max_over_time({m}{{instance=~".*"}}[5m]))'):
            records[s["metric"]["cause"]] += int(float(s["value"][1]))
    assert sum(records.values()) >= sum(live.values()) > 0, (dict(records), dict(live))
    empty = [(t, q) for t, q in dashboard_queries() if not results[q]]
    assert not empty, empty
    causes, text = report_causes(sessions)
    print(f"\nprometheus per cause: {dict(live)}\nreport:\n{text}")
    assert live == causes, (dict(live), text)
