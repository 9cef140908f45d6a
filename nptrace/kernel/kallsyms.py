"""Kernel text ranges from /proc/kallsyms, for the few drops the kernel frees without a reason.

IPv6 neighbour failure: when neighbour discovery for a next hop fails, neigh_invalidate()
(net/core/neighbour.c) hands each packet queued on the entry to the family's error_report.
IPv4's arp_error_report frees it with SKB_DROP_REASON_NEIGH_FAILED ("net: neigh: use
kfree_skb_reason() in arp_error_report()", Linux 5.18); IPv6's ndisc_error_report still calls
plain kfree_skb(): reason NOT_SPECIFIED, which nptrace does not send (every healthy close
frees a few). Its kfree_skb is a tail call, so the tracepoint's `location` is the return
address in neigh_invalidate (measured on 6.18: `location=neigh_invalidate+0x7e reason:
NOT_SPECIFIED` for a SYN to an address nobody answers neighbour solicitations for), or in
ndisc_error_report where it is not a tail call.
The neigh tracepoints do not help: trace_neigh_timer_handler fires after neigh_invalidate has
freed the queue, and neigh_update's "failed" state carries no packet. So the kfree_skb program
names a NOT_SPECIFIED drop freed in either function NEIGH_FAILED, as IPv4's (bpf/tracepoints.bpf.c
NPT_NEIGH_FAIL_*): -D flags with both functions' [start, end) from kallsyms.

kallsyms shows addresses only with CAP_SYSLOG (and kptr_restrict < 2); without them every
address reads 0 and there are no flags: such drops stay unsent, as before.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["DROP_SITES", "NEIGH_FAIL_SITES", "drop_site_cflags", "neigh_cflags", "text_ranges"]

# Functions whose NOT_SPECIFIED frees are a failed neighbour's queued packets.
NEIGH_FAIL_SITES = ("neigh_invalidate", "ndisc_error_report")
# Before kfree_skb had a reason (5.17): the function that frees what a netfilter rule dropped
# (net/netfilter/core.c, NF_DROP -> kfree_skb), by its -D name (bpf/tracepoints.bpf.c).
DROP_SITES = {"NF": "nf_hook_slow"}


def text_ranges(text: bytes, names) -> dict[str, tuple[int, int]]:
    """[start, end) of each named text symbol of vmlinux: its address to the next line's
    (kallsyms lists vmlinux in address order). Names not found, or at address 0 (hidden), are
    left out. A bytes.find per name: the file is ~120,000 lines (5 MB)."""
    out = {}
    for name in names:
        for kind in (b" t ", b" T "):
            at = text.find(kind + name.encode() + b"\n")
            if at < 0:
                continue
            start = text.rfind(b"\n", 0, at) + 1
            end = text.find(b"\n", at + 1) + 1
            try:
                lo = int(text[start:at], 16)
                hi = int(text[end:text.index(b" ", end)], 16)
            except ValueError:
                break
            if lo and hi > lo:
                out[name] = (lo, hi)
            break
    return out


def neigh_cflags(drops, path: Path = Path("/proc/kallsyms")) -> list[str]:
    """-D flags that let the kfree_skb program name IPv6's neighbour-failure frees
    NEIGH_FAILED: the two reason values (from the running kernel's BTF enum, `drops`) and the
    functions' ranges. [] where kallsyms hides addresses or the kernel lacks either reason."""
    unspec, failed = drops.value("NOT_SPECIFIED"), drops.value("NEIGH_FAILED")
    if unspec is None or failed is None:
        return []
    try:
        text = path.read_bytes()
    except OSError:
        return []
    ranges = text_ranges(text, NEIGH_FAIL_SITES)
    if not ranges:
        return []
    flags = [f"-DNPT_REASON_NOT_SPECIFIED={unspec}", f"-DNPT_REASON_NEIGH_FAILED={failed}"]
    for i, name in enumerate(NEIGH_FAIL_SITES):
        lo, hi = ranges.get(name, (0, 0))
        flags += [f"-DNPT_NEIGH_FAIL_LO{i}={lo:#x}ULL", f"-DNPT_NEIGH_FAIL_HI{i}={hi:#x}ULL"]
    return flags


def drop_site_cflags(path: Path = Path("/proc/kallsyms")) -> list[str]:
    """-DNPT_DROP_SITE_<NAME>_LO/HI: [start, end) of each DROP_SITES function, for kernels
    whose kfree_skb has no reason. [] where kallsyms hides addresses: then netfilter drops
    stay unnamed there."""
    try:
        ranges = text_ranges(path.read_bytes(), DROP_SITES.values())
    except OSError:
        return []
    flags = []
    for key, func in DROP_SITES.items():
        if func in ranges:
            lo, hi = ranges[func]
            flags += [f"-DNPT_DROP_SITE_{key}_LO={lo:#x}ULL", f"-DNPT_DROP_SITE_{key}_HI={hi:#x}ULL"]
    return flags
