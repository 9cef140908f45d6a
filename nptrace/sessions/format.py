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
    packet    {raw}: a packet-bytes record (bpf/npt_packet.h struct npt_packet and its first
              --snaplen bytes of the packet) as the ring buffer gave it, after the event it
              belongs to or before it in the same batch; `replay -w` writes the real bytes.
              Format 2 (format 1 files have none and read as before; an older nptrace
              refuses format 2 files by their header, as it refuses any newer format).
    names     {ifnames: {netns: {ifindex: name|None}}}: lookups the live classifier made
    services  {services: [[addr, port, name|None]]}: likewise for Service names
    lookup    {name, key, value}: another Context lookup's answer (nf_rule, endpoint_of, ...)
    counters  {ts_ns, counts: [[type, hook, reason, ifindex, netns, n]], stats}: the exact
              in-kernel counts (cumulative since the probes loaded) and ring-buffer loss
    stop      {why: stop|rotate, ts_ns, records, dropped}: the last frame of a file that was
              closed on purpose. A file without one lost its end (a crash, a cut copy, or it is
              still being written), even when the cut fell exactly between two frames.

Each kind has one schema (sessions/schema.py); the reader checks every header and record
against it, so what leaves this module has the types the readers expect: a record that fails
is counted and skipped, never passed on. Frames, their resync and the bounds of unpacking one
are sessions/framing.py: a frame msgpack refuses within them is counted and skipped too, named
by its index and byte offset. Only regular files are read (a FIFO or /dev/zero given as a
session is refused, not waited on).

Lookup answers are bounded (LOOKUP_CACHE per lookup, oldest written first out), so a scanner's
ever-new client tuples cannot grow the recorder: an answer is written again when it was
forgotten, and replay keeps twice as many, so it always holds what the recorder assumed.

Files are mode 0600 and the directory 0700: events hold client addresses. Written as root
into a directory others may reach, so: files are created with O_NOFOLLOW|O_EXCL relative to
the directory's fd (a planted link is refused, never followed); the directory must not be a
link, must be ours and not writable by others (`--record /tmp` is refused, not chmodded; a
0755 directory of ours, as the kubelet creates a hostPath, is tightened to 0700); and the size
cap deletes only files that start with an nptrace session header, whatever their names.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import socket
import stat
import struct
import sys
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

import msgpack

from nptrace import __version__
from nptrace import events as ev
from nptrace.config import MAX_SNAPLEN
from nptrace.errors import NptraceError
from nptrace.sessions.framing import (FRAME, MAGIC, MAX_PAYLOAD, Refused, Resync, frame,
                                      unpack, valid_frame)
from nptrace.sessions.schema import Invalid, check_header, check_record

FORMAT = "nptrace-session"
FORMAT_VERSION = 2       # 2: packet records (format 1 is read alike)
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


# Lookup answers the recorder keeps per lookup (and repeats in each rotated file's header):
# keyed by client addresses, they would otherwise grow forever (2M distinct client tuples
# measured +440 MB). Replay keeps REPLAY_FACTOR times as many (see LookupTables).
LOOKUP_CACHE = 4096
REPLAY_FACTOR = 2


class SessionError(NptraceError):
    """A session cannot be written or read at all (not a session, unreadable, bad limits)."""


# --- writing ------------------------------------------------------------------------------


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


