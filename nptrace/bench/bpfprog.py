"""An empty tc program to measure against, and per-program run statistics of any process.

The empty program is two instructions (r0 = -1 [TC_ACT_UNSPEC]; exit) loaded with the raw
bpf(BPF_PROG_LOAD) syscall: no bcc, no compiler, nothing that could make the floor differ
from run to run. Statistics are the kernel's own `run_cnt` / `run_time_ns`, counted while
BPF_ENABLE_STATS is held (nptrace.kernel.tc.enable_bpf_stats) and read from /proc/<pid>/fdinfo/<fd>
of whichever process holds the program: nptrace's, read from outside (a black box).
"""
from __future__ import annotations

import ctypes as ct
import errno
import json
import os
import struct
import time
from pathlib import Path

from nptrace.bench.report import bpf_prog_fdinfo, tc_filter_progs
from nptrace.bench.topology import BenchError, sh
from nptrace.kernel.bpfsys import bpf

BPF_PROG_LOAD = 5
BPF_PROG_TYPE_SCHED_CLS = 3
# struct bpf_insn {u8 code; u8 dst:4, src:4; s16 off; s32 imm}
EMPTY_INSNS = struct.pack("<BBhi", 0xB7, 0, 0, -1) + struct.pack("<BBhi", 0x95, 0, 0, 0)


def load_empty_sched_cls(name: str = "npt_bn_empty") -> int:
    """fd of a loaded SCHED_CLS program that returns TC_ACT_UNSPEC (the next filter runs)."""
    insns = ct.create_string_buffer(EMPTY_INSNS, len(EMPTY_INSNS))
    lic = ct.create_string_buffer(b"GPL")
    attr = ct.create_string_buffer(128)
    struct.pack_into("<IIQQ", attr, 0, BPF_PROG_TYPE_SCHED_CLS, 2, ct.addressof(insns),
                     ct.addressof(lic))
    struct.pack_into("16s", attr, 48, name.encode()[:15])
    fd = bpf(BPF_PROG_LOAD, attr)
    if fd < 0:
        raise BenchError(f"loading the empty tc program failed: {os.strerror(-fd)}"
                         + (" (needs root)" if -fd in (errno.EPERM, errno.EACCES) else ""))
    return fd


def attach_filter(ns: str, dev: str, fd: int, name: str, ingress: bool) -> None:
    """A direct-action bpf filter on dev's clsact (added if missing) through nptrace.kernel.netlink."""
    from nptrace.kernel import netlink
    from nptrace.errors import InterfaceError
    for attempt in range(5):
        try:
            with netlink.open_netns(ns) as r:
                idx = r.link(dev).ifindex
                if not r.has_clsact(idx):
                    r.add_clsact(idx)
                r.add_bpf_filter(idx, netlink.PARENT_INGRESS if ingress
                                 else netlink.PARENT_EGRESS, fd, name)
                return
        except InterfaceError:
            # seen once: pyroute2's helper did not find a veth `ip link` had just moved
            # into the namespace; a moment later it does
            if attempt == 4:
                raise
            time.sleep(0.2)


def ifindex(ns: str, dev: str) -> int:
    return int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/ifindex"))


def attach_empty(ns: str, dev: str, fd: int, ingress: bool) -> tuple[str, int | None]:
    """The empty program on dev the way nptrace attaches its own (tc.py, --tc-mode auto): a
    tcx link where the kernel has tcx, else a clsact filter. ("tcx", link fd) or
    ("clsact", None); close the link fd to unlink (the filter goes with the namespace)."""
    from nptrace.kernel import tcx
    from nptrace.kernel.nsenter import path_of
    idx = ifindex(ns, dev)
    try:
        return "tcx", tcx.link_create(fd, idx, ingress, path_of(ns))
    except OSError as e:
        if e.errno not in tcx.NOT_SUPPORTED:
            raise BenchError(f"empty tcx program on {ns}/{dev}: {e}") from None
    attach_filter(ns, dev, fd, f"npt_bn_empty_{'ing' if ingress else 'egr'}", ingress)
    return "clsact", None


def own_stats(fd: int) -> tuple[int, int]:
    """(run_cnt, run_time_ns) of one of our own program fds."""
    d = bpf_prog_fdinfo(Path(f"/proc/self/fdinfo/{fd}").read_text())
    return d.get("run_cnt", 0), d.get("run_time_ns", 0)


def process_prog_stats(pid: int) -> dict[int, dict]:
    """{prog_id: {type, cnt, ns}} of every BPF program fd process `pid` holds."""
    out: dict[int, dict] = {}
    base = Path(f"/proc/{pid}/fdinfo")
    for p in base.iterdir():
        try:
            d = bpf_prog_fdinfo(p.read_text())
        except OSError:
            continue
        if "prog_id" in d and "prog_type" in d:
            out[d["prog_id"]] = {"type": d["prog_type"], "cnt": d.get("run_cnt", 0),
                                 "ns": d.get("run_time_ns", 0)}
    return out


def prog_names(ids) -> dict[int, str]:
    """Program names by id from bpftool (one call); missing names stay out."""
    want = set(ids)
    try:
        progs = json.loads(sh("bpftool", "-j", "prog", "show", timeout=20) or "[]")
    except (BenchError, ValueError):
        return {}
    return {int(p["id"]): p.get("name", "") for p in progs if int(p.get("id", -1)) in want}


def tc_prog_ids(ns: str, dev: str) -> dict[str, dict[str, int]]:
    """{'ingress'|'egress': {name: prog id}} of the programs on dev: tc bpf filters by filter
    name, tcx-linked programs by program name (bpftool's, 15 characters at most)."""
    from nptrace.kernel import tcx
    from nptrace.kernel.nsenter import path_of
    idx = ifindex(ns, dev)
    out = {}
    for hook in ("ingress", "egress"):
        out[hook] = tc_filter_progs(json.loads(
            sh("tc", "-n", ns, "-j", "filter", "show", "dev", dev, hook) or "[]"))
        try:
            ids = tcx.prog_ids(idx, hook == "ingress", path_of(ns))
        except OSError:
            ids = []            # no tcx in this kernel
        for i, name in prog_names(ids).items():
            out[hook][name] = i
    return out


def delta(a: dict[int, dict], b: dict[int, dict]) -> dict[int, dict]:
    """Per program: runs and ns between two process_prog_stats snapshots, ns per run."""
    out = {}
    for pid_, after in b.items():
        before = a.get(pid_, {"cnt": 0, "ns": 0})
        cnt, ns = after["cnt"] - before["cnt"], after["ns"] - before["ns"]
        out[pid_] = {"type": after["type"], "runs": cnt, "ns": ns,
                     "ns_per_run": ns / cnt if cnt else None}
    return out
