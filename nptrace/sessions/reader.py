"""Reading a session (read_header, read_session): every header and record checked against
its schema (sessions/schema.py), so what leaves this module has the types the readers expect,
and what was lost said once per kind and file (Problem). The format: sessions/format.py.

A record that fails its schema is counted and skipped, never passed on; so is a lookup the
schema's table does not hold, or a record kind it does not know (a newer writer's). Frames,
their resync and the bounds of unpacking one are sessions/framing.py: a frame msgpack refuses
within them is counted and skipped too, named by its index and byte offset. Only regular
files are read (a FIFO or /dev/zero given as a session is refused, not waited on).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

from nptrace import events as ev
from nptrace.sessions.framing import FRAME, MAGIC, MAX_PAYLOAD, Refused, Resync, unpack, valid_frame
from nptrace.sessions.header import FORMAT, FORMAT_VERSION, SessionError, read_head, session_files
from nptrace.sessions.schema import Invalid, Unknown, check_header, check_record


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



def read_header(path) -> dict:
    """The first record of a session file, checked by its schema; SessionError if it is not
    one."""
    path = Path(path)
    fd = _open_regular(path)
    try:
        buf = read_head(fd)
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
    loss.unknown.update(header.get("_unknown", {}))    # lookup tables of the header left out
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
            except Unknown as e:
                loss.unknown[str(e)] = loss.unknown.get(str(e), 0) + 1
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
