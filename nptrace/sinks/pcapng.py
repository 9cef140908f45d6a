"""`--pcap FILE`: each labeled reset or drop as a packet in a pcapng file, with the label as
the packet comment, for Wireshark or `tcpdump -r FILE -nn`.

Our events carry header fields, not payloads, so each packet is RECONSTRUCTED from the event:
IPv4 or IPv6 + TCP (UDP when the event says so) with the event's addresses, ports, flags,
sequence and acknowledgment numbers and valid checksums; TTL 64, window 0, no options and no
payload are placeholders. Every comment says so. Link type Ethernet with zero MAC addresses:
LINKTYPE_RAW (101) would fit better, but libpcap 1.10 (Debian 12's tcpdump) refuses a file
with two type-101 interfaces ("an interface has a type 101 different from the type of the
first interface": it compares the first one's mapped DLT_RAW with the next one's raw 101).

Written from the pcapng spec (draft-ietf-opsawg-pcapng): one Section Header Block, one
Interface Description Block per interface name (written when the name first appears, which
the spec allows anywhere before its first use), one Enhanced Packet Block per verdict, with
nanosecond timestamps (if_tsresol 9). Little-endian throughout. Mode 0600: packets hold client
addresses; written as root, so the file is opened without following links (open_output).
"""
from __future__ import annotations

import errno
import os
import socket
import stat
import struct

from nptrace import __version__
from nptrace.classify import Verdict
from nptrace.events import Event

LINKTYPE_ETHERNET = 1
_ETH_V4 = bytes(12) + b"\x08\x00"
_ETH_V6 = bytes(12) + b"\x86\xdd"
SHB, IDB, EPB = 0x0A0D0D0A, 0x00000001, 0x00000006
BYTE_ORDER_MAGIC = 0x1A2B3C4D
OPT_END, OPT_COMMENT = 0, 1
SHB_USERAPPL = 4
IF_NAME, IF_DESCRIPTION, IF_TSRESOL = 2, 3, 9
MAX_COMMENT = 65000      # option length is a u16
RECONSTRUCTED = ("packet reconstructed by nptrace from the kernel event's header fields "
                 "(addresses, ports, flags, seq/ack): not captured; no payload; TTL, window "
                 "and options are placeholders")


def _pad4(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 4)


def _option(code: int, value: bytes) -> bytes:
    return struct.pack("<HH", code, len(value)) + _pad4(value)


def _options(opts: list[tuple[int, bytes]]) -> bytes:
    if not opts:
        return b""
    return b"".join(_option(c, v) for c, v in opts) + struct.pack("<HH", OPT_END, 0)


def _block(btype: int, body: bytes) -> bytes:
    n = 12 + len(body)
    return struct.pack("<II", btype, n) + body + struct.pack("<I", n)


def section_header(node: str = "") -> bytes:
    body = struct.pack("<IHHq", BYTE_ORDER_MAGIC, 1, 0, -1)
    opts = [(SHB_USERAPPL, f"nptrace {__version__}".encode())]
    if node:     # the capturing node, as a section comment (Wireshark: Statistics > Capture File)
        opts.append((OPT_COMMENT, f"node: {node}".encode("utf-8", "replace")[:MAX_COMMENT]))
    body += _options(opts)
    return _block(SHB, body)


def interface_block(name: str) -> bytes:
    body = struct.pack("<HHI", LINKTYPE_ETHERNET, 0, 0)
    body += _options([(IF_NAME, name.encode()[:255]),
                      (IF_DESCRIPTION, b"nptrace: reconstructed packets seen on this interface"),
                      (IF_TSRESOL, bytes([9]))])
    return _block(IDB, body)


def packet_block(iface_id: int, ts_ns: int, packet: bytes, comment: str) -> bytes:
    body = struct.pack("<IIIII", iface_id, (ts_ns >> 32) & 0xFFFFFFFF, ts_ns & 0xFFFFFFFF,
                       len(packet), len(packet))
    body += _pad4(packet)
    body += _options([(OPT_COMMENT, comment.encode("utf-8", "replace")[:MAX_COMMENT])])
    return _block(EPB, body)


# --- packet reconstruction ----------------------------------------------------------------

def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _l4(e: Event, src: bytes, dst: bytes, pseudo_tail) -> tuple[int, bytes]:
    if e.l4proto == socket.IPPROTO_UDP:
        hdr = struct.pack("!HHHH", e.sport, e.dport, 8, 0)
        c = _csum(src + dst + pseudo_tail(17, 8) + hdr) or 0xFFFF
        return 17, hdr[:6] + struct.pack("!H", c)
    hdr = struct.pack("!HHIIBBHHH", e.sport, e.dport, e.seq & 0xFFFFFFFF, e.ack_seq & 0xFFFFFFFF,
                      5 << 4, e.tcpflags & 0xFF, 0, 0, 0)
    c = _csum(src + dst + pseudo_tail(6, len(hdr)) + hdr)
    return 6, hdr[:16] + struct.pack("!H", c) + hdr[18:]


