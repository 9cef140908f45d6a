"""--snaplen headers, the default: the packet bytes -w and --record keep stop where the packet's
Ethernet, IP and TCP/UDP/ICMP headers end (sinks/snap.py), so no payload reaches a file; the
kernel copies HEADERS_SNAPLEN; --snaplen N keeps N bytes as before."""
import struct

import pytest

from nptrace import events as ev
from nptrace.cli import run_config
from nptrace.config import HEADERS_SNAPLEN, Config
from nptrace.sinks.snap import header_len, headers_only

from test_pcap_packets import tracer_taking_packets

PAYLOAD = b"GET /secret?token=abc HTTP/1.1\r\n" * 3


def eth(etype: int, vlans=()) -> bytes:
    out = bytes.fromhex("527e23898307" "3698da609b4a")
    for tpid, tci in vlans:
        out += struct.pack(">HH", tpid, tci)
    return out + struct.pack(">H", etype)


def ipv4(proto: int, body: bytes, options: bytes = b"", frag: int = 0) -> bytes:
    ihl = (20 + len(options)) // 4
    hdr = struct.pack(">BBHHHBBH4s4s", 0x40 | ihl, 0, 20 + len(options) + len(body), 1, frag,
                      64, proto, 0, bytes([192, 168, 10, 100]), bytes([172, 16, 21, 11]))
    return hdr + options + body


def ipv6(nh: int, body: bytes) -> bytes:
    return struct.pack(">IHBB16s16s", 6 << 28, len(body), nh, 64, bytes(15) + b"\1",
                       bytes(15) + b"\2") + body


def tcp(options: bytes = b"", flags: int = 0x18) -> bytes:
    doff = (20 + len(options)) // 4
    return struct.pack(">HHIIBBHHH", 33589, 30080, 1, 2, doff << 4, flags, 64240, 0, 0) + options


TS_OPTS = bytes.fromhex("0101080a0000000100000002")           # NOP NOP timestamps: 12 bytes
SYN_OPTS = bytes.fromhex("020405b40402080a000000010000000001030307")   # 20 bytes


@pytest.mark.parametrize("name,link,packet,want", [
    ("tcp data", ev.PL_ETHERNET, eth(0x0800) + ipv4(6, tcp(TS_OPTS) + PAYLOAD), 14 + 20 + 32),
    ("tcp syn, no payload", ev.PL_ETHERNET, eth(0x0800) + ipv4(6, tcp(SYN_OPTS, 0x02)),
     14 + 20 + 40),
    ("ip options", ev.PL_ETHERNET, eth(0x0800) + ipv4(6, tcp() + PAYLOAD, options=bytes(8)),
     14 + 28 + 20),
    ("802.1Q + 802.1ad", ev.PL_ETHERNET,
     eth(0x0800, [(0x88A8, 10), (0x8100, 20)]) + ipv4(6, tcp() + PAYLOAD), 22 + 20 + 20),
    ("udp", ev.PL_ETHERNET, eth(0x0800) + ipv4(17, bytes(8) + PAYLOAD), 14 + 20 + 8),
    ("icmp", ev.PL_ETHERNET, eth(0x0800) + ipv4(1, bytes([3, 3]) + bytes(6) + PAYLOAD), 14 + 28),
    ("other protocol: IP header only", ev.PL_ETHERNET, eth(0x0800) + ipv4(47, PAYLOAD), 34),
    ("later fragment: IP header only", ev.PL_ETHERNET,
     eth(0x0800) + ipv4(6, PAYLOAD, frag=0x2000 | 185), 34),
    ("no link header", ev.PL_IP, ipv4(6, tcp(TS_OPTS) + PAYLOAD), 20 + 32),
    ("ipv6 tcp", ev.PL_ETHERNET, eth(0x86DD) + ipv6(6, tcp(TS_OPTS) + PAYLOAD), 14 + 40 + 32),
    ("ipv6 hop-by-hop then tcp", ev.PL_ETHERNET,
     eth(0x86DD) + ipv6(0, bytes([6, 0]) + bytes(6) + tcp() + PAYLOAD), 14 + 40 + 8 + 20),
    ("ipv6 later fragment", ev.PL_ETHERNET,
     eth(0x86DD) + ipv6(44, bytes([6, 0]) + struct.pack(">HI", 185 << 3, 7) + PAYLOAD),
     14 + 40 + 8),
    ("ipv6 no link header", ev.PL_IP, ipv6(58, bytes(8) + PAYLOAD), 40 + 8),
    ("arp: Ethernet header only", ev.PL_ETHERNET, eth(0x0806) + bytes(28), 14),
])
def test_header_len_stops_where_the_headers_end(name, link, packet, want):
    assert header_len(link, packet) == want
    assert PAYLOAD not in packet[:want] and PAYLOAD[:8] not in packet[:want]


