"""On a real kernel: SIGTERM at random points of start and stop leaves nothing
behind (no BPF programs of ours, no tc filters, no nft trace tables, the lock free); a start
removes the nft trace table a killed run left; a watched interface that is deleted and
re-created is traced again, and the gap is said.

clsact mode throughout: its filters outlive the process (tcx links die with it), so it is the
mode where a missed clean-up shows."""
from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.privileged]

NPTRACE = [sys.executable, "-m", "nptrace.cli"]
NS = f"npt-cs{os.getpid() % 100000}"


def sh(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


@pytest.fixture
def ns(root_and_bcc):
    """A namespace with a veth pair v0 (10.77.0.1) / v1 (10.77.0.2), both up."""
    sh("ip", "netns", "add", NS)
    try:
        sh("ip", "-n", NS, "link", "set", "lo", "up")
        _veth()
        yield NS
    finally:
        sh("ip", "netns", "del", NS, check=False)


def _veth():
    sh("ip", "-n", NS, "link", "add", "v0", "type", "veth", "peer", "v1")
    sh("ip", "-n", NS, "addr", "add", "10.77.0.1/24", "dev", "v0")
    sh("ip", "-n", NS, "addr", "add", "10.77.0.2/24", "dev", "v1")
    sh("ip", "-n", NS, "link", "set", "v0", "up")
    sh("ip", "-n", NS, "link", "set", "v1", "up")


def our_filters() -> list[str]:
    out = []
    for parent in ("ingress", "egress"):
        r = sh("tc", "-n", NS, "filter", "show", "dev", "v0", parent, check=False)
        out += [w for w in r.stdout.split() if w.startswith("npt_")]
    return out


def npt_progs() -> set[int]:
    r = sh("bpftool", "-j", "prog", "show", check=False)
    try:
        return {p["id"] for p in json.loads(r.stdout or "[]") if "npt" in p.get("name", "")}
    except ValueError:
        return set()


def has_trace_table() -> bool:
    return "nptrace_trace" in sh("ip", "netns", "exec", NS, "nft", "list", "tables").stdout


def plant_table(owner: str = "nptrace 999999 1") -> None:
    sh("ip", "netns", "exec", NS, "nft",
       f'table inet nptrace_trace {{ comment "{owner}"; chain pre {{ type filter hook '
       f'prerouting priority raw - 10; policy accept; }}; }}')


def lock_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def launch(tmp_path: Path, *extra) -> tuple[subprocess.Popen, Path, Path]:
    ready, err = tmp_path / "ready", tmp_path / "stderr"
    ready.unlink(missing_ok=True)
    env = dict(os.environ, NPTRACE_LOCK_FILE=str(tmp_path / "lock"),
               NPTRACE_STATE_DIR=str(tmp_path / "state"))
    p = subprocess.Popen(NPTRACE + ["run", "--json", "--iface", f"{NS}/v0", "--tc-mode", "clsact",
                                    "--ready-file", str(ready), *extra],
                         stdout=open(tmp_path / "stdout", "w"), stderr=open(err, "w"), env=env)
    return p, ready, err


def test_sigterm_at_random_points_of_start_and_stop_leaves_nothing(ns, tmp_path):
    rng = random.Random(int(os.environ.get("NPTRACE_SIGNAL_SEED", "18")))
    before = npt_progs()
    tried = []
    for i in range(8):
        plant_table()
        p, ready, err = launch(tmp_path)
        # 0-3 s covers the checks, the compile (about 1 s here), the attach and the loop
        first = rng.uniform(0.0, 3.0)
        time.sleep(first)
        p.send_signal(signal.SIGTERM)
        second = rng.uniform(0.0, 0.3)          # a second signal while stop() runs
        time.sleep(second)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"run {i}: no exit 30 s after SIGTERM at {first:.2f}s")
        text = err.read_text()
        assert "Traceback" not in text, text
        assert rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM), (rc, text)
        tried.append((round(first, 2), round(second, 2), rc, "plan:" in text))
        assert our_filters() == [], (i, first, text)
        assert npt_progs() - before == set(), (i, first, text)
        if "plan:" in text:       # got past the lock and the sweep
            assert not has_trace_table(), (i, first, text)
        assert lock_free(tmp_path / "lock")
    # the random points must have hit start-up (before the ready file) and the loop
    print("tried (first, second, rc, swept):", tried)


def test_start_sweeps_dead_runs_table_and_keeps_a_live_ones(ns, tmp_path):
    plant_table()
    p, ready, err = launch(tmp_path, "--duration", "1")
    assert p.wait(60) == 0, err.read_text()
    assert "removed table inet nptrace_trace left by a killed nptrace run" in err.read_text()
    assert not has_trace_table()
    # a table whose owner still runs (our pytest process, with its real start time) stays
    from nptrace.node.nftrace_live import owner_comment
    plant_table(owner_comment())
    p, ready, err = launch(tmp_path, "--duration", "1")
    assert p.wait(60) == 0, err.read_text()
    assert has_trace_table()


def _connect_closed(n: int) -> None:
    """SYNs from v0's address to a closed port on v1's: the RSTs cross v0."""
    def go():
        for _ in range(n):
            s = socket.socket()
            s.settimeout(0.5)
            try:
                s.bind(("10.77.0.1", 0))
                s.connect(("10.77.0.2", 9))
            except OSError:
                pass
            finally:
                s.close()
    from nptrace.kernel.nsenter import run_in
    run_in(f"/run/netns/{NS}", go)


def test_deleted_and_recreated_interface_is_traced_again(ns, tmp_path):
    p, ready, err = launch(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        sh("ip", "-n", NS, "link", "del", "v0")
        time.sleep(2.5)                          # seen gone by the 1 s watch
        _veth()
        deadline = time.monotonic() + 10
        while "is back (ifindex" not in err.read_text():
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        assert our_filters(), (sh("tc", "-n", NS, "filter", "show", "dev", "v0", "ingress").stdout,
                               err.read_text())
        _connect_closed(5)
        time.sleep(2.0)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    text = err.read_text()
    assert "interface %s/v0 disappeared" % NS in text
    assert "tc programs re-attached; not traced for" in text
    lines = [json.loads(ln) for ln in (tmp_path / "stdout").read_text().splitlines() if ln.strip()]
    gaps = [d for d in lines if d.get("kind") == "loss" and d.get("loss") == "iface_gap"]
    assert gaps, lines[-5:]
    # tc events from the new device: evidence at tc hooks on v0 after the gap
    tc_seen = [d for d in lines if d.get("kind") != "loss"
               and any("tc" in str(e.get("hook", "")) for e in d.get("evidence", []))]
    assert tc_seen, "no verdict with tc evidence after the re-attach"
    assert our_filters() == []
