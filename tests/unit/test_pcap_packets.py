"""-w with real packet bytes: the packet-bytes record (bpf/npt_packet.h, events.Packet) and the
pcapng sink that pairs it with its event; rotation (-C/-W), SIGHUP reopen, ENOSPC, --snaplen."""
import errno
import socket
import struct

import pytest
from click.testing import CliRunner

from nptrace import events as ev
from nptrace.classify import classify
from nptrace.config import Config
from nptrace.kernel.cflags import build_cflags
from nptrace.kernel.ringbuf import walk
from nptrace.sinks import pcapng

from test_pcapng import CTX, E0, read_pcapng

ETH = bytes.fromhex("527e23898307" "3698da609b4a" "0800")
SYN = bytes.fromhex("4500003c2be640003f0683aec0a80a64ac10150b83357580b055abe8000000"
                    "00a002faf08c5600000204") + bytes(18)


def drop_and_packet(ts=1_000, skb=0xffff888000001000, link=ev.PL_ETHERNET, data=ETH + SYN,
                    dir=ev.PD_INBOUND):
    raw = ev.encode(ts_ns=ts, skb=skb, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16,
                    ifindex=3, saddr="192.168.10.100", sport=33589, daddr="172.16.21.11",
                    dport=30080, l4proto=6, tcpflags=ev.TCP_SYN)
    pkt = ev.encode_packet(data, ts_ns=ts, skb=skb, ifindex=3, ev_type=ev.EvType.DROP,
                           hook=ev.Hook.KFREE_SKB, link=link, dir=dir, orig_len=len(data) + 20)
    return raw, pkt


def test_packet_record_round_trip_and_split():
    raw, pkt = drop_and_packet()
    assert ev.is_packet(pkt) and not ev.is_packet(raw)
    p = ev.decode_packet(pkt)
    assert (p.ts_ns, p.ifindex, p.link, p.dir, p.data) == (1_000, 3, ev.PL_ETHERNET,
                                                            ev.PD_INBOUND, ETH + SYN)
    assert p.orig_len == len(ETH + SYN) + 20
    records, packets = ev.split_packets([raw, pkt, raw])
    assert records == [raw, raw] and packets == [p]
    same = [raw, raw]
    assert ev.split_packets(same)[0] is same        # no packet records: the batch itself
    with pytest.raises(ev.DecodeError):
        ev.decode_packet(pkt[:-1])                   # cap_len says more than the record has


def test_ring_walk_raw_returns_records_of_any_length():
    """The live ring holds events and packet records of other lengths back to back."""
    raw, pkt = drop_and_packet()
    area = bytearray(8192)
    off = 0
    for rec in (raw, pkt, raw):
        struct.pack_into("<II", area, off, len(rec), 0)
        area[off + 8:off + 8 + len(rec)] = rec
        off += (len(rec) + 8 + 7) & ~7
    mv = memoryview(bytes(area) * 2)
    out = []
    assert walk(mv, 0, off, 8191, ev.RECORD, out, 100, raw=True) == off
    assert out == [raw, pkt, raw]


def _sink_with(tmp_path, packets, **kw):
    sink = pcapng.PcapngSink(tmp_path / "out.pcapng", E0, node="node-a", **kw)
    for p in packets:
        sink.on_packet(ev.decode_packet(p))
    return sink


def test_real_bytes_direction_and_comment(tmp_path):
    raw, pkt = drop_and_packet()
    sink = _sink_with(tmp_path, [pkt])
    (v,) = classify([ev.decode(raw)], CTX)
    sink.write(v)
    sink.close()
    ifaces, packets = read_pcapng(tmp_path / "out.pcapng")
    (idx, ts, data, opts), = packets
    assert data == ETH + SYN and ts == E0 + 1_000
    assert opts[pcapng.EPB_FLAGS] == [struct.pack("<I", 1)]           # inbound
    c = opts[pcapng.OPT_COMMENT][0].decode()
    assert c.startswith("nptrace: rp_filter (drop)") and "hint: " in c
    assert "as the kernel had them at this hook" in c and "reconstructed" not in c
    assert ifaces[idx][1][pcapng.IF_NAME] == [b"npt-node1/eth1"]
    shb = (tmp_path / "out.pcapng").read_bytes()
    assert b"node: node-a" in shb[:200]


def test_ip_only_capture_gets_a_zero_ethernet_header_said_in_the_comment(tmp_path):
    raw, pkt = drop_and_packet(link=ev.PL_IP, data=SYN, dir=ev.PD_UNKNOWN)
    sink = _sink_with(tmp_path, [pkt])
    (v,) = classify([ev.decode(raw)], CTX)
    sink.write(v)
    sink.close()
    (_, _, data, opts), = read_pcapng(tmp_path / "out.pcapng")[1]
    assert data == bytes(12) + b"\x08\x00" + SYN
    assert pcapng.EPB_FLAGS not in opts
    assert "no link-layer header" in opts[pcapng.OPT_COMMENT][0].decode()


