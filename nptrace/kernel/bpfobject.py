"""A compiled BPF object apart from the compile: its maps and program instructions as data
(Snapshot), and the object loaded from that data (Loaded), a bcc BPF whose programs and
tables come from the snapshot rather than from a libbcc module.

Why: bcc 0.26 compiles, creates the maps and writes their fds into the code in one call
(`bpf_module_create_c_from_string`, 1.7 s of a 2.9 s start here) and cannot load a compiled
object. Every start now goes compile (or cache, kernel/objcache.py) -> Snapshot -> Loaded, so
the path a warm start takes is the one every start takes.

What a Snapshot holds, read from bcc's module after its compile: per map its type, sizes,
flags and bcc's JSON type descriptions of key and value (bcc's own ctypes decoding turns them
into Key/Leaf); per function its instructions, each map reference (a 16-byte load of
src_reg BPF_PSEUDO_MAP_FD whose immediate is the map's fd) rewritten to the map's index, so
that the same instructions load against maps created anew.

Loaded keeps bcc's BPF for what bcc does well and needs no module: attaching and detaching
tracepoints and kprobes, the ring buffer callback consumer, cleanup(). Its tables are bcc's
own table classes, given the map's fd and types instead of asking the module (TableBase's
constructor would). Programs are loaded with the bpf(2) syscall; a refusal prints the
verifier's log on fd 2, where bcc's loader prints it, so the callers' captures see the same.
bcc's classes and its libbcc wrapper are passed in by loader.py, the one module that imports
bcc.
"""
from __future__ import annotations

import ctypes as ct
import errno
import json
import os
import resource
import struct
from dataclasses import dataclass

from nptrace.errors import LoadError
from nptrace.kernel.bpfsys import bpf as bpf_syscall

BPF_MAP_CREATE = 0
BPF_PROG_LOAD = 5
BPF_PSEUDO_MAP_FD = 1
LD_IMM64 = 0x18          # BPF_LD | BPF_IMM | BPF_DW: the first half of a 16-byte load
OBJ_NAME_LEN = 16
LOG_SIZES = (1 << 22, 1 << 26)   # verifier log buffers tried after a refusal (4, 64 MiB)
INSN = struct.Struct("<BBhi")


class SnapshotError(ValueError):
    """A snapshot that cannot be this kernel's object (malformed, or a map reference out of
    range): a cache entry is then ignored and the source compiled."""


@dataclass(frozen=True)
class MapSpec:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    key_desc: str      # bcc's JSON description of the key type
    leaf_desc: str


@dataclass(frozen=True)
class Snapshot:
    license: bytes
    kern_version: int
    maps: tuple[MapSpec, ...]
    progs: dict[str, bytes]    # function name -> instructions, map references by index

    def to_data(self) -> dict:
        return {"license": self.license, "kern_version": self.kern_version,
                "maps": [[m.name, m.type, m.key_size, m.value_size, m.max_entries, m.flags,
                          m.key_desc, m.leaf_desc] for m in self.maps],
                "progs": self.progs}

    @classmethod
    def from_data(cls, d) -> "Snapshot":
        """The inverse of to_data(), checking every field's type: SnapshotError otherwise."""
        try:
            maps = tuple(MapSpec(*m) for m in d["maps"])
            snap = cls(d["license"], d["kern_version"], maps, dict(d["progs"]))
        except (KeyError, TypeError, ValueError) as e:
            raise SnapshotError(f"malformed: {e}") from None
        kinds = ((snap.license, bytes), (snap.kern_version, int))
        if not all(isinstance(v, t) for v, t in kinds) or not all(
                isinstance(v, t) for m in maps for v, t in zip(
                    (m.name, m.type, m.key_size, m.value_size, m.max_entries, m.flags,
                     m.key_desc, m.leaf_desc), (str, int, int, int, int, int, str, str))):
            raise SnapshotError("malformed: a field of the wrong type")
        if not all(0 <= v < 1 << 32 for m in maps for v in (
                m.type, m.key_size, m.value_size, m.max_entries, m.flags)) \
                or not 0 <= snap.kern_version < 1 << 32:
            raise SnapshotError("malformed: a number out of range")
        for name, code in snap.progs.items():
            if not isinstance(name, str) or not isinstance(code, bytes) or len(code) % 8:
                raise SnapshotError(f"malformed program {name!r}")
            for _, imm in map_refs(code):
                if not 0 <= imm < len(maps):
                    raise SnapshotError(f"program {name} refers to map {imm} of {len(maps)}")
        return snap


