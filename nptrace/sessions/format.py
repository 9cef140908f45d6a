"""Recorded sessions (`nptrace run --record DIR`): the raw kernel records, framed so a crash
costs at most the last record and says so.

A session directory holds files `nptrace-<UTC start>-<run>-<part>.nps`. Each file is a
sequence of frames

    magic b"NPS1" | u32 payload length | u32 crc32(payload) | msgpack payload     (little end.)

and every payload is a map with a `rec` key:

    header    first frame of every file: format version, nptrace version, ABI, record size,
              node, kernel release, features, epoch_offset_ns (CLOCK_MONOTONIC -> epoch),
              reason tables {value: name}, interface names {netns: {ifindex: name}}, service
              names [[addr, port, name]], run id, part number, start time. Names and services
              are cumulative, so every file replays on its own after older ones are deleted.
    event     {abi, type, raw}: the 216-byte npt_event exactly as the ring buffer gave it
              (STYLE.md section 6), so `replay` re-runs the CURRENT classifier over it.
    names     {ifnames: {netns: {ifindex: name|None}}}: lookups the live classifier made
    services  {services: [[addr, port, name|None]]}: likewise for Service names
    counters  {ts_ns, counts: [[type, hook, reason, ifindex, netns, n]], stats}: the exact
              in-kernel counts (cumulative since the probes loaded) and ring-buffer loss

Why frames: a power loss can leave a partly written record or a tail of zeros (ext4 extends
the size before the data lands). The reader stops at the first frame whose magic, length or
crc is wrong. If no valid frame follows, that is a torn tail (expected after a crash: reported,
not fatal); if one does, the file is corrupt in the middle (reported as an error, reading
resumes at the next good frame).

Files are mode 0600 and a created directory 0700: events hold client addresses. An existing
directory's mode is left alone (`--record /tmp` must not chmod /tmp).
"""
from __future__ import annotations

import mmap
import os
import socket
import struct
import sys
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

import msgpack

from nptrace import __version__
from nptrace import events as ev
from nptrace.errors import NptraceError

FORMAT = "nptrace-session"
FORMAT_VERSION = 1
MAGIC = b"NPS1"
FRAME = struct.Struct("<4sII")
MAX_PAYLOAD = 64 << 20          # a header with every name of a big node is well below this
SUFFIX = ".nps"
PREFIX = "nptrace-"

# Offsets of `type` and `abi` in struct npt_event, so writing an event never decodes it.
_TYPE_ABI = struct.Struct("<HH")
_TYPE_OFF = ev.RawEvent.type.offset
assert ev.RawEvent.abi.offset == _TYPE_OFF + 2

DEFAULT_MAX_FILE_BYTES = 64 << 20
DEFAULT_MAX_AGE_S = 3600.0
DEFAULT_MAX_TOTAL_BYTES = 1 << 30
FLUSH_INTERVAL_S = 0.5          # buffered records reach the kernel within this (+ one poll)
FSYNC_INTERVAL_S = 1.0          # and the disk within this, for power loss
FLUSH_BYTES = 256 << 10
RETRY_S = 10.0                  # after a write error (disk full), try a new file this late


# Lookup answers repeated in each rotated file's header (the newest; older answers stay in
# the files that recorded them): keyed by client address, they could otherwise grow forever.
MAX_HEADER_LOOKUPS = 2048


class SessionError(NptraceError):
    """A session cannot be written or read at all (not a session, unreadable, bad limits)."""


# --- writing ------------------------------------------------------------------------------

def frame(payload: bytes) -> bytes:
    return FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _pack(rec: dict) -> bytes:
    return msgpack.packb(rec, use_bin_type=True)


def make_header(*, epoch_offset_ns: int, drops=None, resets=None, features: dict | None = None,
                ifnames: dict | None = None, services: Iterable | None = None,
                node: str | None = None, kernel: str | None = None,
                start_ns: int | None = None) -> dict:
    """The facts about the node that `replay` needs besides the events. `drops`/`resets` are
    nptrace.reasons.ReasonTable (or plain {value: name} dicts)."""
    def table(t):
        if t is None:
            return {}
        names = getattr(t, "names", t)
        return {int(k): str(v) for k, v in names.items()}
    uts = os.uname()
    return {
        "rec": "header",
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "nptrace": __version__,
        "abi": ev.ABI_VERSION,
        "record_size": ev.SIZE,
        "node": node or socket.gethostname(),
        "kernel": kernel or uts.release,
        "features": dict(features or {}),
        "epoch_offset_ns": int(epoch_offset_ns),
        "drop_reasons": table(drops),
        "rst_reasons": table(resets),
        "ifnames": {int(ns): {int(i): n for i, n in m.items()} for ns, m in (ifnames or {}).items()},
        "services": [list(s) for s in (services or ())],
        "start_ns": int(start_ns if start_ns is not None else time.time_ns()),
    }


