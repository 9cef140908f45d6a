"""The one hook table: every place nptrace attaches a BPF program, with its BPF file, gate
macro, minimum kernel, whether it is required, what is lost without it, and its fallback.

Everything else derives from it: the tracepoint gates of kernel/cflags.py build_cflags, the
hook rows of kernel/features.py PROBES (what `nptrace doctor` prints), the kprobe groups
kernel/loader.py attaches, and kernel/attach.py plan(), which decides from features.probe()
what `nptrace run` compiles and attaches. tests/unit/test_hooks.py checks that this table, the
programs defined in bpf/*.bpf.c and features' hook rows name the same hooks. Adding a
tracepoint touches its .bpf.c, bpf/nptrace_events.h and one row here.

Pure data: no bcc, no root.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Field", "Hook", "HOOKS", "KPROBE_GROUPS", "TRACEPOINTS", "TRACEPOINT_FIELDS", "by_name",
           "probe_rows"]

NO_FALLBACK = "none"


@dataclass(frozen=True)
class Field:
    """A tracepoint field that some kernels with the tracepoint lack: it arrived later, or a
    later kernel removed it (a layout change). Its program reads it only under its gate
    (Hook.field_gate), set by build_cflags from the format file features.probe() read, because
    bcc builds `args` from that file: a field the kernel lacks is a compile error, not a zero."""
    name: str          # the field in the tracepoint's format file
    row: str           # its features/doctor row; "" for a layout marker (no capability lost)
    min_kernel: str
    cost: str          # what is lost on a kernel whose tracepoint lacks it
    until: str = ""    # the kernel that removed it ("" = still there)
    lost: tuple[str, ...] = ()   # causes no other hook names where it is missing


@dataclass(frozen=True)
class Hook:
    name: str          # "skb:kfree_skb", "tc:ingress", "netfilter:post_routing", "kprobe:nat"
    kind: str          # tracepoint | tc | netfilter | kprobe
    bpf_file: str      # under bpf/
    programs: tuple[str, ...]   # functions it attaches (TRACEPOINT_PROBE for tracepoints)
    gate: str          # the -D switch that compiles it in
    min_kernel: str
    required: bool     # tracing is impossible without it (retis can_run(): bail only if required)
    cost: str          # what is lost without it
    fallback: str      # what runs instead, or "none"
    probe: str         # the features row that says whether this kernel offers it
    fields: tuple[Field, ...] = ()
    fail_reason: str = ""       # doctor's one-line reason when a required hook is missing
    # tracepoints: the fields its program reads on every kernel that has the tracepoint (the
    # Fields above are the rest; tests/unit/test_tracepoint_fields.py holds both against the
    # program text and the format files of 5.4, 5.10, 6.1, 6.12 and 6.18)
    reads: tuple[str, ...] = ()
    # kprobe groups: "cat/event:field" whose presence makes the group redundant (the
    # tracepoint field's kernel fires the tracepoint where the kprobe would)
    unless: str = ""
    # kprobe groups: alternatives tried in order; each a list of (program, "entry"|"return",
    # kernel function) that must all attach (an entry/return pair)
    alternatives: tuple[tuple[tuple[str, str, str], ...], ...] = ()

    @property
    def tracepoint(self) -> str:
        """"skb:kfree_skb" -> "skb/kfree_skb" (its tracefs path under events/)."""
        return self.name.replace(":", "/", 1) if self.kind == "tracepoint" else ""

    def field_gate(self, fld: Field) -> str:
        """The -D switch that says the running kernel's format has `fld`:
        skb:kfree_skb reason -> NPT_TPF_KFREE_SKB_REASON."""
        return f"NPT_TPF_{self.name.split(':', 1)[1]}_{fld.name}".upper()

    @property
    def group(self) -> str:
        """"kprobe:nat" -> "nat"."""
        return self.name.split(":", 1)[1] if self.kind == "kprobe" else ""


def _tp(name, gate, min_kernel, cost, reads, required=False, fields=(), fail_reason=""):
    cat, _, event = name.partition(":")
    # bcc names a TRACEPOINT_PROBE(cat, event) function tracepoint__<cat>__<event>
    return Hook(name, "tracepoint", "tracepoints.bpf.c", (f"tracepoint__{cat}__{event}",), gate,
                min_kernel, required, cost, NO_FALLBACK, name, fields, fail_reason,
                reads=tuple(reads))


# The socket tracepoints' address layout (include/trace/events/tcp.h TP_STORE_ADDRS): an IPv4
# socket's addresses also stand v4-mapped in saddr_v6, which is how the programs tell the
# family where the `family` field is missing (before 5.11).
_SOCK_ADDRS = ("sport", "dport", "saddr", "daddr", "saddr_v6", "daddr_v6")


_KP_COST = "kprobe enrichment (bpf/kprobes.bpf.c) only adds detail: "


def _kp(group, cost, alternatives, fallback=NO_FALLBACK, unless=""):
    progs = tuple(dict.fromkeys(p for alt in alternatives for p, _, _ in alt))
    return Hook(f"kprobe:{group}", "kprobe", "kprobes.bpf.c", progs, "NPT_WITH_KPROBES", "4.1",
                False, _KP_COST + cost, fallback, "kprobes", alternatives=alternatives,
                unless=unless)


# Tracepoints, with the kernel that added each (include/trace/events/*.h); the order is doctor's.
HOOKS: tuple[Hook, ...] = (
    _tp("skb:kfree_skb", "NPT_TP_KFREE_SKB", "2.6.30",        # added with the drop monitor
        "no drop events: rp_filter, netfilter drops and no_listener drops are not seen",
        ("skbaddr", "location", "protocol"), required=True,
        fields=(Field("reason", "skb:kfree_skb reason", "5.17",   # commit c504e5c2f964
                      "drops are told apart by where they were freed (nf_hook_slow: "
                      "NETFILTER_DROP, a failed neighbour), rp_filter by kprobe:rp_filter, "
                      "no_listener by kprobe:tcp_reset; a bad TCP checksum is freed where "
                      "other drops are (tcp_v4_rcv): the checksum cause is lost",
                      lost=("checksum",)),),
        fail_reason="no drop hook: skb:kfree_skb is missing (no fallback)"),
    _tp("tcp:tcp_send_reset", "NPT_TP_TCP_SEND_RESET", "4.15",  # with the other tcp tracepoints
        "resets sent by the local TCP stack (no_listener) are not seen",
        ("skbaddr", "skaddr", "state", "saddr", "daddr"),
        fields=(Field("reason", "tcp:tcp_send_reset reason", "6.10",   # sk_rst_reason
                      "why the stack reset (NO_SOCKET vs state errors) is unknown; resets "
                      "sent without a socket (no listener) do not fire it: kprobe:tcp_reset"),
                # 6.10 gave tcp_send_reset its own event with sockaddr-sized saddr/daddr
                # (trace/events/tcp.h); before, the socket layout of _SOCK_ADDRS
                Field("sport", "", "4.15", "", until="6.10"),
                Field("dport", "", "4.15", "", until="6.10"),
                Field("saddr_v6", "", "4.15", "", until="6.10"),
                Field("daddr_v6", "", "4.15", "", until="6.10"))),
    _tp("tcp:tcp_receive_reset", "NPT_TP_TCP_RECEIVE_RESET", "4.15",
        "resets received by local sockets (peer_reset) are not seen",
        ("skaddr", *_SOCK_ADDRS)),
    _tp("icmp:icmp_send", "NPT_TP_ICMP_SEND", "6.10",           # trace/events/icmp.h
        "REJECT with ICMP (kube-proxy's no-endpoints rule) is seen only as a NETFILTER_DROP",
        ("skbaddr", "type", "code")),
    _tp("tcp:tcp_retransmit_synack", "NPT_TP_TCP_RETRANSMIT_SYNACK", "4.15",
        "lost handshakes (SYN-ACK retransmits) are not seen",
        ("skaddr", *_SOCK_ADDRS)),
    # tc (bpf/tc.bpf.c): on --iface's devices or those chosen (node/ifchoice.py). clsact 4.5 (direct-action 4.4); tcx links 6.6.
    Hook("tc:ingress", "tc", "tc.bpf.c", ("npt_tc_ingress",), "NPT_WITH_TC", "4.5", False,
         "no wire view: resets sent by iptables REJECT --reject-with tcp-reset are not seen",
         "clsact filters where tcx links are refused (kernel/tc.py); programs without kernel "
         "sk_buff reads (-DNPT_TC_KSKB=0: no conntrack on tc events) where the verifier "
         "refuses them", "tc clsact"),
    Hook("tc:egress", "tc", "tc.bpf.c", ("npt_tc_egress",), "NPT_WITH_TC", "4.5", False,
         "no wire view: resets and un-NATed replies leaving the node are not seen",
         "as tc:ingress", "tc clsact"),
    # BPF_PROG_TYPE_NETFILTER linked at POST_ROUTING, NF_IP_PRI_NAT_SRC + 1 (kernel/nfhook.py):
    # Linux 6.4, commit fd9c663b9ad6, CONFIG_NETFILTER_BPF_LINK.
    Hook("netfilter:post_routing", "netfilter", "nf_hook.bpf.c", ("npt_nf_view",),
         "NPT_WITH_NF_HOOK", "6.4", False,
         "no view of packets at a netfilter hook (after NAT): a pod's packets are linked to "
         "their client only later in a flow",
         "conntrack tuples read at the tracepoints and tc egress (npt_read_ct)", "netfilter bpf"),
    # kprobes (bpf/kprobes.bpf.c): CONFIG_KPROBES, absent on this project's 6.18 VM.
    _kp("nat", "the packet NAT was applied to is not seen from inside NAT",
        ((("npt_kp_nat_manip", "entry", "nf_nat_manip_pkt"),),
         (("npt_kp_nat_packet", "entry", "nf_nat_packet"),)),
        fallback="nf_nat_packet where nf_nat_manip_pkt is not probeable"),
    _kp("rp_filter", "the reverse-path check's result is known from the kfree_skb reason only",
        ((("npt_kp_fib_validate_entry", "entry", "fib_validate_source"),
          ("npt_kp_fib_validate_ret", "return", "fib_validate_source")),)),
    _kp("tcp_reset", "resets the stack sends without a socket (no listener) are not seen "
        "before 6.10 (tcp:tcp_send_reset fires for them only since)",
        ((("npt_kp_tcp_reset", "entry", "tcp_v4_send_reset"),),), unless="tcp/tcp_send_reset:reason"),
    _kp("tcp_reset6", "IPv6 resets without a socket are not seen before 6.10",
        ((("npt_kp_tcp_reset", "entry", "tcp_v6_send_reset"),),), unless="tcp/tcp_send_reset:reason"),
    _kp("reject_reset", "resets sent by REJECT --reject-with tcp-reset are seen on tc only",
        ((("npt_kp_nf_send_reset", "entry", "nf_send_reset"),),)),
    _kp("reject_reset6", "IPv6 REJECT resets are seen on tc only",
        ((("npt_kp_nf_send_reset", "entry", "nf_send_reset6"),),)),
    # ip_vs_in_hook/ip_vs_out_hook since 6.2; ip_vs_remote_request4/ip_vs_reply4 before
    _kp("ipvs_in", "IPVS verdicts on requests are not seen",
        ((("npt_kp_ipvs_in_entry", "entry", "ip_vs_in_hook"),
          ("npt_kp_ipvs_in_ret", "return", "ip_vs_in_hook")),
         (("npt_kp_ipvs_in_entry", "entry", "ip_vs_remote_request4"),
          ("npt_kp_ipvs_in_ret", "return", "ip_vs_remote_request4"))),
        fallback="ip_vs_remote_request4 before Linux 6.2"),
    _kp("ipvs_out", "IPVS verdicts on replies are not seen",
        ((("npt_kp_ipvs_out_entry", "entry", "ip_vs_out_hook"),
          ("npt_kp_ipvs_out_ret", "return", "ip_vs_out_hook")),
         (("npt_kp_ipvs_out_entry", "entry", "ip_vs_reply4"),
          ("npt_kp_ipvs_out_ret", "return", "ip_vs_reply4"))),
        fallback="ip_vs_reply4 before Linux 6.2"),
)

# The features rows that gate a kind of hook (a facility, not one hook): one row for all
# kprobe groups, one for both tc directions, one for the netfilter program.
# name -> (min_kernel, cost, by_version)
FACILITIES: dict[str, tuple[str, str, bool]] = {
    "kprobes": ("4.1", "no enrichment kprobes: NAT, the reverse-path check, REJECT resets and "
                "IPVS are not seen from inside the kernel functions (nothing falls back to "
                "them)", False),
    "tc clsact": ("4.5", "no wire view: resets sent by iptables REJECT --reject-with tcp-reset "
                  "are not seen", False),
    "netfilter bpf": ("6.4", "no view of packets at a netfilter hook (after DNAT): NAT is read "
                      "from conntrack only", False),
}

# tracefs path -> the -D switch that compiles its program in (kernel/cflags.py)
TRACEPOINTS: dict[str, str] = {h.tracepoint: h.gate for h in HOOKS if h.kind == "tracepoint"}
# (tracefs path, field, its -D switch, removed in) of every gated field (kernel/cflags.py)
TRACEPOINT_FIELDS: tuple[tuple[str, str, str, str], ...] = tuple(
    (h.tracepoint, f.name, h.field_gate(f), f.until) for h in HOOKS if h.kind == "tracepoint"
    for f in h.fields)
# kprobe group -> alternatives (kernel/loader.py attach_kprobes)
KPROBE_GROUPS = {h.group: h.alternatives for h in HOOKS if h.kind == "kprobe"}


def by_name(name: str) -> Hook:
    for h in HOOKS:
        if h.name == name:
            return h
    raise KeyError(name)


def probe_rows() -> tuple[str, ...]:
    """The features rows derived from this table, in doctor's order within each kind."""
    rows: list[str] = []
    for h in HOOKS:
        for r in (h.probe, *(f.row for f in h.fields if f.row)):
            if r not in rows:
                rows.append(r)
    return tuple(rows)
