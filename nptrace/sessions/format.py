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

Where each part lives: sessions/header.py (file names, the header record, SessionError),
sessions/framing.py (frames, their resync, bounded unpacking), sessions/schema.py (one schema
per record kind), sessions/lookups.py (the bounded lookup tables), sessions/writer.py
(SessionWriter: rotation, limits, the directory's safety) and sessions/reader.py (read_header,
read_session and the problems a session shows).
"""
from __future__ import annotations

# The names of the format in one place: `from nptrace.sessions import format as S` is how
# the tests, the recorder's opener and the benchmark reach the writer and the reader at once.
from nptrace.sessions.framing import FRAME, MAGIC, MAX_PAYLOAD, frame  # noqa: F401
from nptrace.sessions.header import (FORMAT, FORMAT_VERSION, PREFIX, SUFFIX,  # noqa: F401
                                     SessionError, make_header, read_head, session_files)
from nptrace.sessions.lookups import (IFACE, LOOKUP_CACHE, REPLAY_FACTOR, SERVICE,  # noqa: F401
                                      LookupTables, ifnames_rows)
from nptrace.sessions.reader import (Problem, Record, is_session_file, read_header,  # noqa: F401
                                     read_session)
from nptrace.sessions.writer import (DEFAULT_MAX_AGE_S, DEFAULT_MAX_FILE_BYTES,  # noqa: F401
                                     DEFAULT_MAX_TOTAL_BYTES, FLUSH_BYTES, FLUSH_INTERVAL_S,
                                     FSYNC_INTERVAL_S, RETRY_S, SessionWriter, check_session_dir)
from nptrace.sessions.writer import pack as _pack  # noqa: F401
