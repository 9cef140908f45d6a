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
    # no --iface: the node's own devices, chosen and followed while running (node/ifchoice.py)
    iface_auto: bool = False
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
    snap_headers: bool = False         # --snaplen headers: files keep each packet's headers only
    service_gate: bool = False         # run --service in the kernel (bpf/npt_common.h filter_svc)
    # the tracer is one node of several on this kernel: its namespace and its pods' alone
    # (node/scope.py; bpf/npt_common.h filter_netns)
    node_scope: bool = False
    extra: dict = field(default_factory=dict)

    def port_set(self) -> set[int]:
        out: set[int] = set()
        for r in self.ports:
            out.update(range(r.lo, r.hi + 1))
        return out


MAX_SNAPLEN = 9216     # a jumbo frame; the copy is per-CPU scratch plus one ring record
# --snaplen headers (the default): the kernel copies this much and sinks/snap.py cuts each
# packet where its headers end. 160 holds Ethernet (14) + two VLAN tags (8) + the longest IPv4
# header (60) + the longest TCP header (60) = 142, and IPv6 (40) with 32 bytes of extension
# headers + TCP (60) + one VLAN tag = 150.
SNAP_HEADERS = "headers"
HEADERS_SNAPLEN = 160


def check_snaplen(n: int) -> int:
    if not 1 <= n <= MAX_SNAPLEN:
        raise ConfigError(f"bad --snaplen {n}: want 1-{MAX_SNAPLEN} bytes")
    return n


# The largest ring bcc sizes: BPF_RINGBUF_OUTPUT(events, pages) computes pages * 4096 as a C
# int, and the kernel wants a power of two (kernel/bpf/ringbuf.c ringbuf_map_alloc).
MAX_RING_PAGES = 1 << 18       # 1 GiB
# The kernel's token bucket charges a record 1e9 / rate ns (bpf/npt_common.h NPT_RATE_COST):
# past a billion a second the cost is 0 and the bucket never refills.
MAX_RATE = 1_000_000_000


def check_ring_pages(n: int) -> int:
    if not 1 <= n <= MAX_RING_PAGES or n & (n - 1):
        raise ConfigError(f"bad --ring-pages {n}: want a power of two from 1 to {MAX_RING_PAGES} "
                          f"(4 KiB pages; {MAX_RING_PAGES} is 1 GiB, the largest ring bcc sizes)")
    return n


def parse_address(text: str, opt: str) -> str:
    """One host address a user typed (explain --from, --to's host): what the ipaddress module
    accepts and nothing else (not 999.1.1.1, not a trailing newline), an IPv4-mapped IPv6
    address (::ffff:a.b.c.d) as its IPv4 address, in canonical text."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        raise ConfigError(f"bad {opt} {text!r}: want an IP address") from None
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def parse_network(text: str, opt: str, want: str = "an address or CIDR"):
    """An address or CIDR a user typed (--host, --pod), as parse_address reads addresses: an
    IPv4-mapped IPv6 network (::ffff:a.b.c.d/128) is the IPv4 network it maps."""
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ConfigError(f"bad {opt} {text!r}: want {want}") from None
    v4 = getattr(net.network_address, "ipv4_mapped", None)
    if v4 is not None and net.prefixlen >= 96:
        return ipaddress.ip_network(f"{v4}/{net.prefixlen - 96}", strict=False)
    return net


def parse_endpoint(text: str, opt: str) -> tuple[str, int]:
    """ADDR:PORT or [V6ADDR]:PORT a user typed (explain --to)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = text.rpartition(":")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536 or not host:
        raise ConfigError(f"bad {opt} {text!r}: want ADDR:PORT ([ADDR]:PORT for IPv6)")
    return parse_address(host, opt), int(port)


DEFAULT_METRICS_ADDR = "127.0.0.1:9464"


def parse_metrics_addr(addr: str) -> tuple[str, int]:
    """"HOST:PORT", "[V6]:PORT" or "V6:PORT" -> (host, port). The host is required: binding
    beyond loopback must be an explicit choice. A host that is an address is read as
    parse_address reads it; a name is left to the resolver."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ConfigError(f"bad metrics address {addr!r}: use HOST:PORT, e.g. "
                          f"{DEFAULT_METRICS_ADDR}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ConfigError(f"bad metrics address {addr!r}: use [V6ADDR]:PORT for IPv6")
        host = host[1:-1]
    # An unbracketed IPv6 address takes the last ":N" as the port: the DaemonSet passes
    # $(NODE_IP):9464, and status.hostIP is unbracketed on IPv6 nodes.
    if ":" in host or host[-1:].isdigit():
        host = parse_address(host, "metrics address")
    elif not (host.isascii() and all(c.isalnum() or c in ".-" for c in host)):
        raise ConfigError(f"bad metrics address {addr!r}: the host is neither an address "
                          "nor a host name")
    return host, int(port)


def parse_hosts(values) -> tuple:
    return tuple(parse_network(v, "--host") for v in values)


def per_cpu(budget: int, cpus: int) -> int:
    """A node-wide record budget as the per-CPU one the kernel's token bucket keeps (per-CPU
    state needs no atomics). Rounded up: every CPU may send at least one record; 0 stays 0
    (no limit). A storm spread over the CPUs by RSS gets the whole budget; one that a single
    CPU handles gets its share."""
    return -(-int(budget) // max(1, cpus)) if budget > 0 else 0
