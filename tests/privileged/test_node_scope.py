"""One kernel, several nodes (node/scope.py): a plain `nptrace run` inside a node's network
namespace takes that node's instance lock, finds its pods (the namespaces whose veths all lead
to it) and reports them and itself alone, as the lab's shipped form runs it."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.privileged

P = f"nsc{os.getpid() % 10000}"


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


@pytest.fixture
def two_nodes():
    """a and b, each a node with a pod (a-pod 10.77.1.2 behind a's 10.77.1.1, b-pod likewise
    in 10.77.2.0/24); a and b wired to each other by a veth, as the lab's underlay is."""
    spaces = [f"{P}-{n}" for n in ("a", "a-pod", "b", "b-pod")]
    for ns in spaces:
        sh("ip", "netns", "add", ns)
    try:
        for node, net in (("a", 1), ("b", 2)):
            sh("ip", "-n", f"{P}-{node}", "link", "add", "pod0", "type", "veth", "peer", "name",
               "eth0", "netns", f"{P}-{node}-pod")
            sh("ip", "-n", f"{P}-{node}", "addr", "add", f"10.77.{net}.1/24", "dev", "pod0")
            sh("ip", "-n", f"{P}-{node}-pod", "addr", "add", f"10.77.{net}.2/24", "dev", "eth0")
            for ns in (f"{P}-{node}", f"{P}-{node}-pod"):
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", f"{P}-{node}", "link", "set", "pod0", "up")
            sh("ip", "-n", f"{P}-{node}-pod", "link", "set", "eth0", "up")
        sh("ip", "-n", f"{P}-a", "link", "add", "ul0", "type", "veth", "peer", "name", "ul0",
           "netns", f"{P}-b")
        yield spaces
    finally:
        for ns in spaces:
            sh("ip", "netns", "del", ns, check=False)


def in_ns(ns, code):
    r = sh("ip", "netns", "exec", ns, sys.executable, "-c", code)
    return r.stdout.strip()


def test_a_node_s_pods_are_the_namespaces_whose_veths_all_lead_to_it(two_nodes):
    code = ("from nptrace.node.scope import is_nested, pods_of_here;"
            "import os; print(is_nested(), sorted(os.path.basename(p) for p in pods_of_here().values()))")
    assert in_ns(f"{P}-a", code) == f"True ['{P}-a-pod']"      # b leads to a, and elsewhere
    assert in_ns(f"{P}-b", code) == f"True ['{P}-b-pod']"


def test_two_plain_runs_one_per_node_each_report_their_own_node(two_nodes, root_and_bcc, tmp_path):
    """Both start (each its node's lock), and a refused connection inside node a's pod is
    a's line alone."""
    procs = []
    for n in ("a", "b"):
        out, err = tmp_path / f"{n}.json", tmp_path / f"{n}.err"
        procs.append((n, subprocess.Popen(
            ["ip", "netns", "exec", f"{P}-{n}", sys.executable, "-m", "nptrace.cli", "run",
             "--json", "--node-name", n, "--ready-file", str(tmp_path / f"{n}.ready")],
            stdout=open(out, "w"), stderr=open(err, "w")), out, err))
    try:
        end = time.monotonic() + 120
        while not all((tmp_path / f"{n}.ready").exists() for n in ("a", "b")):
            for n, p, _, err in procs:
                assert p.poll() is None, f"{n}: {err.read_text()[-500:]}"
            assert time.monotonic() < end, "the runs did not attach"
            time.sleep(0.2)
        # a's node connects to its pod's closed port: the pod's kernel resets it
        sh("ip", "netns", "exec", f"{P}-a", sys.executable, "-c",
           "import socket\ntry:\n socket.create_connection(('10.77.1.2', 9), 2)\n"
           "except OSError: pass")
        time.sleep(2.5)
    finally:
        for _, p, _, _ in procs:
            p.send_signal(signal.SIGINT)
        for _, p, _, _ in procs:
            p.wait(60)
    lines = {n: [json.loads(l) for l in out.read_text().splitlines() if l.strip()]
             for n, _, out, _ in procs}
    errs = {n: err.read_text() for n, _, _, err in procs}
    for n in ("a", "b"):
        assert "node scope:" in errs[n] and "interfaces chosen automatically" in errs[n], errs[n]
    assert f"its pods' (1: {P}-a-pod)" in errs["a"]
    mine = [e for e in lines["a"] if e.get("dport") == 9 or e.get("sport") == 9]
    assert mine and all(e["cause"] == "no_listener" for e in mine), lines["a"]
    assert not [e for e in lines["b"] if 9 in (e.get("dport"), e.get("sport"))], lines["b"]


def test_a_vxlan_device_made_after_start_is_attached_within_a_second(two_nodes, root_and_bcc, tmp_path):
    """No --iface: the node's devices are followed; one created while tracing is attached
    about a second after the kernel announces it, and its deletion is said."""
    err = tmp_path / "err"
    p = subprocess.Popen(["ip", "netns", "exec", f"{P}-a", sys.executable, "-m", "nptrace.cli",
                          "run", "--json", "--ready-file", str(tmp_path / "ready")],
                         stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    try:
        end = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert p.poll() is None, err.read_text()[-500:]
            assert time.monotonic() < end, "did not attach"
            time.sleep(0.2)
        t0 = time.monotonic()
        sh("ip", "-n", f"{P}-a", "link", "add", "vx9", "type", "vxlan", "id", "9", "dstport", "4789")
        while "interface vx9 (vxlan overlay): tc programs attached" not in err.read_text():
            assert time.monotonic() - t0 < 3, err.read_text()[-800:]
            time.sleep(0.05)
        took = time.monotonic() - t0
        sh("ip", "-n", f"{P}-a", "link", "del", "vx9")
        while "interface vx9 disappeared" not in err.read_text():
            assert time.monotonic() - t0 < 6, err.read_text()[-800:]
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(60)
    assert took < 2.0, took
