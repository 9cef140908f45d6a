"""--port and --host filter in the kernel: events outside them are counted as filtered and never
reach user space; events inside them do."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from nptrace.lab.harness import wait_ready

pytestmark = pytest.mark.privileged
NS = f"npt-flt{os.getpid() % 10000}"


@pytest.fixture
def netns():
    subprocess.run(["ip", "netns", "add", NS], check=True)
    subprocess.run(["ip", "-n", NS, "link", "set", "lo", "up"], check=True)
    yield NS
    subprocess.run(["ip", "netns", "del", NS])


def refused(ns, port, n):
    code = ("import socket\n"
            f"for _ in range({n}):\n"
            "    s = socket.socket()\n"
            f"    try: s.connect(('127.0.0.1', {port}))\n"
            "    except OSError: pass\n"
            "    s.close()\n")
    subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=True)


def test_port_filter_runs_in_the_kernel(netns, tmp_path):
    ready = tmp_path / "ready"
    env = dict(os.environ, NPTRACE_LOCK_FILE=str(tmp_path / "lock"))
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "nptrace.cli", "run", "--json", "--port", "7",
                              "--host", "127.0.0.0/8", "--ready-file", str(ready)],
                             stdout=out, stderr=err, env=env)
        try:
            wait_ready(ready, p, stderr=tmp_path / "err")
            refused(netns, 7, 5)
            refused(netns, 8, 5)
            time.sleep(1.5)
        finally:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=30)
    inode = os.stat(f"/run/netns/{netns}").st_ino
    incidents = [json.loads(l) for l in (tmp_path / "out").read_text().splitlines()]
    ours = [e for e in incidents if e["netns"] == inode]
    assert ours and all(7 in (e["sport"], e["dport"]) for e in ours), ours
    assert len([e for e in ours if e["cause"] == "no_listener"]) == 5
    assert p.returncode == 0
