"""Run configuration: what the user asked for, checked.

Its translation into BPF compile-time switches is nptrace/kernel/cflags.py build_cflags (pure,
unit-tested), next to the hook table whose gates it sets.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from nptrace.errors import NptraceError

DEFAULT_VXLAN_PORTS = (4789, 8472)


class ConfigError(NptraceError, ValueError):
    """Bad user input; the CLI shows the message as one line."""


@dataclass(frozen=True)
class PortRange:
    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> "PortRange":
        try:
            lo, _, hi = text.partition("-")
            r = cls(int(lo), int(hi or lo))
        except ValueError:
            raise ConfigError(f"bad port or range {text!r}: want N or N-M") from None
        if not (0 < r.lo <= r.hi <= 65535):
            raise ConfigError(f"bad port range {text!r}: ports are 1-65535, low before high")
        return r


@dataclass(frozen=True)
class IfaceSpec:
    """`[NETNS/]IFNAME` from --iface; netns None is the namespace nptrace runs in."""
    netns: str | None
    name: str

    @classmethod
    def parse(cls, text: str) -> "IfaceSpec":
        ns, sep, name = text.rpartition("/")
        if not name or (sep and not ns) or len(name) > 15:
            raise ConfigError(f"bad interface {text!r}: want IFNAME or NETNS/IFNAME")
        return cls(ns or None, name)

    def __str__(self) -> str:
        return f"{self.netns}/{self.name}" if self.netns else self.name


@dataclass(frozen=True)
class Config:
    ifaces: tuple[IfaceSpec, ...] = ()
    ports: tuple[PortRange, ...] = ()
    hosts: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    vxlan_ports: tuple[int, ...] = DEFAULT_VXLAN_PORTS
    ringbuf_pages: int = 1024          # 4 MiB: ~18k records; its pages count in RSS twice (mmap)
    max_rate: int = 0                  # records/s per kind for the node to user space (0: all); counts stay exact
    max_burst: int = 400               # ...after a burst of this many (a token bucket)
    cpus: int = 0                      # CPUs the budgets are shared by (0: os.cpu_count())
    # a CPU wakes the ring's reader every this many records (a power of two); 1: at every record
    # the reader has not caught up with (the kernel's own rule), which readers that only read
    # when woken need (bcc's ring_buffer_poll); `nptrace run` reads by time and asks for 256
    wake_every: int = 1
    flow_table_size: int = 65536
    max_counts: int = 16384
    nf_hook: bool = True               # netfilter-hook view of NATed SYNs (Linux 6.4+)
    tc_mode: str = "auto"              # --iface programs: tcx links, clsact filters, or auto
    nft_trace: bool = True             # nf_tables tracing of dropped flows (nftrace_live.py)
    kprobes: bool = False              # enrichment kprobes (set where the kernel has them)
    tracepoints: tuple[str, ...] | None = None   # "cat/name"s; None: every one in kernel/hooks.py
    snaplen: int = 0                   # packet bytes copied per event for --pcap (0: none)
    service_gate: bool = False         # run --service in the kernel (bpf/npt_common.h filter_svc)
    extra: dict = field(default_factory=dict)

    def port_set(self) -> set[int]:
        out: set[int] = set()
        for r in self.ports:
            out.update(range(r.lo, r.hi + 1))
        return out


MAX_SNAPLEN = 9216     # a jumbo frame; the copy is per-CPU scratch plus one ring record


def check_snaplen(n: int) -> int:
    if not 1 <= n <= MAX_SNAPLEN:
        raise ConfigError(f"bad --snaplen {n}: want 1-{MAX_SNAPLEN} bytes")
    return n


def parse_hosts(values) -> tuple:
    out = []
    for v in values:
        try:
            out.append(ipaddress.ip_network(v, strict=False))
        except ValueError:
            raise ConfigError(f"bad --host {v!r}: want an address or CIDR") from None
    return tuple(out)


def per_cpu(budget: int, cpus: int) -> int:
    """A node-wide record budget as the per-CPU one the kernel's token bucket keeps (per-CPU
    state needs no atomics). Rounded up: every CPU may send at least one record; 0 stays 0
    (no limit). A storm spread over the CPUs by RSS gets the whole budget; one that a single
    CPU handles gets its share."""
    return -(-int(budget) // max(1, cpus)) if budget > 0 else 0
