"""Compile, load and attach the BPF programs through bcc. The ONLY module that imports bcc.

A start takes the compiled object from the cache where an earlier start made the same one
(kernel/objcache.py), else bcc compiles it; either way the object is a kernel/bpfobject.py
Snapshot loaded as a Loaded (bcc's BPF over the snapshot's maps and instructions), so a
cached start and a compiling one run the same code from there on.

One bcc BPF() object holds every hook family (the bpf/*.bpf.c files, concatenated), so all of
them share one ring buffer, one exact-counter map and one stats array. They are concatenated
rather than #included because bcc generates TRACEPOINT_PROBE argument structs only for probes
in the main text, and rewrites map calls (`events.ringbuf_output(...)`) only in the main
text: the shared helpers in npt_common.h are therefore inlined first (its include guard makes
the families' own #include of it a no-op). (STYLE.md proposes one
BPF() per family; bcc 0.26 cannot share a ring buffer between objects without pinning, and a
second ring buffer would mean a second consumer.)
"""
from __future__ import annotations

import ctypes as ct
import enum
import mmap
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nptrace import events as ev
from nptrace.config import Config
from nptrace.errors import LoadError
from nptrace.kernel import causekeys, natpeers
from nptrace.kernel.cflags import build_cflags
# fd 2 capture, its tail and the LLVM exit guard (kernel/compilelog.py), under the names this
# module has always called them by
from nptrace.kernel.compilelog import capture_stderr as _capture_stderr
from nptrace.kernel.compilelog import llvm_exits as _llvm_exits
from nptrace.kernel.compilelog import log_tail as _tail
from nptrace.kernel.compilelog import map_failure
from nptrace.kernel.hooks import KPROBE_GROUPS, TRACEPOINTS
from nptrace.reasons import SOURCE_DROPS, ReasonTable, interesting_drops


def bpf_dir(env: str | None = os.environ.get("NPTRACE_BPF_DIR"),
            checkout: Path = Path(__file__).resolve().parents[2] / "bpf",
            prefix: str = sys.prefix) -> Path:
    """Where the BPF C sources are: NPTRACE_BPF_DIR (the image sets it); else the checkout's
    bpf/ beside the package (`make setup`'s editable install); else the installed copy in the
    prefix of a non-editable install (scripts/install.sh: /opt/nptrace/share/nptrace/bpf)."""
    if env:
        return Path(env)
    installed = Path(prefix) / "share/nptrace/bpf"
    if not checkout.is_dir() and installed.is_dir():
        return installed
    return checkout


BPF_DIR = bpf_dir()
# Hook families in load order; each file gates its programs with its own -DNPT_* switches.
FAMILIES = ("npt_common.h", "npt_packet.h", "tracepoints.bpf.c", "tc.bpf.c", "nf_hook.bpf.c",
            "kprobes.bpf.c")


class Stat(enum.IntEnum):
    """enum npt_stat (bpf/nptrace_events.h): index into the `stats` per-CPU array. Its names,
    lower case, are the keys of Probes.stats(); tests/unit/test_layout.py checks the mirror."""
    EMITTED = 0
    LOST = 1
    FILTERED = 2
    SAMPLED = 3
    FLOW_KEPT = 4
    COUNT_FULL = 5
    SVC_GATED = 6


# bcc 0.26 prepends `#define bpf_probe_read_kernel bpf_probe_read` when it cannot find the
# helper's address in /proc/kallsyms, and without CAP_SYSLOG (perf_event_paranoid 2) every
# address there reads 0: under the unit's sandbox (ProtectKernelLogs= also drops CAP_SYSLOG)
# and in the DaemonSet. The legacy helper exists for tracing programs only, so the tc programs
# were refused ("unknown func bpf_probe_read#4") and fell back, and the netfilter program did
# not load. bpf_probe_read_kernel is in every kernel nptrace runs on (Linux 5.5, commit
# 6ae08ae3dea2; the BTF offsets need 5.4+): use the real helpers whatever kallsyms shows.
REAL_PROBE_READ = """#undef bpf_probe_read_kernel
#undef bpf_probe_read_kernel_str
#undef bpf_probe_read_user
#undef bpf_probe_read_user_str
"""


