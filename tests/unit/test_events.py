"""Decoding from byte fixtures (no bcc, no root)."""
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
