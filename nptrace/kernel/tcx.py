"""tcx links (Linux 6.6+): the tc programs attached as BPF links instead of cls_bpf filters.

Why tcx first, clsact as the fallback (nptrace/kernel/tc.py):
- Cost. A tcx link runs the program straight from the device's hook (bpf_mprog), without the
  clsact qdisc's classifier walk. On the 6.18 VM, with EMPTY programs on both directions of a
  NodePort's two devices, clsact + cls_bpf took 3.5% of the connection rate and tcx 2.0%
  (10 interleaved rounds of 2 s; `python -m nptrace.bench --only connrate` shows both).
- Crash safety. A link lives as long as a file descriptor refers to it: when nptrace dies,
  even by kill -9, the kernel unlinks its programs. Nothing is left on the node to recover.

The programs return TC_ACT_UNSPEC (-1), which is TCX_NEXT: the next tcx program, then any
legacy clsact filter, still see the packet. Ours is linked FIRST on the device (BPF_F_BEFORE
with no relative program): a CNI program after it that redirects or drops the packet (Cilium
links its own programs with tcx on these kernels) cannot hide it from the observer.

The link is created in the network namespace of the calling thread (target_ifindex is looked
up there), so it is made by a thread that joined the interface's namespace (nsenter.run_in).
"""
from __future__ import annotations

import ctypes as ct
import errno
import os
import struct

from nptrace.kernel.bpfsys import bpf
from nptrace.kernel.nsenter import run_in

BPF_PROG_QUERY = 16
BPF_LINK_CREATE = 28
BPF_TCX_INGRESS = 46
BPF_TCX_EGRESS = 47
BPF_F_BEFORE = 1 << 3
# errnos that mean "this kernel has no tcx": the attach type is unknown before 6.6
NOT_SUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, 524)   # 524: the kernel's ENOTSUPP


class TcxError(OSError):
    """Linking failed; .errno says why (NOT_SUPPORTED: no tcx in this kernel)."""


def link_create(prog_fd: int, ifindex: int, ingress: bool, netns_path: str | None = None) -> int:
    """Link a SCHED_CLS program first on ifindex's ingress or egress; the link's fd (close it to
    unlink). netns_path: an nsfs file of the interface's namespace (None: this one)."""
    attr = (ct.c_uint8 * 64)()
    # union bpf_attr.link_create: prog_fd, target_ifindex, attach_type, flags, then
    # .tcx { relative_fd | relative_id, expected_revision }: 0 = first, any revision
    struct.pack_into("=IIII", attr, 0, prog_fd, ifindex,
                     BPF_TCX_INGRESS if ingress else BPF_TCX_EGRESS, BPF_F_BEFORE)
    fd = run_in(netns_path, lambda: bpf(BPF_LINK_CREATE, attr), "npt-tcx")
    if fd < 0:
        why = ("kernel without tcx (Linux < 6.6)" if -fd in NOT_SUPPORTED else
               "needs CAP_NET_ADMIN and CAP_BPF" if -fd == errno.EPERM else
               "no such interface" if -fd == errno.ENODEV else "")
        raise TcxError(-fd, f"tcx {'ingress' if ingress else 'egress'} link on ifindex "
                            f"{ifindex}: {os.strerror(-fd)}{' (' + why + ')' if why else ''}")
    return fd


def prog_ids(ifindex: int, ingress: bool, netns_path: str | None = None) -> list[int]:
    """Ids of the programs linked with tcx on ifindex's ingress or egress, in run order."""
    ids = (ct.c_uint32 * 64)()
    attr = (ct.c_uint8 * 64)()
    # union bpf_attr.query: target_ifindex, attach_type, query_flags, attach_flags,
    # prog_ids (u64 pointer), prog_cnt
    struct.pack_into("=IIIIQI", attr, 0, ifindex, BPF_TCX_INGRESS if ingress else BPF_TCX_EGRESS,
                     0, 0, ct.addressof(ids), len(ids))
    r = run_in(netns_path, lambda: bpf(BPF_PROG_QUERY, attr), "npt-tcx")
    if r < 0:
        raise TcxError(-r, f"tcx query of ifindex {ifindex}: {os.strerror(-r)}")
    n = struct.unpack_from("=I", attr, 24)[0]
    return list(ids[:min(n, len(ids))])
