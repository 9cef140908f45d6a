"""Kernel reason codes: drop reasons (enum skb_drop_reason), reset reasons (enum sk_rst_reason).

Names come from the running kernel's BTF (the numbering changes between releases: a reason
added in one release shifts the ones after it), never from a hard-coded table. The tables
here only say which NAMES are routine and not worth an event.
"""
from __future__ import annotations

DROP_PREFIX = "SKB_DROP_REASON_"
RST_PREFIX = "SK_RST_REASON_"

# Freed-as-dropped on healthy traffic: duplicates, queue merges, normal close. They are still
# never hidden from counters; they only do not produce ring-buffer records.
ROUTINE_DROPS = frozenset({
    "NOT_DROPPED_YET", "CONSUMED", "MAX",
    "TCP_OLD_DATA",        # duplicate segment already acked (retransmission overlap)
    "TCP_OFOMERGE",        # out-of-order segment merged into the queue
    "TCP_OLD_ACK",         # ACK for data already acked
    "DUP_FRAG",
    "SOCKET_RCVBUFF",      # socket receive buffer full: local pressure, not a path fault
    "PROTO_MEM",
    "FULL_RING",
    "QUEUE_PURGE",         # a closing socket freeing what it still had queued
    "NOT_SPECIFIED",       # every healthy close frees a few; a sign only next to a real cause
})


def strip(name, prefix: str) -> str:
    """`name` without `prefix`. Names come from BTF and from session files: anything that is
    not a str (a crafted session's number, None) becomes its str() first."""
    if type(name) is not str:
        name = str(name)
    return name[len(prefix):] if name.startswith(prefix) else name

# Drop reasons whose rules read the dropped packet's source address (a NetworkPolicy's ipBlock,
# loadBalancerSourceRanges): the kernel keeps the client address in their cause key.
SOURCE_DROPS = frozenset({"NETFILTER_DROP"})


class ReasonTable:
    """Value -> short name for one enum, e.g. 16 -> "IP_RPFILTER"."""

    def __init__(self, values: dict[int, str], prefix: str):
        self.names = {v: strip(n, prefix) for v, n in values.items()}
        self.values = {n: v for v, n in self.names.items()}

    def name(self, value: int) -> str:
        return self.names.get(value, f"REASON_{value}")

    def value(self, name: str) -> int | None:
        return self.values.get(name)

    def __len__(self) -> int:
        return len(self.names)


def interesting_drops(table: ReasonTable, limit: int) -> list[int]:
    """Reason values, below `limit` (the BPF array size), that produce ring-buffer records."""
    return sorted(v for v, n in table.names.items() if v < limit and n not in ROUTINE_DROPS)


# Kernels without the enums (skb_drop_reason 5.17, sk_rst_reason 6.10) still have these causes:
# there a drop is named by the function that freed it (bpf/tracepoints.bpf.c npt_drop_site),
# the reverse-path check's failure by its kprobe and a socket-less reset by the reset sender's
# kprobe (bpf/kprobes.bpf.c). Their values are nptrace's own, used only on such kernels; the
# names are the kernel's, so the rules are the same on every kernel.
LEGACY_DROPS = {1: "NOT_SPECIFIED", 2: "NO_SOCKET", 3: "NETFILTER_DROP", 4: "IP_RPFILTER",
                5: "NEIGH_FAILED"}
LEGACY_RSTS = {1: "NOT_SPECIFIED", 2: "NO_SOCKET"}


def load_tables(btf) -> tuple[ReasonTable, ReasonTable]:
    """(drop reasons, reset reasons) from BTF; an enum the kernel lacks gives the legacy table."""
    def enum(name, prefix, legacy):
        try:
            return ReasonTable(btf.enum(name), prefix)
        except Exception:
            return ReasonTable(legacy, prefix)
    return (enum("skb_drop_reason", DROP_PREFIX, LEGACY_DROPS),
            enum("sk_rst_reason", RST_PREFIX, LEGACY_RSTS))


def bpf_flags(drops: ReasonTable, rsts: ReasonTable, kfree_reason: bool) -> list[str]:
    """-D values of the reasons the programs set themselves: a socket-less reset's NO_SOCKET
    (the reset sender's kprobe), and where kfree_skb has no reason field (`kfree_reason`
    False) the call-site names and the reverse-path kprobe's IP_RPFILTER."""
    flags = []
    if rsts.value("NO_SOCKET") is not None:
        flags.append(f"-DNPT_RST_NO_SOCKET={rsts.value('NO_SOCKET')}")
    if not kfree_reason:
        for name in ("NOT_SPECIFIED", "NETFILTER_DROP", "IP_RPFILTER"):
            if drops.value(name) is not None:
                flags.append(f"-DNPT_DROP_{name}={drops.value(name)}")
        if drops.value("IP_RPFILTER") is not None:
            flags.append("-DNPT_KP_RPF_REASON=NPT_DROP_IP_RPFILTER")
    return flags