def map_refs(code: bytes):
    """(byte offset, immediate) of each map reference in `code`."""
    for off in range(0, len(code) - 15, 8):
        op, regs, _, imm = INSN.unpack_from(code, off)
        if op == LD_IMM64 and regs >> 4 == BPF_PSEUDO_MAP_FD:
            yield off, imm


def relink(code: bytes, fds) -> bytes:
    """`code` with each map reference's immediate i replaced by fds[i] (from the fd to the
    index: pass a dict fd -> index)."""
    out = bytearray(code)
    for off, imm in map_refs(code):
        op, regs, o, _ = INSN.unpack_from(code, off)
        INSN.pack_into(out, off, op, regs, o, fds[imm])
    return bytes(out)


# libbcc's module accessors (bcc_common.h) this module calls, with their result types; each
# takes the module, and all but the first an index. Every call goes through a declared
# prototype: an undeclared one passes the module pointer as a C int, cut to 32 bits, which
# works while the pointer is low (a non-PIE python's heap) and reads garbage when it is not.
MODULE_CALLS = (("bpf_num_tables", ct.c_size_t), ("bpf_num_functions", ct.c_ulonglong),
                ("bpf_table_name", ct.c_char_p), ("bpf_table_fd_id", ct.c_int),
                ("bpf_table_type_id", ct.c_int), ("bpf_table_max_entries_id", ct.c_size_t),
                ("bpf_table_flags_id", ct.c_int), ("bpf_table_key_desc_id", ct.c_char_p),
                ("bpf_table_leaf_desc_id", ct.c_char_p), ("bpf_table_key_size_id", ct.c_size_t),
                ("bpf_table_leaf_size_id", ct.c_size_t))


def _module_calls():
    """MODULE_CALLS on a handle of our own: bcc's Python declares only some of them, and its
    declarations are not ours to change."""
    lib = ct.CDLL("libbcc.so.0")
    for fn, res in MODULE_CALLS:
        f = getattr(lib, fn)
        f.restype = res
        f.argtypes = [ct.c_void_p] if fn.startswith("bpf_num_") else [ct.c_void_p, ct.c_ulonglong]
    return lib


def snapshot(b, bcc_lib) -> tuple[Snapshot, list[int]]:
    """(the Snapshot of a compiled bcc BPF, its map fds in the snapshot's order); bcc_lib is
    bcc's libbcc wrapper (its function accessors are declared there)."""
    lib = _module_calls()
    m = b.module
    maps, fds = [], []
    for i in range(lib.bpf_num_tables(m)):
        name = lib.bpf_table_name(m, i)
        maps.append(MapSpec(name.decode(), lib.bpf_table_type_id(m, i),
                            lib.bpf_table_key_size_id(m, i), lib.bpf_table_leaf_size_id(m, i),
                            lib.bpf_table_max_entries_id(m, i), lib.bpf_table_flags_id(m, i),
                            lib.bpf_table_key_desc_id(m, i).decode(),
                            lib.bpf_table_leaf_desc_id(m, i).decode()))
        fds.append(lib.bpf_table_fd_id(m, i))
    index = {fd: i for i, fd in enumerate(fds)}
    progs = {}
    for i in range(lib.bpf_num_functions(m)):
        fn = bcc_lib.bpf_function_name(m, i)
        start = bcc_lib.bpf_function_start(m, fn) if fn else None
        if not start:            # never read through a null pointer
            raise LoadError(f"bcc's compiled module has no code for its function {i} ({fn!r})")
        code = ct.string_at(start, bcc_lib.bpf_function_size(m, fn))
        progs[fn.decode()] = relink(code, index)
    return Snapshot(bcc_lib.bpf_module_license(m), bcc_lib.bpf_module_kern_version(m),
                    tuple(maps), progs), fds


