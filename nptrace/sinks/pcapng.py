"""`-w/--pcap FILE`: the packets behind each labeled reset or drop in a pcapng file, with the
cause, Service and hint as each packet's comment, for Wireshark, tshark or `tcpdump -r FILE -nn`.

Real bytes where the event is a packet: with --pcap, `run` compiles bpf/npt_packet.h, which
copies the first bytes of the packet the event is about (--snaplen N: N; the default `headers`:
config.HEADERS_SNAPLEN, then cut where its headers end, sinks/snap.py), as the kernel had it
at that hook (the dropped SYN at skb:kfree_skb, the packet an ICMP error is
about at icmp:icmp_send, the RST, the retransmitted SYN or the asymmetric SYN-ACK at tc), into
a record that follows the event (events.Packet). The tracer hands those to on_packet(); each
incident's events that have bytes become one Enhanced Packet Block each, with the original
length, the interface and the direction (EPB flags: inbound/outbound) the hook saw.
An event that is no packet (a reset sent by a socket: tcp_send_reset's skb is the packet it
answers, not the RST; a reset received; a SYN-ACK retransmitted), a packet record that did
not arrive (ring full, or its event came from a session file in `replay`), or an incident with
no packet at all is written as today: RECONSTRUCTED from the event's fields, and its comment
says so.

Link type Ethernet for every interface: at kfree_skb a packet with no link-layer header yet (a
locally generated one) starts at its IP header, and gets a zero Ethernet header in front, said
in its comment. LINKTYPE_RAW (101) would fit better, but libpcap 1.10 (Debian 12's tcpdump)
refuses a file with two type-101 interfaces ("an interface has a type 101 different from the
type of the first interface": it compares the first one's mapped DLT_RAW with the next one's
raw 101).

Written from the pcapng spec (draft-ietf-opsawg-pcapng): one Section Header Block (with the
node's name in its comment), one Interface Description Block per interface name (written when
the name first appears, which the spec allows anywhere before its first use), one Enhanced
Packet Block per packet, with nanosecond timestamps (if_tsresol 9). Little-endian throughout.
Rotation as tcpdump's -C/-W: past -C MB a new file (FILE1, FILE2, ...; with -W N the names are
FILE0..FILE<N-1>, reused in turn). SIGHUP reopens FILE (after logrotate moved it). A write that
fails (ENOSPC) is one line and exit 2. Mode 0600: packets hold client addresses; written as
root, so the file is opened without following links (open_output).
"""
from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from collections import OrderedDict

from nptrace import __version__
from nptrace.classify import Verdict
from nptrace.events import PL_IP, Event, Packet
from nptrace.names import HOOKS
from nptrace.sinks.fmt import endpoint

LINKTYPE_ETHERNET = 1
_ETH_V4 = bytes(12) + b"\x08\x00"
_ETH_V6 = bytes(12) + b"\x86\xdd"
SHB, IDB, EPB = 0x0A0D0D0A, 0x00000001, 0x00000006
BYTE_ORDER_MAGIC = 0x1A2B3C4D
OPT_END, OPT_COMMENT = 0, 1
SHB_USERAPPL = 4
EPB_FLAGS = 2            # u32; bits 0-1 direction: 1 inbound, 2 outbound
IF_NAME, IF_DESCRIPTION, IF_TSRESOL = 2, 3, 9
MAX_COMMENT = 65000      # option length is a u16
NO_LINK_HEADER = ("no link-layer header at this hook: the Ethernet header in front of the "
                  "captured IP packet is zeros")
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


def section_header(node: str | None = None) -> bytes:
    body = struct.pack("<IHHq", BYTE_ORDER_MAGIC, 1, 0, -1)
    node = node or socket.gethostname()
    # the capturing node, as a section comment (Wireshark: Statistics > Capture File)
    body += _options([(OPT_COMMENT, f"node: {node}".encode("utf-8", "replace")[:MAX_COMMENT]),
                      (SHB_USERAPPL, f"nptrace {__version__}".encode())])
    return _block(SHB, body)


def interface_block(name: str) -> bytes:
    body = struct.pack("<HHI", LINKTYPE_ETHERNET, 0, 0)
    body += _options([(IF_NAME, name.encode()[:255]),
                      (IF_DESCRIPTION, b"nptrace: packets behind labeled events on this interface"),
                      (IF_TSRESOL, bytes([9]))])
    return _block(IDB, body)