def _utc_stamp(ns: int) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(ns / 1e9))


def session_files(directory: Path) -> list[Path]:
    """Session files of a directory, oldest first (the UTC start time leads the name)."""
    try:
        return sorted(p for p in directory.iterdir()
                      if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX) and p.is_file())
    except OSError:
        return []


class SessionWriter:
    """Appends framed records to a rotating set of files in `directory`.

    Records are buffered and reach the file at least every FLUSH_INTERVAL_S, provided
    `write_*` or `tick()` is called (the tracer's poll loop calls tick()); fsync at most once a
    second, and on rotate/close. A file is rotated when it would pass `max_file_bytes` or is
    older than `max_age_s`; then the oldest files are deleted until the directory's session
    files fit `max_total_bytes`. A write error (disk full) pauses recording, says so once on
    stderr, and retries with a new file RETRY_S later; tracing goes on.
    """

    def __init__(self, directory, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 max_age_s: float = DEFAULT_MAX_AGE_S,
                 max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES, header: dict | None = None,
                 *, clock: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns, log=None):
        if max_file_bytes < 4096:
            raise SessionError(f"session file size limit {max_file_bytes} bytes is too small "
                               "(at least 4096)")
        if max_total_bytes < max_file_bytes:
            raise SessionError(f"session total size limit {max_total_bytes} is below the file "
                               f"size limit {max_file_bytes}: raise the total or lower the file size")
        if max_age_s <= 0:
            raise SessionError("session file age limit must be positive")
        self.dir = Path(directory)
        self.max_file_bytes = int(max_file_bytes)
        self.max_age_s = float(max_age_s)
        self.max_total_bytes = int(max_total_bytes)
        self.clock, self.wall_ns = clock, wall_ns
        self.log = log or (lambda msg: print(f"nptrace: {msg}", file=sys.stderr, flush=True))
        hdr = dict(header) if header is not None else make_header(epoch_offset_ns=0)
        self.ifnames: dict[int, dict[int, str]] = {
            int(ns): dict(m) for ns, m in hdr.pop("ifnames", {}).items()}
        self.services: dict[tuple[str, int], str] = {
            (a, int(p)): n for a, p, n in hdr.pop("services", []) if n is not None}
        # other Context lookups the classifier made (rules, routes, endpoints): name -> {key: value}
        self.lookups: dict[str, dict[tuple, object]] = {
            name: {tuple(k): v for k, v in rows} for name, rows in hdr.pop("lookups", {}).items()}
        self.header = hdr
        self.run_id = uuid.uuid4().hex[:12]
        self.run_start_ns = int(hdr.get("start_ns") or wall_ns())
        self.part = 0
        self.fd: int | None = None
        self.path: Path | None = None
        self.buf = bytearray()
        self.buffered_records = 0
        self.size = 0                    # bytes written to the current file
        self.opened_at = 0.0
        self.buffered_since: float | None = None
        self.last_fsync = 0.0
        self.reopen_requested = False
        self.paused_until: float | None = None
        self.records = 0
        self.dropped = 0                 # records lost to write errors
        self.deleted: list[Path] = []    # files removed by the total-size cap
        self._make_dir()
        self._open()

    # -- files ---------------------------------------------------------------------------
    def _make_dir(self) -> None:
        try:
            self.dir.mkdir(mode=0o700, parents=False, exist_ok=False)
        except FileExistsError:
            if not self.dir.is_dir():
                raise SessionError(f"--record {self.dir}: exists and is not a directory") from None
        except FileNotFoundError:
            try:   # parents get the default mode; the session directory itself is 0700
                self.dir.parent.mkdir(parents=True, exist_ok=True)
                self.dir.mkdir(mode=0o700)
            except OSError as e:
                raise SessionError(f"cannot create session directory {self.dir}: {e.strerror}") from None
        except OSError as e:
            raise SessionError(f"cannot create session directory {self.dir}: {e.strerror}") from None

    def _header_record(self) -> dict:
        rec = dict(self.header)
        rec.update(run_id=self.run_id, part=self.part, run_start_ns=self.run_start_ns,
                   start_ns=self.wall_ns(),
                   ifnames={ns: dict(m) for ns, m in self.ifnames.items()},
                   services=[[a, p, n] for (a, p), n in self.services.items()],
                   lookups={name: [[list(k), v] for k, v in list(tab.items())[-MAX_HEADER_LOOKUPS:]]
                            for name, tab in self.lookups.items()})
        return rec

    def _open(self) -> None:
        now_ns = self.wall_ns()
        name = f"{PREFIX}{_utc_stamp(now_ns)}-{self.run_id}-{self.part:05d}{SUFFIX}"
        path = self.dir / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, 0o600)   # whatever the umask: the file holds client addresses
        except OSError as e:
            raise SessionError(f"cannot create session file {path}: {e.strerror}") from None
        self.fd, self.path = fd, path
        self.size = 0
        self.opened_at = self.clock()
        self.buf = bytearray(frame(_pack(self._header_record())))
        self.buffered_since = self.opened_at
        self._flush(force_sync=True)
        self._enforce_total()

    def _enforce_total(self) -> None:
        files = session_files(self.dir)
        sizes = {}
        for p in files:
            try:
                sizes[p] = p.stat().st_size
            except OSError:
                sizes[p] = 0
        total = sum(sizes.values())
        for p in files:
            if total <= self.max_total_bytes:
                break
            if p == self.path:
                continue
            try:
                p.unlink()
                self.deleted.append(p)
                total -= sizes[p]
            except OSError:
                continue

    def _close_file(self) -> None:
        if self.fd is None:
            return
        try:
            self._flush(force_sync=True)
        finally:
            fd, self.fd = self.fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def _rotate(self) -> None:
        self._close_file()
        self.part += 1
        try:
            self._open()
        except SessionError as e:
            self._pause(str(e))

    # -- buffering -----------------------------------------------------------------------
    def _flush(self, force_sync: bool = False) -> None:
        if self.fd is None:
            return
        now = self.clock()
        if self.buf:
            data, self.buf = bytes(self.buf), bytearray()
            n_records, self.buffered_records = self.buffered_records, 0
            self.buffered_since = None
            try:
                view = memoryview(data)
                while view:
                    n = os.write(self.fd, view)
                    view = view[n:]
                self.size += len(data)
            except OSError as e:
                self.buffered_records = n_records
                self._pause(f"cannot write session file {self.path}: {e.strerror}")
                return
        if force_sync or now - self.last_fsync >= FSYNC_INTERVAL_S:
            try:
                os.fsync(self.fd)
            except OSError:
                pass
            self.last_fsync = now

    def _pause(self, why: str) -> None:
        self.log(f"warning: session recording paused: {why}; retrying in {RETRY_S:.0f}s")
        self.dropped += self.buffered_records
        self.buffered_records = 0
        self.buf = bytearray()
        self.buffered_since = None
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        self.paused_until = self.clock() + RETRY_S

    def _resume_if_due(self) -> bool:
        if self.paused_until is None:
            return True
        if self.clock() < self.paused_until:
            return False
        self.paused_until = None
        self.part += 1
        try:
            self._open()
        except SessionError as e:
            self._pause(str(e))
            return False
        self.log(f"session recording resumed in {self.path}")
        return True

    def _append(self, rec: dict) -> None:
        if self.reopen_requested:
            self.reopen_requested = False
            if self.fd is not None:
                self._rotate()
        if not self._resume_if_due():
            self.dropped += 1
            return
        data = frame(_pack(rec))
        full = self.size + len(self.buf) + len(data) > self.max_file_bytes
        if full or self.clock() - self.opened_at >= self.max_age_s:
            self._rotate()
            if self.fd is None:
                self.dropped += 1
                return
        self.buf += data
        self.buffered_records += 1
        self.records += 1
        now = self.clock()
        if self.buffered_since is None:
            self.buffered_since = now
        if len(self.buf) >= FLUSH_BYTES or now - self.buffered_since >= FLUSH_INTERVAL_S:
            self._flush()

    # -- public --------------------------------------------------------------------------
    def write_event(self, raw: bytes) -> None:
        """One ring-buffer record, as received (at least ev.SIZE bytes)."""
        raw = bytes(raw[:ev.SIZE])
        typ, abi = _TYPE_ABI.unpack_from(raw, _TYPE_OFF) if len(raw) >= ev.SIZE else (0, 0)
        self._append({"rec": "event", "abi": abi, "type": typ, "raw": raw})

    def write_names(self, ifnames: dict) -> None:
        """{netns: {ifindex: name or None}}: new or changed interface names."""
        clean = {}
        for ns, m in ifnames.items():
            for i, n in m.items():
                clean.setdefault(int(ns), {})[int(i)] = n
                if n is None:
                    self.ifnames.get(int(ns), {}).pop(int(i), None)
                else:
                    self.ifnames.setdefault(int(ns), {})[int(i)] = n
        if clean:
            self._append({"rec": "names", "ifnames": clean})

    def write_services(self, entries: Iterable) -> None:
        """[(addr, port, name or None)]: new or changed Service names of address:port pairs."""
        clean = []
        for a, p, n in entries:
            clean.append([a, int(p), n])
            if n is None:
                self.services.pop((a, int(p)), None)
            else:
                self.services[(a, int(p))] = n
        if clean:
            self._append({"rec": "services", "services": clean})

    def write_lookup(self, name: str, key: tuple, value) -> None:
        """A new or changed answer of a Context lookup (msgpack-able key and value)."""
        self.lookups.setdefault(name, {})[tuple(key)] = value
        self._append({"rec": "lookup", "name": name, "key": list(key), "value": value})

    def write_counters(self, counts: dict, stats: dict, ts_ns: int | None = None) -> None:
        """Cumulative kernel counts {(type, hook, reason, ifindex, netns): n} and the ring's
        {"emitted", "lost", "filtered"} (loader.Probes.counts() / .stats())."""
        rows = [[int(x) for x in k] + [int(n)] for k, n in counts.items()]
        self._append({"rec": "counters", "ts_ns": int(ts_ns if ts_ns is not None else time.monotonic_ns()),
                      "counts": rows, "stats": {k: int(v) for k, v in stats.items()}})

    def tick(self) -> None:
        """From the main loop: flush what is due, rotate by age, honour reopen()."""
        if self.reopen_requested:
            self.reopen_requested = False
            if self.fd is not None:
                self._rotate()
        if not self._resume_if_due():
            return
        now = self.clock()
        if self.buffered_since is not None and now - self.buffered_since >= FLUSH_INTERVAL_S:
            self._flush()
        elif now - self.last_fsync >= FSYNC_INTERVAL_S and self.fd is not None:
            self._flush()
        if self.fd is not None and now - self.opened_at >= self.max_age_s:
            self._rotate()

    def reopen(self) -> None:
        """SIGHUP: start a new file at the next write or tick. Only sets a flag, so it is safe
        to call from a signal handler."""
        self.reopen_requested = True

    def flush(self) -> None:
        self._flush(force_sync=True)

    def close(self) -> None:
        self._close_file()


