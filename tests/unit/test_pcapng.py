"""--pcap: pcapng written from scratch; tcpdump reads it back; comments carry the label."""
import shutil
import socket
import stat
import struct
import subprocess

import pytest

from nptrace import events as ev
from nptrace.classify import Context, classify
from nptrace.sinks import pcapng

E0 = 1_700_000_000 * 10**9
CTX = Context(drop_name=lambda v: {16: "IP_RPFILTER"}.get(v, f"REASON_{v}"),
              rst_name=lambda v: {1: "NO_SOCKET"}.get(v, f"REASON_{v}"),
              iface_name=lambda ns, i: {3: "npt-node1/eth1", 5: "eth0"}.get(i))


def verdicts():
    raws = [
        ev.encode(ts_ns=1_000, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16, ifindex=3,
                  saddr="192.168.2.10", sport=5000, daddr="10.0.0.2", dport=30080, l4proto=6,
                  tcpflags=ev.TCP_SYN, seq=123456789),
        ev.encode(ts_ns=2_500, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1,
                  ifindex=5, saddr="10.244.1.5", sport=8080, daddr="192.0.2.10", dport=40000,
                  l4proto=6, tcpflags=ev.TCP_RST | ev.TCP_ACK, seq=0, ack_seq=987654321,
                  aux=ev.TCP_SYN),
        ev.encode(ts_ns=3_000, type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST, ifindex=5,
                  family=socket.AF_INET6, saddr="fd00::1", sport=443, daddr="fd00::2",
                  dport=5555, l4proto=6, tcpflags=ev.TCP_RST, seq=42),
    ]
    return list(classify([ev.decode(r) for r in raws], CTX))


def read_pcapng(path):
    """Minimal reader: (interfaces [(linktype, options)], packets [(iface, ts, data, opts)])."""
    data = open(path, "rb").read()
    ifaces, packets, off = [], [], 0
    assert struct.unpack_from("<I", data, 0)[0] == pcapng.SHB
    assert struct.unpack_from("<I", data, 8)[0] == 0x1A2B3C4D

    def opts(buf, o, end):
        out = {}
        while o + 4 <= end:
            code, n = struct.unpack_from("<HH", buf, o)
            if code == 0:
                break
            out.setdefault(code, []).append(buf[o + 4:o + 4 + n])
            o += 4 + n + (-n % 4)
        return out
    while off < len(data):
        btype, blen = struct.unpack_from("<II", data, off)
        assert blen % 4 == 0 and struct.unpack_from("<I", data, off + blen - 4)[0] == blen
        end = off + blen - 4
        if btype == pcapng.IDB:
            link = struct.unpack_from("<H", data, off + 8)[0]
            ifaces.append((link, opts(data, off + 16, end)))
        elif btype == pcapng.EPB:
            idx, hi, lo, cap, orig = struct.unpack_from("<IIIII", data, off + 8)
            pkt = data[off + 28: off + 28 + cap]
            packets.append((idx, (hi << 32) | lo, pkt, opts(data, off + 28 + cap + (-cap % 4), end)))
        off += blen
    return ifaces, packets


def checksum_ok(data):
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s == 0xFFFF


def test_reconstructed_ipv4_tcp_has_valid_checksums():
    v = verdicts()[0]
    p = pcapng.build_packet(v.event)
    assert len(p) == 40 and p[0] == 0x45 and p[9] == 6
    assert checksum_ok(p[:20])
    pseudo = p[12:20] + struct.pack("!BBH", 0, 6, 20)
    assert checksum_ok(pseudo + p[20:])
    sport, dport, seq, _ack, _off, flags = struct.unpack_from("!HHIIBB", p, 20)
    assert (sport, dport, seq, flags) == (5000, 30080, 123456789, ev.TCP_SYN)


def test_reconstructed_ipv6_tcp_has_valid_checksum():
    v = verdicts()[2]
    p = pcapng.build_packet(v.event)
    assert len(p) == 60 and p[0] >> 4 == 6 and p[6] == 6
    pseudo = p[8:40] + struct.pack("!I3xB", 20, 6)
    assert checksum_ok(pseudo + p[40:])


def test_udp_when_the_event_says_udp():
    e = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, saddr="10.0.0.1",
                            daddr="10.0.0.2", sport=53, dport=5353, l4proto=17))
    p = pcapng.build_packet(e)
    assert len(p) == 28 and p[9] == 17
    assert checksum_ok(p[12:20] + struct.pack("!BBH", 0, 17, 8) + p[20:])


def test_file_reads_back_with_interfaces_times_and_comments(tmp_path):
    f = tmp_path / "out.pcapng"
    sink = pcapng.PcapngSink(f, E0)
    vs = verdicts()
    for v in vs:
        sink.write(v)
    sink.close()
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    ifaces, packets = read_pcapng(f)
    names = [o[pcapng.IF_NAME][0].decode() for _, o in ifaces]
    assert names == ["npt-node1/eth1", "eth0"]
    assert all(link == pcapng.LINKTYPE_ETHERNET and o[pcapng.IF_TSRESOL] == [b"\x09"] for link, o in ifaces)
    assert [p[0] for p in packets] == [0, 1, 1]
    assert [p[1] for p in packets] == [E0 + 1_000, E0 + 2_500, E0 + 3_000]
    comments = [p[3][pcapng.OPT_COMMENT][0].decode() for p in packets]
    assert comments[0].startswith("nptrace: rp_filter (drop)")
    assert f"hint: {vs[0].hint}" in comments[0] and "evidence: skb:kfree_skb IP_RPFILTER" in comments[0]
    assert "no_listener (rst/sent)" in comments[1]
    assert all("reconstructed" in c for c in comments)


@pytest.mark.skipif(shutil.which("tcpdump") is None, reason="tcpdump not installed (scripts/setup.sh installs it)")
def test_tcpdump_reads_tuples_and_flags(tmp_path):
    f = tmp_path / "out.pcapng"
    sink = pcapng.PcapngSink(f, E0)
    for v in verdicts():
        sink.write(v)
    sink.close()
    r = subprocess.run(["tcpdump", "-r", str(f), "-nn", "-vv", "-tt", "--time-stamp-precision=nano"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if " > " in x]
    out = r.stdout
    assert "192.168.2.10.5000 > 10.0.0.2.30080: Flags [S]" in out
    assert "seq 123456789" in out
    assert "10.244.1.5.8080 > 192.0.2.10.40000: Flags [R.]" in out
    assert "ack 987654321" in out
    assert "fd00::1.443 > fd00::2.5555: Flags [R]" in out
    assert "incorrect" not in out and "bad cksum" not in out
    assert out.count("(correct)") == 3     # TCP checksums; a bad IPv4 one would say "bad cksum"
    assert out.splitlines()[0].startswith(f"{E0 // 10**9}.000001000 ")   # ns kept
    assert len(lines) >= 3


def test_unwritable_path_is_one_clear_error(tmp_path):
    from nptrace.errors import NptraceError
    with pytest.raises(NptraceError, match="cannot write --pcap"):
        pcapng.PcapngSink(tmp_path / "no" / "such" / "dir.pcapng", 0)
