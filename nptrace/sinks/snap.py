"""`--snaplen headers` (the default): the packet bytes -w and --record keep stop where the
packet's headers end, so no payload is written to files that are kept for days.

The kernel copies the first HEADERS_SNAPLEN bytes of the packet behind an event
(bpf/npt_packet.h, config.HEADERS_SNAPLEN: the longest Ethernet + VLAN + IP + TCP header this
reads); headers_only() then cuts each packet-bytes record where its headers end, before the
pcapng sink or the session recorder sees it (daemon/tracer.py _take_packets):

  Ethernet (14) and up to two 802.1Q/802.1ad tags (4 each)
  IPv4 (IHL words) or IPv6 (40) and its extension headers (hop-by-hop, routing, fragment,
    destination options, AH)
  TCP (data offset words), UDP (8), ICMP and ICMPv6 (8); other protocols: the IP header only;
    a fragment that is not the first: the IP header only (it holds no L4 header)

An EtherType other than IPv4/IPv6 keeps its Ethernet header alone. A packet whose headers run
past the copy keeps the copy (header bytes only). The original length stays the packet's, so
Wireshark shows the packet as cut to its headers ("Packet size limited during capture").
Encapsulated traffic (VXLAN, Geneve, IPIP seen on the underlay NIC) keeps its outer headers
only; `--snaplen N` keeps the first N bytes, payload included, for every packet.
"""
from __future__ import annotations

from nptrace import events as ev

__all__ = ["header_len", "headers_only"]

_VLAN = (0x8100, 0x88A8)
_IPV4, _IPV6 = 0x0800, 0x86DD
_V6_EXT = {0, 43, 44, 51, 60}       # hop-by-hop, routing, fragment, AH, destination options
_L4_FIXED = {17: 8, 1: 8, 58: 8}    # UDP, ICMP, ICMPv6
_TCP = 6


def header_len(link: int, data: bytes) -> int:
    """How many of data's first bytes are headers (L2, L3, L4), at most len(data)."""
    n = len(data)
    off = 0
    if link == ev.PL_ETHERNET:
        if n < 14:
            return n
        etype = int.from_bytes(data[12:14], "big")
        off = 14
        for _ in range(2):
            if etype not in _VLAN or n < off + 4:
                break
            etype = int.from_bytes(data[off + 2:off + 4], "big")
            off += 4
        if etype == _IPV4:
            version = 4
        elif etype == _IPV6:
            version = 6
        else:
            return min(off, n)
    else:
        if n < 1:
            return n
        version = data[0] >> 4
    end = _l3_l4(data, off, version)
    return min(end, n)


def _l3_l4(data: bytes, off: int, version: int) -> int:
    n = len(data)
    if version == 4:
        if n < off + 20:
            return n
        ihl = (data[off] & 0x0F) * 4
        if ihl < 20:
            return off            # not an IPv4 header this reads: the link header alone
        proto = data[off + 9]
        l4 = off + ihl
        if ((data[off + 6] & 0x1F) << 8) | data[off + 7]:
            return l4             # a later fragment: no L4 header in it
    elif version == 6:
        if n < off + 40:
            return n
        proto = data[off + 6]
        l4 = off + 40
        for _ in range(8):
            if proto not in _V6_EXT:
                break
            if n < l4 + 8:
                return n
            if proto == 44:       # fragment header: 8 bytes; a later fragment has no L4
                if int.from_bytes(data[l4 + 2:l4 + 4], "big") & 0xFFF8:
                    return l4 + 8
                size = 8
            elif proto == 51:     # AH: length in 4-byte words, minus 2
                size = (data[l4 + 1] + 2) * 4
            else:
                size = (data[l4 + 1] + 1) * 8
            proto = data[l4]
            l4 += size
    else:
        return off
    if proto == _TCP:
        if n < l4 + 13:
            return n
        return l4 + max(20, (data[l4 + 12] >> 4) * 4)
    return l4 + _L4_FIXED.get(proto, 0)


def headers_only(raw: bytes) -> bytes:
    """A packet-bytes record (events.is_packet) cut where its packet's headers end; the
    record as it is when there is nothing to cut or it does not decode (it is then counted
    where events are decoded)."""
    try:
        p = ev.decode_packet(raw)
    except ev.DecodeError:
        return raw
    keep = header_len(p.link, p.data)
    if keep >= len(p.data):
        return raw
    return ev.encode_packet(p.data[:keep], ts_ns=p.ts_ns, skb=p.skb, ifindex=p.ifindex,
                            ev_type=p.ev_type, hook=p.hook, link=p.link, dir=p.dir,
                            orig_len=p.orig_len)
