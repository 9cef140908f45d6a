"""Writing a session (SessionWriter): framed records appended to a rotating set of files,
within size, age and total limits. The format: sessions/format.py.

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
import os
import stat
import struct
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable

import msgpack

from nptrace import events as ev
from nptrace.config import MAX_SNAPLEN
from nptrace.sessions.framing import Refused, frame, unpack, valid_frame
from nptrace.sessions.header import FORMAT, PREFIX, SUFFIX, SessionError, make_header, read_head
from nptrace.sessions.lookups import IFACE, LOOKUP_CACHE, SERVICE, LookupTables, ifnames_rows

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


def pack(rec: dict) -> bytes:
    return msgpack.packb(rec, use_bin_type=True)


def _utc_stamp(ns: int) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(ns / 1e9))


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
        self.buf = bytearray(frame(pack(self._header_record())))
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
            self.buf += frame(pack({"rec": "stop", "why": why, "ts_ns": time.monotonic_ns(),
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
        data = frame(pack(rec))
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
        buf = read_head(fd)
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

