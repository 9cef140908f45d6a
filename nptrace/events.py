"""Decoded form of `struct npt_event` (bpf/nptrace_events.h).

Two mirrors of the C layout live here: a ctypes Structure (`RawEvent`), which the layout test
compiles against the header with clang, and a `struct.Struct` (`RECORD`) built from it, which the
hot path uses because unpacking bytes is several times faster than ctypes attribute access.
Nothing here imports bcc.

`Event` is a NamedTuple, not a dataclass: a reset storm decodes every record, and building a
28-field frozen dataclass cost 2.3 us in CPython 3.11 against 0.2 us for a tuple (fields are
read at the same speed). Enum members come from dicts, not EvType(n) calls (0.25 us each), and
IPv4 address strings from a bounded cache (a storm repeats its server address in every record).
`decode_many` decodes a drained batch in one loop (the live path), the same Events as `decode`.
"""
from __future__ import annotations

import ctypes as ct
import enum
import socket
import struct
from dataclasses import dataclass
from typing import NamedTuple


ABI_VERSION = 1


class EvType(enum.IntEnum):
    DROP = 1
    RST_SENT = 2
    RST_RECV = 3
    ICMP_UNREACH = 4
    SYNACK_RETX = 5
    WIRE_RST = 6
    ASYM_IFACE = 7
    ASYM_SRC = 8
    SYN_RETX = 9
    NF_VIEW = 10
    WIRE_ICMP = 11


class Hook(enum.IntEnum):
    KFREE_SKB = 1
    TCP_SEND_RST = 2
    TCP_RECV_RST = 3
    ICMP_SEND = 4
    SYNACK_RETX = 5
    TC_INGRESS = 6
    TC_EGRESS = 7
    NF_HOOK = 8
    KPROBE = 9


HOOK_NAMES = {
    Hook.KFREE_SKB: "skb:kfree_skb",
    Hook.TCP_SEND_RST: "tcp:tcp_send_reset",
    Hook.TCP_RECV_RST: "tcp:tcp_receive_reset",
    Hook.ICMP_SEND: "icmp:icmp_send",
    Hook.SYNACK_RETX: "tcp:tcp_retransmit_synack",
    Hook.TC_INGRESS: "tc:ingress",
    Hook.TC_EGRESS: "tc:egress",
    Hook.NF_HOOK: "netfilter",
    Hook.KPROBE: "kprobe",
}


class KFunc(enum.IntEnum):
    NAT_MANIP = 1
    NAT_PACKET = 2
    FIB_VALIDATE = 3
    NF_SEND_RESET = 4
    IPVS_IN = 5
    IPVS_OUT = 6


class Dir(enum.IntEnum):
    UNKNOWN = 0
    INGRESS = 1
    EGRESS = 2
    LOCAL = 3


# record flags (NPT_F_* in nptrace_events.h)
F_HAS_CT = 0x01
F_ENCAP = 0x02
F_HAS_SOCK = 0x04
F_TRUNC = 0x08
F_ICMP_QUOTE = 0x10

# nf_conn.status bits (NPT_IPS_* in nptrace_events.h; tests/unit/test_events.py checks both)
IPS_EXPECTED = 1 << 0
IPS_SEEN_REPLY = 1 << 1
IPS_ASSURED = 1 << 2
IPS_CONFIRMED = 1 << 3
IPS_SRC_NAT = 1 << 4
IPS_DST_NAT = 1 << 5
IPS_SRC_NAT_DONE = 1 << 7
IPS_DST_NAT_DONE = 1 << 8

TCP_FIN, TCP_SYN, TCP_RST, TCP_PSH, TCP_ACK = 0x01, 0x02, 0x04, 0x08, 0x10

_A16 = ct.c_uint8 * 16


class RawEvent(ct.Structure):
    """ctypes mirror of struct npt_event; field names equal the C names."""
    _fields_ = [
        ("ts_ns", ct.c_uint64),
        ("skb", ct.c_uint64),
        ("ifindex", ct.c_uint32),
        ("type", ct.c_uint16),
        ("abi", ct.c_uint16),
        ("location", ct.c_uint64),
        ("netns", ct.c_uint32),
        ("reason", ct.c_uint32),
        ("ct_status", ct.c_uint32),
        ("mark", ct.c_uint32),
        ("saddr", _A16),
        ("daddr", _A16),
        ("sport", ct.c_uint16),
        ("dport", ct.c_uint16),
        ("family", ct.c_uint16),
        ("l4proto", ct.c_uint8),
        ("tcpflags", ct.c_uint8),
        ("hook", ct.c_uint8),
        ("dir", ct.c_uint8),
        ("state", ct.c_uint8),
        ("flags", ct.c_uint8),
        ("aux", ct.c_uint32),
        ("ct_osrc", _A16),
        ("ct_odst", _A16),
        ("ct_rsrc", _A16),
        ("ct_rdst", _A16),
        ("ct_osport", ct.c_uint16),
        ("ct_odport", ct.c_uint16),
        ("ct_rsport", ct.c_uint16),
        ("ct_rdport", ct.c_uint16),
        ("outer_saddr", _A16),
        ("outer_daddr", _A16),
        ("vni", ct.c_uint32),
        ("seq", ct.c_uint32),
        ("ack_seq", ct.c_uint32),
        ("aux2", ct.c_uint32),
    ]


