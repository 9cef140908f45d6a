"""The cause keys the kernel counts every record under (bpf/nptrace_events.h struct
npt_cause_key, struct npt_cause_val; written by npt_common.h npt_count_cause) and their
decoded form. Pure: no bcc. loader.Probes.cause_counts() reads the map through decode_key();
tests/unit/test_layout.py checks the mirror against the header with clang.

A key is a record projected onto what the rules read (nptrace/classify/keylabel.py labels it):
the client end's port is always 0, its address is the unspecified address unless the rules
read it (netfilter verdicts).
"""
from __future__ import annotations

import ctypes as ct
import socket
import struct
from typing import NamedTuple

_A16 = ct.c_uint8 * 16


class RawCauseKey(ct.Structure):
    _fields_ = [
        ("saddr", _A16), ("daddr", _A16), ("odst", _A16),
        ("netns", ct.c_uint32), ("ifindex", ct.c_uint32), ("reason", ct.c_uint32),
        ("prior_reason", ct.c_uint32), ("prior_key", ct.c_uint32),
        ("sport", ct.c_uint16), ("dport", ct.c_uint16), ("oport", ct.c_uint16),
        ("type", ct.c_uint16), ("family", ct.c_uint16), ("prior_type", ct.c_uint16),
        ("hook", ct.c_uint8), ("dir", ct.c_uint8), ("flags", ct.c_uint8),
        ("tcpflags", ct.c_uint8), ("ct_bits", ct.c_uint8), ("prior_hook", ct.c_uint8),
        ("prior_tcpflags", ct.c_uint8), ("prior_late", ct.c_uint8),
    ]


class RawCauseVal(ct.Structure):
    _fields_ = [("counted", ct.c_uint64), ("sent", ct.c_uint64)]


LAYOUTS = {"npt_cause_key": RawCauseKey, "npt_cause_val": RawCauseVal}
CK_SNAT, CK_DNAT = 0x01, 0x02
# One unpack for the whole key (the same layout as RawCauseKey; the layout test checks sizes)
CAUSE_KEY = struct.Struct("<16s16s16s5I6H8B")


class CauseKey(NamedTuple):
    """A decoded cause key. Addresses as text ("0.0.0.0" / "::" where the kernel zeroed them)."""
    type: int
    hook: int
    reason: int
    netns: int
    ifindex: int
    dir: int
    saddr: str
    sport: int
    daddr: str
    dport: int
    family: int
    flags: int
    tcpflags: int
    ct_bits: int
    odst: str
    oport: int
    prior_type: int = 0
    prior_hook: int = 0
    prior_reason: int = 0
    prior_tcpflags: int = 0
    prior_late: int = 0           # the prior named an earlier incident (over 1 s before)
    prior_key: int = 0            # key_hash of the prior record's own key


def _ntop(family: int, raw: bytes) -> str:
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw)
    return socket.inet_ntop(socket.AF_INET, raw[:4])


_WORDS = struct.Struct(f"<{CAUSE_KEY.size // 4}I")


def key_hash(buf: bytes) -> int:
    """npt_common.h npt_cause_key_hash of a key's kernel bytes (keep the two identical)."""
    h = 0x811C9DC5
    for w in _WORDS.unpack_from(buf):
        h = ((h ^ w) * 0x9E3779B1) & 0xFFFFFFFF
    h ^= h >> 16
    return h or 1


def decode_key(buf: bytes) -> CauseKey:
    (sa, da, od, netns, ifindex, reason, preason, pkey, sport, dport, oport, typ, family, ptype,
     hook, dir_, flags, tcpflags, ct_bits, phook, pflags, plate) = CAUSE_KEY.unpack_from(buf)
    fam = family or socket.AF_INET
    return CauseKey(typ, hook, reason, netns, ifindex, dir_, _ntop(fam, sa), sport,
                    _ntop(fam, da), dport, fam, flags, tcpflags, ct_bits,
                    _ntop(fam, od), oport, ptype, phook, preason, pflags, plate, pkey)


def encode_key(k: CauseKey) -> bytes:
    """The kernel's bytes of a key (tests, and fixtures)."""
    fam = k.family or socket.AF_INET

    def pton(a: str) -> bytes:
        if fam == socket.AF_INET6:
            return socket.inet_pton(socket.AF_INET6, a)
        return socket.inet_pton(socket.AF_INET, a) + bytes(12)
    return CAUSE_KEY.pack(pton(k.saddr), pton(k.daddr), pton(k.odst), k.netns, k.ifindex,
                          k.reason, k.prior_reason, k.prior_key, k.sport, k.dport, k.oport, k.type,
                          k.family, k.prior_type, k.hook, k.dir, k.flags, k.tcpflags,
                          k.ct_bits, k.prior_hook, k.prior_tcpflags, k.prior_late)


