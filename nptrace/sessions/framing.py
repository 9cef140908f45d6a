"""Session frames: `magic b"NPS1" | u32 payload length | u32 crc32(payload) | msgpack payload`
(little endian), how a reader finds the next good one after damage, and how a payload is
unpacked within bounds sized from its frame.

Why frames: a power loss can leave a partly written record or a tail of zeros (ext4 extends
the size before the data lands). The reader stops at the first frame whose magic, length or
crc is wrong. If no valid frame follows, that is a torn tail (expected after a crash: reported,
not fatal); if one does, the file is corrupt in the middle (reported as an error, reading
resumes at the next good frame).

Memory is bounded before any schema sees a value: msgpack builds a Python object for every
value it reads, and an empty list costs 64 bytes for its one byte, so a 64 MiB frame of empty
arrays took 5 GB. unpack() hands msgpack its own limits (no string, bytes, list or map longer
than any record of ours holds, nor than the frame itself) and counts the lists and maps it
builds against the frame's length: at most one per CONTAINER_BYTES bytes, where everything we
write needs at least 5.5 (the tightest is a lookup row [[netns], "a/b"]: 11 bytes, two lists).
What remains is what Python makes of leaves: a 2-character string costs about 20 times its 3
bytes, and real lookup tables about the same, so a frame costs at most ~25 times its size. A frame past a limit is
refused, whole and by itself (its crc was right: the frames after it are read).
"""
from __future__ import annotations

import struct
import zlib

import msgpack

from nptrace.sessions.schema import MAX_BYTES, MAX_ITEMS, MAX_TEXT

MAGIC = b"NPS1"
FRAME = struct.Struct("<4sII")
MAX_PAYLOAD = 64 << 20          # a header with every name of a big node is well below this
CONTAINER_BYTES = 5
MAX_STR_BYTES = 4 * MAX_TEXT    # MAX_TEXT characters of UTF-8
MAX_EXT_BYTES = 64              # we write no ext types; a few are tolerated to be refused by schema


class Refused(ValueError):
    """A frame whose crc is right but whose payload msgpack cannot decode within its limits."""


def frame(payload: bytes) -> bytes:
    return FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def frame_at(buf, off: int, end: int) -> tuple[int, int] | None:
    """(payload length, crc) of a frame header at off whose payload fits before end."""
    if end - off < FRAME.size or buf[off:off + 4] != MAGIC:
        return None
    _magic, n, crc = FRAME.unpack_from(buf, off)
    if n > MAX_PAYLOAD or off + FRAME.size + n > end:
        return None
    return n, crc


def valid_frame(buf, off: int, end: int) -> tuple[int, bytes] | None:
    """(frame length, payload) of a frame at off whose crc is right."""
    got = frame_at(buf, off, end)
    if got is None:
        return None
    n, crc = got
    payload = bytes(buf[off + FRAME.size: off + FRAME.size + n])
    if zlib.crc32(payload) != crc:
        return None
    return FRAME.size + n, payload


def unpack(payload: bytes) -> dict | None:
    """The record map of a payload; None if it decodes to something else (not a record of
    ours: the reader resyncs past it); Refused if msgpack cannot decode it within bounds."""
    n = len(payload)
    left = [n // CONTAINER_BYTES + 64]

    def count(container):
        left[0] -= 1
        if left[0] < 0:
            raise Refused(f"more lists and maps than its {n} bytes hold (one per "
                          f"{CONTAINER_BYTES} bytes)")
        return container
    try:
        rec = msgpack.unpackb(
            payload, raw=False, strict_map_key=False,
            max_str_len=min(n, MAX_STR_BYTES), max_bin_len=min(n, MAX_BYTES),
            max_array_len=min(n, MAX_ITEMS), max_map_len=min(n // 2, MAX_ITEMS),
            max_ext_len=min(n, MAX_EXT_BYTES), list_hook=count, object_hook=count)
    except Refused:
        raise
    except msgpack.StackError:
        raise Refused("nested deeper than msgpack unpacks") from None
    except msgpack.ExtraData:
        raise Refused("bytes after its record") from None
    except ValueError as e:          # a limit passed (msgpack names it), or not msgpack
        raise Refused(str(e)[:120] or "not msgpack") from None
    except Exception as e:           # an unhashable map key, an invalid UTF-8 string, ...
        raise Refused(f"{type(e).__name__}: {str(e)[:100]}") from None
    return rec if isinstance(rec, dict) and isinstance(rec.get("rec"), str) else None


# What a payload of ours starts with: a msgpack map (fixmap, map16, map32).
MAP_FIRST = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
# A resync checks the crc of candidate frames (a magic, a length that fits, a map after it);
# a file full of fake frame headers, each claiming most of the file, would make that
# quadratic. So the crc work of one file's resyncs is budgeted linearly in its size; past the
# budget only record-sized candidates are checked (events are ~250 bytes), which stays linear.
RESYNC_BUDGET_FACTOR = 4
RESYNC_SMALL = 4096


class Resync:
    def __init__(self, size: int):
        self.budget = RESYNC_BUDGET_FACTOR * size + (1 << 20)
        self.gave_up = 0          # candidates not checked once the budget was spent

    def next_valid(self, buf, start: int, end: int) -> int | None:
        pos = start
        while True:
            pos = buf.find(MAGIC, pos, end)
            if pos < 0:
                return None
            got = frame_at(buf, pos, end)
            if got is not None and got[0] and buf[pos + FRAME.size] in MAP_FIRST:
                n, crc = got
                if n <= RESYNC_SMALL or self.budget >= n:
                    if n > RESYNC_SMALL:
                        self.budget -= n
                    if zlib.crc32(buf[pos + FRAME.size:pos + FRAME.size + n]) == crc:
                        return pos
                else:
                    self.gave_up += 1
            pos += 1