# --- reading ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    path: str
    kind: str           # torn_tail | corrupt | not_session | unreadable | abi
    offset: int
    dropped: int
    message: str

    @property
    def serious(self) -> bool:
        """A torn tail is what a crash leaves; everything else means data we cannot trust."""
        return self.kind != "torn_tail"

    def __str__(self) -> str:
        return self.message


class Record(NamedTuple):
    kind: str           # event | names | services | counters
    data: dict
    header: dict        # the header of the file this record is in
    path: str
    offset: int


def _valid_frame(buf, off: int, end: int) -> tuple[int, bytes] | None:
    if end - off < FRAME.size:
        return None
    magic, n, crc = FRAME.unpack_from(buf, off)
    if magic != MAGIC or n > MAX_PAYLOAD or off + FRAME.size + n > end:
        return None
    payload = bytes(buf[off + FRAME.size: off + FRAME.size + n])
    if zlib.crc32(payload) != crc:
        return None
    return FRAME.size + n, payload


def _unpack(payload: bytes) -> dict | None:
    try:
        rec = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("rec"), str) else None


def _next_valid(buf, start: int, end: int) -> int | None:
    pos = start
    while True:
        pos = buf.find(MAGIC, pos, end)
        if pos < 0:
            return None
        if _valid_frame(buf, pos, end) is not None:
            return pos
        pos += 1


