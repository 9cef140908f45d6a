"""Attach the tc programs (bpf/tc.bpf.c) to each --iface, and take them off again.

`TcAttachments` is a context manager: on entry it resolves every interface first (bad input
changes nothing) and removes what dead nptrace runs left behind. Then, per interface:
- mode "tcx" (and "auto" on Linux 6.6+): two tcx links, ours first on the device
  (nptrace/kernel/tcx.py: cheaper dispatch, and the kernel unlinks them when the process dies);
- mode "clsact" (and "auto" where the kernel has no tcx): a clsact qdisc where none exists
  and two direct-action bpf filters named `npt_<pid>_ing` / `npt_<pid>_egr`.
On exit (normal or exception) it closes the links, removes only its filters, and the qdisc
only if it created it and nothing else is filtering there, in reverse order.

A state file /run/nptrace/tc-<pid>.json records each step as it succeeds, so that after a
`kill -9` the next start removes what the dead run left (`recover`). Filters are also found
by name: a filter whose name says it belongs to a pid that no longer runs is removed from
every interface we attach to, which covers a crash between adding a filter and recording it.

netlink goes through nptrace/kernel/netlink.py (pyroute2), loaded lazily: this module imports
without pyroute2 and without root, and unit tests pass a fake in its place.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from nptrace.kernel import tcx
from nptrace.kernel.bpfsys import bpf
from nptrace.config import Config, IfaceSpec
from nptrace.errors import InterfaceError
from nptrace.kernel.nsenter import path_of

log = logging.getLogger(__name__)

STATE_DIR = Path(os.environ.get("NPTRACE_STATE_DIR", "/run/nptrace"))
PARENT_INGRESS = 0xFFFFFFF2
PARENT_EGRESS = 0xFFFFFFF3
FILTER_PREFIX = "npt_"
_NAME_RE = re.compile(r"^npt_(\d+)_(ing|egr)$")
_STATE_RE = re.compile(r"^tc-(\d+)\.json$")
# Link types whose packets start with an Ethernet header at tc (include/uapi/linux/if_arp.h):
# ARPHRD_ETHER (NICs, veth, bridge, vxlan, bond, vlan) and ARPHRD_LOOPBACK (eth_header too).
# L3 devices (ARPHRD_NONE: wireguard, tun; ipip, gre) start at the IP header: not parsed.
ETHERNET_LINK_TYPES = {1: "ether", 772: "loopback"}
TC_MODES = ("auto", "tcx", "clsact")


def filter_name(pid: int, parent: int) -> str:
    return f"{FILTER_PREFIX}{pid}_{'ing' if parent == PARENT_INGRESS else 'egr'}"


def filter_owner(name: str) -> int | None:
    """The pid a filter name says it belongs to, or None if it is not ours."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


# --- compile switches and config maps ----------------------------------------------------
def tc_cflags(cfg: Config) -> list[str]:
    """-D switches for bpf/tc.bpf.c (kernel/attach.py tc_cflags adds them to the cflags)."""
    return [
        # netns inode and conntrack read from the kernel sk_buff behind the tc context
        "-DNPT_TC_KSKB=1",
        f"-DNPT_TC_VXLAN={1 if cfg.vxlan_ports else 0}",
    ]


def configure(probes, cfg: Config) -> None:
    """Fill tc config maps that do not depend on attachment: the VXLAN UDP ports."""
    m = probes.map("vxlan_ports")
    for port in cfg.vxlan_ports:
        if not 0 < port < 65536:
            raise InterfaceError(f"bad VXLAN port {port}: want 1-65535")
        m[m.Key(port)] = m.Leaf(1)


TC_IF_AMBIGUOUS = 0x01     # bpf/tc.bpf.c NPT_TC_IF_AMBIGUOUS
TC_IF_SLOTS = 4096         # bpf/tc.bpf.c NPT_TC_IF_SLOTS


