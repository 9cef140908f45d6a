"""What makes a file a session file: its name (PREFIX...SUFFIX, session_files), its first
frame, the header record (FORMAT, FORMAT_VERSION, make_header, read_head), and SessionError for
a session that cannot be written or read at all. The whole format: sessions/format.py.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Iterable

from nptrace import __version__
from nptrace import events as ev
from nptrace.errors import NptraceError
from nptrace.sessions.framing import FRAME, MAGIC, MAX_PAYLOAD

FORMAT = "nptrace-session"
FORMAT_VERSION = 2       # 2: packet records (format 1 is read alike)
SUFFIX = ".nps"
PREFIX = "nptrace-"


class SessionError(NptraceError):
    """A session cannot be written or read at all (not a session, unreadable, bad limits)."""


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


def session_files(directory: Path) -> list[Path]:
    """Session files of a directory, oldest first (the UTC start time leads the name)."""
    try:
        return sorted(p for p in directory.iterdir()
                      if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX) and p.is_file())
    except OSError:
        return []


def read_head(fd: int) -> bytes:
    """The first frame's bytes (at most its claimed length), read from a regular file."""
    head = os.pread(fd, FRAME.size, 0)
    if len(head) < FRAME.size or head[:4] != MAGIC:
        return head
    n = FRAME.unpack(head)[1]
    if n > MAX_PAYLOAD:
        return head
    return head + os.pread(fd, n, FRAME.size)