def packet_block(iface_id: int, ts_ns: int, packet: bytes, comment: str,
                 orig_len: int | None = None, direction: int = 0) -> bytes:
    """direction: events.PD_INBOUND / PD_OUTBOUND (EPB flags), 0 unknown (no flags option)."""
    body = struct.pack("<IIIII", iface_id, (ts_ns >> 32) & 0xFFFFFFFF, ts_ns & 0xFFFFFFFF,
                       len(packet), max(len(packet), orig_len or 0))
    body += _pad4(packet)
    opts = [(OPT_COMMENT, comment.encode("utf-8", "replace")[:MAX_COMMENT])]
    if direction in (1, 2):
        opts.append((EPB_FLAGS, struct.pack("<I", direction)))
    body += _options(opts)
    return _block(EPB, body)


# --- packet reconstruction ----------------------------------------------------------------

def inet_checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of data: IP headers, TCP/UDP with their pseudo-header."""
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _l4(e: Event, src: bytes, dst: bytes, pseudo_tail) -> tuple[int, bytes]:
    if e.l4proto == socket.IPPROTO_UDP:
        hdr = struct.pack("!HHHH", e.sport, e.dport, 8, 0)
        c = inet_checksum(src + dst + pseudo_tail(17, 8) + hdr) or 0xFFFF
        return 17, hdr[:6] + struct.pack("!H", c)
    hdr = struct.pack("!HHIIBBHHH", e.sport, e.dport, e.seq & 0xFFFFFFFF, e.ack_seq & 0xFFFFFFFF,
                      5 << 4, e.tcpflags & 0xFF, 0, 0, 0)
    c = inet_checksum(src + dst + pseudo_tail(6, len(hdr)) + hdr)
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
    ip = ip[:10] + struct.pack("!H", inet_checksum(ip)) + ip[12:]
    return ip + l4


def frame(e: Event) -> bytes:
    """build_packet() behind a placeholder Ethernet header."""
    return (_ETH_V6 if e.family == socket.AF_INET6 else _ETH_V4) + build_packet(e)


def comment(v: Verdict, packet: str | None = RECONSTRUCTED) -> str:
    """The incident (cause, Service, hint, evidence), then what this packet is: `packet`, a
    line about the captured bytes, or RECONSTRUCTED."""
    what = v.kind + (f"/{v.direction}" if v.direction else "")
    lines = [f"nptrace: {v.cause} ({what}) confidence {v.confidence:.2f}; {v.hook} {v.reason}"
             + (f"; service {v.service}" if v.service else "")]
    if v.event.ct is not None and v.event.ct.dnat:
        c = v.event.ct
        lines.append(f"conntrack: {endpoint(c.orig_src, c.orig_sport)} -> "
                     f"{endpoint(c.orig_dst, c.orig_dport)} dnat to "
                     f"{endpoint(c.reply_src, c.reply_sport)}")
    lines.append(f"hint: {v.hint}")
    for x in v.evidence:
        lines.append(f"evidence: {x.hook} {x.what}" + (f" on {x.iface}" if x.iface else "")
                     + (f" {x.detail}" if x.detail else ""))
    if packet:
        lines.append(packet)
    return "\n".join(lines)


def _captured(ev: Event, rname: str, p: Packet) -> str:
    line = (f"packet: {HOOKS[ev.hook]} {rname}, {len(p.data)} of {p.orig_len} bytes as the "
            "kernel had them at this hook")
    return line + ("; " + NO_LINK_HEADER if p.link == PL_IP else "")


def _eth_for(data: bytes) -> bytes:
    return _ETH_V6 if data[:1] and data[0] >> 4 == 6 else _ETH_V4


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


# Packets waiting for their incident: the classifier holds an incident up to its max_hold
# (5 s); a storm's packets past this many are dropped oldest first (their incidents are then
# written reconstructed, and say so). 8192 x (~100 bytes + 128 snap) is about 2 MB.
MAX_PENDING = 8192


class PcapngSink:
    def __init__(self, path, epoch_offset_ns: int, *, node: str | None = None,
                 max_file_bytes: int = 0, max_files: int = 0):
        """max_file_bytes: rotate past it (tcpdump -C, 0: never); max_files: with it, reuse
        the names FILE0..FILE<max_files-1> in turn (tcpdump -W)."""
        self.path = str(path)
        self.offset = epoch_offset_ns     # replay sets it per recorded run
        self.node = node
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.file_no = 0
        self.pending: OrderedDict = OrderedDict()   # (ts_ns, skb) -> Packet
        self.packets = 0
        self.captured = 0
        self.f = None
        self._open()

    def _name(self, n: int) -> str:
        if self.max_files:
            width = len(str(self.max_files - 1))
            return f"{self.path}{n % self.max_files:0{width}d}"
        return self.path if n == 0 else f"{self.path}{n}"

    def _open(self) -> None:
        name = self._name(self.file_no)
        self.f = os.fdopen(open_output(name, "--pcap"), "wb")
        self.name = name
        self.size = 0
        self.ifaces: dict[str, int] = {}
        self._put(section_header(self.node))
        try:
            self.f.flush()
        except OSError as e:
            self._failed(e)

    def _put(self, b: bytes) -> None:
        try:
            self.f.write(b)
        except OSError as e:
            self._failed(e)
        self.size += len(b)

    def _failed(self, e: OSError):
        """A full disk is one line and exit 2 (errors.output_error); with a hint to rotate."""
        from nptrace.errors import OUTPUT_ERRNOS, output_error
        if e.errno not in OUTPUT_ERRNOS:
            raise e
        err = output_error(f"--pcap {self.name}", e)
        raise type(err)(f"{err} (or rotate with -C MB -W FILES)") from None

    def _iface(self, name: str) -> int:
        idx = self.ifaces.get(name)
        if idx is None:
            idx = self.ifaces[name] = len(self.ifaces)
            self._put(interface_block(name))
        return idx

    def on_packet(self, p: Packet) -> None:
        """A packet-bytes record from the ring (the tracer), kept until its incident comes."""
        pend = self.pending
        pend[(p.ts_ns, p.skb)] = p
        if len(pend) > MAX_PENDING:
            pend.popitem(last=False)

    def write(self, v: Verdict) -> None:
        ctx = v.ctx
        name_of = ctx.iface_name if ctx is not None else None
        wrote = 0
        primary = False          # the primary event's own bytes were written
        evs = [(l.ev, l.rname) for l in v.labeled or ()]
        if not any(ev is v.event for ev, _ in evs):
            evs.insert(0, (v.event, v.reason))
        for ev, rname in evs:
            p = self.pending.pop((ev.ts_ns, ev.skb), None) if self.pending else None
            if p is None:
                continue
            primary = primary or ev is v.event
            data = p.data if p.link != PL_IP else _eth_for(p.data) + p.data
            orig = p.orig_len + (14 if p.link == PL_IP else 0)
            iface = (name_of(ev.netns, ev.ifindex) if name_of and ev.ifindex else None) or \
                (v.iface if ev is v.event else None) or \
                (f"ifindex{ev.ifindex}" if ev.ifindex else "unknown")
            self._put(packet_block(self._iface(iface), max(0, ev.ts_ns + self.offset), data,
                                   comment(v, _captured(ev, rname, p)), orig, p.dir))
            wrote += 1
        if not primary:          # no bytes of its own (a socket's reset, ...): as before
            e = v.event
            idx = self._iface(v.iface or (f"ifindex{e.ifindex}" if e.ifindex else "unknown"))
            self._put(packet_block(idx, max(0, e.ts_ns + self.offset), frame(e), comment(v)))
        self.packets += wrote + (not primary)
        self.captured += wrote
        try:
            self.f.flush()
        except OSError as e:
            self._failed(e)
        if self.max_file_bytes and self.size >= self.max_file_bytes:
            self.f.close()
            self.file_no += 1
            self._open()

    def reopen(self) -> None:
        """SIGHUP: the file was moved away (logrotate); start it again at its name."""
        if self.f is not None and not self.f.closed:
            self.f.close()
        self._open()

    def close(self) -> None:
        if self.f is not None and not self.f.closed:
            try:
                self.f.close()
            except OSError:
                pass
