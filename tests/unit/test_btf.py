"""nptrace.kernel.btf: hand-built BTF blobs, then the running kernel's BTF against bpftool."""
from __future__ import annotations

import os
import platform
import re
import shutil
import struct
import subprocess
import time

import pytest

from nptrace.kernel import btf as B
from nptrace.kernel import offsets

VMLINUX = "/sys/kernel/btf/vmlinux"


# ---- a tiny BTF writer (test only) ----------------------------------------

class Blob:
    """Builds raw BTF bytes; ids start at `first` (base.nr_types + 1 for split BTF)."""

    def __init__(self, order="<", first=1, str_base=0):
        self.order, self.first, self.str_base = order, first, str_base
        self.recs: list[bytes] = []
        # Split BTF string sections need no leading NUL; base ones must have it.
        self.strs = bytearray(b"\0" if str_base == 0 else b"")

    def s(self, name: str) -> int:
        if not name:
            return 0
        off = self.str_base + len(self.strs)  # no dedup: duplicates are legal
        self.strs += name.encode() + b"\0"
        return off

    def _add(self, kind, name, vlen=0, kflag=0, st=0, *extra) -> int:
        info = (kflag << 31) | (kind << 24) | vlen
        self.recs.append(struct.pack(f"{self.order}III{len(extra)}I", self.s(name), info, st, *extra))
        return self.first + len(self.recs) - 1

    def int_(self, name, size, bits=None, signed=False, bit_off=0):
        bits = 8 * size if bits is None else bits
        return self._add(B.INT, name, 0, 0, size, (int(signed) << 24) | (bit_off << 16) | bits)

    def ptr(self, t):
        return self._add(B.PTR, "", 0, 0, t)

    def typedef(self, name, t):
        return self._add(B.TYPEDEF, name, 0, 0, t)

    def const(self, t):
        return self._add(B.CONST, "", 0, 0, t)

    def volatile(self, t):
        return self._add(B.VOLATILE, "", 0, 0, t)

    def fwd(self, name):
        return self._add(B.FWD, name)

    def array(self, elem, n, index_type=1):
        return self._add(B.ARRAY, "", 0, 0, 0, elem, index_type, n)

    def struct(self, name, size, members, union=False):
        """members: (name, type, bit_offset[, bitfield_size])."""
        kflag = int(any(len(m) > 3 and m[3] for m in members))
        words = []
        for m in members:
            off = m[2] | ((m[3] if len(m) > 3 else 0) << 24) if kflag else m[2]
            words += [self.s(m[0]), m[1], off]
        return self._add(B.UNION if union else B.STRUCT, name, len(members), kflag, size, *words)

    def enum(self, name, values, signed=False, size=4):
        words = []
        for n, v in values:
            words += [self.s(n), v & 0xFFFFFFFF]
        return self._add(B.ENUM, name, len(values), int(signed), size, *words)

    def enum64(self, name, values, signed=False):
        words = []
        for n, v in values:
            v &= (1 << 64) - 1
            words += [self.s(n), v & 0xFFFFFFFF, v >> 32]
        return self._add(B.ENUM64, name, len(values), int(signed), 8, *words)

    def func_proto(self, ret, params):
        words = []
        for n, t in params:
            words += [self.s(n), t]
        return self._add(B.FUNC_PROTO, "", len(params), 0, ret, *words)

    def raw(self, kind, name="", vlen=0, st=0, *extra):
        return self._add(kind, name, vlen, 0, st, *extra)

    def bytes(self, type_len_delta=0, magic=0xEB9F, version=1) -> bytes:
        types = b"".join(self.recs)
        hdr = struct.pack(f"{self.order}HBBIIIII", magic, version, 0, 24,
                          0, len(types) + type_len_delta, len(types), len(self.strs))
        return hdr + types + bytes(self.strs)


