"""nptrace.kernel.offsets: -D cflags for the struct members the probes read."""
from __future__ import annotations

import os
import re

import pytest

from nptrace.kernel import btf as B
from nptrace.kernel import offsets
from nptrace.kernel.offsets import MEMBERS, SIZES, cflags, describe, macro_name

VMLINUX = "/sys/kernel/btf/vmlinux"
needs_vmlinux = pytest.mark.skipif(not os.access(VMLINUX, os.R_OK),
                                   reason=f"{VMLINUX} absent (kernel without CONFIG_DEBUG_INFO_BTF)")
FLAG = re.compile(r"^-D(NPT_[A-Za-z0-9_]+)=(-?\d+)$")


def as_dict(flags):
    out = {}
    for f in flags:
        m = FLAG.match(f)
        assert m, f
        assert m.group(1) not in out, f"duplicate macro {m.group(1)}"
        out[m.group(1)] = int(m.group(2))
    return out


class StubBtf:
    """Answers member()/size() from a dict; anything else is NotFoundError."""

    def __init__(self, members, sizes=None):
        self.members, self.sizes = members, sizes or {}

    def member(self, struct, path):
        try:
            return self.members[(struct, path)]
        except KeyError:
            raise B.NotFoundError(f"stub: no {struct}.{path}") from None

    def size(self, name):
        try:
            return self.sizes[name.removeprefix("struct ")]
        except KeyError:
            raise B.NotFoundError(f"stub: no {name}") from None


@pytest.mark.parametrize("struct,path,want", [
    ("sk_buff", "dev", "sk_buff__dev"),
    ("sk_buff", "_nfct", "sk_buff___nfct"),
    ("net_device", "nd_net.net", "net_device__nd_net_net"),
    ("nf_conn", "tuplehash[1]", "nf_conn__tuplehash_1"),
    ("nf_conntrack_tuple", "dst.u.all", "nf_conntrack_tuple__dst_u_all"),
    ("x", "a[1][2].b", "x__a_1_2_b"),
])
def test_macro_name(struct, path, want):
    assert macro_name(struct, path) == want


def test_members_table_is_well_formed():
    seen = set()
    for entry in MEMBERS:
        struct, path, required = entry
        assert isinstance(required, bool) and struct and path
        assert macro_name(struct, path) not in seen
        seen.add(macro_name(struct, path))
    assert all(isinstance(r, bool) for _, r in SIZES)


def test_missing_optional_member_and_struct_are_skipped():
    stub = StubBtf({("sk_buff", "len"): B.Member(112, 4, 896, 0, "unsigned int")},
                   {"sk_buff": 224})
    members = (("sk_buff", "len", True), ("sk_buff", "_nfct", False), ("nf_conn", "status", False))
    d = as_dict(cflags(stub, members, (("sk_buff", True), ("nf_conn", False))))
    assert d == {
        "NPT_HAVE_sk_buff__len": 1, "NPT_OFF_sk_buff__len": 112, "NPT_SZ_sk_buff__len": 4,
        "NPT_HAVE_sk_buff___nfct": 0, "NPT_HAVE_nf_conn__status": 0,
        "NPT_HAVE_SIZEOF_sk_buff": 1, "NPT_SIZEOF_sk_buff": 224,
        "NPT_HAVE_SIZEOF_nf_conn": 0,
    }
    rows = describe(stub, members, (("sk_buff", True), ("nf_conn", False)))
    assert [r["present"] for r in rows] == [True, False, False, True, False]
    assert "_nfct" in rows[1]["error"]


def test_missing_required_member_raises_naming_it():
    with pytest.raises(B.NotFoundError, match=r"required kernel member sk_buff\.dev"):
        cflags(StubBtf({}), (("sk_buff", "dev", True),), ())
    with pytest.raises(B.NotFoundError, match="required kernel struct sk_buff"):
        cflags(StubBtf({}), (), (("sk_buff", True),))


