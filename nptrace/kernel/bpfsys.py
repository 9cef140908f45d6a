"""The bpf(2) system call, for the commands bcc 0.26 does not wrap or wraps only inside a
compile: link creation (tcx, netfilter), program queries, BPF_ENABLE_STATS, map creation and
program loads of a compiled object (kernel/bpfobject.py), the bench's empty program. One
place for the syscall number of each architecture."""
from __future__ import annotations

import ctypes as ct
import errno
import platform

# __NR_bpf (arch/*/include/uapi/asm/unistd*.h; the generic table for arm64 and riscv)
SYS_BPF = {"x86_64": 321, "aarch64": 280, "arm64": 280, "riscv64": 280, "s390x": 351,
           "ppc64le": 361, "ppc64": 361}


def bpf(cmd: int, attr) -> int:
    """bpf(cmd, &attr, sizeof(attr)) for a ctypes buffer attr: the result (an fd, 0), or
    -errno; -ENOSYS where this architecture's syscall number is not known."""
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        return -errno.ENOSYS
    libc = ct.CDLL(None, use_errno=True)
    libc.syscall.restype = ct.c_long
    r = libc.syscall(ct.c_long(nr), ct.c_int(cmd), attr, ct.c_uint(ct.sizeof(attr)))
    return -ct.get_errno() if r < 0 else int(r)