def test_a_copy_shorter_than_the_headers_is_kept_whole():
    packet = eth(0x0800) + ipv4(6, tcp(SYN_OPTS, 0x02))
    for cut in (0, 5, 14, 20, 40, 47, len(packet) - 1):
        assert header_len(ev.PL_ETHERNET, packet[:cut]) == cut
    assert header_len(ev.PL_IP, b"") == 0
    bad = eth(0x0800) + bytes([0x41]) + bytes(40)        # IHL 1: not a header this reads
    assert header_len(ev.PL_ETHERNET, bad) == 14


def test_headers_only_cuts_the_record_and_keeps_the_original_length():
    packet = eth(0x0800) + ipv4(6, tcp(TS_OPTS) + PAYLOAD)
    raw = ev.encode_packet(packet, ts_ns=7, skb=9, ifindex=3, ev_type=ev.EvType.DROP,
                           hook=ev.Hook.KFREE_SKB, dir=ev.PD_INBOUND, orig_len=1500)
    p = ev.decode_packet(headers_only(raw))
    assert p.data == packet[:66] and p.orig_len == 1500
    assert (p.ts_ns, p.skb, p.ifindex, p.dir, p.hook) == (7, 9, 3, ev.PD_INBOUND,
                                                          ev.Hook.KFREE_SKB)
    syn = ev.encode_packet(eth(0x0800) + ipv4(6, tcp(SYN_OPTS, 0x02)))
    assert headers_only(syn) is syn                     # nothing to cut: the record itself
    assert headers_only(syn[:10]) == syn[:10]           # undecodable: left to the decoder


@pytest.mark.parametrize("snaplen,kept", [("headers", 66), (128, 128)])
def test_the_session_and_the_pcap_get_headers_only_by_default(snaplen, kept):
    cfg = run_config((), (), (), 1024, 100, 400, True, "auto", None, snaplen, None, None,
                     record="/var/lib/nptrace")
    assert cfg.snaplen == (HEADERS_SNAPLEN if snaplen == "headers" else 128)
    assert cfg.snap_headers is (snaplen == "headers")
    packet = (eth(0x0800) + ipv4(6, tcp(TS_OPTS) + PAYLOAD * 4))[:cfg.snaplen]   # the kernel's copy
    raw = ev.encode_packet(packet, ts_ns=1, orig_len=600)
    event = ev.encode(ts_ns=1, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB)
    t, got, seen = tracer_taking_packets(cfg)
    assert t._take_packets([event, raw]) == [event]
    [rec] = got
    assert ev.decode_packet(rec).data == packet[:kept] == seen[0].data
    assert (PAYLOAD[:16] in rec) is (snaplen != "headers")


def test_headers_are_the_default_and_numbers_still_work():
    from click.testing import CliRunner

    from nptrace.cli import main_group
    r = CliRunner().invoke(main_group, ["run", "--help"], terminal_width=200)
    assert "--snaplen headers|BYTES" in r.output and "default: headers]" in r.output
    assert run_config((), (), (), 1024, 100, 400, True, "auto", None, "headers", None,
                      None).snaplen == 0              # no -w, no --record: nothing copied
    assert Config().snap_headers is False