def source_text(families=FAMILIES) -> str:
    parts = [REAL_PROBE_READ]
    for name in families:
        path = BPF_DIR / name
        if not path.exists() and name not in FAMILIES[:3]:
            continue
        try:
            parts.append(f"/* ---- {name} ---- */\n" + path.read_text())
        except OSError as e:
            raise LoadError(f"cannot read BPF source {path}: {e.strerror} "
                            f"(set NPTRACE_BPF_DIR to the project's bpf/ folder)") from None
    return "\n".join(parts)


def all_cflags(cfg: Config, available_tracepoints, offset_flags, fields=None) -> list[str]:
    return [f"-I{BPF_DIR}"] + build_cflags(cfg, available_tracepoints, offset_flags, fields)



@contextmanager
def _compiling(what: str):
    """Around a bcc compile (BPF(text=...)): fd 2 captured, LLVM's exits turned into one
    line and exit 2 naming `what`. Yields _capture_stderr()'s box."""
    from bcc.libbcc import lib

    with _capture_stderr() as log, _llvm_exits(log, what, lib):
        yield log


def _load_object(text: str, cflags: list[str]):
    """(kernel/bpfobject.py Loaded object, where it came from: "cache" or "compiled", notes
    for the log: fd 2 is captured meanwhile). A cached object of the same source, headers,
    switches, bcc and kernel is loaded without compiling (kernel/objcache.py); otherwise bcc
    compiles, the object is taken apart into a Snapshot (the maps' fds kept, the module
    freed) and cached for the next start."""
    import bcc

    from nptrace.kernel import bpfobject, objcache
    notes: list[str] = []
    folder = objcache.cache_dir()
    k = objcache.key(text, cflags, getattr(bcc, "__version__", "?"),
                     objcache.include_identity(BPF_DIR, os.environ.get("BCC_KERNEL_SOURCE")))
    if folder is not None:
        snap, why = objcache.load(folder, k)
        if why:
            notes.append(f"BPF object cache: {why}; compiling")
        if snap is not None:
            return bpfobject.loaded(_loaded_class(), snap), "cache", notes

    class Compiled(bcc.BPF):
        def _trace_autoload(self):      # programs are loaded from the snapshot, never here
            pass

    b = Compiled(text=text.encode(), cflags=cflags)
    try:
        from bcc.libbcc import lib
        snap, fds = bpfobject.snapshot(b, lib)
        own = [os.dup(fd) for fd in fds]     # the maps outlive bcc's module
    finally:
        b.cleanup()
    obj = bpfobject.loaded(_loaded_class(), snap, own)
    if folder is not None:
        why = objcache.save(folder, k, snap)
        if why:
            notes.append(f"BPF object cache not written ({why}): every start compiles")
    return obj, "compiled", notes


_LOADED = None


def _loaded_class():
    """kernel/bpfobject.py's Loaded class over bcc's BPF (made once)."""
    global _LOADED
    if _LOADED is None:
        from bcc import BPF, table
        from bcc.utils import get_possible_cpus

        from nptrace.kernel import bpfobject
        _LOADED = bpfobject.define_loaded(BPF, table, get_possible_cpus)
    return _LOADED


def _attach_tracepoints(b) -> None:
    """Load and attach every TRACEPOINT_PROBE program, as bcc's autoload does by name."""
    from bcc import BPF
    names = [n for n in b.function_names() if n.startswith("tracepoint__")]
    b.load_funcs_at_once(names, BPF.TRACEPOINT)
    for name in names:
        tp = name[len("tracepoint__"):].replace("__", ":", 1)
        b.attach_tracepoint(tp=tp.encode(), fn_name=name.encode())


@dataclass
class TrialResult:
    ok: bool
    error: str = ""


