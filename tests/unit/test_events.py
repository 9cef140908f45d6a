"""Decoding from byte fixtures (no bcc, no root)."""
import re
from pathlib import Path

import pytest

from nptrace import events as ev


def test_round_trip_v4_with_conntrack():
    raw = ev.encode(ts_ns=123, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, ifindex=7,
                    netns=4026531840, reason=16, saddr="192.0.2.10", sport=40000,
                    daddr="10.0.0.2", dport=30080, l4proto=6, tcpflags=ev.TCP_SYN,
                    flags=ev.F_HAS_CT, ct_osrc="192.0.2.10", ct_osport=40000,
                    ct_odst="10.0.0.2", ct_odport=30080, ct_rsrc="10.244.1.5", ct_rsport=8080,
                    ct_rdst="192.0.2.10", ct_rdport=40000,
                    ct_status=ev.IPS_DST_NAT | ev.IPS_DST_NAT_DONE)
    e = ev.decode(raw + b"\0" * 8)        # padded like a perf sample
    assert e.type is ev.EvType.DROP and e.hook is ev.Hook.KFREE_SKB
    assert e.flow == ("192.0.2.10", 40000, "10.0.0.2", 30080)
    assert e.ct.dnat and not e.ct.snat
    assert (e.ct.reply_src, e.ct.reply_sport) == ("10.244.1.5", 8080)
    assert e.raw == raw


def test_ipv6_addresses():
    raw = ev.encode(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, family=10,
                    saddr="2001:db8::1", daddr="2001:db8::2", sport=80, dport=5555)
    e = ev.decode(raw)
    assert (e.saddr, e.daddr) == ("2001:db8::1", "2001:db8::2")


def test_icmp_quote_outer_addresses():
    raw = ev.encode(type=ev.EvType.ICMP_UNREACH, hook=ev.Hook.ICMP_SEND, flags=ev.F_ICMP_QUOTE,
                    saddr="192.0.2.10", daddr="10.96.0.5", sport=1234, dport=80,
                    outer_saddr="10.0.0.1", outer_daddr="192.0.2.10", reason=3 << 8 | 3)
    e = ev.decode(raw)
    assert e.outer_saddr == "10.0.0.1" and e.flow[2:] == ("10.96.0.5", 80)


def test_short_record_is_an_error():
    with pytest.raises(ev.DecodeError, match="need"):
        ev.decode(b"\0" * 10)


def test_a_view_of_wider_items_is_read_as_its_bytes():
    """A memoryview's len() and slices count items: a view of array('I') of a record's bytes
    decodes as those bytes, and one too short is a DecodeError, never struct.error."""
    import array
    raw = ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, saddr="192.0.2.1")
    raw += bytes(-len(raw) % 4)
    wide = memoryview(array.array("I", raw))
    assert ev.decode(wide).saddr == "192.0.2.1"
    assert ev.decode(memoryview(raw).cast("B", (len(raw) // 4, 4))).saddr == "192.0.2.1"
    try:     # not contiguous: copied out; what it holds is no record, but said as one
        ev.decode(memoryview(array.array("I", raw * 2))[::2])
    except ev.DecodeError:
        pass
    got, bad = ev.decode_many([wide, memoryview(array.array("I", raw[:ev.SIZE // 2]))])
    assert [e.saddr for e in got] == ["192.0.2.1"] and bad == 1
    with pytest.raises(ev.DecodeError, match="need"):
        ev.decode(memoryview(array.array("I", raw[:40])))


def test_wrong_abi_is_an_error():
    raw = bytearray(ev.encode(type=1, hook=1))
    raw[22:24] = (99).to_bytes(2, "little")
    with pytest.raises(ev.DecodeError, match="ABI 99"):
        ev.decode(bytes(raw))


def test_unknown_type_is_an_error():
    with pytest.raises(ev.DecodeError):
        ev.decode(ev.encode(type=200, hook=1))


def test_event_is_immutable_and_compares_by_value():
    raw = ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, saddr="192.0.2.1")
    a, b = ev.decode(raw), ev.decode(bytearray(raw))
    assert a == b and a.saddr == "192.0.2.1" and a.dir is ev.Dir.UNKNOWN
    with pytest.raises(AttributeError):
        a.saddr = "x"


def test_address_cache_stays_bounded():
    for i in range(ev._ADDRS_MAX + 10):
        e = ev.decode(ev.encode(type=1, hook=1, saddr=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"))
    assert e.saddr == f"10.0.{(i >> 8) & 255}.{i & 255}"
    assert len(ev._ADDRS) <= ev._ADDRS_MAX


def test_unknown_hook_or_direction_is_an_error():
    with pytest.raises(ev.DecodeError, match="Hook"):
        ev.decode(ev.encode(type=1, hook=99))
    with pytest.raises(ev.DecodeError, match="Dir"):
        ev.decode(ev.encode(type=1, hook=1, dir=9))


HEADER = Path(__file__).resolve().parents[2] / "bpf" / "nptrace_events.h"
# a #define's value as the header writes flags: 0x10, 16, (1 << 5)
_FLAG = re.compile(r"^#define NPT_((?:F|IPS)_\w+)\s+(0x[0-9a-fA-F]+|\d+|\(1 << \d+\))", re.M)


def _header_flags() -> dict[str, int]:
    out = {}
    for name, val in _FLAG.findall(HEADER.read_text()):
        shift = re.fullmatch(r"\(1 << (\d+)\)", val)
        out[name] = 1 << int(shift.group(1)) if shift else int(val, 0)
    return out


def test_flag_constants_match_header():
    """F_* (record flags) and IPS_* (conntrack status bits) have one home, the header."""
    header = _header_flags()
    mirror = {n: getattr(ev, n) for n in dir(ev) if re.fullmatch(r"(F|IPS)_[A-Z_]+", n)}
    assert header and header == mirror


def test_aux_fields_read_by_name_per_type():
    def E(**kw):
        return ev.decode(ev.encode(hook=ev.Hook.TC_EGRESS, **kw))
    rst = ev.decode(ev.encode(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, aux=ev.TCP_SYN,
                              tcpflags=ev.TCP_RST))
    assert rst.answered_flags == ev.TCP_SYN
    drop = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, tcpflags=ev.TCP_ACK))
    assert drop.answered_flags == ev.TCP_ACK and drop.in_ifindex == 0
    asym = E(type=ev.EvType.ASYM_IFACE, aux=3, aux2=4)
    assert (asym.in_ifindex, asym.in_ifindex2, asym.syn_dport) == (3, 4, 0)
    src = E(type=ev.EvType.ASYM_SRC, aux=3, aux2=30080)
    assert (src.in_ifindex, src.in_ifindex2, src.syn_dport) == (3, 0, 30080)
    retx = E(type=ev.EvType.SYN_RETX, aux=2, aux2=5)
    assert (retx.syn_copies, retx.in_ifindex) == (2, 5)
    view = ev.decode(ev.encode(type=ev.EvType.NF_VIEW, hook=ev.Hook.NF_HOOK, aux=2 << 24 | 1 << 16))
    assert view.nf_hook_point == 2 << 24 | 1 << 16 and view.kfunc == 0
    kp = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KPROBE, aux=ev.KFunc.NF_SEND_RESET,
                             aux2=1))
    assert (kp.kfunc, kp.kfunc_arg) == (ev.KFunc.NF_SEND_RESET, 1)
