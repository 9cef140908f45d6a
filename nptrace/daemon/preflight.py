"""What `nptrace run` checks and holds before and around tracing: privileges, the interfaces
asked for, the one-tracer-per-node lock, the ready file, and the start-up memory handed back
once everything is attached."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from nptrace.config import Config
from nptrace.errors import InterfaceError, LockError, PrivilegeError

LOCK_FILE = Path(os.environ.get("NPTRACE_LOCK_FILE", "/run/nptrace/nptrace.lock"))


def node_lock_file() -> Path:
    """The instance lock of the node nptrace runs as: the kernel's, or where one kernel runs
    several nodes as namespaces (node/scope.py), its namespace's."""
    if "NPTRACE_LOCK_FILE" in os.environ:
        return LOCK_FILE
    from nptrace.kernel.nsenter import host_inode
    from nptrace.node.scope import is_nested
    try:
        nested = is_nested()
        here = host_inode()
    except OSError:
        return LOCK_FILE
    return LOCK_FILE.with_name(f"nptrace-net{here}.lock") if nested else LOCK_FILE


def log(msg: str) -> None:
    print(f"nptrace: {msg}", file=sys.stderr, flush=True)


def check_privileges() -> None:
    """Before the slow compile: CAP_SYS_ADMIN, or CAP_BPF + CAP_PERFMON + CAP_NET_ADMIN."""
    try:
        from nptrace.kernel.evidence import has_bpf_caps
        ok = has_bpf_caps()
    except ImportError:  # features.py absent: fall back to the uid
        ok = os.geteuid() == 0
    if not ok:
        raise PrivilegeError("needs root or CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN to load BPF: "
                             "run with sudo")


def check_ifaces(cfg: Config) -> None:
    """Unknown namespace or interface: fail before compiling anything."""
    for spec in cfg.ifaces:
        if spec.netns and not (Path("/run/netns") / spec.netns).exists():
            raise InterfaceError(f"network namespace {spec.netns!r} not found (ip netns list)")
        cmd = (["ip", "-n", spec.netns] if spec.netns else ["ip"]) + ["link", "show", "dev", spec.name]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            where = f" in namespace {spec.netns}" if spec.netns else ""
            raise InterfaceError(f"interface {spec.name!r} not found{where} (ip link)")


def release_startup_memory() -> None:
    """Start-up needs the whole BTF (tens of MB of Python objects) and clang's heap; the
    running tracer needs neither. Drop the BTF and hand freed heap back to the kernel, so a
    long-running node agent's RSS is what it uses."""
    import ctypes
    import gc
    from nptrace.kernel import btf
    btf.release_default()
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return
    # LLVM and clang (about 80 MiB of library text) only ran for the compile. Ask the kernel to
    # reclaim their clean file pages now (MADV_PAGEOUT, Linux 5.4); if a recompile ever needs
    # them, they fault back in from the page cache.
    MADV_PAGEOUT = 21
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6 or not ("libLLVM" in parts[5] or "libclang" in parts[5]):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                libc.madvise(lo, hi - lo, MADV_PAGEOUT)
    except OSError:
        pass


def write_ready_file(path: str) -> None:
    """The ready file, written once everything is attached, as every file nptrace writes as
    root: no symlink followed, no FIFO, hard link or someone else's file written
    (sinks/pcapng.py open_output)."""
    from nptrace.sinks.pcapng import open_output
    fd = open_output(path, "the ready file")
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)


def inode_of_netns(name: str) -> int:
    return os.stat(Path("/run/netns") / name).st_ino


class InstanceLock:
    """One tracer per node: two would attach the same tc filters and double every counter.
    flock(2) is released by the kernel when the process dies, so `kill -9` leaves no stale lock."""

    def __init__(self, path: Path | None = None):
        self.path = node_lock_file() if path is None else path
        self.fd: int | None = None

    def acquire(self) -> None:
        import fcntl
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # O_NOFOLLOW: the lock is opened as root in a directory others may share (a
            # hostPath); a planted symlink must not make us truncate its target
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise LockError(f"cannot open the instance lock {self.path}: {e.strerror} (its directory "
                            "must be writable: RuntimeDirectory=nptrace in the unit, a /run/nptrace "
                            "volume in the pod, or NPTRACE_LOCK_FILE elsewhere)") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise LockError(f"the instance lock {self.path} is not a regular file: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise LockError(f"another nptrace is already tracing on this node (pid {holder}, "
                            f"lock {self.path}): stop it first") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