class RawCountKey(ct.Structure):
    """ctypes mirror of struct npt_count_key (key of the `counts` map)."""
    _fields_ = [
        ("ifindex", ct.c_uint32),
        ("reason", ct.c_uint32),
        ("netns", ct.c_uint32),
        ("type", ct.c_uint16),
        ("hook", ct.c_uint8),
        ("_pad", ct.c_uint8),
    ]


class RawPacket(ct.Structure):
    """ctypes mirror of struct npt_packet: the header of a packet-bytes record (--pcap); its
    cap_len bytes of packet follow it."""
    _fields_ = [
        ("ts_ns", ct.c_uint64),
        ("skb", ct.c_uint64),
        ("ifindex", ct.c_uint32),
        ("type", ct.c_uint16),
        ("abi", ct.c_uint16),
        ("orig_len", ct.c_uint32),
        ("cap_len", ct.c_uint16),
        ("ev_type", ct.c_uint16),
        ("link", ct.c_uint8),
        ("dir", ct.c_uint8),
        ("hook", ct.c_uint8),
        ("_pad", ct.c_uint8 * 5),
    ]


LAYOUTS = {"npt_event": RawEvent, "npt_count_key": RawCountKey, "npt_packet": RawPacket}


def _struct_format(cls: type[ct.Structure]) -> str:
    """A struct-module format equal to the ctypes layout (checked by a unit test)."""
    codes = {1: "B", 2: "H", 4: "I", 8: "Q"}
    out = "<"
    for name, typ in cls._fields_:
        if issubclass(typ, ct.Array):
            out += f"{ct.sizeof(typ)}s"
        else:
            out += codes[ct.sizeof(typ)]
    return out


RECORD = struct.Struct(_struct_format(RawEvent))
SIZE = RECORD.size
FIELDS = tuple(name for name, _ in RawEvent._fields_)
# Positions in the tuple RECORD.unpack gives, for the hot paths that stay on tuples.
IDX = {name: i for i, name in enumerate(FIELDS)}
_unpack = RECORD.unpack
COUNT_KEY = struct.Struct(_struct_format(RawCountKey))


class DecodeError(ValueError):
    pass


def ntop(family: int, raw: bytes) -> str:
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw)
    return socket.inet_ntop(socket.AF_INET, raw[:4])


@dataclass(frozen=True, slots=True)
class CtTuples:
    """The skb's conntrack entry: original direction (client -> NodePort) and reply (pod -> ?)."""
    orig_src: str
    orig_sport: int
    orig_dst: str
    orig_dport: int
    reply_src: str
    reply_sport: int
    reply_dst: str
    reply_dport: int
    status: int

    @property
    def dnat(self) -> bool:
        return bool(self.status & IPS_DST_NAT)

    @property
    def snat(self) -> bool:
        return bool(self.status & IPS_SRC_NAT)

    @property
    def seen_reply(self) -> bool:
        return bool(self.status & IPS_SEEN_REPLY)


def _carried(field: str, doc: str, typ: int = 0, hook: int = 0) -> property:
    """A read-only name for aux or aux2 on the event type (or hook) that carries that meaning;
    0 on any other."""
    typ, hook = int(typ), int(hook)

    def get(ev) -> int:
        return getattr(ev, field) if (ev.type == typ if typ else ev.hook == hook) else 0
    return property(get, doc=doc)