def build_packet(e: Event) -> bytes:
    """IP + TCP/UDP header with the event's fields and valid checksums (no payload, no
    link-layer header: see frame())."""
    if e.family == socket.AF_INET6:
        src, dst = socket.inet_pton(socket.AF_INET6, e.saddr), socket.inet_pton(socket.AF_INET6, e.daddr)
        proto, l4 = _l4(e, src, dst, lambda p, n: struct.pack("!I3xB", n, p))
        return struct.pack("!IHBB", 6 << 28, len(l4), proto, 64) + src + dst + l4
    src, dst = socket.inet_aton(e.saddr), socket.inet_aton(e.daddr)
    proto, l4 = _l4(e, src, dst, lambda p, n: struct.pack("!BBH", 0, p, n))
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 0, 0x4000, 64, proto, 0, src, dst)
    ip = ip[:10] + struct.pack("!H", _csum(ip)) + ip[12:]
    return ip + l4


def frame(e: Event) -> bytes:
    """build_packet() behind a placeholder Ethernet header."""
    return (_ETH_V6 if e.family == socket.AF_INET6 else _ETH_V4) + build_packet(e)


def comment(v: Verdict) -> str:
    what = v.kind + (f"/{v.direction}" if v.direction else "")
    lines = [f"nptrace: {v.cause} ({what}) confidence {v.confidence:.2f}; {v.hook} {v.reason}"
             + (f"; service {v.service}" if v.service else "")]
    if v.event.ct is not None and v.event.ct.dnat:
        c = v.event.ct
        lines.append(f"conntrack: {c.orig_src}:{c.orig_sport} -> {c.orig_dst}:{c.orig_dport} "
                     f"dnat to {c.reply_src}:{c.reply_sport}")
    lines.append(f"hint: {v.hint}")
    for x in v.evidence:
        lines.append(f"evidence: {x.hook} {x.what}" + (f" on {x.iface}" if x.iface else "")
                     + (f" {x.detail}" if x.detail else ""))
    lines.append(RECONSTRUCTED)
    return "\n".join(lines)


def open_output(path: str, what: str) -> int:
    """A file nptrace writes as root at a path someone else may reach (/tmp): opened with
    O_NOFOLLOW (a planted symbolic link is refused, never followed) and O_NONBLOCK (a planted
    FIFO does not block the open), then refused unless it is a regular file of ours with one
    link (a planted hard link or someone else's file would get our client addresses); only
    then truncated and made 0600."""
    from nptrace.errors import NptraceError
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC | os.O_NOCTTY, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NptraceError(f"cannot write {what} {path}: it is a symbolic link; nptrace "
                               "does not follow links for files it writes (name the target)") from None
        raise NptraceError(f"cannot write {what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "it is not a regular file"
        elif st.st_uid != os.geteuid():
            why = f"it exists and belongs to uid {st.st_uid}"
        elif st.st_nlink > 1:
            why = f"it has {st.st_nlink} hard links"
        if why:
            raise NptraceError(f"cannot write {what} {path}: {why}; remove it or name another file")
        os.ftruncate(fd, 0)
        os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
    except OSError as e:
        os.close(fd)
        raise NptraceError(f"cannot write {what} {path}: {e.strerror}") from None
    except NptraceError:
        os.close(fd)
        raise
    return fd


class PcapngSink:
    def __init__(self, path, epoch_offset_ns: int, node: str = ""):
        self.path = str(path)
        self.offset = epoch_offset_ns     # replay sets it per recorded run
        self.f = os.fdopen(open_output(self.path, "--pcap"), "wb")
        self.ifaces: dict[str, int] = {}
        self.packets = 0
        self._put(section_header(node))

    def _put(self, *blocks: bytes) -> None:
        """Write and flush; a full disk is one line and exit 2 (errors.output_error)."""
        try:
            for b in blocks:
                self.f.write(b)
            self.f.flush()
        except OSError as e:
            from nptrace.errors import OUTPUT_ERRNOS, output_error
            if e.errno not in OUTPUT_ERRNOS:
                raise
            raise output_error(f"--pcap {self.path}", e) from None

    def _iface(self, name: str) -> int:
        idx = self.ifaces.get(name)
        if idx is None:
            idx = self.ifaces[name] = len(self.ifaces)
            self._put(interface_block(name))
        return idx

    def write(self, v: Verdict) -> None:
        e = v.event
        idx = self._iface(v.iface or (f"ifindex{e.ifindex}" if e.ifindex else "unknown"))
        self._put(packet_block(idx, max(0, e.ts_ns + self.offset), frame(e), comment(v)))
        self.packets += 1

    def close(self) -> None:
        if not self.f.closed:
            try:
                self.f.close()
            except OSError:
                pass      # what could not be written was said when it failed