class LookupTables:
    """The answers a session holds, per lookup: {name: {key: value}}, bounded.

    An absent key means the answer None (replay answers None for what it was never told), so
    None answers of unknown keys are never stored or written. Each table keeps its newest
    `cap` written answers; the oldest go when an event is written (trim(), between two
    events' lookups, so a span of lookups for one event never loses what it just used).

    The recorder's tables hold `cap`, replay's REPLAY_FACTOR * cap: both apply the same writes
    in the same order, so replay's hold everything the recorder's do, whenever replay asks
    (also for flows a live tick reported between two events). A key the recorder forgot
    but replay may still hold is kept in `ghost` (keys only): its None answer is written, so
    replay forgets it too.
    """

    def __init__(self, cap: int | None, ghost: bool = False):
        self.cap = cap                       # None: unbounded (sessions of older writers)
        self.tabs: dict[str, OrderedDict] = {}
        self.ghosts: dict[str, OrderedDict] | None = {} if ghost else None

    def get(self, name: str, key, default=None):
        tab = self.tabs.get(name)
        return default if tab is None else tab.get(key, default)

    def table(self, name: str) -> OrderedDict:
        tab = self.tabs.get(name)
        if tab is None:
            tab = self.tabs[name] = OrderedDict()
        return tab

    def needs_write(self, name: str, key, value) -> bool:
        """Does the answer differ from what a replay of the session would answer?"""
        tab = self.tabs.get(name)
        if tab is not None and key in tab:
            return tab[key] != value
        if value is not None:
            return True
        g = self.ghosts.get(name) if self.ghosts is not None else None
        return g is not None and key in g

    def put(self, name: str, key, value) -> None:
        tab = self.table(name)
        if value is None:
            tab.pop(key, None)
        else:
            tab[key] = value
            tab.move_to_end(key)
        if self.ghosts is not None and name in self.ghosts:
            self.ghosts[name].pop(key, None)

    def trim(self) -> None:
        if self.cap is None:
            return
        for name, tab in self.tabs.items():
            if len(tab) <= self.cap:
                continue
            g = None
            if self.ghosts is not None:
                g = self.ghosts.setdefault(name, OrderedDict())
            while len(tab) > self.cap:
                k, _v = tab.popitem(last=False)
                if g is not None:
                    g[k] = None
            if g is not None:
                while len(g) > self.cap * (REPLAY_FACTOR - 1):
                    g.popitem(last=False)

    def replace(self, name: str, rows) -> None:
        """A header's copy of one table (in its order) becomes the table."""
        tab = self.tabs[name] = OrderedDict()
        for k, v in rows:
            if v is not None:
                tab[k] = v

    def merge(self, name: str, rows) -> None:
        tab = self.table(name)
        for k, v in rows:
            tab[k] = v

    def size(self) -> int:
        return sum(len(t) for t in self.tabs.values())


# Table names of the two lookups that have record kinds of their own (names, services).
IFACE, SERVICE = "iface_name", "service_of"


def ifnames_rows(ifnames: dict) -> list:
    """{netns: {ifindex: name}} as table rows ((netns, ifindex), name), in its order."""
    return [((int(ns), int(i)), n) for ns, m in ifnames.items() for i, n in m.items()]