class Event(NamedTuple):
    """One decoded record (immutable). Fields and properties as before; a tuple underneath."""
    ts_ns: int
    type: EvType
    hook: Hook
    dir: Dir
    skb: int
    ifindex: int
    netns: int
    reason: int
    saddr: str
    sport: int
    daddr: str
    dport: int
    family: int
    l4proto: int
    tcpflags: int
    state: int
    flags: int
    mark: int
    aux: int
    aux2: int
    seq: int
    ack_seq: int
    location: int
    ct: CtTuples | None = None
    outer_saddr: str | None = None
    outer_daddr: str | None = None
    vni: int = 0
    raw: bytes = b""

    @property
    def flow(self) -> tuple[str, int, str, int]:
        return (self.saddr, self.sport, self.daddr, self.dport)

    @property
    def is_rst(self) -> bool:
        return self.type in (EvType.RST_SENT, EvType.RST_RECV, EvType.WIRE_RST)

    # aux and aux2 mean something else per event type (struct npt_event in nptrace_events.h):
    # read them by these names. A name read on an event type that does not carry it is 0.
    @property
    def answered_flags(self) -> int:
        """TCP flags of the packet the event is about: for a sent reset those of the packet
        it answers (aux), else the packet's own (a NO_SOCKET drop: the SYN or ACK dropped)."""
        return self.aux if self.type == _RST_SENT else self.tcpflags

    @property
    def in_ifindex(self) -> int:
        """ASYM_IFACE, ASYM_SRC: the ifindex the SYN came in on (aux); SYN_RETX: the first
        copy's (aux2)."""
        t = self.type
        if t == _ASYM_IFACE or t == _ASYM_SRC:
            return self.aux
        return self.aux2 if t == _SYN_RETX else 0

    in_ifindex2 = _carried("aux2", "ASYM_IFACE: a second, stacked ingress ifindex of the SYN, "
                           "0 if none.", EvType.ASYM_IFACE)
    syn_dport = _carried("aux2", "ASYM_SRC: the port the SYN was sent to; outer_daddr is its "
                         "address.", EvType.ASYM_SRC)
    syn_copies = _carried("aux", "SYN_RETX: how many copies of the SYN were seen.", EvType.SYN_RETX)
    nf_hook_point = _carried("aux", "NF_VIEW: pf << 24 | hooknum << 16 | priority of the netfilter "
                             "hook (kernel.nfhook.decode_aux splits it).", EvType.NF_VIEW)
    kfunc = _carried("aux", "Hook KPROBE: which kernel function (enum npt_kfunc, KFunc) the event "
                     "comes from.", hook=Hook.KPROBE)
    kfunc_arg = _carried("aux2", "Hook KPROBE: the function's argument or return value, per kfunc "
                         "(bpf/kprobes.bpf.c).", hook=Hook.KPROBE)


_TYPES = {int(m): m for m in EvType}
_HOOKS = {int(m): m for m in Hook}
_DIRS = {int(m): m for m in Dir}
_new_event = tuple.__new__
_AF_INET, _AF_INET6 = socket.AF_INET, socket.AF_INET6
_ASYM_SRC = int(EvType.ASYM_SRC)   # carries outer addresses, as an ICMP quote does
_RST_SENT, _ASYM_IFACE = int(EvType.RST_SENT), int(EvType.ASYM_IFACE)
_SYN_RETX = int(EvType.SYN_RETX)
_ntop = socket.inet_ntop
# 16-byte address field -> text. Bounded: a flood of spoofed sources must not grow it.
_ADDRS: dict[bytes, str] = {}
_ADDRS_MAX = 8192


def _addr(family: int, raw: bytes) -> str:
    key = raw if family == _AF_INET6 else raw[:4]
    s = _ADDRS.get(key)
    if s is None:
        s = _ntop(_AF_INET6 if family == _AF_INET6 else _AF_INET, key)
        if len(_ADDRS) >= _ADDRS_MAX:
            _ADDRS.clear()
        _ADDRS[key] = s
    return s


def decode(buf: bytes | bytearray | memoryview) -> Event:
    """Decode one record. `buf` may be longer than the record (perf samples are padded).
    DecodeError for anything that is not a buffer of at least SIZE bytes (a session file may
    hold any msgpack value where a record's raw bytes belong)."""
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise DecodeError(f"record is a {type(buf).__name__}, not bytes")
    if type(buf) is memoryview:
        buf = _bytes_view(buf)
    if len(buf) < SIZE:
        raise DecodeError(f"record of {len(buf)} bytes, need {SIZE}")
    if type(buf) is not bytes or len(buf) != SIZE:
        buf = bytes(buf[:SIZE])
    return from_tuple(_unpack(buf), buf)


def _bytes_view(buf: memoryview) -> memoryview | bytes:
    """A view of wider items (array('I'), a 2-D buffer) as the bytes it holds: its len()
    and slices count items, not bytes."""
    if buf.itemsize == 1 and buf.ndim == 1:
        return buf
    return buf.cast("B") if buf.c_contiguous else buf.tobytes()