def create_map(spec: MapSpec) -> int:
    """A new map as bcc would create it; an fd, or OSError naming the map the way bcc's
    "could not open bpf map: NAME, error: ..." does (kernel/compilelog.py map_failure)."""
    attr = ct.create_string_buffer(72)
    struct.pack_into("<5I", attr, 0, spec.type, spec.key_size, spec.value_size,
                     spec.max_entries, spec.flags)
    struct.pack_into("16s", attr, 28, spec.name.encode()[:OBJ_NAME_LEN - 1])
    fd = bpf_syscall(BPF_MAP_CREATE, attr)
    if fd == -errno.EPERM:
        _raise_memlock()       # before 5.11 maps are charged to RLIMIT_MEMLOCK (bcc does so)
        fd = bpf_syscall(BPF_MAP_CREATE, attr)
    if fd < 0:
        raise OSError(-fd, f"could not open bpf map: {spec.name}, error: {os.strerror(-fd)}")
    return fd


def _raise_memlock() -> None:
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY,) * 2)
    except (ValueError, OSError):
        pass


def load_program(name: str, prog_type: int, code: bytes, license: bytes, kern_version: int,
                 attach_type: int = -1) -> int:
    """bpf(BPF_PROG_LOAD) of relinked `code`: the fd. A refusal loads again with the
    verifier's log, prints that on fd 2 and raises as bcc's load_func does."""
    insns = ct.create_string_buffer(code, len(code))
    lic = ct.create_string_buffer(license)
    attr = ct.create_string_buffer(128)
    struct.pack_into("<IIQQ", attr, 0, prog_type, len(code) // 8, ct.addressof(insns),
                     ct.addressof(lic))
    struct.pack_into("<I", attr, 40, kern_version)
    struct.pack_into("16s", attr, 48, name.encode()[:OBJ_NAME_LEN - 1])
    if attach_type >= 0:
        struct.pack_into("<I", attr, 68, attach_type)
    fd = bpf_syscall(BPF_PROG_LOAD, attr)
    if fd == -errno.EPERM:
        _raise_memlock()
        fd = bpf_syscall(BPF_PROG_LOAD, attr)
    if fd >= 0:
        return fd
    err = -fd
    for size in LOG_SIZES:
        log = ct.create_string_buffer(size)
        struct.pack_into("<IIQ", attr, 24, 1, size, ct.addressof(log))
        fd = bpf_syscall(BPF_PROG_LOAD, attr)
        if fd >= 0:      # loads with a log where it did not without: take it
            return fd
        if -fd != errno.ENOSPC:
            break
    text = log.value.decode(errors="replace")
    if text:
        os.write(2, f"bpf: Failed to load program: {os.strerror(err)}\n{text}\n".encode())
    if err == errno.EPERM:
        raise Exception("Need super-user privileges to run")
    raise Exception(f"Failed to load BPF program {name.encode()}: {os.strerror(err)}")


def loaded(cls, snap: Snapshot, fds: list[int] | None = None):
    """The `cls` (define_loaded()'s class) object of `snap`: over `fds` (one per map, owned
    from now on) or over maps created anew. A map the kernel refuses closes those made before
    it and raises OSError."""
    made = []
    if fds is None:
        try:
            for spec in snap.maps:
                made.append(create_map(spec))
        except OSError:
            for fd in made:
                os.close(fd)
            raise
        fds = made
    return cls(snap, fds)


