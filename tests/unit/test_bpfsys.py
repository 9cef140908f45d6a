"""nptrace.kernel.bpfsys: the one bpf(2) wrapper (no root needed for these cases)."""
from __future__ import annotations

import ctypes as ct
import errno

from nptrace.kernel import bpfsys


def test_unknown_architecture_is_enosys_not_a_crash(monkeypatch):
    monkeypatch.setattr(bpfsys.platform, "machine", lambda: "vax")
    assert bpfsys.bpf(0, (ct.c_uint8 * 8)()) == -errno.ENOSYS


def test_errors_come_back_as_negative_errno():
    # BPF_OBJ_GET_INFO_BY_FD (15) on fd -1: an error for root and non-root alike (which one
    # depends on the kernel: EBADF, EBADFD; EPERM where bpf() is forbidden to this user)
    attr = (ct.c_uint8 * 16)()
    ct.memmove(attr, (ct.c_int32 * 1)(-1), 4)
    r = bpfsys.bpf(15, attr)
    assert r < 0 and -r in errno.errorcode