def from_tuple(t: tuple, raw: bytes = b"") -> Event:
    (ts_ns, skb, ifindex, typ, abi, location, netns, reason, ct_status, mark, saddr, daddr,
     sport, dport, family, l4proto, tcpflags, hook, dir_, state, flags, aux,
     ct_osrc, ct_odst, ct_rsrc, ct_rdst, ct_osport, ct_odport, ct_rsport, ct_rdport,
     outer_saddr, outer_daddr, vni, seq, ack_seq, aux2) = t
    if abi != ABI_VERSION:
        raise DecodeError(f"record ABI {abi}, this nptrace reads ABI {ABI_VERSION}")
    typ_e, hook_e, dir_e = _TYPES.get(typ), _HOOKS.get(hook), _DIRS.get(dir_)
    if typ_e is None or hook_e is None or dir_e is None:
        what = ("EvType", typ) if typ_e is None else ("Hook", hook) if hook_e is None \
            else ("Dir", dir_)
        raise DecodeError(f"bad record: {what[1]} is not a valid {what[0]}")
    fam = family or _AF_INET
    ctt = None
    if flags & F_HAS_CT:
        ctt = CtTuples(_addr(fam, ct_osrc), ct_osport, _addr(fam, ct_odst), ct_odport,
                       _addr(fam, ct_rsrc), ct_rsport, _addr(fam, ct_rdst), ct_rdport, ct_status)
    osrc = odst = None
    if flags & F_ENCAP:          # VXLAN over an IPv4 underlay
        osrc, odst = _addr(_AF_INET, outer_saddr), _addr(_AF_INET, outer_daddr)
    elif flags & F_ICMP_QUOTE or typ == _ASYM_SRC:
        ofam = _AF_INET6 if (l4proto == 58 or (typ == _ASYM_SRC and fam == _AF_INET6)) else _AF_INET
        osrc, odst = _addr(ofam, outer_saddr), _addr(ofam, outer_daddr)
    return _new_event(Event, (ts_ns, typ_e, hook_e, dir_e, skb, ifindex, netns, reason,
                              _addr(fam, saddr), sport, _addr(fam, daddr), dport, fam, l4proto,
                              tcpflags, state, flags, mark, aux, aux2, seq, ack_seq, location,
                              ctt, osrc, odst, vni, raw))


def decode_many(bufs) -> tuple[list[Event], int]:
    """Decode a batch of records: (the events, how many records were bad). The same Events
    `decode` gives one by one, without its per-call overhead: the common record (no conntrack,
    no outer header, a known family) is built inline; any other goes through from_tuple."""
    out: list[Event] = []
    append = out.append
    bad = 0
    unpack, size = _unpack, SIZE
    types, hooks, dirs = _TYPES, _HOOKS, _DIRS
    v4, v6 = _ADDRS4, _ADDRS6
    rare = F_HAS_CT | F_ENCAP | F_ICMP_QUOTE
    new = _new_event
    for buf in bufs:
        if type(buf) is not bytes or len(buf) != size:
            if type(buf) is memoryview:
                buf = _bytes_view(buf)
            if not isinstance(buf, (bytes, bytearray, memoryview)) or len(buf) < size:
                bad += 1
                continue
            buf = bytes(buf[:size])
        t = unpack(buf)
        typ = t[3]
        if t[4] != ABI_VERSION or t[20] & rare or typ == _ASYM_SRC:
            try:
                append(from_tuple(t, buf))
            except DecodeError:
                bad += 1
            continue
        typ_e, hook_e, dir_e = types.get(typ), hooks.get(t[17]), dirs.get(t[18])
        if typ_e is None or hook_e is None or dir_e is None:
            bad += 1
            continue
        family = t[14]
        if family == _AF_INET6:
            cache = v6
        else:
            cache = v4
            family = family or _AF_INET
        s = t[10]
        saddr = cache.get(s)
        if saddr is None:
            saddr = _addr_miss(cache, family, s)
        d = t[11]
        daddr = cache.get(d)
        if daddr is None:
            daddr = _addr_miss(cache, family, d)
        append(new(Event, (t[0], typ_e, hook_e, dir_e, t[1], t[2], t[6], t[7], saddr, t[12], daddr,
                           t[13], family, t[15], t[16], t[19], t[20], t[9], t[21], t[35], t[33],
                           t[34], t[5], None, None, None, t[32], buf)))
    return out, bad


# decode_many's address caches: the whole 16-byte field is the key (no slicing), one dict per
# family (the same bytes are another address in the other family). Bounded like _ADDRS.
_ADDRS4: dict[bytes, str] = {}
_ADDRS6: dict[bytes, str] = {}