class Probes:
    """A loaded and attached set of nptrace programs."""

    def __init__(self, cfg: Config, offset_flags: list[str], drops: ReasonTable,
                 available_tracepoints: set[str], fields=None):
        self.cfg = cfg
        self.cflags = all_cflags(cfg, available_tracepoints, offset_flags, fields)
        self.attached: list[str] = []
        t0 = time.monotonic()
        with _compiling("BPF compile/load failed") as log:
            try:
                self.bpf, self.origin, self.notes = _load_object(source_text(), self.cflags)
                _attach_tracepoints(self.bpf)
            except Exception as e:
                err = e
            else:
                err = None
        if err is not None:
            if getattr(self, "bpf", None) is not None:
                self.bpf.cleanup()
            refused = map_failure(log["text"] + "\n" + str(err), {
                "events": f"--ring-pages {cfg.ringbuf_pages} = {cfg.ringbuf_pages >> 8} MiB",
                "pkt_scratch": f"--snaplen {cfg.snaplen}"})
            if refused:
                raise LoadError(refused)
            raise LoadError(f"BPF compile/load failed: {err}", _tail(log["text"]))
        self.compile_s = time.monotonic() - t0
        for tp, macro in TRACEPOINTS.items():
            if f"-D{macro}=1" in self.cflags:
                self.attached.append(tp)
        self._fill_drop_reasons(drops)
        self._fill_filters()
        self._ring = None
        self._nat = None     # (slots in memory, slot count, used flag) once nat_peer is asked
        self._nat_mem = None

    # --- configuration maps -------------------------------------------------------------
    def _fill_drop_reasons(self, drops: ReasonTable) -> None:
        table = self.bpf["drop_reasons"]
        limit = len(table)
        for v in interesting_drops(drops, limit):
            # bit 1: the rules read the source (npt_common.h NPT_DR_SRC: the cause key)
            table[ct.c_int(v)] = ct.c_uint8(1 | (2 if drops.name(v) in SOURCE_DROPS else 0))
        self._drops = drops
        if not len(drops):
            # No enum in BTF (kernel < 5.17): reason is always 0; keep every drop.
            table[ct.c_int(0)] = ct.c_uint8(1)

    def _fill_filters(self) -> None:
        m = self.bpf["vxlan_ports"]
        for p in self.cfg.vxlan_ports:
            m[ct.c_uint16(p)] = ct.c_uint8(1)
        if self.cfg.ports:
            m = self.bpf["filter_ports"]
            for p in sorted(self.cfg.port_set())[:1024]:
                m[ct.c_uint16(p)] = ct.c_uint8(1)
        if self.cfg.hosts:
            m = self.bpf["filter_hosts"]
            for net in self.cfg.hosts:
                k = m.Key()
                # IPv4 addresses sit in the first 4 bytes of the 16-byte field, so an IPv4
                # /N is a /N over the same bytes.
                k.prefixlen = net.prefixlen
                raw = net.network_address.packed.ljust(16, b"\0")
                ct.memmove(ct.addressof(k.addr), raw, 16)
                m[k] = ct.c_uint8(1)

    def set_netns_scope(self, inodes) -> int:
        """Make the kernel's namespace filter (npt_common.h filter_netns: the namespaces NOT
        reported) hold exactly `inodes`."""
        m = self.bpf["filter_netns"]
        want = {int(i) for i in inodes}
        have = {k.value for k in m.keys()}
        for i in want - have:
            m[m.Key(i)] = ct.c_uint8(1)
        for i in have - want:
            del m[m.Key(i)]
        return len(want)

    def set_service_ends(self, ends) -> int:
        """Make the kernel's --service gate (npt_common.h filter_svc) hold exactly `ends`,
        (addr, port) as classify/filters.py ServiceSel.kernel_ends() gives them ("" for any
        address, port 0 for any port): new ones added first, gone ones deleted after, so a
        refill never leaves a moment with neither. Returns how many it holds (at most 4096)."""
        import ipaddress
        m = self.bpf["filter_svc"]

        def key(addr, port):
            k = m.Key()
            raw = ipaddress.ip_address(addr).packed.ljust(16, b"\0") if addr else bytes(16)
            ct.memmove(ct.addressof(k.addr), raw, 16)
            k.port = port
            return k
        want = {}
        for a, p in sorted(ends)[:getattr(m, "max_entries", 4096)]:
            k = key(a, p)
            want[bytes(k)] = k
        have = {bytes(k): k for k in m.keys()}
        for b, k in want.items():
            if b not in have:
                m[k] = ct.c_uint8(1)
        for b, k in have.items():
            if b not in want:
                del m[k]
        return len(want)

    # --- tc programs (bpf/tc.bpf.c, compiled in with -DNPT_WITH_TC=1) --------------------
    def tc_program_fds(self) -> tuple[int, int]:
        """(ingress fd, egress fd) of the SCHED_CLS programs, for nptrace/kernel/tc.py to attach."""
        from bcc import BPF
        try:
            with _capture_stderr() as log:     # libbcc prints the verifier log on fd 2
                ing, egr = self.bpf.load_funcs_at_once(["npt_tc_ingress", "npt_tc_egress"],
                                                       BPF.SCHED_CLS)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise LoadError(f"tc programs failed to load: {first}", _tail(log["text"])) from None
        return ing.fd, egr.fd

    def nat_peer(self, saddr: str, sport: int, daddr: str, dport: int):
        """The other side of a NATed connection (bpf/nf_hook.bpf.c, `conn_slots`), as
        (src, sport, dst, dport) in that side's packet direction, or None."""
        nat = self._nat
        if nat is None:
            nat = self._nat = self._map_nat_peers()
        mem, size, used = nat
        if not used[0]:
            return None             # nothing NATed yet: no slot can match
        return natpeers.find(mem, size, saddr, sport, daddr, dport)

    def _map_nat_peers(self):
        """(read-only mapping of conn_slots' slots, slot count, nat_used as u64s); no slots
        and a zero flag without the maps (no netfilter-hook program). Both arrays are
        BPF_F_MMAPABLE: a lookup is a flag read and two slice compares, no syscall."""
        try:
            m, u = self.bpf["conn_slots"], self.bpf["nat_used"]
        except KeyError:
            return (b"", 0, (0,))
        size = len(m)
        if ct.sizeof(m.Leaf) != natpeers.CONN_SET:
            raise LoadError(f"conn_slots set is {ct.sizeof(m.Leaf)} bytes, loader expects "
                            f"{natpeers.CONN_SET}")
        length = -(-size * natpeers.CONN_SET // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            mem = mmap.mmap(m.map_fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
            flag = mmap.mmap(u.map_fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as e:
            raise LoadError(f"cannot map conn_slots: {e.strerror}") from None
        self._nat_mem = (mem, flag)
        return (memoryview(mem).toreadonly(), size, memoryview(flag).cast("Q"))

    def map(self, name: str):
        """A bcc table by name, for modules that fill config maps (no bcc import needed there)."""
        return self.bpf[name]

    # --- event delivery -----------------------------------------------------------------
    def open_ring(self, callback) -> None:
        """callback(raw: bytes) per record, from poll()."""
        size = ev.SIZE

        def _cb(_ctx, data, length):
            callback(ct.string_at(data, min(length, size)))
            return 0
        self._cb = _cb  # keep a reference: bcc keeps only a C pointer
        self.bpf["events"].open_ring_buffer(_cb)

    def poll(self, timeout_ms: int = 100) -> None:
        self.bpf.ring_buffer_poll(timeout_ms)

    def consume(self) -> None:
        """Read what the ring holds now, without waiting for a wake-up: the programs wake
        user space only every WAKE_EVERY records (BPF_RB_NO_WAKEUP), so poll() alone can
        sleep through records already there."""
        self.bpf.ring_buffer_consume()

    def ring_map_fd(self) -> int:
        return self.bpf["events"].map_fd

    # --- counters -----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        arr = self.bpf["stats"]
        out = {}
        for s in Stat:
            out[s.name.lower()] = int(sum(arr.getvalue(ct.c_int(s))))
        return out

    def counts(self) -> dict[tuple[int, int, int, int, int], int]:
        """(type, hook, reason, ifindex, netns) -> exact count."""
        out = {}
        for k, v in self.bpf["counts"].items():
            out[(k.type, k.hook, k.reason, k.ifindex, k.netns)] = int(sum(v))
        return out

    def mark_weak_drops(self, weak: frozenset) -> None:
        """Flag the drop reasons that are only evidence (classify.verdict.WEAK_DROPS: the
        caller's, the kernel layer does not import the classifier): such a drop never becomes
        its flow's causal fact (npt_common.h NPT_DR_WEAK)."""
        table = self.bpf["drop_reasons"]
        for v in interesting_drops(self._drops, len(table)):
            if self._drops.name(v) in weak:
                table[ct.c_int(v)] = ct.c_uint8(table[ct.c_int(v)].value | 4)

    def cause_counts(self) -> dict:
        """{causekeys.CauseKey: (counted, sent)} summed over CPUs (every record but
        evidence-only ones, exact), and under the key None, {type: (counted, sent)} of the
        records that found the map full (cause "other"). One BPF_MAP_LOOKUP_BATCH pass (5.6+;
        two syscalls per key with bcc's items() were most of a storm's user-space CPU at
        16k keys), items() where batches are refused."""
        m = self.bpf["cause_counts"]
        try:
            items = list(m.items_lookup_batch())
        except Exception:
            items = list(m.items())
        out: dict = {}
        raw = self._cause_raw = {}
        decode = causekeys.decode_key
        for k, v in items:
            b = bytes(k)
            key = decode(b)
            raw[key] = b
            out[key] = (sum(x.counted for x in v), sum(x.sent for x in v))
        other = {}
        arr = self.bpf["cause_other"]
        for t in range(len(arr)):
            vals = arr.getvalue(ct.c_int(t))
            n = sum(x.counted for x in vals)
            if n:
                other[t] = (n, sum(x.sent for x in vals))
        out[None] = other
        return out

    def delete_cause_keys(self, keys) -> int:
        """Delete idle keys (read by the last cause_counts()) so the bounded map keeps room
        for the keys of the day; how many went. A record counted under one between that read
        and the delete is lost: the caller picks keys idle for a minute."""
        m = self.bpf["cause_counts"]
        raw = getattr(self, "_cause_raw", {})
        n = 0
        for key in keys:
            b = raw.get(key)
            if b is None:
                continue
            try:
                del m[m.Key.from_buffer_copy(b)]
                n += 1
            except KeyError:
                pass
        return n

    def close(self) -> None:
        if self._nat_mem is not None:
            self._nat = None
            for mem in self._nat_mem:
                try:
                    mem.close()
                except BufferError:
                    pass    # a memoryview of it is still referenced: unmapped when freed
            self._nat_mem = None
        for t in self.begin_detach():
            t.join()
        try:
            self.bpf.cleanup()
        except Exception:
            pass

    def begin_detach(self) -> list:
        """Start detaching every tracepoint, one thread each, and return the threads (close()
        joins them): closing a tracepoint's perf event waits in the kernel for the probes in
        flight to end (~70 ms each here, 0.37 s for five one after another), and concurrent
        waits overlap, with each other and with the tc links' own (the tracer begins this
        before it closes those). bcc's cleanup() then finds none."""
        import threading

        if getattr(self, "_detaching", None) is not None:
            return self._detaching

        def detach(tp):
            try:
                self.bpf.detach_tracepoint(tp)
            except Exception:
                pass      # cleanup() tries once more
        threads = [threading.Thread(target=detach, args=(tp,), name="npt-detach")
                   for tp in list(getattr(self.bpf, "tracepoint_fds", {}))]
        for t in threads:
            t.start()
        self._detaching = threads
        return threads


def trial_load(kind: str) -> TrialResult:
    """A real trial of a program type the kernel may refuse (features.py / `nptrace doctor`)."""
    from bcc import BPF
    texts = {
        "fentry": "KFUNC_PROBE(tcp_v4_rcv) { return 0; }",
        "kprobe": 'int npt_trial(void *ctx) { return 0; }',
        "tracepoint": "TRACEPOINT_PROBE(sock, inet_sock_set_state) { return 0; }",
    }
    if kind not in texts:
        return TrialResult(False, f"unknown trial {kind}")
    try:
        with _compiling(f"trial load of a {kind} program failed") as log:
            try:
                b = BPF(text=texts[kind], cflags=["-Wno-ignored-attributes"])
                if kind == "kprobe":
                    b.attach_kprobe(event="tcp_v4_rcv", fn_name="npt_trial")
                b.cleanup()
                ok, msg = True, ""
            except Exception as e:
                ok, msg = False, str(e).splitlines()[0] if str(e) else type(e).__name__
        if not ok:
            detail = _tail(log["text"], 2)
            return TrialResult(False, f"{msg}{': ' + detail if detail else ''}")
        return TrialResult(True)
    except Exception as e:  # a trial must never take doctor down
        return TrialResult(False, str(e))


# --- enrichment: kprobes and the netfilter-hook program ---
# Load, verify and attach the optional enrichment programs (bpf/kprobes.bpf.c,
# bpf/nf_hook.bpf.c) of a Probes object (kernel/attach.py, for `nptrace run`) or of a
# compile_families() object (tests/privileged/test_enrichment_compile.py). The netfilter
# program's fd goes to nptrace/kernel/nfhook.py, which links it.

BPF_PROG_TYPE_NETFILTER = 32   # Linux 6.4
BPF_NETFILTER = 45             # enum bpf_attach_type: expected attach type of netfilter progs

# Enrichment kprobe groups (group -> alternatives tried in order): the kprobe rows of the hook
# table, kernel/hooks.py KPROBE_GROUPS, imported above.


def compile_families(families, cflags: list[str]):
    """One bcc object from the given bpf/ files, attaching nothing. Kprobe programs are only
    loaded on attach, so this compiles kprobes.bpf.c where the kernel has no kprobes."""
    from bcc import BPF
    with _compiling(f"BPF compile failed ({', '.join(families)})") as log:
        try:
            b = BPF(text=source_text(tuple(families)), cflags=[f"-I{BPF_DIR}"] + list(cflags))
        except Exception as e:
            err = e
        else:
            err = None
    if err is not None:
        refused = map_failure(log["text"])
        if refused:
            raise LoadError(refused)
        raise LoadError(f"BPF compile failed ({', '.join(families)}): {err}", _tail(log["text"]))
    return b


def verify_programs(bpf, names, prog_type: int, attach_type: int = -1) -> dict[str, str]:
    """Load each program into the kernel (the verifier runs) without attaching it.
    name -> "" when accepted, else the error and the verifier log's tail."""
    out = {}
    for name in names:
        with _capture_stderr() as log:
            try:
                bpf.load_func(name, prog_type, attach_type=attach_type)
                err = ""
            except Exception as e:
                err = str(e)
        out[name] = f"{err}: {_tail(log['text'], 6)}" if err else ""
    return out


def attach_kprobes(bpf, groups=None) -> dict[str, str]:
    """Attach the enrichment kprobes (every group of the hook table, or `groups`). group ->
    the kernel function attached, or "skipped: <why>" (an optional hook that cannot run is
    skipped, never fatal)."""
    groups = KPROBE_GROUPS if groups is None else groups
    out = {}
    for group, alternatives in groups.items():
        errors = []
        for alt in alternatives:
            done = []
            try:
                with _capture_stderr():
                    for prog, kind, func in alt:
                        if kind == "return":
                            bpf.attach_kretprobe(event=func, fn_name=prog)
                        else:
                            bpf.attach_kprobe(event=func, fn_name=prog)
                        done.append((kind, func))
            except Exception as e:
                errors.append(f"{alt[0][2]}: {str(e).splitlines()[0] if str(e) else e!r}")
                for kind, func in done:
                    try:
                        (bpf.detach_kretprobe if kind == "return" else bpf.detach_kprobe)(event=func)
                    except Exception:
                        pass
                continue
            out[group] = alt[0][2]
            break
        else:
            out[group] = "skipped: " + "; ".join(errors)
    return out


def verify_kprobes(bpf, programs) -> int:
    """Load (verify) kprobe programs without attaching them, as `run` would before its
    attach: how many loaded. LoadError names the first the verifier refuses."""
    from bcc import BPF
    for name in programs:
        with _capture_stderr() as log:
            try:
                bpf.load_func(name, BPF.KPROBE)
            except Exception as e:
                err = e
            else:
                continue
        raise LoadError(f"kprobe program {name} failed to load: {err}", _tail(log["text"]))
    return len(programs)


def load_netfilter_prog(bpf, name: str = "npt_nf_view") -> int:
    """fd of a BPF_PROG_TYPE_NETFILTER program (bcc 0.26 load_func passes the expected attach
    type); nptrace/kernel/nfhook.py links it with BPF_LINK_CREATE."""
    with _capture_stderr() as log:
        try:
            fn = bpf.load_func(name, BPF_PROG_TYPE_NETFILTER, attach_type=BPF_NETFILTER)
        except Exception as e:
            err = e
        else:
            return fn.fd
    raise LoadError(f"netfilter program {name} failed to load: {err} (needs Linux 6.4+ with "
                    f"CONFIG_NETFILTER_BPF_LINK)", _tail(log["text"]))