def define_loaded(BPF, bt, get_possible_cpus):
    """The Loaded class over bcc's BPF, its table module and its get_possible_cpus (passed in:
    loader.py alone imports bcc)."""
    import atexit

    classes = {bt.BPF_MAP_TYPE_HASH: bt.HashTable, bt.BPF_MAP_TYPE_ARRAY: bt.Array,
               bt.BPF_MAP_TYPE_PERCPU_HASH: bt.PerCpuHash,
               bt.BPF_MAP_TYPE_PERCPU_ARRAY: bt.PerCpuArray,
               bt.BPF_MAP_TYPE_LRU_HASH: bt.LruHash,
               bt.BPF_MAP_TYPE_LRU_PERCPU_HASH: bt.LruPerCpuHash,
               bt.BPF_MAP_TYPE_LPM_TRIE: bt.LpmTrie, bt.BPF_MAP_TYPE_RINGBUF: bt.RingBuf}
    percpu = (bt.PerCpuHash, bt.PerCpuArray)

    class Loaded(BPF):
        """bcc's BPF over a Snapshot (see the module's docstring)."""

        def __init__(self, snap: Snapshot, fds: list[int]):   # noqa: bcc's __init__ compiles
            for attr in ("kprobe_fds", "uprobe_fds", "tracepoint_fds", "raw_tracepoint_fds",
                         "kfunc_entry_fds", "kfunc_exit_fds", "lsm_fds", "perf_buffers",
                         "open_perf_events", "funcs", "tables"):
                setattr(self, attr, {})
            self._ringbuf_manager = None
            self.tracefile = None
            self.debug = 0
            self.module = None
            self.snap = snap
            self.map_fds = list(fds)
            self._by_name = {m.name: i for i, m in enumerate(snap.maps)}
            atexit.register(self.cleanup)

        def get_table(self, name, keytype=None, leaftype=None, reducer=None):
            name = name.decode() if isinstance(name, bytes) else name
            i = self._by_name.get(name)
            if i is None or not self.map_fds:
                raise KeyError(name)
            spec = self.snap.maps[i]
            cls = classes.get(spec.type)
            if cls is None:
                raise Exception(f"table {name}: map type {spec.type} not supported")
            t = cls.__new__(cls)
            key = keytype or BPF._decode_table_type(json.loads(spec.key_desc))
            leaf = leaftype or BPF._decode_table_type(json.loads(spec.leaf_desc))
            # what TableBase.__init__ would set from the module
            t.__dict__.update(bpf=self, map_id=i, map_fd=self.map_fds[i], Key=key, Leaf=leaf,
                              ttype=spec.type, flags=spec.flags, _cbs={}, _name=name.encode(),
                              max_entries=spec.max_entries)
            if isinstance(t, bt.RingBuf):
                t._ringbuf, t._event_class = None, None
            if isinstance(t, percpu):      # as PerCpuHash/PerCpuArray.__init__ do
                t.reducer, t.sLeaf = reducer, leaf
                t.total_cpu = len(get_possible_cpus())
                t.alignment = ct.sizeof(leaf) % 8
                if t.alignment == 0:
                    t.Leaf = leaf * t.total_cpu
                elif leaf in (ct.c_uint, ct.c_int):
                    t.Leaf = (ct.c_uint64 if leaf == ct.c_uint else ct.c_int64) * t.total_cpu
                else:
                    raise IndexError("Leaf must be aligned to 8 bytes")
            return t

        def load_func(self, func_name, prog_type, device=None, attach_type=-1):
            name = func_name.decode() if isinstance(func_name, bytes) else func_name
            key = name.encode()
            if key in self.funcs:
                return self.funcs[key]
            code = self.snap.progs.get(name)
            if code is None:
                raise Exception(f"Unknown program {key}")
            fd = load_program(name, prog_type, relink(code, self.map_fds), self.snap.license,
                              self.snap.kern_version, attach_type)
            fn = BPF.Function(self, key, fd)
            self.funcs[key] = fn
            return fn

        def load_funcs_at_once(self, names, prog_type, attach_type=-1) -> list:
            """load_func of each name, the loads side by side: the verifier runs in the
            loading thread, outside the GIL and any lock for a privileged load, so 2 CPUs
            verify two programs at once (the tc pair: 0.4 s one after the other here).
            Raises the first refusal in `names`' order."""
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(min(len(names), os.cpu_count() or 1) or 1) as pool:
                return list(pool.map(lambda n: self.load_func(n, prog_type,
                                                              attach_type=attach_type), names))

        def function_names(self) -> list[str]:
            return list(self.snap.progs)

        def close(self):
            super().close()                   # the programs' fds
            fds, self.map_fds = self.map_fds, []
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    return Loaded
