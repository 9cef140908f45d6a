"""Kernel struct layouts read from raw BTF, in pure Python.

bcc compiles our probes against borrowed Debian 6.12 headers whose struct
layouts are not the running kernel's, so every offset the BPF C reads comes
from the kernel's own BTF (/sys/kernel/btf/vmlinux, ~126k types, 5.5 MB on
6.18) and is passed in as a -D macro (see nptrace/kernel/offsets.py).

Format: Documentation/bpf/btf.rst (kernel). Kinds up to BTF_KIND_ENUM64
(kernel 6.0). Split BTF (kernel 5.11+, /sys/kernel/btf/<module>) is read
on top of vmlinux, because distribution kernels build nf_conntrack as a module
and its structs are then absent from vmlinux BTF.

Speed: `load()` makes one pass that records where each type record starts;
names and members are decoded only for the types asked about.
bpftool would take ~0.5 s just to dump; we never shell out at run time.
"""
from __future__ import annotations

import array
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Btf",
    "BtfError",
    "Member",
    "NotFoundError",
    "default",
    "load",
    "load_kernel",
]

VMLINUX = "/sys/kernel/btf/vmlinux"
# Modules whose structs the probes read; loaded only if vmlinux lacks a type.
KERNEL_MODULES = ("nf_conntrack", "nf_nat")

_MAGIC = 0xEB9F
_HDR = struct.Struct("<HBBIIIII")

# BTF_KIND_* (include/uapi/linux/btf.h).
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF = 1, 2, 3, 4, 5, 6, 7, 8
VOLATILE, CONST, RESTRICT, FUNC, FUNC_PROTO, VAR, DATASEC = 9, 10, 11, 12, 13, 14, 15
FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = 16, 17, 18, 19

# u32 words after the 3-word common header: fixed part, and per vlen entry.
# Kind 0 (UNKN) and kinds past ENUM64 are invalid: None makes the scan fail.
_FIXED = (None, 1, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0)
_PER = (None, 0, 0, 0, 3, 3, 2, 0, 0, 0, 0, 0, 0, 2, 0, 3, 0, 0, 0, 3)

_MODIFIERS = frozenset((TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG))
_KIND_NAMES = {
    "struct": (STRUCT,),
    "union": (UNION,),
    "enum": (ENUM, ENUM64),
    "typedef": (TYPEDEF,),
    "int": (INT,),
    "float": (FLOAT,),
    "func": (FUNC,),
    "var": (VAR,),
    "any": (INT, STRUCT, UNION, ENUM, ENUM64, TYPEDEF, FLOAT),
}
_COMPONENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")


class BtfError(Exception):
    """BTF missing, malformed, or a lookup that cannot be answered."""


class NotFoundError(BtfError):
    """A type or member is not in this kernel's BTF."""


@dataclass(frozen=True)
class Member:
    offset: int      # bytes from the start of the outer struct
    size: int        # bytes of the member's type (a bitfield's storage type)
    bit_offset: int  # absolute, in bits, from the start of the outer struct
    bit_size: int    # 0 unless a bitfield
    type_name: str


