"""Run time of the tc programs per packet, beside an empty tc program in the same run.

Traffic: a bulk TCP transfer over a veth pair between two namespaces (npt-tc<pid>-*), then a
burst of connects to a closed port (each one a SYN through the flow table and a RST event).
Both programs sit on the same hooks of the server's veth, so they see the same packets.
Statistics come from BPF_ENABLE_STATS (nptrace.kernel.tc.enable_bpf_stats) and fdinfo
(nptrace.kernel.tc.prog_stats). The numbers are printed (pytest -s); the assertions only catch a
program that became grossly slower (an accidental loop, a map op per data packet).
"""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from nptrace.config import Config, IfaceSpec

pytestmark = [pytest.mark.privileged,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # bcc 0.26 str args

PY = "/usr/bin/python3"
EMPTY = "int npt_bench_empty(struct __sk_buff *skb) { return -1; }"

SINK = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5201)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
n = 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(n, flush=True)
"""

SOURCE = r"""
import socket, sys, time
secs = float(sys.argv[1])
s = socket.create_connection(("10.239.0.2", 5201))
buf = b"x" * (256 << 10)
end = time.monotonic() + secs
n = 0
while time.monotonic() < end:
    s.sendall(buf); n += len(buf)
s.close()
print(n)
"""

CHURN = r"""
import socket, sys
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    try:
        s.connect(("10.239.0.2", 9))
    except OSError:
        pass
    s.close()
"""


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def veth():
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN)")
    pytest.importorskip("bcc", reason="bcc is not importable (python3-bpfcc; use the venv)")
    cli, srv = f"npt-tc{os.getpid()}-bc", f"npt-tc{os.getpid()}-bs"
    try:
        for ns in (cli, srv):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", "c0", "netns", cli, "type", "veth", "peer", "s0", "netns", srv)
        for ns, dev, addr in ((cli, "c0", "10.239.0.1/24"), (srv, "s0", "10.239.0.2/24")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        yield cli, srv
    finally:
        for ns in (cli, srv):
            subprocess.run(["ip", "netns", "del", ns], check=False)


def _per_run(before, after):
    cnt, ns = after[0] - before[0], after[1] - before[1]
    return cnt, (ns / cnt if cnt else float("nan"))


def test_tc_program_cost_against_empty_program(veth, tmp_path):
    from bcc import BPF

    from nptrace import reasons
    from nptrace.kernel import btf, loader, netlink, offsets, tc
    cli, srv = veth
    b = btf.default()
    cfg = Config(ifaces=(IfaceSpec(srv, "s0"),))
    probes = loader.Probes(cfg, offsets.cflags(b) + tc.tc_cflags(cfg),
                           reasons.load_tables(b)[0], set())
    empty = BPF(text=EMPTY, cflags=["-Wno-ignored-attributes"])
    sink = None
    try:
        tc.configure(probes, cfg)
        ing, egr = probes.tc_program_fds()
        efd = empty.load_func("npt_bench_empty", BPF.SCHED_CLS).fd
        with tc.TcAttachments(cfg.ifaces, ing, egr, state_dir=tmp_path):
            with netlink.open_netns(srv) as r:
                idx = r.link("s0").ifindex
                for parent in (netlink.PARENT_INGRESS, netlink.PARENT_EGRESS):
                    r.add_bpf_filter(idx, parent, efd, "bench_empty")
            sink = subprocess.Popen(["ip", "netns", "exec", srv, PY, "-c", SINK],
                                    stdout=subprocess.PIPE, text=True)
            assert sink.stdout.readline().strip() == "ready"
            with tc.enable_bpf_stats():
                fds = {"ingress": ing, "egress": egr, "empty": efd}
                t0 = {k: tc.prog_stats(fd) for k, fd in fds.items()}
                start = time.monotonic()
                sent = int(subprocess.run(["ip", "netns", "exec", cli, PY, "-c", SOURCE, "2"],
                                          check=True, capture_output=True, text=True).stdout)
                secs = time.monotonic() - start
                t1 = {k: tc.prog_stats(fd) for k, fd in fds.items()}
                subprocess.run(["ip", "netns", "exec", cli, PY, "-c", CHURN, "2000"],
                               check=True, capture_output=True)
                t2 = {k: tc.prog_stats(fd) for k, fd in fds.items()}
    finally:
        if sink is not None:
            sink.kill()
            sink.wait()
        empty.cleanup()
        probes.close()

    bulk = {k: _per_run(t0[k], t1[k]) for k in fds}
    churn = {k: _per_run(t1[k], t2[k]) for k in fds}
    ours_bulk = (bulk["ingress"][0] + bulk["egress"][0],
                 ((t1["ingress"][1] - t0["ingress"][1]) + (t1["egress"][1] - t0["egress"][1]))
                 / max(1, bulk["ingress"][0] + bulk["egress"][0]))
    print(f"\nbulk TCP over veth: {sent * 8 / secs / 1e9:.1f} Gbit/s for {secs:.1f} s")
    for name, (cnt, per) in bulk.items():
        print(f"  bulk  {name:8s} runs {cnt:8d}  {per:7.1f} ns/run")
    for name, (cnt, per) in churn.items():
        print(f"  churn {name:8s} runs {cnt:8d}  {per:7.1f} ns/run")
    # same packets through both: ours ran once per hook where the empty one ran
    assert ours_bulk[0] == bulk["empty"][0] > 1000
    assert ours_bulk[1] < bulk["empty"][1] + 1000
    assert churn["ingress"][1] < churn["empty"][1] + 3000
