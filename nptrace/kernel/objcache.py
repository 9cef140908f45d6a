"""Compiled BPF objects kept between starts: a start whose source, cflags, bcc and kernel are
those of an earlier one loads that start's object (kernel/bpfobject.py Snapshot) instead of
compiling, 1.7 s of a 2.9 s start here.

Where: $NPTRACE_BPF_CACHE, else /var/cache/nptrace (the systemd unit's CacheDirectory=, the
DaemonSet's emptyDir); NPTRACE_BPF_CACHE=off (or empty) compiles every start. One file per
key, `<sha256>.bpfobj`: b"NPTBPF1\\n", the SHA-256 of the payload, then the msgpack payload
{"key", "object"}. The key covers everything the compiled code depends on: nptrace's BPF
source, the headers it includes (include_identity) and every -D switch (BTF offsets,
tracepoint fields and reason values among them), bcc's version (its rewriter and helpers) and
the kernel (release, build, machine: tracepoint argument layouts bcc reads from tracefs). The
newest KEEP entries stay.

The files hold code the kernel runs as root, so an entry is used only where this user owns
it and its folder and neither is writable by group or others; anything else (a foreign owner,
a bad digest, a damaged or hostile payload) is a miss with one line saying why, and the start
compiles. Nothing here is fatal: a read-only or full cache folder means compiling every start.
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

import msgpack

from nptrace.kernel.bpfobject import Snapshot, SnapshotError

FORMAT = 1
MAGIC = b"NPTBPF1\n"
DEFAULT_DIR = "/var/cache/nptrace"
ENV = "NPTRACE_BPF_CACHE"
KEEP = 32
MAX_BYTES = 16 << 20      # the whole object is ~0.2 MB; a larger file is not ours
SUFFIX = ".bpfobj"


def cache_dir() -> Path | None:
    """The cache folder, or None when the environment turns the cache off."""
    v = os.environ.get(ENV, DEFAULT_DIR)
    return None if v.strip().lower() in ("", "off", "none", "0") else Path(v)


def key(source: str, cflags, bcc_version: str, includes=()) -> str:
    """includes: what the compile reads besides `source` (the headers it #includes, as
    include_identity() gives them)."""
    u = os.uname()
    h = hashlib.sha256()
    for part in (str(FORMAT), bcc_version, u.release, u.version, u.machine, *cflags, *includes):
        h.update(part.encode() + b"\0")
    h.update(source.encode())
    return h.hexdigest()


def include_identity(bpf_dir: Path, kernel_source: str | None) -> list[str]:
    """What identifies the headers a compile #includes: the digest of each header in nptrace's
    bpf/ folder (an edited nptrace_events.h changes the code under the same file name), and
    the kernel header tree bcc is pointed at ($BCC_KERNEL_SOURCE, with its SOURCE stamp's or
    its own modification time; unset: the running kernel's, which uname already names)."""
    out = []
    for p in sorted(bpf_dir.glob("*.h")):
        try:
            out.append(f"{p.name}:{hashlib.sha256(p.read_bytes()).hexdigest()}")
        except OSError:
            out.append(f"{p.name}:unreadable")
    if kernel_source:
        stamp = Path(kernel_source) / "SOURCE"
        try:
            t = (stamp if stamp.exists() else Path(kernel_source)).stat().st_mtime_ns
        except OSError:
            t = 0
        out.append(f"kernel headers:{kernel_source}:{t}")
    return out


def _untrusted(st: os.stat_result, what: str) -> str:
    """Why a file or folder with this stat may not be trusted with code, or ""."""
    if st.st_uid != os.geteuid():
        return f"{what} is owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others ({stat.filemode(st.st_mode)})"
    return ""


def load(folder: Path, k: str) -> tuple[Snapshot | None, str]:
    """(the cached object of key k, "") or (None, why not: "" for a plain miss)."""
    path = folder / (k + SUFFIX)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, f"cannot open {path}: {e.strerror}"
    try:
        why = _untrusted(os.stat(folder), str(folder)) or _untrusted(os.fstat(fd), str(path))
        if why:
            return None, why
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror}"
    finally:
        os.close(fd)
    try:
        snap = decode(data, k)
    except (SnapshotError, ValueError) as e:
        return None, f"{path} unusable ({e})"
    try:
        os.utime(path)    # recently used: pruned last
    except OSError:
        pass
    return snap, ""


def encode(k: str, snap: Snapshot) -> bytes:
    payload = msgpack.packb({"key": k, "object": snap.to_data()}, use_bin_type=True)
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode(data: bytes, k: str) -> Snapshot:
    """The Snapshot in an entry's bytes, for key k; ValueError or SnapshotError otherwise."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES >> 20} MiB")
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        raise ValueError("not a cached BPF object")
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC):head]:
        raise ValueError("digest mismatch: damaged")
    try:
        d = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:        # msgpack raises several kinds on a bad payload
        raise ValueError(f"payload: {type(e).__name__}") from None
    if not isinstance(d, dict) or d.get("key") != k:
        raise ValueError("written for another key")
    return Snapshot.from_data(d.get("object"))


def save(folder: Path, k: str, snap: Snapshot) -> str:
    """Write the entry of key k (atomically: a temporary file renamed) and prune to KEEP;
    "" when written, else why not (the start goes on either way)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _untrusted(os.stat(folder), str(folder))
        if why:
            return why
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".npt-", suffix=SUFFIX + ".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(encode(k, snap))
            os.replace(tmp, folder / (k + SUFFIX))
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        return f"cannot write to {folder}: {e.strerror}"
    prune(folder)
    return ""


def prune(folder: Path, keep: int = KEEP) -> None:
    """Remove all but the `keep` most recently used entries (and temporary files a killed
    writer left, an hour old)."""
    import time
    try:
        entries = [(e.stat().st_mtime, e) for e in os.scandir(folder)
                   if e.name.endswith(SUFFIX) or e.name.endswith(SUFFIX + ".tmp")]
    except OSError:
        return
    now = time.time()
    stale = [e for t, e in entries if e.name.endswith(".tmp") and now - t > 3600]
    done = sorted((x for x in entries if x[1].name.endswith(SUFFIX)), key=lambda x: -x[0])
    for e in stale + [e for _, e in done[keep:]]:
        try:
            os.unlink(e.path)
        except OSError:
            pass