_SYN, _ACK = 0x02, 0x10
_RST_SENT, _DROP, _ICMP, _WIRE_ICMP = 2, 1, 4, 11
_F_KEPT = 0x01 | 0x02 | 0x04 | 0x10       # HAS_CT | ENCAP | HAS_SOCK | ICMP_QUOTE
_IPS_SRC_NAT, _IPS_DST_NAT = 1 << 4, 1 << 5
_ZERO = {2: "0.0.0.0", 10: "::"}


def keeps_source(typ: int, reason: int, reason_name) -> bool:
    """Whether the rules read the client address of this record (npt_cause_key_of keep_src)."""
    if typ == _DROP:
        from nptrace.reasons import SOURCE_DROPS
        return reason_name(reason) in SOURCE_DROPS
    if typ in (_ICMP, _WIRE_ICMP):
        return reason >> 8 == 3 and reason & 0xff in (3, 9, 10, 13)
    return False


def key_of(ev, drop_name=lambda v: f"REASON_{v}", prior: tuple = (0, 0, 0, 0),
           client_is_src: bool | None = None, prior_late: bool = False,
           prior_key: int = 0) -> CauseKey:
    """The key the kernel counts a decoded event under (npt_common.h npt_cause_key_of, in
    Python: the unit tests label recorded events' keys; keep the two identical). prior: the
    flow's causal fact (type, hook, reason, SYN/ACK bits) the kernel would add; client_is_src
    the orientation that fact gives (the kernel takes it from the fact's server end);
    prior_late: the record is over a second after the fact (another incident)."""
    t = int(ev.type)
    fl = (ev.aux if t == _RST_SENT else ev.tcpflags) & (_SYN | _ACK)
    c = ev.ct
    dnat = c is not None and bool(c.status & _IPS_DST_NAT)
    if client_is_src is not None:
        cli_src = client_is_src
    elif dnat:
        cli_src = ev.sport == c.orig_sport and ev.saddr == c.orig_src
    elif fl == _SYN:
        cli_src = t != _RST_SENT
    elif fl == _SYN | _ACK:
        cli_src = t == _RST_SENT
    else:
        cli_src = ev.sport > ev.dport
    pt, ph, pr, pf = (tuple(prior) + (0,))[:4]
    if (pt, ph, pr, pf) == (t, int(ev.hook), ev.reason, fl):
        pt = ph = pr = pf = 0
    keep = keeps_source(t, ev.reason, drop_name) or bool(pt and keeps_source(pt, pr, drop_name))
    zero = _ZERO.get(ev.family, "0.0.0.0")
    if cli_src:
        sa, sp, da, dp = (ev.saddr if keep else zero), 0, ev.daddr, ev.dport
    else:
        sa, sp, da, dp = ev.saddr, ev.sport, (ev.daddr if keep else zero), 0
    odst, oport = (c.orig_dst, c.orig_dport) if dnat else (zero, 0)
    status = c.status if c is not None else 0
    bits = (CK_SNAT if status & _IPS_SRC_NAT else 0) | (CK_DNAT if status & _IPS_DST_NAT else 0)
    return CauseKey(t, int(ev.hook), ev.reason, ev.netns, ev.ifindex, int(ev.dir), sa, sp, da,
                    dp, ev.family, ev.flags & _F_KEPT, fl, bits, odst, oport, pt, ph, pr, pf,
                    int(bool(pt and prior_late)), prior_key if pt else 0)


def fact_of(ev) -> tuple:
    """The flow fact (type, hook, reason, SYN/ACK bits) the kernel keeps for a causal record."""
    t = int(ev.type)
    return (t, int(ev.hook), ev.reason, (ev.aux if t == _RST_SENT else ev.tcpflags) & (_SYN | _ACK))


def server_ends(ev) -> set:
    """The server ends (address, port) the kernel's flow fact keeps for a causal record
    (npt_count_cause srv_end/srv_end2): the NodePort and the endpoint of a DNAT, else the end
    npt_client_is_src() does not name the client. A later record of the flow whose source is
    not one of them has the client as its source."""
    c = ev.ct
    if c is not None and c.status & _IPS_DST_NAT:
        return {(c.orig_dst, c.orig_dport), (c.reply_src, c.reply_sport)}
    k = key_of(ev)
    return {(ev.daddr, ev.dport)} if k.sport == 0 and k.dport else {(ev.saddr, ev.sport)}