@pytest.mark.parametrize("bit_offset,bit_size,off,sz,shift", [
    (1024, 3, 128, 1, 0),   # sk_buff.pkt_type on 6.18
    (1029, 3, 128, 1, 5),   # ends on the byte boundary
    (1030, 3, 128, 2, 6),   # straddles two bytes
    (1031, 20, 128, 4, 7),
    (1031, 40, 128, 8, 7),
])
def test_bitfield_macros(bit_offset, bit_size, off, sz, shift):
    m = B.Member(bit_offset // 8, 1, bit_offset, bit_size, "__u8")
    d = as_dict(cflags(StubBtf({("s", "f"): m}), (("s", "f", True),), ()))
    assert d == {"NPT_HAVE_s__f": 1, "NPT_OFF_s__f": off, "NPT_SZ_s__f": sz,
                 "NPT_BIT_OFF_s__f": shift, "NPT_BIT_SZ_s__f": bit_size}


def test_bitfield_too_wide_for_one_load():
    m = B.Member(0, 8, 7, 60, "u64")
    with pytest.raises(B.BtfError, match="does not fit"):
        cflags(StubBtf({("s", "f"): m}), (("s", "f", True),), ())


@pytest.fixture(scope="module")
def kernel():
    return B.load(VMLINUX)


@needs_vmlinux
def test_kernel_cflags_match_btf(kernel):
    d = as_dict(cflags(kernel))
    for struct, path, required in MEMBERS:
        name = macro_name(struct, path)
        if not kernel.has_member(struct, path):
            assert not required and d[f"NPT_HAVE_{name}"] == 0
            continue
        m = kernel.member(struct, path)
        assert d[f"NPT_HAVE_{name}"] == 1
        assert d[f"NPT_OFF_{name}"] == m.offset
        if m.bit_size:
            assert d[f"NPT_BIT_OFF_{name}"] == m.bit_offset - 8 * m.offset
            assert d[f"NPT_BIT_SZ_{name}"] == m.bit_size
        else:
            assert d[f"NPT_SZ_{name}"] == m.size
            assert f"NPT_BIT_OFF_{name}" not in d
    for struct, required in SIZES:
        if kernel.has(struct):
            assert d[f"NPT_SIZEOF_{struct}"] == kernel.size(struct)


@needs_vmlinux
def test_kernel_has_every_required_member(kernel):
    d = as_dict(cflags(kernel))
    for struct, path, required in MEMBERS:
        if required:
            assert d[f"NPT_HAVE_{macro_name(struct, path)}"] == 1
    # sk_buff.pkt_type is a 3-bit field: the C must mask it.
    assert d["NPT_BIT_SZ_sk_buff__pkt_type"] == 3
    assert d["NPT_SIZEOF_nf_conntrack_tuple_hash"] == (
        d["NPT_OFF_nf_conn__tuplehash_1"] - d["NPT_OFF_nf_conn__tuplehash_0"])


@needs_vmlinux
def test_kernel_optional_member_missing(kernel):
    extra = MEMBERS + (("sk_buff", "no_such_member", False),)
    d = as_dict(cflags(kernel, extra))
    assert d["NPT_HAVE_sk_buff__no_such_member"] == 0
    assert "NPT_OFF_sk_buff__no_such_member" not in d
    assert d["NPT_OFF_sk_buff__dev"] == kernel.member("sk_buff", "dev").offset


@needs_vmlinux
def test_kernel_describe(kernel):
    rows = describe(kernel)
    assert len(rows) == len(MEMBERS) + len(SIZES)
    assert all(r["present"] for r in rows if r["required"])
    dev = next(r for r in rows if (r["struct"], r["member"]) == ("sk_buff", "dev"))
    assert dev["offset"] == kernel.member("sk_buff", "dev").offset
    assert dev["type"] == "struct net_device *"
    assert offsets.describe(kernel) == rows