class SessionWriter:
    """Appends framed records to a rotating set of files in `directory`.

    Records are buffered and reach the file at least every FLUSH_INTERVAL_S, provided
    `write_*` or `tick()` is called (the tracer's poll loop calls tick()); fsync at most once a
    second, and on rotate/close. A file is rotated when it would pass `max_file_bytes` or is
    older than `max_age_s`; then the oldest session files are deleted until the directory's
    session files fit `max_total_bytes`. A write error (disk full) pauses recording, says so
    once on stderr, and retries with a new file RETRY_S later; tracing goes on. Every file
    ends with a stop record (why: rotate or stop) when it is closed on purpose.
    """

    def __init__(self, directory, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 max_age_s: float = DEFAULT_MAX_AGE_S,
                 max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES, header: dict | None = None,
                 *, clock: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns, log=None,
                 lookup_cache: int = LOOKUP_CACHE):
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
        self.known = LookupTables(int(lookup_cache), ghost=True)
        for k, n in ifnames_rows(hdr.pop("ifnames", {})):
            self.known.put(IFACE, k, n)
        for a, p, n in hdr.pop("services", []):
            self.known.put(SERVICE, (a, int(p)), n)
        # other Context lookups the classifier made (rules, routes, endpoints): name -> rows
        for name, rows in hdr.pop("lookups", {}).items():
            for k, v in rows:
                self.known.put(name, tuple(k), v)
        self.known.trim()
        self.header = hdr
        self.run_id = uuid.uuid4().hex[:12]
        self.run_start_ns = int(hdr.get("start_ns") or wall_ns())
        self.part = 0
        self.fd: int | None = None
        self.dir_fd: int | None = None
        self.path: Path | None = None
        self.buf = bytearray()
        self.buffered_records = 0
        self.file_records = 0            # records in the current file
        self.size = 0                    # bytes written to the current file
        self.opened_at = 0.0
        self.buffered_since: float | None = None
        self.last_fsync = 0.0
        self.reopen_requested = False
        self.paused_until: float | None = None
        self.records = 0
        self.dropped = 0                 # records lost to write errors
        self.last_error: OSError | None = None
        self.deleted: list[Path] = []    # files removed by the total-size cap
        self._open_dir()
        self._open()

    # compatibility views of the tables (tests, snapshot readers)
    @property
    def ifnames(self) -> dict[int, dict[int, str]]:
        out: dict[int, dict[int, str]] = {}
        for (ns, i), n in self.known.table(IFACE).items():
            out.setdefault(ns, {})[i] = n
        return out

    @property
    def services(self) -> dict[tuple[str, int], str]:
        return dict(self.known.table(SERVICE))

    # -- files ---------------------------------------------------------------------------
    def _open_dir(self) -> None:
        """Create (0700) or check the session directory and keep an fd of it: every file is
        then created relative to that fd, so a directory swapped for a link later is not
        followed either."""
        d = self.dir
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            try:   # parents get the default mode; the session directory itself is 0700
                d.parent.mkdir(parents=True, exist_ok=True)
                d.mkdir(mode=0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise SessionError(f"cannot create session directory {d}: {e.strerror}") from None
        except OSError as e:
            raise SessionError(f"cannot create session directory {d}: {e.strerror}") from None
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if os.path.islink(d):
                raise SessionError(f"--record {d}: is a symbolic link; nptrace writes session "
                                   "files only into a real directory (give its target)") from None
            if e.errno == errno.ENOTDIR:
                raise SessionError(f"--record {d}: exists and is not a directory") from None
            raise SessionError(f"cannot open session directory {d}: {e.strerror}") from None
        try:
            check_session_dir(fd, d)
        except SessionError:
            os.close(fd)
            raise
        self.dir_fd = fd

    def _header_record(self) -> dict:
        rec = dict(self.header)
        k = self.known
        # The header's order becomes the tables' order (replay rebuilds them from it).
        ifn: dict[int, dict[int, str]] = {}
        for (ns, i), n in k.table(IFACE).items():
            ifn.setdefault(ns, {})[i] = n
        k.replace(IFACE, ifnames_rows(ifn))
        rec.update(run_id=self.run_id, part=self.part, run_start_ns=self.run_start_ns,
                   start_ns=self.wall_ns(), ifnames=ifn,
                   services=[[a, p, n] for (a, p), n in k.table(SERVICE).items()],
                   lookups={name: [[list(key), v] for key, v in tab.items()]
                            for name, tab in k.tabs.items() if name not in (IFACE, SERVICE)},
                   lookup_cache=k.cap, stop_record=True)
        return rec

    def _open(self) -> None:
        now_ns = self.wall_ns()
        name = f"{PREFIX}{_utc_stamp(now_ns)}-{self.run_id}-{self.part:05d}{SUFFIX}"
        path = self.dir / name
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
            os.fchmod(fd, 0o600)   # whatever the umask: the file holds client addresses
        except OSError as e:
            raise SessionError(f"cannot create session file {path}: {e.strerror}") from None
        try:      # held while the file is written: a reader then knows why it has no stop yet
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        self.fd, self.path = fd, path
        self.size = 0
        self.file_records = 0
        self.opened_at = self.clock()
        self.buf = bytearray(frame(_pack(self._header_record())))
        self.buffered_since = self.opened_at
        self._flush(force_sync=True)
        self._enforce_total()

    def _enforce_total(self) -> None:
        """Delete the oldest session files until the directory's fit the total. Only files
        that start with a session header count and are deleted, whatever their names: a
        file someone else put there (or a link named like ours) is never touched."""
        ours = []
        try:
            names = sorted(n for n in os.listdir(self.dir_fd)
                           if n.startswith(PREFIX) and n.endswith(SUFFIX))
        except OSError:
            return
        for n in names:
            try:
                st = os.stat(n, dir_fd=self.dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if self.path is not None and n == self.path.name:
                ours.append((n, st.st_size))
                continue
            if _starts_with_header(self.dir_fd, n):
                ours.append((n, st.st_size))
        total = sum(sz for _, sz in ours)
        for n, sz in ours:
            if total <= self.max_total_bytes:
                break
            if self.path is not None and n == self.path.name:
                continue
            try:
                os.unlink(n, dir_fd=self.dir_fd)
                self.deleted.append(self.dir / n)
                total -= sz
            except OSError:
                continue

    def _close_file(self, why: str = "stop") -> None:
        if self.fd is None:
            return
        try:
            self.buf += frame(_pack({"rec": "stop", "why": why, "ts_ns": time.monotonic_ns(),
                                     "records": self.file_records, "dropped": self.dropped}))
            self._flush(force_sync=True)
        finally:
            fd, self.fd = self.fd, None
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _rotate(self) -> None:
        self._close_file("rotate")
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
                self.last_error = e      # open_outputs: a header that never fits stops the start
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
        full = self.size + len(self.buf) + len(data) > self.max_file_bytes - 64   # + stop
        if full or self.clock() - self.opened_at >= self.max_age_s:
            self._rotate()
            if self.fd is None:
                self.dropped += 1
                return
        self.buf += data
        self.buffered_records += 1
        self.file_records += 1
        self.records += 1
        now = self.clock()
        if self.buffered_since is None:
            self.buffered_since = now
        if len(self.buf) >= FLUSH_BYTES or now - self.buffered_since >= FLUSH_INTERVAL_S:
            self._flush()

    # -- public --------------------------------------------------------------------------
    def write_event(self, raw: bytes) -> None:
        """One ring-buffer record, as received (at least ev.SIZE bytes)."""
        self.known.trim()     # between two events' lookups (LookupTables)
        raw = bytes(raw[:ev.SIZE])
        typ, abi = _TYPE_ABI.unpack_from(raw, _TYPE_OFF) if len(raw) >= ev.SIZE else (0, 0)
        self._append({"rec": "event", "abi": abi, "type": typ, "raw": raw})

    def write_packet(self, raw: bytes) -> None:
        """One packet-bytes record, as received (bounded: the kernel copies at most
        --snaplen <= MAX_SNAPLEN bytes)."""
        self._append({"rec": "packet", "raw": bytes(raw[:ev.PACKET.size + MAX_SNAPLEN])})

    def needs_write(self, name: str, key, value) -> bool:
        return self.known.needs_write(name, key, value)

    def write_names(self, ifnames: dict) -> None:
        """{netns: {ifindex: name or None}}: new or changed interface names."""
        clean = {}
        for (ns, i), n in ifnames_rows(ifnames):
            clean.setdefault(ns, {})[i] = n
            self.known.put(IFACE, (ns, i), n)
        if clean:
            self._append({"rec": "names", "ifnames": clean})

    def write_services(self, entries: Iterable) -> None:
        """[(addr, port, name or None)]: new or changed Service names of address:port pairs."""
        clean = []
        for a, p, n in entries:
            clean.append([a, int(p), n])
            self.known.put(SERVICE, (a, int(p)), n)
        if clean:
            self._append({"rec": "services", "services": clean})

    def write_lookup(self, name: str, key: tuple, value) -> None:
        """A new or changed answer of a Context lookup (msgpack-able key and value)."""
        self.known.put(name, tuple(key), value)
        self._append({"rec": "lookup", "name": name, "key": list(key), "value": value})

    def write_counters(self, counts: dict, stats: dict, ts_ns: int | None = None) -> None:
        """Cumulative kernel counts {(type, hook, reason, ifindex, netns): n} and the ring's
        {"emitted", "lost", "filtered"} (loader.Probes.counts() / .stats())."""
        rows = [[int(x) for x in k] + [int(n)] for k, n in counts.items()]
        self._append({"rec": "counters", "ts_ns": int(ts_ns if ts_ns is not None else time.monotonic_ns()),
                      "counts": rows, "stats": {k: int(v) for k, v in stats.items()}})

    def write_summary(self, rows) -> None:
        """The live run's summary rows (sinks/exact.py SummaryRow): records counted under
        their cause in the kernel and not sent, so replay and report give the same totals."""
        for r in rows:
            lab = r.label
            self._append({"rec": "summary", "ts_ns": int(r.until_ns), "since_ns": int(r.since_ns),
                          "kind": lab.kind, "direction": lab.direction, "hook": lab.hook,
                          "reason": lab.reason, "cause": lab.cause, "service": lab.service,
                          "iface": lab.iface, "repeat": int(r.repeat)})

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
        """A clean stop: the file ends with a stop record (replay checks for it)."""
        self._close_file("stop")
        if self.dir_fd is not None:
            try:
                os.close(self.dir_fd)
            except OSError:
                pass
            self.dir_fd = None


def _starts_with_header(dir_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        buf = _read_head(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        got = valid_frame(buf, 0, len(buf))
        rec = unpack(got[1]) if got else None
    except Refused:
        return False
    return rec is not None and rec.get("rec") == "header" and rec.get("format") == FORMAT


def check_session_dir(fd: int, path: Path) -> None:
    """The session directory must be ours and closed to others: files are written as root
    and hold client addresses. Ours and open (0755, as the kubelet creates a hostPath): it
    is tightened to 0700. Someone else's, or shared (world-writable or sticky, as /tmp):
    refused, not chmodded."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        raise SessionError(f"--record {path}: owned by uid {st.st_uid}, not by nptrace's uid "
                           f"{os.geteuid()}: give nptrace a directory of its own (it writes "
                           "client addresses there)")
    if mode & 0o002 or st.st_mode & stat.S_ISVTX:
        raise SessionError(f"--record {path}: a shared directory, writable by every user "
                           f"(mode {stat.S_IMODE(st.st_mode) | (st.st_mode & stat.S_ISVTX):04o}): "
                           f"give nptrace a directory of its own, e.g. {path}/nptrace")
    if mode & 0o077:
        try:
            os.fchmod(fd, mode & 0o700)
        except OSError as e:
            raise SessionError(f"--record {path}: mode {mode:04o} and cannot make it 0700: "
                               f"{e.strerror}") from None


# --- reading ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    path: str
    kind: str           # torn_tail | no_stop | corrupt | invalid | refused | unknown | not_session
    offset: int         # | unreadable | abi | undecodable | recorder_dropped | ring_lost
    dropped: int        # bytes (torn_tail, corrupt) or records (the others)
    message: str

    @property
    def serious(self) -> bool:
        """A torn tail or a missing stop record is what a crash leaves, records of a kind a
        newer nptrace writes are skipped on purpose, and losses the live run counted are
        facts; everything else means data we cannot trust."""
        return self.kind not in ("torn_tail", "no_stop", "unknown", "recorder_dropped",
                                 "ring_lost")

    def __str__(self) -> str:
        return self.message


class Record(NamedTuple):
    kind: str           # event | names | services | lookup | counters
    data: dict
    header: dict        # the header of the file this record is in
    path: str
    offset: int



def _open_regular(path: Path) -> int:
    """An fd of path opened for reading, refusing what is not a regular file (a FIFO would
    block the open and every read, /dev/zero never ends). O_NONBLOCK: opening a FIFO returns
    at once, so it can be refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise SessionError(f"cannot read {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise SessionError(f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SessionError(f"{path}: not a regular file ({_file_type(st.st_mode)}): a session "
                           "is a file nptrace run --record wrote")
    return fd


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"


def _open_map(path: Path):
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def _read_head(fd: int) -> bytes:
    """The first frame's bytes (at most its claimed length), read from a regular file."""
    head = os.pread(fd, FRAME.size, 0)
    if len(head) < FRAME.size or head[:4] != MAGIC:
        return head
    n = FRAME.unpack(head)[1]
    if n > MAX_PAYLOAD:
        return head
    return head + os.pread(fd, n, FRAME.size)


def read_header(path) -> dict:
    """The first record of a session file, checked by its schema; SessionError if it is not
    one."""
    path = Path(path)
    fd = _open_regular(path)
    try:
        buf = _read_head(fd)
    except OSError as e:
        raise SessionError(f"cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    got = valid_frame(buf, 0, len(buf))
    if got is None:
        raise SessionError(f"{path}: not an nptrace session file")
    try:
        rec = unpack(got[1])
    except Refused as e:
        raise SessionError(f"{path}: its first frame (the header, {len(got[1])} bytes) "
                           f"was refused: {e}") from None
    if rec is None or rec.get("rec") != "header" or rec.get("format") != FORMAT:
        raise SessionError(f"{path}: not an nptrace session file (bad first record)")
    version = rec.get("format_version")
    if type(version) is int and version > FORMAT_VERSION:
        raise SessionError(f"{path}: session format {version} is newer than "
                           f"this nptrace reads ({FORMAT_VERSION}): upgrade nptrace")
    try:
        rec = check_header(rec)
    except Invalid as e:
        raise SessionError(f"{path}: not a valid nptrace session header ({e})") from None
    rec["_path"] = str(path)
    return rec


def is_session_file(path) -> bool:
    """Does path start with an nptrace session header (whatever its name)?"""
    try:
        read_header(path)
        return True
    except SessionError:
        return False


def _cut_at_birth(path: Path) -> bool:
    """Empty, or a first frame that starts right (magic) but is cut short."""
    try:
        fd = _open_regular(path)
    except SessionError:
        return False
    try:
        head = os.pread(fd, FRAME.size, 0)
        if not head:
            return True
        if head[:4] != MAGIC[:len(head[:4])]:
            return False
        if len(head) < FRAME.size:
            return True
        n = FRAME.unpack(head)[1]
        return n <= MAX_PAYLOAD and len(os.pread(fd, n, FRAME.size)) < n
    except OSError:
        return False
    finally:
        os.close(fd)


def _being_written(path: Path) -> bool:
    """Does a live recorder hold this file (SessionWriter locks the file it writes)?"""
    try:
        fd = _open_regular(path)
    except SessionError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


class _FileLoss:
    """What one file lost, summed: one problem per kind and file, not one per frame (a file
    of a million bad frames is one line)."""

    def __init__(self, path: str):
        self.path = path
        self.corrupt = []          # (offset, bytes skipped)
        self.invalid = 0
        self.first_invalid = ""
        self.unknown: dict[str, int] = {}
        self.refused = []          # (frame index, offset, why)

    def problems(self, resync: Resync) -> list[Problem]:
        p, out = self.path, []
        if self.corrupt:
            off, n = self.corrupt[0]
            total = sum(x[1] for x in self.corrupt)
            if len(self.corrupt) == 1:
                msg = (f"{p}: corrupt record at byte {off}: {n} bytes skipped, "
                       f"reading resumed at byte {off + n}")
            else:
                msg = (f"{p}: {len(self.corrupt)} corrupt regions, {total} bytes skipped "
                       f"(the first at byte {off})")
            if resync.gave_up:
                msg += (f"; {resync.gave_up} long candidate frames were not checked (a file "
                        "full of fake frame headers)")
            out.append(Problem(p, "corrupt", off, total, msg))
        if self.invalid:
            out.append(Problem(p, "invalid", 0, self.invalid,
                               f"{p}: {self.invalid} record{'s' if self.invalid > 1 else ''} "
                               f"invalid and skipped (the first: {self.first_invalid})"))
        if self.refused:
            i, off, why = self.refused[0]
            n = len(self.refused)
            first = f"frame {i} at byte {off}: {why}"
            out.append(Problem(p, "refused", off, n, f"{p}: {first}: refused and skipped" if n == 1
                               else f"{p}: {n} frames refused and skipped (the first: {first})"))
        if self.unknown:
            kinds = ", ".join(f"{k} ({n})" for k, n in sorted(self.unknown.items())[:5])
            out.append(Problem(p, "unknown", 0, sum(self.unknown.values()),
                               f"{p}: skipped records of kinds this nptrace does not know: "
                               f"{kinds} (written by a newer nptrace?)"))
        return out


def _records_of(path: Path, header: dict, problems: list) -> Iterator[Record]:
    try:
        buf = _open_map(path)
    except SessionError as e:
        problems.append(Problem(str(path), "unreadable", 0, 0, str(e)))
        return
    loss = _FileLoss(str(path))
    size = len(buf)
    resync = Resync(size)
    stopped: dict | None = None
    torn = False
    try:
        end = len(buf)
        first = valid_frame(buf, 0, end)
        off = first[0] if first else end
        index = 0                 # of the frame at off (the header is frame 0)
        while off < end:
            index += 1
            got = valid_frame(buf, off, end)
            try:
                rec = unpack(got[1]) if got else None
            except Refused as e:   # its crc is right: skip exactly this frame
                loss.refused.append((index, off, e))
                off += got[0]
                continue
            if rec is None:
                nxt = resync.next_valid(buf, off + 1, end)
                if nxt is None:
                    problems.append(Problem(
                        str(path), "torn_tail", off, end - off,
                        f"{path}: torn tail at byte {off}: {end - off} bytes dropped "
                        "(the writer stopped mid-record: a crash or power loss)"))
                    torn = True
                    break
                loss.corrupt.append((off, nxt - off))
                off = nxt
                continue
            at = off
            off += got[0]
            kind = rec.pop("rec")
            if kind == "header":
                continue      # files are never concatenated by us; tolerate it if someone did
            try:
                data = check_record(kind, rec)
            except KeyError:
                loss.unknown[kind[:32]] = loss.unknown.get(kind[:32], 0) + 1
                continue
            except Invalid as e:
                loss.invalid += 1
                loss.first_invalid = loss.first_invalid or f"at byte {at}: {e}"
                continue
            if kind == "stop":
                stopped = data
                continue
            stopped = None    # records after a stop: someone appended; the stop is not the end
            yield Record(kind, data, header, str(path), at)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()
    problems.extend(loss.problems(resync))
    if stopped is None and not torn and header.get("stop_record") and not _being_written(path):
        problems.append(Problem(
            str(path), "no_stop", size, 0,
            f"{path}: no stop record at its end: records may be missing there (the recorder "
            "was killed, the file was cut, or it is still being written)"))
    if stopped is not None and stopped.get("dropped"):
        problems.append(Problem(
            str(path), "recorder_dropped", 0, stopped["dropped"],
            f"{path}: the recorder dropped {stopped['dropped']} records it could not write "
            "(disk full or a write error; see the daemon's log)"))


def _expand(paths) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        try:
            st = p.stat()
        except FileNotFoundError:
            raise SessionError(f"{p}: no such file or directory") from None
        except OSError as e:
            raise SessionError(f"cannot read {p}: {e.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            found = session_files(p)
            if not found:
                raise SessionError(f"{p}: no session files (nptrace-*.nps) in this directory")
            files += found
        else:
            files.append(p)     # read_header refuses what is not a regular file
    return files


def read_session(paths) -> tuple[list[dict], Iterator[Record], list[Problem]]:
    """(headers, records, problems) of one or more session files or directories.

    Headers are read up front (one per file, each with "_path"), and files are ordered by run
    start and part. `records` is a lazy iterator of records that passed their schema;
    `problems` fills while it is consumed (torn tails, corrupt middles, invalid records, a
    missing stop record) and already holds files that are not sessions. A missing path, or a
    single named file that is not a session, raises SessionError.
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