def _open_map(path: Path):
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_header(path) -> dict:
    """The first record of a session file; SessionError if it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(FRAME.size)
            if len(head) < FRAME.size or head[:4] != MAGIC:
                raise SessionError(f"{path}: not an nptrace session file")
            n = FRAME.unpack(head)[1]
            if n > MAX_PAYLOAD:
                raise SessionError(f"{path}: not an nptrace session file")
            buf = head + f.read(n)
    except OSError as e:
        raise SessionError(f"cannot read {path}: {e.strerror}") from None
    got = _valid_frame(buf, 0, len(buf))
    rec = _unpack(got[1]) if got else None
    if rec is None or rec.get("rec") != "header" or rec.get("format") != FORMAT:
        raise SessionError(f"{path}: not an nptrace session file (bad first record)")
    if int(rec.get("format_version", 0)) > FORMAT_VERSION:
        raise SessionError(f"{path}: session format {rec.get('format_version')} is newer than "
                           f"this nptrace reads ({FORMAT_VERSION}): upgrade nptrace")
    rec["_path"] = str(path)
    return rec


def _cut_at_birth(path: Path) -> bool:
    """Empty, or a first frame that starts right (magic) but is cut short."""
    try:
        with open(path, "rb") as f:
            head = f.read(FRAME.size)
            if not head:
                return True
            if head[:4] != MAGIC[:len(head[:4])]:
                return False
            if len(head) < FRAME.size:
                return True
            n = FRAME.unpack(head)[1]
            return n <= MAX_PAYLOAD and len(f.read(n)) < n
    except OSError:
        return False


def _records_of(path: Path, header: dict, problems: list) -> Iterator[Record]:
    try:
        buf = _open_map(path)
    except OSError as e:
        problems.append(Problem(str(path), "unreadable", 0, 0, f"cannot read {path}: {e.strerror}"))
        return
    try:
        end = len(buf)
        first = _valid_frame(buf, 0, end)
        off = first[0] if first else end
        while off < end:
            got = _valid_frame(buf, off, end)
            rec = _unpack(got[1]) if got else None
            if rec is None:
                nxt = _next_valid(buf, off + 1, end)
                if nxt is None:
                    problems.append(Problem(
                        str(path), "torn_tail", off, end - off,
                        f"{path}: torn tail at byte {off}: {end - off} bytes dropped "
                        "(the writer stopped mid-record: a crash or power loss)"))
                    return
                problems.append(Problem(
                    str(path), "corrupt", off, nxt - off,
                    f"{path}: corrupt record at byte {off}: {nxt - off} bytes skipped, "
                    f"reading resumed at byte {nxt}"))
                off = nxt
                continue
            off += got[0]
            kind = rec.pop("rec")
            if kind == "header":
                continue      # files are never concatenated by us; tolerate it if someone did
            yield Record(kind, rec, header, str(path), off - got[0])
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()


def _expand(paths) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = session_files(p)
            if not found:
                raise SessionError(f"{p}: no session files (nptrace-*.nps) in this directory")
            files += found
        elif p.exists():
            files.append(p)
        else:
            raise SessionError(f"{p}: no such file or directory")
    return files


def read_session(paths) -> tuple[list[dict], Iterator[Record], list[Problem]]:
    """(headers, records, problems) of one or more session files or directories.

    Headers are read up front (one per file, each with "_path"), and files are ordered by run
    start and part. `records` is a lazy iterator; `problems` fills while it is consumed (torn
    tails, corrupt middles) and already holds files that are not sessions. A missing path,
    or a single named file that is not a session, raises SessionError.
    """
    files = _expand(paths)
    problems: list[Problem] = []
    headers = []
    for f in files:
        try:
            headers.append(read_header(f))
        except SessionError as e:
            if len(files) > 1 and _cut_at_birth(f):
                # A crash between creating a rotated file and writing its header: a torn tail
                # of the session, not a foreign file.
                size = f.stat().st_size
                problems.append(Problem(str(f), "torn_tail", 0, size,
                                        f"{f}: torn tail at byte 0: {size} bytes dropped "
                                        "(the header was never completely written)"))
                continue
            if len(files) == 1:
                raise
            problems.append(Problem(str(f), "not_session", 0, 0, str(e)))
    headers.sort(key=lambda h: (h.get("run_start_ns", h.get("start_ns", 0)), h.get("run_id", ""),
                                h.get("part", 0), h["_path"]))
    for h in headers:
        if h.get("abi") != ev.ABI_VERSION:
            problems.append(Problem(h["_path"], "abi", 0, 0,
                                    f"{h['_path']}: recorded with event ABI {h.get('abi')}, this "
                                    f"nptrace reads ABI {ev.ABI_VERSION}: replay it with nptrace "
                                    f"{h.get('nptrace', '?')}"))

    def gen() -> Iterator[Record]:
        for h in headers:
            if h.get("abi") != ev.ABI_VERSION:
                continue
            yield from _records_of(Path(h["_path"]), h, problems)
    return headers, gen(), problems

