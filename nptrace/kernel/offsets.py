"""Kernel struct members the BPF probes read, turned into -D cflags from BTF.

bcc compiles against borrowed Debian 6.12 headers, whose struct layouts differ
from the running kernel's, so the BPF C never dereferences kernel structs by
field name: it reads `ptr + NPT_OFF_<struct>__<member>` with
bpf_probe_read_kernel(). Add a member by adding one line to MEMBERS.

Macros, with the member path's '.' and '[' turned into '_' and ']' dropped
(nf_conn tuplehash[1] -> nf_conn__tuplehash_1):
  NPT_OFF_<s>__<m>      byte offset (a bitfield: of the first byte holding it)
  NPT_SZ_<s>__<m>       bytes to read (a bitfield: 1/2/4/8 bytes covering it)
  NPT_BIT_OFF_<s>__<m>  bitfields only: right shift after a little-endian load
  NPT_BIT_SZ_<s>__<m>   bitfields only: width in bits
  NPT_HAVE_<s>__<m>     1, or 0 when an optional member is absent (then no
                        OFF/SZ macros: guard the C with #if NPT_HAVE_...)
  NPT_SIZEOF_<s>        sizeof(struct s), for the structs in SIZES
  NPT_HAVE_SIZEOF_<s>   1, or 0 when an optional struct is absent
"""
from __future__ import annotations

import re

from nptrace.kernel.btf import Btf, BtfError, NotFoundError

# (struct, member path, required). Optional: absent from some configs/kernels.
MEMBERS: tuple[tuple[str, str, bool], ...] = (
    ("sk_buff", "dev", True),            # in an anonymous union since 4.14-ish
    ("sk_buff", "sk", True),
    ("sk_buff", "_nfct", False),         # CONFIG_NF_CONNTRACK only
    ("sk_buff", "len", True),
    ("sk_buff", "data_len", True),       # bytes in fragments: the linear part is len - data_len
    ("sk_buff", "pkt_type", True),       # 3-bit bitfield in the headers group
    ("sk_buff", "mark", True),
    ("sk_buff", "protocol", True),
    ("sk_buff", "transport_header", True),
    ("sk_buff", "network_header", True),
    ("sk_buff", "mac_header", True),
    ("sk_buff", "skb_iif", True),
    ("sk_buff", "head", True),
    ("sk_buff", "data", True),
    ("net_device", "ifindex", True),
    ("net_device", "nd_net.net", False),  # possible_net_t is empty without CONFIG_NET_NS
    ("net_device", "name", True),
    ("net", "ns.inum", True),
    # Conntrack may be a module (most distributions): then these come from
    # /sys/kernel/btf/nf_conntrack, or are absent if it is not loaded.
    ("nf_conn", "status", False),
    ("nf_conn", "tuplehash", False),
    ("nf_conn", "tuplehash[0]", False),  # IP_CT_DIR_ORIGINAL
    ("nf_conn", "tuplehash[1]", False),  # IP_CT_DIR_REPLY
    ("nf_conn", "mark", False),          # CONFIG_NF_CONNTRACK_MARK
    ("nf_conntrack_tuple_hash", "tuple", False),
    ("nf_conntrack_tuple", "src.u3", False),
    ("nf_conntrack_tuple", "src.u.all", False),
    ("nf_conntrack_tuple", "dst.u3", False),
    ("nf_conntrack_tuple", "dst.u.all", False),
    ("nf_conntrack_tuple", "dst.protonum", False),
    ("sock", "__sk_common", True),
    ("sock_common", "skc_family", True),
    ("sock_common", "skc_state", True),
    ("sock_common", "skc_daddr", True),
    ("sock_common", "skc_rcv_saddr", True),
    ("sock_common", "skc_dport", True),
    ("sock_common", "skc_num", True),
    ("sock_common", "skc_net.net", False),     # CONFIG_NET_NS, as nd_net
    ("sock_common", "skc_v6_daddr", False),    # CONFIG_IPV6
    ("sock_common", "skc_v6_rcv_saddr", False),
)