def kernel_like(order="<") -> Blob:
    """A miniature sk_buff/net_device/nf_conn with the shapes vmlinux uses."""
    b = Blob(order)
    u8 = b.int_("unsigned char", 1)                        # 1
    u16 = b.int_("short unsigned int", 2)                  # 2
    u32 = b.int_("unsigned int", 4)                        # 3
    ul = b.int_("long unsigned int", 8)                    # 4
    b.int_("long int", 8, signed=True)                     # 5
    be16 = b.typedef("__be16", u16)                        # 6
    nd_fwd = b.fwd("net_device")                           # 7
    nd_ptr = b.ptr(nd_fwd)                                 # 8
    # union { struct { next; prev; union { dev; dev_scratch; }; }; rbnode; }
    inner_u = b.struct("", 8, [("dev", nd_ptr, 0), ("dev_scratch", ul, 0)], union=True)
    anon_s = b.struct("", 24, [("next", ul, 0), ("prev", ul, 64), ("", inner_u, 128)])
    outer_u = b.struct("", 24, [("", anon_s, 0), ("rbnode", ul, 0)], union=True)
    hdr_s = b.struct("", 4, [("pkt_type", u8, 0, 3), ("ignore_df", u8, 3, 1),
                             ("protocol", be16, 16)])
    hdr_named = b.struct("", 4, [("pkt_type", u8, 0, 3), ("ignore_df", u8, 3, 1),
                                 ("protocol", be16, 16)])
    grp = b.struct("", 4, [("", hdr_s, 0), ("headers", hdr_named, 0)], union=True)
    cvol = b.const(b.volatile(u32))
    b.struct("sk_buff", 48, [("", outer_u, 0), ("_nfct", ul, 192), ("", grp, 256),
                             ("len", cvol, 288), ("tail", u8, 320)])
    char = b.int_("char", 1, signed=True)
    name_arr = b.array(char, 16)
    net_fwd = b.fwd("net")
    pnet = b.struct("", 8, [("net", b.ptr(net_fwd), 0)])
    pnet_t = b.typedef("possible_net_t", pnet)
    b.struct("net_device", 40, [("name", name_arr, 0), ("ifindex", u32, 128),
                                ("nd_net", pnet_t, 192)])
    tuple_ = b.struct("nf_conntrack_tuple", 8, [("src", u32, 0), ("dport", be16, 32)])
    th = b.struct("nf_conntrack_tuple_hash", 16, [("node", ul, 0), ("tuple", tuple_, 64)])
    th_arr = b.array(th, 2)
    b.struct("nf_conn", 48, [("ct_general", u32, 0), ("tuplehash", th_arr, 64),
                             ("status", ul, 320)])
    grid = b.array(b.array(u16, 3), 2)  # u16 grid[2][3]
    b.typedef("grid_t", b.struct("grid_s", 12, [("g", grid, 0)]))
    # Old-style bitfield: struct kind_flag 0, width in the INT type.
    bf4 = b.int_("unsigned int", 4, bits=4, bit_off=0)
    b.struct("oldbf", 4, [("lo", bf4, 0), ("hi", bf4, 4)])
    b.enum("skb_drop_reason", [("SKB_NOT_DROPPED_YET", 0), ("SKB_DROP_REASON_NO_SOCKET", 3),
                               ("SKB_DROP_REASON_IP_RPFILTER", 16)])
    b.enum("sneg", [("MINUS", -5), ("PLUS", 7)], signed=True)
    b.enum64("big", [("HUGE", 0xFFFF_FFFF_FFFF_FFE0), ("SMALL", 1)])
    b.enum64("sbig", [("NEG", -2)], signed=True)
    b.func_proto(0, [("a", u32)])
    b.raw(B.FLOAT, "double", 0, 8)
    b.raw(B.DECL_TAG, "tag", 0, ul, 0xFFFFFFFF)
    return b


@pytest.fixture(params=["<", ">"], ids=["little-endian", "big-endian"])
def kbtf(request, tmp_path):
    p = tmp_path / "vmlinux"
    p.write_bytes(kernel_like(request.param).bytes())
    return B.load(p)


# ---- parser logic on hand-built blobs --------------------------------------

