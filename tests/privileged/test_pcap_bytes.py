"""-w on the real kernel: the pcapng carries the bytes the kernel had at each hook. Lab
rp-filter-asymmetric: the client's SYN to node1's secondary address is DNATed, then dropped by
strict rp_filter on npt-node1/eth1 (skb:kfree_skb IP_RPFILTER); its retransmissions are seen
at tc ingress (SYN_RETX). A tcpdump on the same interface is the reference: the tc packets are
its frames byte for byte; the kfree_skb packet is its frame after DNAT (destination address
and port, and the two checksums, rewritten; everything else equal). tshark reads the file and
`frame.comment contains "rp_filter"` selects those packets. The same run's --record session
keeps the bytes: `nptrace replay -w` writes the live file's packets again, byte for byte."""
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest

from nptrace import lab
from nptrace.lab.harness import wait_ready

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from test_pcapng import read_pcapng  # noqa: E402

pytestmark = pytest.mark.privileged
SCENARIO = "rp-filter-asymmetric"


def read_pcap(path):
    """Frames of a classic pcap file (tcpdump -w)."""
    data = open(path, "rb").read()
    magic = struct.unpack_from("<I", data)[0]
    end = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    out, off = [], 24
    while off + 16 <= len(data):
        _s, _us, cap, _orig = struct.unpack_from(end + "IIII", data, off)
        out.append(data[off + 16:off + 16 + cap])
        off += 16 + cap
    return out


@pytest.fixture(scope="module")
def rp_lab():
    lab.up(SCENARIO)
    yield
    lab.down(SCENARIO)


@pytest.mark.skipif(shutil.which("tshark") is None,
                    reason="tshark not installed (scripts/setup.sh installs it)")
def test_pcap_holds_the_kernels_bytes(rp_lab, root_and_bcc, tmp_path):
    ready, pcap, ref = tmp_path / "ready", tmp_path / "out.pcapng", tmp_path / "ref.pcap"
    env = dict(os.environ, NPTRACE_LOCK_FILE=str(tmp_path / "lock"))
    td = subprocess.Popen(["ip", "netns", "exec", "npt-node1", "tcpdump", "-i", "eth1", "-U",
                           "-s", "0", "-w", str(ref), "tcp", "port", "30080"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "nptrace.cli", "run", "-o", "json",
                              "-i", "npt-node1/eth1", "-w", str(pcap), "--record", str(tmp_path / "rec"),
                              "--ready-file", str(ready)],
                             stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            wait_ready(ready, p, stderr=tmp_path / "err")
            time.sleep(0.5)        # tcpdump is listening by now too
            attempts = lab.trigger(SCENARIO, count=1)
            assert {a.outcome for a in attempts} == {"timeout"}
            time.sleep(2.5)        # the incident is reported after its hold
        finally:
            for proc in (p, td):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(timeout=30)
    assert p.returncode == 0, (tmp_path / "err").read_text()[-2000:]
    wire = read_pcap(ref)
    assert len(wire) >= 2, "tcpdump saw the SYN and its retransmission"

    ifaces, packets = read_pcapng(pcap)
    comments = [pk[3][1][0].decode() for pk in packets]
    real = [(pk, c) for pk, c in zip(packets, comments) if "as the kernel had them" in c]
    at_tc = [pk for pk, c in real if "packet: tc:ingress" in c]
    at_drop = [pk for pk, c in real if "packet: skb:kfree_skb IP_RPFILTER" in c]
    assert at_tc and at_drop, comments
    for pk in at_tc:                      # the wire's bytes, and inbound (EPB flags)
        assert pk[2] in wire
        assert pk[3][2] == [struct.pack("<I", 1)]
    for pk in at_drop:                    # after DNAT: the same frame but dst, dport, checksums
        data = pk[2]
        twins = [w for w in wire if len(w) == len(data) and w[:14] == data[:14]
                 and w[18:20] == data[18:20]]       # Ethernet header, IP id
        assert twins, data.hex()
        w = twins[0]
        keep = lambda b: b[:24] + b[26:30] + b[34:36] + b[38:50] + b[52:]
        assert keep(w) == keep(data)
        assert data[30:34] != w[30:34] and data[36:38] == (8080).to_bytes(2, "big")
    assert all(ifaces[pk[0]][1][2] == [b"npt-node1/eth1"] for pk, _ in real)

    r = subprocess.run(["tshark", "-r", str(pcap), "-Y", 'frame.comment contains "rp_filter"',
                        "-T", "fields", "-e", "frame.number"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    picked = [int(x) for x in r.stdout.split()]
    want = [i + 1 for i, c in enumerate(comments) if "rp_filter" in c]
    assert picked == want and len(picked) >= len(at_tc) + len(at_drop)

    # the session kept the packet bytes: replay -w gives the live file's packets again
    again = tmp_path / "replayed.pcapng"
    r = subprocess.run([sys.executable, "-m", "nptrace.cli", "replay", str(tmp_path / "rec"),
                        "-w", str(again)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    _ifaces2, replayed = read_pcapng(again)
    assert [pk[2] for pk in replayed if "as the kernel had them" in pk[3][1][0].decode()] == \
        [pk[2] for pk, _c in real]