def iface_map_filler(probes) -> Callable[["Attached"], None]:
    """on_attach callback filling tc_ifaces {ifindex % TC_IF_SLOTS -> (ifindex, netns
    inode)}, which the tc programs read instead of following skb->dev to its namespace. A slot
    is marked ambiguous where watched devices of two namespaces share its ifindex, or two
    ifindexes share it: the programs then read the sk_buff."""
    m = probes.map("tc_ifaces")

    def fill(a: "Attached") -> None:
        key = m.Key(a.ifindex % TC_IF_SLOTS)
        leaf = m.Leaf()
        leaf.ifindex = a.ifindex
        leaf.netns = a.netns_inode
        try:
            old = m[key]
        except KeyError:       # an array holds every slot; a test's table may not
            old = None
        if old is not None and old.ifindex and (old.ifindex != a.ifindex
                                                or old.netns != a.netns_inode
                                                or old.flags & TC_IF_AMBIGUOUS):
            leaf.flags = TC_IF_AMBIGUOUS
        m[key] = leaf
    return fill


# --- process identity (pid reuse) ---------------------------------------------------------
def _start_time(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), None if no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    try:
        return int(text.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): with its pid, its identity."""
    return _start_time(pid)


def process_alive(pid: int, start: int | None = None, proc: Path = Path("/proc")) -> bool:
    st = _start_time(pid, proc)
    if st is None:
        return False
    return start is None or st == start


# --- state file --------------------------------------------------------------------------
@dataclass
class Attached:
    """What one run put on one interface."""
    netns: str | None
    ifname: str
    ifindex: int
    netns_inode: int
    clsact_created: bool = False
    filters: list[dict] = field(default_factory=list)   # FilterRef.to_dict() each

    def to_dict(self) -> dict:
        return {"netns": self.netns, "ifname": self.ifname, "ifindex": self.ifindex,
                "netns_inode": self.netns_inode, "clsact_created": self.clsact_created,
                "filters": list(self.filters)}

    @classmethod
    def from_dict(cls, d: dict) -> "Attached":
        return cls(d.get("netns"), str(d["ifname"]), int(d["ifindex"]), int(d["netns_inode"]),
                   bool(d.get("clsact_created")), [dict(f) for f in d.get("filters", [])])


class StateFile:
    """/run/nptrace/tc-<pid>.json, rewritten atomically after each change."""

    def __init__(self, state_dir: Path, pid: int, start: int | None):
        self.path = Path(state_dir) / f"tc-{pid}.json"
        self.pid, self.start = pid, start

    def write(self, entries: list[Attached]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": self.pid, "start": self.start,
                                   "entries": [e.to_dict() for e in entries]}, indent=1))
        os.replace(tmp, self.path)

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def read_state(path: Path) -> tuple[int, int | None, list[Attached]] | None:
    """(pid, start, entries), or None for a file that is not a readable state file."""
    try:
        d = json.loads(path.read_text())
        return int(d["pid"]), d.get("start"), [Attached.from_dict(e) for e in d["entries"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- netlink access ----------------------------------------------------------------------
def _default_open(netns):
    from nptrace.kernel import netlink
    return netlink.open_netns(netns)


def _remove_entry(r, e: Attached, owner_pid: int) -> list[str]:
    """Remove what entry e recorded, on the interface r (an open Rtnl of e's namespace).
    Only filters whose current name still says they are the owner's are deleted."""
    done = []
    link = r.link_by_index(e.ifindex)
    if link is None or link.name != e.ifname:
        return done       # the device went away (with its qdisc), or the index was reused
    for parent in (PARENT_EGRESS, PARENT_INGRESS):
        for f in r.filters(e.ifindex, parent):
            if filter_owner(f.name) == owner_pid and r.del_filter(f):
                done.append(f"{e.ifname}: filter {f.name}")
    if e.clsact_created:
        left = r.filters(e.ifindex, PARENT_INGRESS) + r.filters(e.ifindex, PARENT_EGRESS)
        if not left and r.has_clsact(e.ifindex):
            r.del_clsact(e.ifindex)
            done.append(f"{e.ifname}: clsact")
    return done


def recover(state_dir: Path = STATE_DIR, open_netns=_default_open, *,
            proc: Path = Path("/proc")) -> list[str]:
    """Remove what dead runs recorded in state_dir; returns one line per removed object.
    A run is alive while its pid runs with the recorded start time (so a file left by an
    earlier process with our own pid counts as dead). Unreadable files are removed."""
    removed: list[str] = []
    try:
        files = sorted(Path(state_dir).iterdir())
    except FileNotFoundError:
        return removed
    for path in files:
        m = _STATE_RE.match(path.name)
        if not m:
            continue
        st = read_state(path)
        if st is None:
            log.warning("ignoring unreadable tc state file %s", path)
            path.unlink(missing_ok=True)
            continue
        pid, start, entries = st
        if process_alive(pid, start, proc):
            continue
        done: list[str] = []
        for e in reversed(entries):
            try:
                with open_netns(e.netns) as r:
                    if r.inode != e.netns_inode:
                        continue   # namespace re-created since: the old one took it all
                    done += _remove_entry(r, e, pid)
            except InterfaceError:
                continue           # namespace gone, and everything in it
        path.unlink(missing_ok=True)
        if done:
            log.warning("removed tc leftovers of dead nptrace run %d: %s", pid, ", ".join(done))
        removed += done
    return removed


def _sweep_dead_filters(r, ifindex: int, ifname: str, proc: Path, self_pid: int) -> list[str]:
    """Filters named npt_<pid>_* whose pid is not running (or is us, before we attached)."""
    done = []
    for parent in (PARENT_INGRESS, PARENT_EGRESS):
        for f in r.filters(ifindex, parent):
            owner = filter_owner(f.name)
            if owner is None:
                continue
            if owner == self_pid or not process_alive(owner, None, proc):
                if r.del_filter(f):
                    done.append(f"{ifname}: filter {f.name}")
    return done


# --- the attachment manager ---------------------------------------------------------------
class TcAttachments:
    """Context manager: the two tc programs on every interface of `ifaces`."""

    def __init__(self, ifaces: Iterable[IfaceSpec], ingress_fd: int, egress_fd: int, *,
                 state_dir: Path = STATE_DIR, open_netns=_default_open,
                 on_attach: Callable[[Attached], None] | None = None,
                 proc: Path = Path("/proc"), pid: int | None = None, mode: str = "clsact",
                 link_tcx=tcx.link_create):
        if mode not in TC_MODES:
            raise ValueError(f"tc mode {mode!r}: want one of {', '.join(TC_MODES)}")
        self.specs = _dedupe(ifaces)
        self.mode = mode              # "auto" becomes "tcx" or "clsact" at the first interface
        self.link_tcx = link_tcx
        self.links: list[tuple[Attached, list[int]]] = []   # tcx: nothing to record on disk
        self.fds = {PARENT_INGRESS: ingress_fd, PARENT_EGRESS: egress_fd}
        self.state_dir = Path(state_dir)
        self.open_netns = open_netns
        self.on_attach = on_attach
        self.proc = proc
        self.pid = os.getpid() if pid is None else pid
        self.state = StateFile(self.state_dir, self.pid, _start_time(self.pid, proc))
        self.attached: list[Attached] = []
        self.recovered: list[str] = []
        self._entered = False

    # Resolve every interface before changing anything.
    def resolve(self) -> list[tuple[IfaceSpec, int, int]]:
        found: dict[int, tuple[int, int]] = {}
        for netns, group in _by_netns(list(enumerate(self.specs)), lambda x: x[1].netns):
            with self.open_netns(netns) as r:
                for i, spec in group:
                    link = r.link(spec.name)
                    arphrd = getattr(link, "arphrd", 1)
                    if arphrd not in ETHERNET_LINK_TYPES:
                        raise InterfaceError(f"--iface {spec}: link type {arphrd} has no "
                                             f"Ethernet header; nptrace's tc parser needs one "
                                             f"(watch the underlying Ethernet device instead)")
                    found[i] = (link.ifindex, r.inode)
        out = [(spec, *found[i]) for i, spec in enumerate(self.specs)]
        seen = {}
        for spec, idx, ino in out:
            if (ino, idx) in seen:
                raise InterfaceError(f"--iface {spec} and --iface {seen[(ino, idx)]} "
                                     f"name the same interface")
            seen[(ino, idx)] = spec
        return out

    def __enter__(self) -> "TcAttachments":
        if self._entered:           # attach() already did it
            return self
        self._entered = True
        targets = self.resolve()
        self.recovered = recover(self.state_dir, self.open_netns, proc=self.proc)
        try:
            for netns, group in _by_netns(targets, lambda t: t[0].netns):
                with self.open_netns(netns) as r:
                    for spec, ifindex, inode in group:
                        self._attach_one(r, spec, ifindex, inode)
        except BaseException:
            self.detach()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def close(self) -> None:
        self.detach()

    def _attach_one(self, r, spec: IfaceSpec, ifindex: int, inode: int) -> None:
        """Attach to one interface; r: an open Rtnl of its namespace."""
        self.recovered += _sweep_dead_filters(r, ifindex, spec.name, self.proc, self.pid)
        entry = Attached(spec.netns, spec.name, ifindex, inode)
        if self.mode != "clsact" and self._attach_tcx(spec, entry):
            if self.on_attach is not None:
                self.on_attach(entry)
            log.info("tc programs linked (tcx) to %s (ifindex %d)", spec, ifindex)
            return
        self.attached.append(entry)
        if not r.has_clsact(ifindex):
            r.add_clsact(ifindex)
            entry.clsact_created = True
            self.state.write(self.attached)
        for parent in (PARENT_INGRESS, PARENT_EGRESS):
            ref = r.add_bpf_filter(ifindex, parent, self.fds[parent],
                                   filter_name(self.pid, parent))
            entry.filters.append(ref.to_dict())
            self.state.write(self.attached)
        if self.on_attach is not None:
            self.on_attach(entry)
        log.info("tc programs attached to %s (ifindex %d)", spec, ifindex)

    def _attach_tcx(self, spec: IfaceSpec, entry: Attached) -> bool:
        """Both programs as tcx links; False when the kernel has no tcx and the mode lets
        clsact stand in (then every later interface goes straight to clsact)."""
        fds: list[int] = []
        try:
            for parent in (PARENT_INGRESS, PARENT_EGRESS):
                fds.append(self.link_tcx(self.fds[parent], entry.ifindex,
                                         parent == PARENT_INGRESS, path_of(spec.netns)))
        except OSError as e:
            for fd in fds:
                os.close(fd)
            if self.mode == "auto" and e.errno in tcx.NOT_SUPPORTED:
                log.info("no tcx here (%s): clsact filters instead", e)
                self.mode = "clsact"
                return False
            raise InterfaceError(f"--iface {spec}: {e.strerror or e}"
                                 + ("" if self.mode == "tcx" else " (try --tc-mode clsact)")
                                 ) from None
        self.mode = "tcx"
        self.links.append((entry, fds))
        return True

    # -- a watched interface that went away and came back (node/ifwatch.py) -------------
    def where(self, spec: IfaceSpec) -> tuple[int, int] | None:
        """(netns inode, ifindex) the programs of `spec` were last attached at."""
        for e in [e for e, _ in self.links] + self.attached:
            if (e.netns, e.ifname) == (spec.netns, spec.name):
                return e.netns_inode, e.ifindex
        return None

    def reattach(self, spec: IfaceSpec, ifindex: int, inode: int) -> None:
        """Attach `spec` again at its new (inode, ifindex): a pod restart or a re-created
        VXLAN device took the old device, and its filters and tcx links with it. The old
        entry is forgotten (its link fds closed) before the new one is made. A spec attached
        nowhere yet (a device the automatic choice just found) is simply attached."""
        self.forget(spec)
        if spec not in self.specs:
            self.specs.append(spec)
        with self.open_netns(spec.netns) as r:
            self._attach_one(r, spec, ifindex, inode)

    def remove(self, spec: IfaceSpec) -> None:
        """Take the programs off `spec` for good (the automatic choice dropped the device)."""
        self.forget(spec)
        if spec in self.specs:
            self.specs.remove(spec)

    def forget(self, spec: IfaceSpec) -> None:
        """Close `spec`'s tcx links and remove its clsact filters where its device still is."""
        for i, (e, fds) in enumerate(self.links):
            if (e.netns, e.ifname) == (spec.netns, spec.name):
                for fd in fds:
                    os.close(fd)
                del self.links[i]
                break
        for e in list(self.attached):
            if (e.netns, e.ifname) == (spec.netns, spec.name):
                self.attached.remove(e)
                try:       # _remove_entry leaves a device that is gone or renamed alone
                    with self.open_netns(e.netns) as r:
                        if r.inode == e.netns_inode:
                            _remove_entry(r, e, self.pid)
                except InterfaceError:
                    pass
        self.state.write(self.attached)

    def detach(self) -> list[str]:
        """Undo, in reverse order. An interface that fails stays in the state file for the
        next start; the others are still cleaned."""
        removed: list[str] = []
        # closing a link's last fd unlinks it, and waits in the kernel for the programs in
        # flight (~10 ms a link here): all of them closed side by side, the waits overlap
        links, self.links = self.links[::-1], []
        fds = [fd for _, link_fds in links for fd in link_fds]
        if fds:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(min(len(fds), 16)) as pool:
                list(pool.map(os.close, fds))
        removed += [f"{e.ifname}: tcx links" for e, _ in links]
        failed: list[Attached] = []
        while self.attached:
            e = self.attached.pop()
            try:
                with self.open_netns(e.netns) as r:
                    if r.inode == e.netns_inode:
                        removed += _remove_entry(r, e, self.pid)
            except InterfaceError:
                pass                # its namespace is gone, and our filters with it
            except Exception as ex:
                log.warning("tc cleanup of %s failed (the next start retries): %s",
                            f"{e.netns + '/' if e.netns else ''}{e.ifname}", ex)
                failed.insert(0, e)
            if self.attached or failed:
                self.state.write(self.attached + failed)
        if not failed:
            self.state.remove()
        return removed


def _by_netns(items: list, netns_of) -> list[tuple]:
    """(namespace, its items) in first-seen order: one netlink socket per namespace, not per
    interface (opening one in another namespace costs ~15 ms; a lab node has five devices)."""
    groups: dict = {}
    for it in items:
        groups.setdefault(netns_of(it), []).append(it)
    return list(groups.items())


def _dedupe(ifaces: Iterable[IfaceSpec]) -> list[IfaceSpec]:
    out: list[IfaceSpec] = []
    for s in ifaces:
        if s not in out:
            out.append(s)
    return out


def attach(probes, cfg: Config, *, state_dir: Path = STATE_DIR, **kw) -> TcAttachments:
    """The tc programs of a loaded Probes, attached to cfg.ifaces now; undo with .close()
    (or use it in a `with`). kw: TcAttachments' test seams (open_netns, proc, pid)."""
    configure(probes, cfg)
    ing, egr = probes.tc_program_fds()
    att = TcAttachments(cfg.ifaces, ing, egr, state_dir=state_dir,
                        on_attach=iface_map_filler(probes), mode=cfg.tc_mode, **kw)
    return att.__enter__()


# --- run-time cost ------------------------------------------------------------------------
def prog_stats(fd: int, proc_self: Path = Path("/proc/self")) -> tuple[int, int]:
    """(run_cnt, run_time_ns) of a loaded BPF program, from /proc/self/fdinfo/<fd>.
    Counted only while BPF stats are on (enable_bpf_stats or kernel.bpf_stats_enabled=1)."""
    cnt = ns = 0
    for line in (proc_self / "fdinfo" / str(fd)).read_text().splitlines():
        key, _, val = line.partition(":")
        if key == "run_cnt":
            cnt = int(val)
        elif key == "run_time_ns":
            ns = int(val)
    return cnt, ns


_BPF_ENABLE_STATS = 32      # enum bpf_cmd, Linux 5.8
_BPF_STATS_RUN_TIME = 0


@contextmanager
def enable_bpf_stats():
    """Run-time statistics on for as long as the block runs (BPF_ENABLE_STATS, Linux 5.8):
    the kernel turns them off when the returned fd closes, even if we are killed, unlike a
    sysctl we would have to restore."""
    attr = (ctypes.c_uint32 * 32)()        # union bpf_attr; enable_stats.type is first
    attr[0] = _BPF_STATS_RUN_TIME
    fd = bpf(_BPF_ENABLE_STATS, attr)
    if fd < 0:
        raise OSError(-fd, f"BPF_ENABLE_STATS failed: {os.strerror(-fd)}")
    try:
        yield
    finally:
        os.close(fd)