def test_anonymous_union_members_found_by_name(kbtf):
    m = kbtf.member("sk_buff", "dev")
    assert (m.offset, m.size, m.bit_offset, m.bit_size) == (16, 8, 128, 0)
    assert m.type_name == "struct net_device *"
    assert kbtf.member("sk_buff", "prev").offset == 8
    assert kbtf.member("sk_buff", "rbnode").offset == 0
    assert kbtf.member("struct sk_buff", "_nfct") == B.Member(24, 8, 192, 0, "long unsigned int")


def test_bitfield_in_struct_group(kbtf):
    assert kbtf.member("sk_buff", "pkt_type") == B.Member(32, 1, 256, 3, "unsigned char")
    assert kbtf.member("sk_buff", "ignore_df") == B.Member(32, 1, 259, 1, "unsigned char")
    assert kbtf.member("sk_buff", "headers.ignore_df").bit_offset == 259
    assert kbtf.member("sk_buff", "protocol") == B.Member(34, 2, 272, 0, "__be16")


def test_old_style_int_bitfield(kbtf):
    assert kbtf.member("oldbf", "hi") == B.Member(0, 4, 4, 4, "unsigned int")
    assert kbtf.member("oldbf", "lo").bit_size == 4


def test_modifiers_and_typedefs_resolved(kbtf):
    assert kbtf.member("sk_buff", "len") == B.Member(36, 4, 288, 0, "const volatile unsigned int")
    assert kbtf.member("net_device", "nd_net.net") == B.Member(24, 8, 192, 0, "struct net *")
    assert kbtf.member("net_device", "nd_net").type_name == "possible_net_t"
    assert kbtf.member("grid_t", "g").size == 12  # lookup through a typedef name


def test_arrays(kbtf):
    assert kbtf.member("net_device", "name") == B.Member(0, 16, 0, 0, "char[16]")
    assert kbtf.member("net_device", "name[3]").offset == 3
    assert kbtf.member("nf_conn", "tuplehash") == B.Member(8, 32, 64, 0, "struct nf_conntrack_tuple_hash[2]")
    assert kbtf.member("nf_conn", "tuplehash[0]").offset == 8
    assert kbtf.member("nf_conn", "tuplehash[1]") == B.Member(24, 16, 192, 0, "struct nf_conntrack_tuple_hash")
    assert kbtf.member("nf_conn", "tuplehash[1].tuple.dport").offset == 24 + 8 + 4
    assert kbtf.member("grid_s", "g").type_name == "short unsigned int[2][3]"
    assert kbtf.member("grid_s", "g[1]").offset == 6
    assert kbtf.member("grid_s", "g[1][2]") == B.Member(10, 2, 80, 0, "short unsigned int")


@pytest.mark.parametrize("struct_name,path", [
    ("sk_buff", "nope"), ("sk_buff", "len.x"), ("nf_conn", "tuplehash[2]"),
    ("nf_conn", "status[0]"), ("sk_buff", "pkt_type.x"), ("no_such", "x"),
    ("net_device", "nd_net.net.x"),  # net is only a forward declaration
])
def test_missing_members(kbtf, struct_name, path):
    with pytest.raises(B.NotFoundError):
        kbtf.member(struct_name, path)
    assert not kbtf.has_member(struct_name, path)


@pytest.mark.parametrize("path", ["", "a..b", "x[", "1x", "x[-1]"])
def test_bad_paths(kbtf, path):
    with pytest.raises(B.BtfError):
        kbtf.member("sk_buff", path)


def test_size_and_has(kbtf):
    assert kbtf.size("sk_buff") == kbtf.size("struct sk_buff") == 48
    assert kbtf.size("nf_conntrack_tuple_hash") == 16
    assert kbtf.size("__be16") == 2
    assert kbtf.size("grid_t") == 12
    assert kbtf.size("enum skb_drop_reason") == 4
    assert kbtf.size("double") == 8
    assert kbtf.has("sk_buff") and kbtf.has("skb_drop_reason", "enum") and kbtf.has("big", "enum")
    assert kbtf.has("possible_net_t", "typedef")
    assert not kbtf.has("net")  # FWD only
    assert not kbtf.has("sk_buff", "union")
    with pytest.raises(B.NotFoundError):
        kbtf.size("struct net")
    with pytest.raises(ValueError):
        kbtf.has("sk_buff", "bogus")