class Btf:
    """One BTF blob; `base` is set for split (module) BTF."""

    def __init__(self, data: bytes, path: str = "<bytes>", base: Btf | None = None):
        self.path = path
        self._base = base
        self._extra: list[Btf] = []
        self._extra_paths: list[str] = []
        self._names: dict[int, list[int]] | None = None
        self._str_cache: dict[int, str] = {}
        self._member_cache: dict[tuple[str, str], Member] = {}
        self._find_cache: dict[tuple, tuple[Btf, int] | None] = {}
        self._parse(data)

    # ---- parsing -------------------------------------------------------

    def _parse(self, data: bytes) -> None:
        if len(data) < _HDR.size:
            raise BtfError(f"{self.path}: malformed BTF: {len(data)} bytes, shorter than the header")
        magic = struct.unpack_from("<H", data)[0]
        if magic == _MAGIC:
            order = "<"
        elif magic == 0x9FEB:
            order = ">"
        else:
            raise BtfError(f"{self.path}: not BTF (magic 0x{magic:04x}, want 0xeb9f)")
        _, version, _, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
            order + "HBBIIIII", data)
        if version != 1:
            raise BtfError(f"{self.path}: unsupported BTF version {version}")
        end = len(data)
        if (hdr_len < _HDR.size or hdr_len + type_off + type_len > end
                or hdr_len + str_off + str_len > end or type_len % 4 or type_off % 4):
            raise BtfError(f"{self.path}: malformed BTF: header sections exceed the {end}-byte file")
        tstart = hdr_len + type_off
        sstart = hdr_len + str_off
        self._strs = bytes(data[sstart:sstart + str_len])
        if self._base is None and str_len and self._strs[0] != 0:
            raise BtfError(f"{self.path}: malformed BTF: string section does not start with NUL")
        raw = bytes(data[tstart:tstart + type_len])
        if (order == "<") == (sys.byteorder == "little"):
            w = memoryview(raw).cast("I")
        else:
            w = array.array("I", raw)
            w.byteswap()
        self._w = w
        offs = []
        app = offs.append
        fixed, per = _FIXED, _PER
        i, n = 0, len(w)
        try:
            while i < n:
                app(i)
                info = w[i + 1]
                k = (info >> 24) & 0x1F
                i += 3 + fixed[k] + per[k] * (info & 0xFFFF)
        except (IndexError, TypeError):
            raise BtfError(f"{self.path}: malformed BTF: bad or truncated type record #{len(offs)}") from None
        if i != n:
            raise BtfError(f"{self.path}: malformed BTF: last type record runs past the type section")
        self._offs = offs
        if self._base is None:
            self._first = 1
            self._str_base = 0
        else:
            self._first = self._base.nr_types + 1
            self._str_base = self._base._total_str_len()
        self.nr_types = self._first - 1 + len(offs)

    def _total_str_len(self) -> int:
        return self._str_base + len(self._strs)

    # ---- raw access ----------------------------------------------------

    def _rec(self, tid: int):
        """(words, index of the record) for a type id, following the base."""
        if tid >= self._first:
            j = tid - self._first
            if j < len(self._offs):
                return self._w, self._offs[j]
        elif self._base is not None:
            return self._base._rec(tid)
        raise BtfError(f"{self.path}: type id {tid} out of range (1..{self.nr_types})")

    def _str(self, off: int) -> str:
        s = self._str_cache.get(off)
        if s is None:
            if off < self._str_base:
                s = self._base._str(off)
            else:
                o = off - self._str_base
                e = self._strs.find(b"\0", o)
                if o >= len(self._strs) or e < 0:
                    raise BtfError(f"{self.path}: string offset {off} out of range")
                s = self._strs[o:e].decode("utf-8", "replace")
            self._str_cache[off] = s
        return s

    def _kind(self, tid: int) -> int:
        if tid == 0:
            return 0
        w, o = self._rec(tid)
        return (w[o + 1] >> 24) & 0x1F

    def _name(self, tid: int) -> str:
        if tid == 0:
            return "void"
        w, o = self._rec(tid)
        return self._str(w[o])

    def _resolve(self, tid: int) -> int:
        """Skip typedef/const/volatile/restrict/type_tag."""
        for _ in range(64):
            if tid == 0:
                return 0
            w, o = self._rec(tid)
            if (w[o + 1] >> 24) & 0x1F not in _MODIFIERS:
                return tid
            tid = w[o + 2]
        raise BtfError(f"{self.path}: modifier chain too long at type {tid}")

    def _ptr_size(self) -> int:
        # BTF does not record the pointer width; `long` has it on every Linux ABI.
        for tid in self._ids_by_name("long int"):
            if self._kind(tid) == INT:
                w, o = self._rec(tid)
                return w[o + 2]
        return 8

    def _size_of(self, tid: int, depth: int = 0) -> int:
        if depth > 64:
            raise BtfError(f"{self.path}: type {tid} nests too deep")
        tid = self._resolve(tid)
        if tid == 0:
            raise BtfError(f"{self.path}: void has no size")
        w, o = self._rec(tid)
        k = (w[o + 1] >> 24) & 0x1F
        if k in (INT, STRUCT, UNION, ENUM, ENUM64, FLOAT, DATASEC):
            return w[o + 2]
        if k == PTR:
            return self._ptr_size()
        if k == ARRAY:
            return w[o + 5] * self._size_of(w[o + 3], depth + 1)
        raise BtfError(f"{self.path}: type {tid} ({self._type_name(tid)}) has no size")

    def _type_name(self, tid: int, depth: int = 0) -> str:
        if tid == 0:
            return "void"
        if depth > 32:
            return "..."
        w, o = self._rec(tid)
        info = w[o + 1]
        k = (info >> 24) & 0x1F
        name = self._str(w[o]) or "(anon)"
        if k in (STRUCT, UNION):
            return ("struct " if k == STRUCT else "union ") + name
        if k == FWD:
            return ("union " if info >> 31 else "struct ") + name
        if k in (ENUM, ENUM64):
            return "enum " + name
        if k == PTR:
            return self._type_name(w[o + 2], depth + 1) + " *"
        if k in (CONST, VOLATILE, RESTRICT):
            q = {CONST: "const ", VOLATILE: "volatile ", RESTRICT: "restrict "}[k]
            return q + self._type_name(w[o + 2], depth + 1)
        if k == TYPE_TAG:
            return self._type_name(w[o + 2], depth + 1)
        if k == ARRAY:
            dims = ""
            while k == ARRAY:
                dims += f"[{w[o + 5]}]"
                tid = w[o + 3]
                if tid == 0:
                    break
                w, o = self._rec(tid)
                k = (w[o + 1] >> 24) & 0x1F
            return self._type_name(tid, depth + 1) + dims
        if k == FUNC_PROTO:
            return "func_proto"
        return name

    # ---- names ---------------------------------------------------------

    def _name_index(self) -> dict[int, list[int]]:
        if self._names is None:
            names: dict[int, list[int]] = {}
            w, first = self._w, self._first
            for j, o in enumerate(self._offs):
                nm = w[o]
                if nm:
                    lst = names.get(nm)
                    if lst is None:
                        names[nm] = [first + j]
                    else:
                        lst.append(first + j)
            self._names = names
        return self._names

    def _str_offsets(self, name: str) -> list[int]:
        """Offsets of `name` in this blob's own string section (usually one)."""
        needle = b"\0" + name.encode() + b"\0"
        out, strs, pos = [], self._strs, 0
        if self._base is not None:
            # Split BTF strings need not start with NUL; treat the start as one.
            if strs.startswith(needle[1:]):
                out.append(self._str_base)
        while True:
            pos = strs.find(needle, pos)
            if pos < 0:
                return out
            out.append(self._str_base + pos + 1)
            pos += 1

    def _ids_by_name(self, name: str) -> list[int]:
        ids = self._base._ids_by_name(name) if self._base is not None else []
        idx = None
        for off in self._str_offsets(name):
            idx = idx if idx is not None else self._name_index()
            ids.extend(idx.get(off, ()))
        if self._base is not None:
            # Types here may reuse names that live in the base string section.
            idx = self._name_index()
            for off in self._base._str_offsets(name):
                ids.extend(idx.get(off, ()))
        return sorted(set(ids))

    def _find(self, name: str, kinds) -> tuple[Btf, int] | None:
        key = (name, tuple(kinds))
        if key in self._find_cache:
            return self._find_cache[key]
        hit = None
        for btf in self._chain():
            hit = next(((btf, t) for t in btf._ids_by_name(name) if btf._kind(t) in kinds), None)
            if hit is not None:
                break
        self._find_cache[key] = hit
        return hit

    def _chain(self):
        yield self
        yield from self._extra
        while self._extra_paths:
            path = self._extra_paths.pop(0)
            try:
                mod = load(path, base=self)
            except BtfError:
                continue
            self._extra.append(mod)
            yield mod

    def _find_aggregate(self, type_name: str) -> tuple[Btf, int]:
        """'sk_buff', 'struct sk_buff', 'union x' or a typedef to one."""
        name = type_name.strip()
        kinds: tuple[int, ...] = (STRUCT, UNION, TYPEDEF)
        for prefix, ks in (("struct ", (STRUCT,)), ("union ", (UNION,))):
            if name.startswith(prefix):
                name, kinds = name[len(prefix):].strip(), ks
        for k in kinds:
            hit = self._find(name, (k,))
            if hit is None:
                continue
            btf, tid = hit
            r = btf._resolve(tid)
            if btf._kind(r) in (STRUCT, UNION):
                return btf, r
        raise NotFoundError(f"{self.path}: no struct or union {type_name!r} in BTF")

    # ---- members -------------------------------------------------------

    def _members(self, tid: int):
        """Yield (name_off, type, bit_offset, bit_size) of a struct/union."""
        w, o = self._rec(tid)
        info = w[o + 1]
        bitfields = info >> 31
        base = o + 3
        for j in range(info & 0xFFFF):
            p = base + 3 * j
            off = w[p + 2]
            if bitfields:
                yield w[p], w[p + 1], off & 0xFFFFFF, off >> 24
            else:
                yield w[p], w[p + 1], off, 0

    def _lookup(self, tid: int, name: str, depth: int = 0):
        """(type, bit_offset, bit_size) of `name` in struct/union `tid`.

        Members of anonymous structs/unions count as direct members, as in C;
        C forbids duplicate names across them, so the first hit is the only one.
        """
        if depth > 32:
            return None
        for name_off, mtype, boff, bsize in self._members(tid):
            if name_off:
                if self._str(name_off) == name:
                    return mtype, boff, bsize
                continue
            r = self._resolve(mtype)
            if self._kind(r) in (STRUCT, UNION):
                hit = self._lookup(r, name, depth + 1)
                if hit is not None:
                    return hit[0], boff + hit[1], hit[2]
        return None

    def _walk(self, outer: str, tid: int, path: str) -> Member:
        if not path:
            raise BtfError(f"empty member path for {outer}")
        bit, bsize, cur = 0, 0, tid
        for comp in path.split("."):
            m = _COMPONENT.match(comp)
            if m is None:
                raise BtfError(f"bad member path {path!r}: cannot parse {comp!r}")
            if bsize:
                raise NotFoundError(f"{outer}.{path}: bitfield has no members")
            r = self._resolve(cur)
            if self._kind(r) not in (STRUCT, UNION):
                raise NotFoundError(f"{outer}.{path}: {self._type_name(cur)} is not a struct or union")
            hit = self._lookup(r, m.group(1))
            if hit is None:
                raise NotFoundError(
                    f"{self.path}: {self._type_name(r)} has no member {m.group(1)!r} ({outer}.{path})")
            cur, boff, bsize = hit
            bit += boff
            for idx in re.findall(r"\[(\d+)\]", m.group(2)):
                r = self._resolve(cur)
                if self._kind(r) != ARRAY:
                    raise NotFoundError(f"{outer}.{path}: {self._type_name(cur)} is not an array")
                w, o = self._rec(r)
                elem, nelems = w[o + 3], w[o + 5]
                if nelems and int(idx) >= nelems:
                    raise NotFoundError(f"{outer}.{path}: index {idx} out of range (array of {nelems})")
                bit += int(idx) * self._size_of(elem) * 8
                cur = elem
        if not bsize:
            r = self._resolve(cur)
            if self._kind(r) == INT:
                # Old-style bitfield (struct kind_flag 0): width lives in the int.
                w, o = self._rec(r)
                enc = w[o + 3]
                nbits, ioff = enc & 0xFF, (enc >> 16) & 0xFF
                if ioff or nbits != 8 * w[o + 2]:
                    bit += ioff
                    bsize = nbits
        return Member(offset=bit // 8, size=self._size_of(cur), bit_offset=bit,
                      bit_size=bsize, type_name=self._type_name(cur))

    # ---- public API ----------------------------------------------------

    def member(self, struct_name: str, path: str) -> Member:
        """Layout of `path` ('a.b[1].c') inside struct/union `struct_name`."""
        key = (struct_name, path)
        m = self._member_cache.get(key)
        if m is None:
            btf, tid = self._find_aggregate(struct_name)
            m = btf._walk(struct_name, tid, path)
            self._member_cache[key] = m
        return m

    def has_member(self, struct_name: str, path: str) -> bool:
        try:
            self.member(struct_name, path)
        except NotFoundError:
            return False
        return True

    def size(self, type_name: str) -> int:
        """sizeof: 'sk_buff', 'struct sk_buff', 'union x', 'enum x', 'u32', 'int'."""
        name = type_name.strip()
        for prefix, kinds in (("struct ", (STRUCT,)), ("union ", (UNION,)), ("enum ", (ENUM, ENUM64))):
            if name.startswith(prefix):
                hit = self._find(name[len(prefix):].strip(), kinds)
                break
        else:
            hit = self._find(name, (STRUCT, UNION, TYPEDEF, INT, FLOAT, ENUM, ENUM64))
        if hit is None:
            raise NotFoundError(f"{self.path}: no type {type_name!r} in BTF")
        btf, tid = hit
        return btf._size_of(tid)

    def has(self, type_name: str, kind: str = "struct") -> bool:
        kinds = _KIND_NAMES.get(kind)
        if kinds is None:
            raise ValueError(f"unknown kind {kind!r}; one of {', '.join(sorted(_KIND_NAMES))}")
        return self._find(type_name, kinds) is not None

    def enum(self, name: str) -> dict[int, str]:
        """value -> enumerator name for enum or enum64 `name` (e.g. skb_drop_reason)."""
        hit = self._find(name.removeprefix("enum ").strip(), (ENUM, ENUM64))
        if hit is None:
            raise NotFoundError(f"{self.path}: no enum {name!r} in BTF")
        btf, tid = hit
        w, o = btf._rec(tid)
        info = w[o + 1]
        signed = info >> 31
        out: dict[int, str] = {}
        if (info >> 24) & 0x1F == ENUM:
            for j in range(info & 0xFFFF):
                p = o + 3 + 2 * j
                v = w[p + 1]
                if signed and v & 0x80000000:
                    v -= 1 << 32
                out.setdefault(v, btf._str(w[p]))
        else:
            for j in range(info & 0xFFFF):
                p = o + 3 + 3 * j
                v = w[p + 1] | (w[p + 2] << 32)
                if signed and v & (1 << 63):
                    v -= 1 << 64
                out.setdefault(v, btf._str(w[p]))
        return out