def test_an_event_without_bytes_stays_reconstructed_and_says_so(tmp_path):
    raw, _pkt = drop_and_packet()
    sink = _sink_with(tmp_path, [])
    (v,) = classify([ev.decode(raw)], CTX)
    sink.write(v)
    sink.close()
    (_, _, data, opts), = read_pcapng(tmp_path / "out.pcapng")[1]
    assert data[:12] == bytes(12)
    assert "reconstructed" in opts[pcapng.OPT_COMMENT][0].decode()


def test_rotation_like_tcpdump_C_and_W(tmp_path):
    sink = pcapng.PcapngSink(tmp_path / "r.pcapng", E0, max_file_bytes=1, max_files=3)
    for i in range(4):
        raw, pkt = drop_and_packet(ts=1_000 + i)
        sink.on_packet(ev.decode_packet(pkt))
        (v,) = classify([ev.decode(raw)], CTX)
        sink.write(v)
    sink.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["r.pcapng0", "r.pcapng1", "r.pcapng2"]
    for n in names:                      # every file is a whole pcapng with its interfaces
        ifaces, packets = read_pcapng(tmp_path / n)
        assert len(ifaces) <= 1 and all(p[0] < len(ifaces) for p in packets)
    plain = pcapng.PcapngSink(tmp_path / "p.pcapng", E0, max_file_bytes=1)
    assert [plain._name(i) for i in range(3)] == [str(tmp_path / "p.pcapng"),
                                                  str(tmp_path / "p.pcapng1"),
                                                  str(tmp_path / "p.pcapng2")]
    plain.close()


def test_sighup_reopen_starts_the_file_again(tmp_path):
    f = tmp_path / "out.pcapng"
    raw, pkt = drop_and_packet()
    sink = _sink_with(tmp_path, [pkt])
    (v,) = classify([ev.decode(raw)], CTX)
    sink.write(v)
    f.rename(tmp_path / "out.pcapng.1")       # logrotate
    sink.reopen()
    sink.write(v)
    sink.close()
    assert len(read_pcapng(f)[1]) == 1 and len(read_pcapng(tmp_path / "out.pcapng.1")[1]) == 1


def test_disk_full_is_one_line(tmp_path):
    raw, _ = drop_and_packet()
    sink = _sink_with(tmp_path, [])
    (v,) = classify([ev.decode(raw)], CTX)

    class Full:
        closed = False

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            self.closed = True
    sink.f = Full()
    from nptrace.errors import NptraceError
    with pytest.raises(NptraceError, match="file system is full") as e:
        sink.write(v)
    assert "\n" not in str(e.value)


def test_snaplen_is_a_cflag_only_with_pcap():
    assert "-DNPT_SNAPLEN=0" in build_cflags(Config())
    assert "-DNPT_SNAPLEN=128" in build_cflags(Config(snaplen=128))


@pytest.mark.parametrize("args,msg", [
    (["-w", "x.pcapng", "--snaplen", "0"], "bad --snaplen 0"),
    (["-w", "x.pcapng", "--snaplen", "100000"], "bad --snaplen 100000"),
    (["-C", "5"], "-C and -W rotate the -w FILE"),
    (["-w", "x.pcapng", "-W", "3"], "-W N needs -C MB"),
])
def test_bad_pcap_options_are_one_line_exit_2(args, msg):
    from nptrace.cli import main_group
    r = CliRunner().invoke(main_group, ["run", *args])
    assert r.exit_code == 2, r.output
    assert msg in r.output and "Traceback" not in r.output


def test_dump_bpf_prints_runs_cflags_without_btf(monkeypatch):
    """dump-bpf takes run's options and prints what run compiles, also where the kernel BTF is
    not readable (no root): then the offsets are left out and it says so."""
    from nptrace.cli import main_group
    from nptrace.kernel import btf

    def no_btf():
        raise btf.BtfError("/sys/kernel/btf/vmlinux: cannot read BTF: Permission denied")
    monkeypatch.setattr(btf, "default", no_btf)
    r = CliRunner().invoke(main_group, ["dump-bpf", "--max-rate", "50", "--max-burst", "10",
                                        "-i", "eth0", "-w", "x.pcapng", "--snaplen", "96"])
    assert r.exit_code == 0, r.output
    flags = next(l for l in r.output.splitlines() if l.startswith("/* cflags: ")).split()
    import os
    cpus = os.cpu_count() or 1
    assert f"-DNPT_MAX_RATE={-(-50 // cpus)}" in flags
    assert f"-DNPT_MAX_BURST={-(-10 // cpus)}" in flags
    assert "-DNPT_SNAPLEN=96" in flags and "-DNPT_WITH_TC=1" in flags
    assert "-DNPT_WAKE_EVERY=256" in flags and any(f.startswith("-DNPT_TC_KSKB=") for f in flags)
    assert "kernel BTF not readable" in r.output and "Traceback" not in r.output
    assert "TRACEPOINT_PROBE(skb, kfree_skb)" in r.output
    assert "-DNPT_FILTER_SVC=0" in flags
    r = CliRunner().invoke(main_group, ["dump-bpf", "--service", "default/web", "--record", "d"])
    flags = next(l for l in r.output.splitlines() if l.startswith("/* cflags: ")).split()
    # as run compiles; --snaplen headers (the default) copies HEADERS_SNAPLEN, cut per packet
    from nptrace.config import HEADERS_SNAPLEN
    assert "-DNPT_FILTER_SVC=1" in flags and f"-DNPT_SNAPLEN={HEADERS_SNAPLEN}" in flags
    assert "npt_svc_wanted" in r.output


