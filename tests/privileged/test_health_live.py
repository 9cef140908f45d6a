"""Health endpoints live: /healthz 503 until the probes are attached then 200, /livez,
nptrace_probe_up (0 for a tc probe that is not attached), nptrace_build_info{node}, and the
node's name on every JSON line of a traced lab reset."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.privileged
PREFIX = f"npt-hl{os.getpid() % 10000}-"


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None, ""


def test_health_names_and_probe_up(root_and_bcc, tmp_path):
    from nptrace import lab
    info = lab.up("no-listener", prefix=PREFIX)
    port = 19464 + os.getpid() % 500
    base = f"http://127.0.0.1:{port}"
    ready = tmp_path / "ready"
    codes = []
    p = subprocess.Popen([sys.executable, "-m", "nptrace.cli", "run", "--json", "--ready-file",
                          str(ready), "--metrics-addr", f"127.0.0.1:{port}",
                          "--node-name", "node-test-1", "--iface", info.watch[0]],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 90
        while not ready.exists() and time.monotonic() < end and p.poll() is None:
            codes.append(get(base + "/healthz")[0])
            time.sleep(0.05)
        assert ready.exists(), p.stderr.read() if p.poll() is not None else "not ready"
        assert 503 in codes, codes[:20]          # answered "not ready" while compiling
        assert get(base + "/healthz")[0] == 200 and get(base + "/livez")[0] == 200
        attempts = lab.trigger("no-listener", count=3, prefix=PREFIX)
        time.sleep(1.0)
        code, text = get(base + "/metrics")
        assert code == 200
        assert 'nptrace_build_info{' in text and 'node="node-test-1"' in text
        up = {l.split('probe="')[1].split('"')[0]: float(l.rsplit(" ", 1)[1])
              for l in text.splitlines() if l.startswith("nptrace_probe_up{")}
        assert up["skb:kfree_skb"] == 1 and up[f"tc:{info.watch[0]}"] == 1, up
        assert all(v in (0, 1) for v in up.values())
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        lab.down("no-listener", prefix=PREFIX)
    assert p.returncode == 0, err[-2000:]
    lines = [json.loads(l) for l in out.splitlines() if l.strip()]
    assert lines and all(l["node"] == "node-test-1" for l in lines)
    ports = {a.sport for a in attempts}
    assert any(l.get("dport") in ports and l["cause"] == "no_listener" for l in lines)
    assert "on node node-test-1 in " in err