def _addr_miss(cache: dict, family: int, raw: bytes) -> str:
    s = _addr(family, raw)
    if len(cache) >= _ADDRS_MAX:
        cache.clear()
    cache[raw] = s
    return s


# --- packet-bytes records (bpf/npt_packet.h): not events; the tracer hands them to the pcapng
# sink, which pairs each with its event by (ts_ns, skb).
T_PACKET = 12                      # NPT_T_PACKET: a record type beside enum npt_type's events
PL_ETHERNET, PL_IP = 1, 2          # enum npt_pkt_link
PD_UNKNOWN, PD_INBOUND, PD_OUTBOUND = 0, 1, 2   # enum npt_pkt_dir (pcapng EPB flags bits 0-1)
PACKET = struct.Struct(_struct_format(RawPacket))
# No skb is this long (BIG TCP's GRO limit is 512 KiB): a packet record claiming more is
# damaged, and its length would overflow the pcapng block's u32 once the link header is added.
MAX_ORIG_LEN = 1 << 24
_TYPE_AT = RawEvent.type.offset
assert RawPacket.type.offset == _TYPE_AT


class Packet(NamedTuple):
    ts_ns: int
    skb: int
    ifindex: int
    ev_type: int
    hook: int
    link: int          # PL_ETHERNET or PL_IP
    dir: int           # PD_*
    orig_len: int
    data: bytes        # the first cap_len bytes


def is_packet(buf) -> bool:
    """A packet-bytes record, not an event (the type field sits where an event's does)."""
    return len(buf) >= PACKET.size and buf[_TYPE_AT] == T_PACKET and buf[_TYPE_AT + 1] == 0


def decode_packet(buf) -> Packet:
    if len(buf) < PACKET.size:
        raise DecodeError(f"packet record of {len(buf)} bytes, need {PACKET.size}")
    (ts_ns, skb, ifindex, typ, abi, orig_len, cap_len, ev_type, link, dir_, hook,
     _pad) = PACKET.unpack_from(buf)
    if typ != T_PACKET or abi != ABI_VERSION:
        raise DecodeError(f"not a packet record (type {typ}, ABI {abi})")
    if PACKET.size + cap_len > len(buf) or link not in (PL_ETHERNET, PL_IP) or dir_ > 2:
        raise DecodeError(f"bad packet record: {cap_len} bytes in a {len(buf)}-byte record, "
                          f"link {link}, dir {dir_}")
    if orig_len > MAX_ORIG_LEN:
        raise DecodeError(f"bad packet record: a packet of {orig_len} bytes (at most "
                          f"{MAX_ORIG_LEN})")
    data = bytes(buf[PACKET.size:PACKET.size + cap_len])
    return Packet(ts_ns, skb, ifindex, ev_type, hook, link, dir_, max(orig_len, cap_len), data)


def split_packets(batch) -> tuple[list, list[Packet]]:
    """(the event records, the decoded packet records) of a drained batch. A batch without
    packet records (no --pcap) costs one scan of a type byte per record."""
    at = _TYPE_AT
    if not any(len(b) > at and b[at] == T_PACKET for b in batch):
        return batch, []
    records, packets = [], []
    for b in batch:
        if is_packet(b):
            try:
                packets.append(decode_packet(b))
            except DecodeError:
                records.append(b)      # counted as undecodable with the events
        else:
            records.append(b)
    return records, packets


def encode_packet(data: bytes, *, ts_ns: int = 0, skb: int = 0, ifindex: int = 0,
                  ev_type: int = 0, hook: int = 0, link: int = PL_ETHERNET, dir: int = 0,
                  orig_len: int | None = None) -> bytes:
    """A raw packet-bytes record (tests, fixtures)."""
    return PACKET.pack(ts_ns, skb, ifindex, T_PACKET, ABI_VERSION,
                       len(data) if orig_len is None else orig_len, len(data), ev_type, link,
                       dir, hook, bytes(5)) + data


def encode(**fields) -> bytes:
    """Build a raw record (tests, fixtures, benchmarks). Addresses may be given as strings."""
    vals = dict.fromkeys(FIELDS, 0)
    vals["abi"] = ABI_VERSION
    vals["family"] = socket.AF_INET
    for k in FIELDS:
        if RawEvent._fields_[IDX[k]][1] is _A16:
            vals[k] = bytes(16)
    for k, v in fields.items():
        if k not in vals:
            raise KeyError(k)
        if isinstance(v, str):
            fam = socket.AF_INET6 if ":" in v else socket.AF_INET
            v = socket.inet_pton(fam, v).ljust(16, b"\0")
        vals[k] = int(v) if isinstance(v, enum.IntEnum) else v
    return RECORD.pack(*(vals[k] for k in FIELDS))