def test_evidence_times_are_on_the_lines_clock():
    """JSON evidence carries `ts` (epoch seconds, as the line's `ts`) beside the kernel's
    monotonic `ts_ns`; the fast line and the dict agree."""
    import json

    from nptrace.sinks.jsonl import verdict_dict, verdict_line
    raw, _ = drop_and_packet(ts=2_000_000_000)
    (v,) = classify([ev.decode(raw)], CTX)
    d = json.loads(verdict_line(v, E0))
    assert d == json.loads(json.dumps(verdict_dict(v, E0)))
    (x,) = d["evidence"]
    assert x["ts_ns"] == 2_000_000_000 and x["ts"] == d["ts"] == (E0 + 2_000_000_000) / 1e9


def _session(d, fmt=None, packets=True):
    from nptrace.reasons import ReasonTable
    from nptrace.sessions import format as S
    from nptrace.sinks.recorder import Recorder
    h = S.make_header(epoch_offset_ns=E0, node="node-a",
                      drops=ReasonTable({16: "SKB_DROP_REASON_IP_RPFILTER"}, "SKB_DROP_REASON_"))
    if fmt is not None:
        h["format_version"] = fmt
    rec = Recorder(S.SessionWriter(d, header=h, log=lambda _m: None))
    raw, pkt = drop_and_packet()
    rec.on_raw(raw)
    if packets:
        rec.on_packet_raw(pkt)
    rec.close()


def test_session_keeps_the_packet_bytes_for_replay_w(tmp_path):
    """run -w/--record records each packet-bytes record (format 2); replay -w writes the
    real bytes, as the live -w did."""
    from nptrace.sessions import format as S
    from nptrace.sessions.commands import replay_command
    _session(tmp_path / "rec")
    headers, recs, problems = S.read_session(tmp_path / "rec")
    assert headers[0]["format_version"] == S.FORMAT_VERSION == 2 and not problems
    assert [r.kind for r in recs] == ["event", "packet"]
    out = tmp_path / "r.pcapng"
    r = CliRunner().invoke(replay_command, [str(tmp_path / "rec"), "-w", str(out)])
    assert r.exit_code == 0, r.output
    _ifaces, packets = read_pcapng(out)
    (idx, ts, data, opts), = packets
    assert data == ETH + SYN and ts == E0 + 1_000
    assert opts[pcapng.EPB_FLAGS] == [struct.pack("<I", 1)]           # inbound, as recorded
    assert b"as the kernel had them at this hook" in opts[pcapng.OPT_COMMENT][0]


def test_format_1_sessions_still_read_and_replay_w_reconstructs(tmp_path):
    from nptrace.sessions.commands import replay_command
    _session(tmp_path / "old", fmt=1, packets=False)
    out = tmp_path / "r.pcapng"
    r = CliRunner().invoke(replay_command, [str(tmp_path / "old"), "-w", str(out)])
    assert r.exit_code == 0 and "rp_filter" in r.stdout, r.output
    (_i, _t, data, opts), = read_pcapng(out)[1]
    assert data != ETH + SYN and pcapng.RECONSTRUCTED.encode() in opts[pcapng.OPT_COMMENT][0]


def tracer_taking_packets(cfg: Config):
    """A Tracer with what _take_packets uses: cfg, a session recorder and a pcap sink that
    keep what they are handed (the raw records, the decoded packets)."""
    from nptrace.daemon.tracer import Tracer
    got, seen = [], []

    class Rec:
        def on_packet_raw(self, b):
            got.append(b)

    class Pcap:
        def on_packet(self, p):
            seen.append(p)
    t = Tracer.__new__(Tracer)
    t.cfg = cfg
    t.recorders, t.sinks = [Rec()], [Pcap()]
    return t, got, seen


def test_the_tracer_hands_packet_records_to_the_session_too():
    t, got, seen = tracer_taking_packets(Config(snaplen=128))
    raw, pkt = drop_and_packet()
    assert t._take_packets([raw, pkt]) == [raw]
    assert got == [pkt] and [p.data for p in seen] == [ETH + SYN]


def test_record_takes_packet_bytes_too():
    from nptrace.cli import pcap_snaplen
    from nptrace.config import HEADERS_SNAPLEN
    assert pcap_snaplen(None, 128, None, None) == 0
    assert pcap_snaplen(None, 96, None, None, record="/var/lib/nptrace") == 96
    assert pcap_snaplen("x.pcapng", 128, None, None) == 128
    assert pcap_snaplen(None, "headers", None, None, record="d") == HEADERS_SNAPLEN
    assert pcap_snaplen(None, "headers", None, None) == 0
