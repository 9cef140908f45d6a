"""Consume the BPF ring buffer (`events` map) by mapping it into this process and walking it.

Why not bcc's `ring_buffer_poll`: it calls back into Python once per record (docs/PLATFORM.md:
350-600k records/s at best). Walking the mapped ring in Python and unpacking whole runs of
records with one `Struct.iter_unpack` call did 1.3-1.5M records/s here (216-byte events, walk
+ unpack into tuples), and the consumer position is advanced once per batch, not per record.
Callers keep the tuples and build events.Event objects (events.from_tuple) only when needed.

Layout (kernel/bpf/ringbuf.c, BPF_MAP_TYPE_RINGBUF, Linux 5.8+):
  offset 0          one page, read-write: consumer position (u64)
  offset page       one page, read-only:  producer position (u64)
  offset 2 * page   the data area, mapped TWICE back to back (2 * data_size bytes), so a record
                    that wraps past the end of the ring can still be read as one slice.
Each record: 8-byte header {u32 len; u32 pg_off}, then len bytes, padded to 8. The top bits
of len: BUSY (1 << 31) while the producer has reserved but not committed the record (stop
there: nothing after it may be consumed before it), DISCARD (1 << 30) for a record the
producer gave up (skip it). Every header below the producer position is already written:
the kernel writes it under its spinlock before publishing the new producer position.

Positions are read and written with single 8-byte accesses (`memoryview.cast('Q')`): the
kernel updates them concurrently, and struct.unpack would read them byte by byte, tearing them
(docs/PLATFORM.md). Memory ordering: x86-64 never reorders loads with loads, so producer position,
header and payload are read in the order the kernel published them. On weakly ordered CPUs
(arm64) plain loads are not acquires, and Python offers no barrier: open_reader() uses this
reader only on x86-64 and bcc's callback consumer (loader.Probes.open_ring, PollReader)
elsewhere, and says which at start.

Nothing here imports bcc: the caller passes the map fd (loader.Probes.ring_map_fd()).
"""
from __future__ import annotations

import ctypes as ct
import errno
import mmap
import os
import select
import struct

from nptrace import events as ev
from nptrace.kernel.bpfsys import bpf

BUSY = 1 << 31
DISCARD = 1 << 30
LEN_MASK = DISCARD - 1
HDR = 8
BPF_MAP_TYPE_RINGBUF = 27
BPF_OBJ_GET_INFO_BY_FD = 15


class RingError(OSError):
    """The fd is not a usable ring buffer map (message says which step failed)."""


def stride_of(record_size: int) -> int:
    """Bytes one record of `record_size` occupies in the ring: header + payload, 8-aligned."""
    return (record_size + HDR + 7) & ~7


def wire_struct(record: struct.Struct) -> struct.Struct:
    """`record` preceded by its ring header and followed by its alignment padding, with both
    as pad bytes ('x'): iter_unpack over a run of records yields exactly `record`'s tuples."""
    fmt = record.format
    order = fmt[0] if fmt[:1] in ("<", ">", "=", "!", "@") else "@"
    body = fmt[1:] if order == fmt[:1] else fmt
    pad = stride_of(record.size) - HDR - record.size
    return struct.Struct(f"{order}{HDR}x{body}{pad}x" if pad else f"{order}{HDR}x{body}")


def _first_mismatch(a: bytes, b: bytes) -> int:
    """Index of the first differing 4-byte word of two equal-length, unequal byte strings."""
    lo, hi = 0, len(a) // 4
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * 4:mid * 4] == b[lo * 4:mid * 4]:
            lo = mid
        else:
            hi = mid
    return lo


class WalkStats:
    __slots__ = ("discarded", "short", "busy_stops")

    def __init__(self):
        self.discarded = 0   # records the producer discarded
        self.short = 0       # records shorter than a full event (not ours): skipped
        self.busy_stops = 0  # batches that ended at a record still being written

    def as_dict(self) -> dict[str, int]:
        return {"discarded": self.discarded, "short": self.short, "busy_stops": self.busy_stops}


