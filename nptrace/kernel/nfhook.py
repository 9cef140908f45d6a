"""Link the netfilter-hook program (bpf/nf_hook.bpf.c) at chosen hooks and priorities of a
network namespace, and read back what its events say.

A BPF_PROG_TYPE_NETFILTER program (Linux 6.4+) is attached with BPF_LINK_CREATE (pf, hook
number, priority); the kernel registers the hook in the network namespace of the CALLING
THREAD, so linking into another namespace is done from a short-lived thread that setns()es
into it first (a thread may change its own network namespace). Closing the link fd unlinks it.
Debian's bpftool/libbpf 1.1 cannot load these programs; bcc loads them (loader.py) and the
link is made here with the raw bpf syscall (ctypes), so nothing here imports bcc.

Default view points, relative to iptables/nftables NAT (include/uapi/linux/netfilter_ipv4.h):
  AFTER_DNAT        PRE_ROUTING  at NF_IP_PRI_NAT_DST + 1 = -99   (NodePort -> pod applied)
  AFTER_DNAT_LOCAL  LOCAL_OUT    at NF_IP_PRI_NAT_DST + 1 = -99   (the node's own connections)
  AFTER_SNAT        POST_ROUTING at NF_IP_PRI_NAT_SRC + 1 = 101   (masquerade applied)
"""
from __future__ import annotations

import ctypes as ct
import errno
import os
import struct
from dataclasses import dataclass

from nptrace.kernel.bpfsys import bpf
from nptrace.kernel.nsenter import path_of, run_in

NFPROTO_IPV4 = 2
NFPROTO_IPV6 = 10
NF_INET_PRE_ROUTING, NF_INET_LOCAL_IN, NF_INET_FORWARD, NF_INET_LOCAL_OUT, \
    NF_INET_POST_ROUTING = range(5)
HOOK_NAMES = ("PRE_ROUTING", "LOCAL_IN", "FORWARD", "LOCAL_OUT", "POST_ROUTING")
NF_IP_PRI_NAT_DST = -100
NF_IP_PRI_NAT_SRC = 100

AFTER_DNAT = (NF_INET_PRE_ROUTING, NF_IP_PRI_NAT_DST + 1)
AFTER_DNAT_LOCAL = (NF_INET_LOCAL_OUT, NF_IP_PRI_NAT_DST + 1)
AFTER_SNAT = (NF_INET_POST_ROUTING, NF_IP_PRI_NAT_SRC + 1)
DEFAULT_POINTS = (AFTER_DNAT, AFTER_DNAT_LOCAL, AFTER_SNAT)

BPF_LINK_CREATE = 28
BPF_NETFILTER = 45


class NfHookError(OSError):
    """Linking failed: the message names the hook, priority and namespace, and the likely cause."""


@dataclass(frozen=True)
class HookPoint:
    pf: int
    hooknum: int
    priority: int

    @property
    def name(self) -> str:
        h = HOOK_NAMES[self.hooknum] if 0 <= self.hooknum < len(HOOK_NAMES) else str(self.hooknum)
        return f"{'ipv4' if self.pf == NFPROTO_IPV4 else 'ipv6' if self.pf == NFPROTO_IPV6 else self.pf}" \
               f"/{h}@{self.priority}"


def decode_aux(aux: int) -> HookPoint:
    """aux of an NF_VIEW event from the NF_HOOK program: pf << 24 | hooknum << 16 | prio."""
    prio = aux & 0xFFFF
    if prio & 0x8000:
        prio -= 0x10000
    return HookPoint((aux >> 24) & 0xFF, (aux >> 16) & 0xFF, prio)


def cflags(btf=None, points=DEFAULT_POINTS) -> list[str]:
    """-D switches for bpf/nf_hook.bpf.c: the gate, the priority each hook number is linked
    at (the program cannot see it), and nf_hook_state offsets from BTF when given."""
    flags = ["-DNPT_WITH_NF_HOOK=1"]
    seen = set()
    for hooknum, prio in points:
        if hooknum in seen:
            raise ValueError(f"hook {HOOK_NAMES[hooknum]} given twice: one priority per hook")
        seen.add(hooknum)
        flags.append(f"-DNPT_NF_PRIO_H{hooknum}=({prio})")
    if btf is not None:
        for member in ("hook", "pf"):
            flags.append(f"-DNPT_OFF_nf_hook_state__{member}="
                         f"{btf.member('nf_hook_state', member).offset}")
    return flags


def link_create(prog_fd: int, point: HookPoint, netns: str | None = None) -> int:
    """BPF_LINK_CREATE for a netfilter program; returns the link fd (close it to unlink)."""
    attr = (ct.c_uint8 * 64)()
    # union bpf_attr.link_create: prog_fd, target_fd (unused: 0), attach_type, flags, then
    # .netfilter { pf, hooknum, priority (s32), flags }
    struct.pack_into("=IIIIIIiI", attr, 0, prog_fd, 0, BPF_NETFILTER, 0,
                     point.pf, point.hooknum, point.priority, 0)
    try:
        fd = run_in(path_of(netns), lambda: bpf(BPF_LINK_CREATE, attr), "npt-nf-link")
    except OSError as e:
        raise NfHookError(e.errno, f"cannot enter network namespace {netns!r}: "
                                   f"{e.strerror or e} (needs CAP_SYS_ADMIN)") from None
    if fd < 0:
        why = {errno.EINVAL: "bad hook or priority, or kernel < 6.4",
               errno.EBUSY: "another BPF link holds that exact priority",
               errno.EPERM: "needs CAP_NET_ADMIN and CAP_BPF",
               errno.EOPNOTSUPP: "kernel built without CONFIG_NETFILTER_BPF_LINK"}.get(-fd, "")
        raise NfHookError(-fd, f"netfilter link {point.name} in "
                               f"{netns or 'this namespace'}: {os.strerror(-fd)}"
                               f"{' (' + why + ')' if why else ''}")
    return fd


class NfHookLinks:
    """The links of one program into some namespaces; close() removes exactly those."""

    def __init__(self, prog_fd: int):
        self.prog_fd = prog_fd
        self.links: list[tuple[str | None, HookPoint, int]] = []

    def attach(self, netns: str | None = None, points=DEFAULT_POINTS,
               pf: int = NFPROTO_IPV4) -> list[HookPoint]:
        """Link at each (hooknum, priority) of `netns`; all or none of them."""
        made: list[tuple[str | None, HookPoint, int]] = []
        try:
            for hooknum, prio in points:
                p = HookPoint(pf, hooknum, prio)
                made.append((netns, p, link_create(self.prog_fd, p, netns)))
        except BaseException:
            for _, _, fd in made:
                os.close(fd)
            raise
        self.links += made
        return [p for _, p, _ in made]

    def close(self) -> None:
        while self.links:
            _, _, fd = self.links.pop()
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "NfHookLinks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
