"""IPv6 neighbour failures: the kernel text ranges (from /proc/kallsyms) the kfree_skb program
names NOT_SPECIFIED frees NEIGH_FAILED in (nptrace/kernel/kallsyms.py)."""
from nptrace.kernel import kallsyms
from nptrace.reasons import ReasonTable

TEXT = b"""ffffffff81ec5800 t __pfx_neigh_invalidate
ffffffff81ec58c0 t neigh_invalidate
ffffffff81ec5a00 t __pfx_neigh_timer_handler
ffffffff821662b0 t __pfx_ndisc_error_report
ffffffff821662c0 t ndisc_error_report
ffffffff82166320 t __pfx_pndisc_destructor
"""
DROPS = ReasonTable({2: "SKB_DROP_REASON_NOT_SPECIFIED", 58: "SKB_DROP_REASON_NEIGH_FAILED"},
                    "SKB_DROP_REASON_")


def test_ranges_run_to_the_next_symbol():
    assert kallsyms.text_ranges(TEXT, kallsyms.NEIGH_FAIL_SITES) == {
        "neigh_invalidate": (0xffffffff81ec58c0, 0xffffffff81ec5a00),
        "ndisc_error_report": (0xffffffff821662c0, 0xffffffff82166320)}
    # a name that is only a prefix of another symbol is not that symbol
    assert kallsyms.text_ranges(b"ffffffff81000000 t neigh_invalidate_x\nffffffff81000100 t y\n",
                                ["neigh_invalidate"]) == {}


def test_cflags(tmp_path):
    p = tmp_path / "kallsyms"
    p.write_bytes(TEXT)
    flags = kallsyms.neigh_cflags(DROPS, p)
    assert flags[:2] == ["-DNPT_REASON_NOT_SPECIFIED=2", "-DNPT_REASON_NEIGH_FAILED=58"]
    assert "-DNPT_NEIGH_FAIL_LO0=0xffffffff81ec58c0ULL" in flags
    assert "-DNPT_NEIGH_FAIL_HI1=0xffffffff82166320ULL" in flags


def test_no_flags_where_kallsyms_hides_addresses_or_the_kernel_lacks_the_reason(tmp_path):
    hidden = tmp_path / "hidden"
    hidden.write_bytes(b"".join(b"0000000000000000" + line[16:] + b"\n" for line in TEXT.splitlines()))
    assert kallsyms.neigh_cflags(DROPS, hidden) == []
    assert kallsyms.neigh_cflags(DROPS, tmp_path / "missing") == []
    old = ReasonTable({2: "SKB_DROP_REASON_NOT_SPECIFIED"}, "SKB_DROP_REASON_")
    p = tmp_path / "kallsyms"
    p.write_bytes(TEXT)
    assert kallsyms.neigh_cflags(old, p) == []


def test_reasonless_kernels_name_drops_by_call_site(tmp_path):
    """Before 5.17 (no kfree_skb reason, no skb_drop_reason enum in BTF): the legacy table,
    nf_hook_slow's range for NETFILTER_DROP, and the reverse-path kprobe's IP_RPFILTER."""
    from nptrace import reasons

    class NoEnums:
        def enum(self, name):
            raise KeyError(name)
    drops, rsts = reasons.load_tables(NoEnums())
    assert drops.value("NETFILTER_DROP") and rsts.value("NO_SOCKET")
    flags = reasons.bpf_flags(drops, rsts, kfree_reason=False)
    assert f"-DNPT_DROP_NETFILTER_DROP={drops.value('NETFILTER_DROP')}" in flags
    assert "-DNPT_KP_RPF_REASON=NPT_DROP_IP_RPFILTER" in flags
    assert f"-DNPT_RST_NO_SOCKET={rsts.value('NO_SOCKET')}" in flags
    # a kernel with the reason field: kfree_skb names its drops, the kprobe adds none
    assert reasons.bpf_flags(drops, rsts, kfree_reason=True) == [
        f"-DNPT_RST_NO_SOCKET={rsts.value('NO_SOCKET')}"]
    p = tmp_path / "kallsyms"
    p.write_bytes(b"ffffffff81a00000 T nf_hook_slow\nffffffff81a00100 T nf_hook_slow_list\n")
    assert kallsyms.drop_site_cflags(p) == ["-DNPT_DROP_SITE_NF_LO=0xffffffff81a00000ULL",
                                            "-DNPT_DROP_SITE_NF_HI=0xffffffff81a00100ULL"]
    p.write_bytes(b"0000000000000000 T nf_hook_slow\n0000000000000000 T x\n")   # hidden
    assert kallsyms.drop_site_cflags(p) == []