def walk(data: memoryview, cons: int, prod: int, mask: int, record: struct.Struct,
         out: list, max_records: int, stats: WalkStats | None = None,
         raw: bool = False, wire: struct.Struct | None = None) -> int:
    """Consume records in [cons, prod) from `data` (the double-mapped area, 2 * (mask + 1)
    bytes), appending `record` tuples (or, with raw, the payload bytes) to `out`. Stops at a
    BUSY record or after max_records. Returns the new consumer position. Pure: no I/O.

    Fast path: when every record in the run has length record.size (the case when one
    producer writes one layout), the run's headers are compared as one byte string and the
    records unpacked with one iter_unpack. The first odd record (busy, discarded, other
    length) is handled alone, then the fast path resumes.
    """
    size = record.size
    stride = stride_of(size)
    if wire is None:
        wire = wire_struct(record)
    words = data.cast("I")
    sw = stride // 4
    exp_word = struct.pack("=I", size)
    start_len = len(out)
    while cons < prod:
        room = max_records - (len(out) - start_len)
        if room <= 0:
            break
        off = cons & mask
        n = min((prod - cons) // stride, room)
        if n:
            w0 = off >> 2
            hb = words[w0:w0 + n * sw:sw].tobytes()
            exp = exp_word * n
            good = n if hb == exp else _first_mismatch(hb, exp)
            if good:
                end = off + good * stride
                if raw:
                    out.extend(bytes(data[o + HDR:o + HDR + size]) for o in range(off, end, stride))
                else:
                    out.extend(wire.iter_unpack(data[off:end]))
                cons += good * stride
                if good == n:
                    continue
                off = cons & mask
        hdr = words[off >> 2]
        if hdr & BUSY:
            if stats is not None:
                stats.busy_stops += 1
            break
        length = hdr & LEN_MASK
        if hdr & DISCARD:
            if stats is not None:
                stats.discarded += 1
        elif raw and length:
            # every record as written: a packet-bytes record (bpf/npt_packet.h) is longer or
            # shorter than an event; events.split_packets / decode_many sort them out
            out.append(bytes(data[off + HDR:off + HDR + length]))
        elif length >= size:
            out.append(record.unpack_from(data, off + HDR))
        elif stats is not None:
            stats.short += 1
        cons += (length + HDR + 7) & ~7
    return cons


def _bpf_syscall(cmd: int, attr: ct.Array) -> int:
    r = bpf(cmd, attr)
    if r < 0:
        raise RingError(-r, f"bpf({cmd}) failed: {os.strerror(-r)}")
    return r


def map_info(fd: int) -> dict[str, int]:
    """type, key_size, value_size, max_entries of a BPF map fd (BPF_OBJ_GET_INFO_BY_FD)."""
    info = (ct.c_uint8 * 96)()
    attr = (ct.c_uint8 * 16)()
    struct.pack_into("=IIQ", attr, 0, fd, len(info), ct.addressof(info))
    _bpf_syscall(BPF_OBJ_GET_INFO_BY_FD, attr)
    typ, _id, ksz, vsz, maxe, flags = struct.unpack_from("=6I", info, 0)
    return {"type": typ, "key_size": ksz, "value_size": vsz, "max_entries": maxe, "flags": flags}


class RingReader:
    """Mapped reader of one BPF ring buffer map.

    reader = RingReader(probes.ring_map_fd())
    while running:
        for t in reader.poll(100):          # tuples of events.RECORD
            ...                             # events.from_tuple(t) only when needed
    reader.close()
    """

    def __init__(self, map_fd: int, data_size: int | None = None,
                 record_size: int = ev.SIZE, record: struct.Struct | None = None):
        """`record` is the Struct to unpack (default events.RECORD, or any Struct of
        record_size bytes, e.g. a slimmer one with pad bytes over unused fields)."""
        if data_size is None:
            info = map_info(map_fd)
            if info["type"] != BPF_MAP_TYPE_RINGBUF:
                raise RingError(errno.EINVAL, f"map fd {map_fd} is of type {info['type']}, "
                                f"not a ring buffer ({BPF_MAP_TYPE_RINGBUF})")
            data_size = info["max_entries"]
        self._setup(data_size, record_size, record)
        page = mmap.PAGESIZE
        try:
            self._maps.append(mmap.mmap(map_fd, page, flags=mmap.MAP_SHARED,
                                        prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=0))
            self._maps.append(mmap.mmap(map_fd, page + 2 * data_size, flags=mmap.MAP_SHARED,
                                        prot=mmap.PROT_READ, offset=page))
        except OSError as e:
            self.close()
            raise RingError(e.errno, f"cannot mmap ring buffer map fd {map_fd}: {e.strerror} "
                            f"(kernel >= 5.8 and a BPF_MAP_TYPE_RINGBUF fd are needed)") from None
        self._attach(memoryview(self._maps[0]), memoryview(self._maps[1]), page)
        self.fd = map_fd
        self._epoll = select.epoll()
        self._epoll.register(map_fd, select.EPOLLIN)

    @classmethod
    def over_memory(cls, consumer_page, producer_area, data_size: int,
                    record_size: int = ev.SIZE, record: struct.Struct | None = None,
                    page: int = mmap.PAGESIZE) -> "RingReader":
        """A reader over plain writable buffers laid out like the kernel's mapping
        (producer_area = producer page + data twice): tests and benchmarks, no kernel."""
        self = cls.__new__(cls)
        self._setup(data_size, record_size, record)
        self._attach(memoryview(consumer_page), memoryview(producer_area), page)
        self.fd = -1
        return self

    def _setup(self, data_size: int, record_size: int, record: struct.Struct | None) -> None:
        self.record = record if record is not None else (
            ev.RECORD if record_size == ev.SIZE else struct.Struct(f"<{record_size}s"))
        if self.record.size != record_size:
            raise ValueError(f"record Struct is {self.record.size} bytes, not {record_size}")
        if data_size <= 0 or data_size & (data_size - 1):
            raise ValueError(f"ring data size must be a power of two, got {data_size}")
        self.data_size = data_size
        self.mask = data_size - 1
        self.wire = wire_struct(self.record)
        self.stats = WalkStats()
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self._epoll = None

    def _attach(self, cmv: memoryview, pmv: memoryview, page: int) -> None:
        if len(pmv) < page + 2 * self.data_size:
            raise ValueError("producer area must hold a page and the data area twice")
        self._cons_q = cmv[:8].cast("Q")
        self._prod_q = pmv[:8].cast("Q")
        self._data = pmv[page:page + 2 * self.data_size]
        self._views = [self._cons_q, self._prod_q, self._data, cmv, pmv]

    def fileno(self) -> int:
        """The map fd: readable (EPOLLIN) while the ring holds unconsumed data."""
        return self.fd

    def pending_bytes(self) -> int:
        return self._prod_q[0] - self._cons_q[0]

    def read_batch(self, max_records: int = 65536, raw: bool = False) -> list:
        """Records available now, oldest first: RECORD tuples, or payload bytes with raw.
        Never blocks. The consumed space is handed back to the kernel before returning."""
        prod = self._prod_q[0]
        cons = self._cons_q[0]
        if prod == cons:
            return []
        out: list = []
        new = walk(self._data, cons, prod, self.mask, self.record, out, max_records,
                   self.stats, raw, self.wire)
        if new != cons:
            self._cons_q[0] = new
        return out

    def poll(self, timeout_ms: int = 100, max_records: int = 65536, raw: bool = False) -> list:
        """read_batch(), waiting up to timeout_ms for data if the ring is empty."""
        out = self.read_batch(max_records, raw)
        if out or self._epoll is None:
            return out
        self._epoll.poll(timeout_ms / 1000 if timeout_ms >= 0 else -1)
        return self.read_batch(max_records, raw)

    def close(self) -> None:
        """Unmap the ring. The tuples already returned stay valid (they are copies)."""
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
        for v in self._views:
            v.release()
        self._views = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a view into the ring: unmapped when it is freed
        self._maps = []

    def __enter__(self) -> "RingReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- which reader -----------------------------------------------------------------------------
# The mapped walk above relies on x86-64's load ordering (TSO: loads are not reordered with
# loads), so the producer position, a record's header and its payload are seen in the order
# the kernel published them (kernel/bpf/ringbuf.c: smp_store_release of the producer position,
# read in libbpf with smp_load_acquire). Python has no acquire load; on arm64, ppc64, riscv
# the walk could read a header or payload older than the position it just read.
MMAP_MACHINES = frozenset({"x86_64", "amd64"})
READERS = ("auto", "mmap", "poll")


def choose(machine: str | None = None, override: str | None = None) -> tuple[str, str]:
    """("mmap" | "poll", why). override: NPTRACE_RING_READER (auto, mmap, poll)."""
    machine = machine or os.uname().machine
    want = (override if override is not None else os.environ.get("NPTRACE_RING_READER", "auto")
            ).strip().lower() or "auto"
    if want not in READERS:
        want = "auto"
    if want == "poll":
        return "poll", "NPTRACE_RING_READER=poll"
    if want == "mmap":
        return "mmap", f"NPTRACE_RING_READER=mmap on {machine}" + (
            "" if machine in MMAP_MACHINES else " (ordering not guaranteed on this CPU)")
    if machine in MMAP_MACHINES:
        return "mmap", f"memory-mapped walk ({machine}: loads are not reordered)"
    return "poll", (f"bcc ring_buffer_poll ({machine}: the memory-mapped walk needs x86-64 load "
                    "ordering; the callback path is slower, about 350-600k records/s)")


class PollReader:
    """RingReader's poll()/close() over bcc's callback consumer (loader.Probes.open_ring and
    poll: libbpf's ring_buffer__poll, which reads the positions with acquire loads). Records
    past max_records in one poll are kept for the next."""

    def __init__(self, probes):
        from collections import deque
        self.probes = probes
        self._pending = deque()
        self.stats = WalkStats()
        probes.open_ring(self._pending.append)

    def poll(self, timeout_ms: int = 100, max_records: int = 65536, raw: bool = False) -> list:
        if not self._pending:
            # the programs wake user space only every WAKE_EVERY records: consume what is
            # there, and only when nothing is, wait for a wake-up (or the timeout) and consume
            consume = getattr(self.probes, "consume", None)
            if consume is not None:
                consume()
            if not self._pending:
                self.probes.poll(timeout_ms)
                if consume is not None and not self._pending:
                    consume()
        out = []
        pend = self._pending
        while pend and len(out) < max_records:
            b = pend.popleft()
            if len(b) < ev.SIZE:
                self.stats.short += 1
                continue
            out.append(b if raw else ev.RECORD.unpack_from(b))
        return out

    def read_batch(self, max_records: int = 65536, raw: bool = False) -> list:
        return self.poll(0, max_records, raw)

    def close(self) -> None:
        self._pending.clear()


def open_reader(probes, log=lambda msg: None, machine: str | None = None):
    """The ring reader this CPU can use (choose()), said once."""
    kind, why = choose(machine)
    log(f"ring reader: {kind} ({why})")
    if kind == "poll":
        return PollReader(probes)
    return RingReader(probes.ring_map_fd())