def load(path: str | os.PathLike = VMLINUX, base: Btf | None = None) -> Btf:
    """Read a raw BTF file; `base` for split BTF such as /sys/kernel/btf/<module>."""
    p = str(path)
    try:
        data = Path(p).read_bytes()
    except OSError as e:
        hint = " (the kernel needs CONFIG_DEBUG_INFO_BTF=y)" if p.startswith("/sys/kernel/btf/") else ""
        raise BtfError(f"{p}: cannot read BTF: {e.strerror or e}{hint}") from None
    return Btf(data, p, base)


def load_kernel(root: str | os.PathLike = "/sys/kernel/btf",
                modules=KERNEL_MODULES) -> Btf:
    """vmlinux BTF; module BTF files are read only when vmlinux lacks a type."""
    r = Path(root)
    btf = load(r / "vmlinux")
    btf._extra_paths = [str(r / m) for m in modules if (r / m).exists()]
    return btf


_DEFAULT: Btf | None = None


def default() -> Btf:
    """The running kernel's BTF, loaded once per process."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = load_kernel()
    return _DEFAULT


def release_default() -> None:
    """Forget the kernel BTF default() loaded (tens of MB of Python objects): the running
    tracer needs it only at start-up; a later default() reads it again."""
    global _DEFAULT
    _DEFAULT = None
