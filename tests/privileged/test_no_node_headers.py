"""No kernel headers from the node. With /lib/modules and /usr/src hidden
(tmpfs over them in a private mount namespace, as on COS/Bottlerocket/Talos or under
ProtectKernelModules=yes), `nptrace run` compiles against nptrace's own minimal tree
(kernel/headertree.py), says so, and traces a lab reset."""
import os
import subprocess
import sys
import time

import pytest

from nptrace.kernel import headers
from nptrace.lab.harness import trace_scenario

pytestmark = pytest.mark.privileged
PREFIX = f"npt-nh{os.getpid() % 10000}-"
HIDE = ("mount -t tmpfs -o ro,mode=0755 tmpfs /usr/lib/modules && "
        "mount -t tmpfs -o ro,mode=0755 tmpfs /usr/src && exec \"$@\"")
WRAP = ("unshare", "-m", "--propagation", "private", "sh", "-c", HIDE, "sh")


def test_hidden_node_headers_are_hidden(shipped_headers):
    r = subprocess.run([*WRAP, sys.executable, "-c",
                        "import os; from nptrace.kernel import headers; "
                        "print(os.listdir('/lib/modules'), os.listdir('/usr/src')); "
                        "print(headers.find().line())"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "[] []"
    assert "kernel headers: shipped" in r.stdout


def test_traces_a_reset_with_no_node_headers(shipped_headers, monkeypatch):
    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)
    files = [p for p in shipped_headers.rglob("*") if p.is_file()]
    assert 50 < len(files) < 400, len(files)      # minimal: what bcc's compile opened
    t0 = time.monotonic()
    info, attempts, events, err = trace_scenario("no-listener", 5, prefix=PREFIX, watch=False,
                                                 settle=0.5, wrap=WRAP)
    took = time.monotonic() - t0
    assert f"kernel headers: shipped (nptrace's minimal tree {shipped_headers})" in err, err[-2000:]
    assert attempts and all(a.outcome == "refused" for a in attempts)
    ports = {a.sport for a in attempts}
    ours = [e for e in events if e["kind"] == "rst" and e["direction"] == "sent"
            and e.get("dport") in ports]
    assert ours and all(e["cause"] == "no_listener" for e in ours), (events[:3], err[-2000:])
    assert "Traceback" not in err
    print(f"traced with the shipped tree ({len(files)} files) in {took:.1f}s")


def test_no_headers_at_all_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "NPTRACE_KHEADERS": str(tmp_path / "none"),
           "NPTRACE_LOCK_FILE": str(tmp_path / "lock")}
    r = subprocess.run([*WRAP, sys.executable, "-m", "nptrace.cli", "run", "--duration", "1"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "no kernel headers for bcc's compile" in r.stderr.splitlines()[-1]