def test_enums(kbtf):
    assert kbtf.enum("skb_drop_reason") == {0: "SKB_NOT_DROPPED_YET", 3: "SKB_DROP_REASON_NO_SOCKET",
                                           16: "SKB_DROP_REASON_IP_RPFILTER"}
    assert kbtf.enum("sneg") == {-5: "MINUS", 7: "PLUS"}
    assert kbtf.enum("enum big") == {0xFFFF_FFFF_FFFF_FFE0: "HUGE", 1: "SMALL"}
    assert kbtf.enum("sbig") == {-2: "NEG"}
    with pytest.raises(B.NotFoundError):
        kbtf.enum("sk_buff")


def test_split_btf_and_load_kernel(tmp_path):
    base = kernel_like()
    base_bytes = base.bytes()
    (tmp_path / "vmlinux").write_bytes(base_bytes)
    vm = B.load(tmp_path / "vmlinux")
    mod = Blob(first=vm.nr_types + 1, str_base=len(base.strs))
    u32 = 3
    t = mod.struct("nf_ct_ext", 8, [("offset", u32, 0), ("len", u32, 32)])
    mod.struct("nf_nat_thing", 16, [("ext", mod.ptr(t), 0), ("skb_back", mod.ptr(13), 64)])
    (tmp_path / "nf_conntrack").write_bytes(mod.bytes())
    m = B.load(tmp_path / "nf_conntrack", base=vm)
    assert m.nr_types == vm.nr_types + 4
    assert m.member("nf_ct_ext", "len") == B.Member(4, 4, 32, 0, "unsigned int")
    assert m.member("sk_buff", "dev").offset == 16  # base types through the split
    k = B.load_kernel(tmp_path, modules=("nf_conntrack", "absent_mod"))
    assert not k._extra  # modules are read only on a miss
    assert k.member("sk_buff", "len").offset == 36
    assert k.member("nf_nat_thing", "ext").type_name == "struct nf_ct_ext *"
    assert k.has("nf_ct_ext") and k.size("nf_ct_ext") == 8
    assert len(k._extra) == 1