# (struct, required): emitted as NPT_SIZEOF_<struct>.
SIZES: tuple[tuple[str, bool], ...] = (
    ("sk_buff", True),
    ("sock_common", True),
    ("nf_conn", False),
    ("nf_conntrack_tuple_hash", False),  # stride of nf_conn.tuplehash[]
    ("nf_conntrack_tuple", False),
)

_NON_IDENT = re.compile(r"[^A-Za-z0-9_]")


def macro_name(struct: str, path: str) -> str:
    """'nf_conn', 'tuplehash[1]' -> 'nf_conn__tuplehash_1'."""
    p = path.replace(".", "_").replace("[", "_").replace("]", "")
    return _NON_IDENT.sub("_", f"{struct}__{p}")


def _load_width(bit_in_byte: int, bit_size: int) -> int:
    need = bit_in_byte + bit_size
    for n in (1, 2, 4, 8):
        if need <= 8 * n:
            return n
    raise BtfError(f"bitfield of {bit_size} bits at bit {bit_in_byte} does not fit an 8-byte load")


def _lookup(btf: Btf, struct: str, path: str, required: bool):
    try:
        return btf.member(struct, path)
    except NotFoundError as e:
        if required:
            raise NotFoundError(
                f"required kernel member {struct}.{path} not found: {e}; "
                "nptrace cannot read this kernel's structs") from None
        return None


def cflags(btf: Btf, members=MEMBERS, sizes=SIZES) -> list[str]:
    """-D flags for every member and size; NotFoundError if a required one is missing."""
    out: list[str] = []
    for struct, path, required in members:
        name = macro_name(struct, path)
        m = _lookup(btf, struct, path, required)
        if m is None:
            out.append(f"-DNPT_HAVE_{name}=0")
            continue
        out.append(f"-DNPT_HAVE_{name}=1")
        if m.bit_size:
            shift = m.bit_offset - 8 * m.offset
            out.append(f"-DNPT_OFF_{name}={m.offset}")
            out.append(f"-DNPT_SZ_{name}={_load_width(shift, m.bit_size)}")
            out.append(f"-DNPT_BIT_OFF_{name}={shift}")
            out.append(f"-DNPT_BIT_SZ_{name}={m.bit_size}")
        else:
            out.append(f"-DNPT_OFF_{name}={m.offset}")
            out.append(f"-DNPT_SZ_{name}={m.size}")
    for struct, required in sizes:
        name = _NON_IDENT.sub("_", struct)
        try:
            n = btf.size(f"struct {struct}")
        except NotFoundError as e:
            if required:
                raise NotFoundError(f"required kernel struct {struct} not found: {e}") from None
            out.append(f"-DNPT_HAVE_SIZEOF_{name}=0")
            continue
        out.append(f"-DNPT_HAVE_SIZEOF_{name}=1")
        out.append(f"-DNPT_SIZEOF_{name}={n}")
    return out


def describe(btf: Btf, members=MEMBERS, sizes=SIZES) -> list[dict]:
    """One row per member and size, for `nptrace doctor`; never raises NotFoundError."""
    rows: list[dict] = []
    for struct, path, required in members:
        try:
            m = btf.member(struct, path)
        except NotFoundError as e:
            rows.append({"struct": struct, "member": path, "required": required,
                         "present": False, "error": str(e)})
            continue
        rows.append({"struct": struct, "member": path, "required": required, "present": True,
                     "offset": m.offset, "size": m.size, "bit_offset": m.bit_offset,
                     "bit_size": m.bit_size, "type": m.type_name})
    for struct, required in sizes:
        try:
            n = btf.size(f"struct {struct}")
        except NotFoundError as e:
            rows.append({"struct": struct, "member": None, "required": required,
                         "present": False, "error": str(e)})
            continue
        rows.append({"struct": struct, "member": None, "required": required,
                     "present": True, "size": n})
    return rows
