"""The on-call filters on `nptrace run`, on two simultaneous lab faults: the no-endpoints
Service (kube-proxy rejects 30080) and a connect to a closed port of node1 (no_listener).
`--service default/web` shows only the first, `--cause no_listener` only the second."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nptrace import lab
from nptrace.lab.harness import wait_ready

pytestmark = pytest.mark.privileged
CLOSED = 9999


def _closed_port_connects(n):
    code = ("import socket\n"
            f"for _ in range({n}):\n"
            "    s = socket.socket()\n"
            f"    try: s.connect(('192.168.10.11', {CLOSED}))\n"
            "    except OSError as e: print(e.errno)\n"
            "    s.close()\n")
    return subprocess.run(["ip", "netns", "exec", "npt-client", sys.executable, "-c", code],
                          capture_output=True, text=True, check=True).stdout.split()


@pytest.fixture(scope="module")
def two_faults():
    lab.up("no-endpoints")
    yield
    lab.down("no-endpoints")


@pytest.mark.parametrize("flt,want,other", [
    (["--service", "default/web"], "no_endpoints", "no_listener"),
    (["--cause", "no_listener", "-o", "json", "-c", "5"], "no_listener", "no_endpoints"),
])
def test_filter_selects_one_of_two_faults(two_faults, root_and_bcc, tmp_path, flt, want, other):
    ready = tmp_path / "ready"
    env = dict(os.environ, NPTRACE_LOCK_FILE=str(tmp_path / "lock"))
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "nptrace.cli", "run",
                              *([] if "-o" in flt else ["--json"]),
                              "--iface", "npt-node1/eth0", "--ready-file", str(ready), *flt],
                             stdout=out, stderr=err, env=env)
        try:
            wait_ready(ready, p, stderr=tmp_path / "err")
            time.sleep(0.3)
            attempts = lab.trigger("no-endpoints", count=5)
            assert {a.outcome for a in attempts} == {"refused"}
            assert len(_closed_port_connects(5)) == 5        # both faults happened
            time.sleep(2.0)
            if "-c" in flt:       # -c 5: it stopped by itself after the 5 incidents
                assert p.wait(timeout=10) == 0
        finally:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait(timeout=30)
    assert p.returncode == 0, (tmp_path / "err").read_text()
    causes = [json.loads(l).get("cause") for l in (tmp_path / "out").read_text().splitlines()]
    assert want in causes, (causes, (tmp_path / "err").read_text()[-2000:])
    assert other not in causes and set(causes) <= {want}, causes


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(text, name, **labels):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_service_filter_in_the_kernel_and_table(two_faults, root_and_bcc, tmp_path):
    """run --service default/web -o table: the closed port's records are counted in the kernel
    (the exact counters) and never sent (svc_gated; the session holds none of them), the
    table shows only the Service's incidents."""
    import urllib.request

    from nptrace.sessions.replay import Replay
    ready, port = tmp_path / "ready", _free_port()
    env = dict(os.environ, NPTRACE_LOCK_FILE=str(tmp_path / "lock"))
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "nptrace.cli", "run", "-o", "table",
                              "--service", "default/web", "--iface", "npt-node1/eth0",
                              "--record", str(tmp_path / "rec"), "--metrics-addr", str(port),
                              "--ready-file", str(ready)], stdout=out, stderr=err, env=env)
        try:
            wait_ready(ready, p, stderr=tmp_path / "err")
            time.sleep(0.3)
            attempts = lab.trigger("no-endpoints", count=5)
            assert {a.outcome for a in attempts} == {"refused"}
            assert len(_closed_port_connects(5)) == 5
            time.sleep(2.5)        # the exact counters are read once a second
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                metrics = r.read().decode()
        finally:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=30)
    err = (tmp_path / "err").read_text()
    assert p.returncode == 0, err[-2000:]
    assert "--service in the kernel:" in err, err[-2000:]
    head, *rows = (tmp_path / "out").read_text().splitlines()
    assert head.split() == ["TIME", "CAUSE", "WHAT", "IFACE", "SERVICE", "N", "FLOW"]
    causes = [r[head.index("CAUSE"):].split()[0] for r in rows]
    assert "no_endpoints" in causes and set(causes) == {"no_endpoints"}, rows
    # the other flow: counted exactly, not sent
    assert _metric(metrics, "nptrace_resets_total", cause="no_listener") >= 5, metrics
    assert _metric(metrics, "nptrace_events_svc_gated_total") >= 5, metrics
    sent = [it.verdict for it in Replay([tmp_path / "rec"]).items()]
    assert sent and not [v for v in sent if CLOSED in (v.event.sport, v.event.dport)], \
        [(v.cause, v.event.sport, v.event.dport) for v in sent]