@pytest.mark.parametrize("mangle,why", [
    (lambda b: b"", "shorter than the header"),
    (lambda b: b[:20], "shorter than the header"),
    (lambda b: b"\x7fELF" + b[4:], "not BTF"),
    (lambda b: b[: len(b) - 40], "exceed"),
])
def test_malformed_files(tmp_path, mangle, why):
    p = tmp_path / "bad"
    p.write_bytes(mangle(kernel_like().bytes()))
    with pytest.raises(B.BtfError, match=why) as e:
        B.load(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_malformed_records(tmp_path):
    p = tmp_path / "bad"
    b = kernel_like()
    for blob, why in [
        (b.bytes(version=2), "version"),
        (b.bytes(type_len_delta=-12), "runs past|truncated"),  # last record cut short
        (b.bytes(type_len_delta=-2), "exceed"),                # not a multiple of 4
    ]:
        p.write_bytes(blob)
        with pytest.raises(B.BtfError, match=why):
            B.load(p)
    bad = Blob()
    bad.int_("int", 4)
    bad.raw(0, "unknown_kind")
    p.write_bytes(bad.bytes())
    with pytest.raises(B.BtfError, match="bad or truncated"):
        B.load(p)
    dangling = Blob()
    dangling.struct("s", 8, [("p", 99, 0)])
    p.write_bytes(dangling.bytes())
    with pytest.raises(B.BtfError, match="out of range"):
        B.load(p).member("s", "p")


def test_missing_file_names_path(tmp_path):
    p = tmp_path / "no" / "vmlinux"
    with pytest.raises(B.BtfError, match=re.escape(str(p))):
        B.load(p)


# ---- the running kernel, against bpftool -----------------------------------

needs_vmlinux = pytest.mark.skipif(not os.access(VMLINUX, os.R_OK),
                                   reason=f"{VMLINUX} absent (kernel without CONFIG_DEBUG_INFO_BTF)")

KERNEL_MEMBERS = [
    ("sk_buff", "dev"), ("sk_buff", "sk"), ("sk_buff", "_nfct"), ("sk_buff", "len"),
    ("sk_buff", "protocol"), ("sk_buff", "transport_header"), ("sk_buff", "network_header"),
    ("sk_buff", "mac_header"), ("sk_buff", "head"), ("sk_buff", "data"), ("sk_buff", "mark"),
    ("sk_buff", "skb_iif"), ("sk_buff", "pkt_type"), ("net_device", "ifindex"),
    ("net_device", "nd_net.net"), ("net_device", "name"), ("net", "ns.inum"),
    ("nf_conn", "tuplehash[0]"), ("nf_conn", "tuplehash[1]"), ("nf_conn", "status"),
    ("nf_conn", "mark"), ("nf_conntrack_tuple_hash", "tuple"),
    ("nf_conntrack_tuple", "src.u3"), ("nf_conntrack_tuple", "dst.u.all"),
    ("nf_conntrack_tuple", "dst.protonum"), ("sock_common", "skc_dport"),
    ("sock_common", "skc_net.net"), ("sock_common", "skc_v6_daddr"), ("sock_common", "skc_state"),
    ("sock", "__sk_common"),
]


class Bpftool:
    """Types from `bpftool btf dump ... format raw`, walked independently of nptrace.kernel.btf."""

    HEAD = re.compile(r"^\[(\d+)\] (\w+) '([^']*)'(.*)$")
    MEMB = re.compile(r"^\t'([^']*)' (?:type_id=(\d+) bits_offset=(\d+)(?: bitfield_size=(\d+))?|val=(-?\d+))")

    def __init__(self, text: str):
        self.types: dict[int, dict] = {}
        self.by_name: dict[tuple[str, str], int] = {}
        cur = None
        for line in text.splitlines():
            if m := self.HEAD.match(line):
                attrs = dict(re.findall(r"(\w+)=(\S+)", m.group(4)))
                cur = {"kind": m.group(2), "name": m.group(3), "attrs": attrs, "members": []}
                tid = int(m.group(1))
                self.types[tid] = cur
                self.by_name.setdefault((cur["kind"], cur["name"]), tid)
            elif (m := self.MEMB.match(line)) and cur is not None:
                if m.group(5) is not None:
                    cur["members"].append((m.group(1), int(m.group(5))))
                else:
                    cur["members"].append((m.group(1), int(m.group(2)), int(m.group(3)),
                                           int(m.group(4) or 0)))

    def resolve(self, tid):
        while self.types[tid]["kind"] in ("TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG"):
            tid = int(self.types[tid]["attrs"]["type_id"])
        return tid

    def size(self, tid):
        t = self.types[self.resolve(tid)]
        if t["kind"] == "PTR":
            return 8
        if t["kind"] == "ARRAY":
            return int(t["attrs"]["nr_elems"]) * self.size(int(t["attrs"]["type_id"]))
        return int(t["attrs"]["size"])

    def find(self, tid, name):
        for mname, mt, off, bsz in self.types[tid]["members"]:
            if mname == name:
                return mt, off, bsz
            r = self.resolve(mt)
            if mname == "(anon)" and self.types[r]["kind"] in ("STRUCT", "UNION"):
                if hit := self.find(r, name):
                    return hit[0], off + hit[1], hit[2]
        return None

    def member(self, struct_name, path):
        tid, bit, bsz = self.by_name[("STRUCT", struct_name)], 0, 0
        for comp in path.split("."):
            name, *idx = re.split(r"[\[\]]+", comp.rstrip("]"))
            tid, off, bsz = self.find(self.resolve(tid), name)
            bit += off
            for i in idx:
                arr = self.types[self.resolve(tid)]["attrs"]
                tid = int(arr["type_id"])
                bit += int(i) * self.size(tid) * 8
        return bit, bsz, self.size(tid)


@pytest.fixture(scope="module")
def kernel():
    return B.load(VMLINUX)


@pytest.fixture(scope="module")
def bpftool():
    exe = shutil.which("bpftool") or next(
        (p for p in ("/usr/sbin/bpftool", "/sbin/bpftool") if os.access(p, os.X_OK)), None)
    if exe is None:
        pytest.skip("bpftool not installed (Debian package bpftool)")
    r = subprocess.run([exe, "btf", "dump", "file", VMLINUX, "format", "raw"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"bpftool cannot dump BTF here: {r.stderr.strip()[:200]}")
    return Bpftool(r.stdout)


@needs_vmlinux
def test_type_count_matches_bpftool(kernel, bpftool):
    assert kernel.nr_types == max(bpftool.types)


@needs_vmlinux
@pytest.mark.parametrize("struct_name,path", KERNEL_MEMBERS)
def test_kernel_member_matches_bpftool(kernel, bpftool, struct_name, path):
    m = kernel.member(struct_name, path)
    bit, bsz, size = bpftool.member(struct_name, path)
    assert (m.bit_offset, m.bit_size, m.size) == (bit, bsz, size)
    assert m.offset == bit // 8


@needs_vmlinux
def test_kernel_bitfield_and_anon_members(kernel):
    # These live in anonymous unions/structs (struct_group) on recent kernels.
    for path in ("dev", "_nfct", "protocol", "transport_header", "pkt_type"):
        assert kernel.has_member("sk_buff", path)
    assert kernel.member("sk_buff", "pkt_type").bit_size == 3
    assert kernel.member("sk_buff", "dev").type_name == "struct net_device *"
    assert kernel.member("net_device", "nd_net.net").type_name == "struct net *"


@needs_vmlinux
@pytest.mark.skipif(not platform.release().startswith("6.18."), reason="offsets measured on 6.18 only")
def test_offsets_recorded_in_platform_md(kernel):
    seen = {("sk_buff", "dev"): 16, ("sk_buff", "_nfct"): 104, ("sk_buff", "len"): 112,
            ("sk_buff", "protocol"): 176, ("sk_buff", "transport_header"): 178,
            ("sk_buff", "network_header"): 180, ("sk_buff", "head"): 192,
            ("net_device", "ifindex"): 224, ("nf_conn", "tuplehash[0]"): 16,
            ("nf_conn", "tuplehash[1]"): 72, ("nf_conn", "status"): 128}
    assert {k: kernel.member(*k).offset for k in seen} == seen


@needs_vmlinux
@pytest.mark.parametrize("name", ["skb_drop_reason", "sk_rst_reason"])
def test_kernel_enum_matches_bpftool(kernel, bpftool, name):
    t = bpftool.types[bpftool.by_name[("ENUM", name)]]
    assert kernel.enum(name) == {v: n for n, v in reversed(t["members"])}


@needs_vmlinux
def test_kernel_drop_reasons_present(kernel):
    names = set(kernel.enum("skb_drop_reason").values())
    for n in ("NOT_SPECIFIED", "IP_RPFILTER", "NETFILTER_DROP", "NO_SOCKET"):
        assert "SKB_DROP_REASON_" + n in names
    assert "SK_RST_REASON_NO_SOCKET" in kernel.enum("sk_rst_reason").values()


@needs_vmlinux
def test_kernel_enum64(kernel, bpftool):
    t = bpftool.types[bpftool.by_name[("ENUM64", "perf_callchain_context")]]
    got = kernel.enum("perf_callchain_context")
    assert got == {v: n for n, v in reversed(t["members"])}
    assert got[(1 << 64) - 32] == "PERF_CONTEXT_HV"


@needs_vmlinux
def test_fresh_load_and_lookups_are_fast():
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        k = B.load(VMLINUX)
        offsets.cflags(k)
        k.enum("skb_drop_reason")
        best = min(best, time.perf_counter() - t0)
    print(f"\nfresh load + {len(offsets.MEMBERS)} member lookups + enum: {best * 1000:.1f} ms")
    assert best < 0.8


@needs_vmlinux
def test_default_loads_once():
    assert B.default() is B.default()
    assert B.default().member("sk_buff", "len").size == 4


@needs_vmlinux
def test_truncated_vmlinux(tmp_path):
    data = open(VMLINUX, "rb").read()
    p = tmp_path / "vmlinux"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(B.BtfError, match=str(p)):
        B.load(p)
