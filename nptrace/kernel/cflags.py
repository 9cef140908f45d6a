"""A run configuration as BPF compile-time switches (-DNPT_*): pure, unit-tested.

What reaches the BPF C is decided here, never by rewriting the C text. Sets of values (ports,
CIDRs) go into maps at load time; only the gates that say "this filter is on" are compile-time,
so an unused filter costs nothing per packet. The tracepoint gates come from the hook table
(kernel/hooks.py); which tracepoints are on is kernel/attach.py plan()'s choice.
"""
from __future__ import annotations

import os

from nptrace.config import Config, ConfigError, check_ring_pages, per_cpu
from nptrace.kernel.hooks import TRACEPOINT_FIELDS, TRACEPOINTS

__all__ = ["build_cflags"]


def build_cflags(cfg: Config, available_tracepoints: set[str] | None = None,
                 offset_flags: list[str] = (), fields: dict[str, tuple[str, ...]] | None = None
                 ) -> list[str]:
    """cflags for the one bcc object. `available_tracepoints`: what the kernel offers (None = all).
    `fields`: each tracepoint's format-file fields (features.probe()); None = the newest layout
    (every gated field on, the ones a later kernel removed off)."""
    pages = check_ring_pages(cfg.ringbuf_pages)
    cpus = cfg.cpus or os.cpu_count() or 1
    wake = cfg.wake_every
    if wake <= 0 or wake & (wake - 1):
        raise ConfigError(f"wake-up batch must be a power of two, got {wake}")
    flags = [
        f"-DNPT_RINGBUF_PAGES={pages}",
        f"-DNPT_MAX_COUNTS={cfg.max_counts}",
        f"-DNPT_MAX_RATE={per_cpu(cfg.max_rate, cpus)}",
        f"-DNPT_MAX_BURST={max(1, per_cpu(cfg.max_burst, cpus))}",
        f"-DNPT_FLOW_TABLE_SIZE={cfg.flow_table_size}",
        f"-DNPT_WAKE_EVERY={wake}",
        f"-DNPT_FILTER_PORTS={1 if cfg.ports else 0}",
        f"-DNPT_FILTER_HOSTS={1 if cfg.hosts else 0}",
        f"-DNPT_FILTER_SVC={1 if cfg.service_gate else 0}",   # run --service (npt_common.h)
        f"-DNPT_FILTER_NETNS={1 if cfg.node_scope else 0}",   # one node of several (node/scope.py)
        f"-DNPT_WITH_TC={1 if cfg.ifaces or cfg.iface_auto else 0}",
        f"-DNPT_WITH_KPROBES={1 if cfg.kprobes else 0}",
        f"-DNPT_SNAPLEN={cfg.snaplen}",     # bpf/npt_packet.h: packet bytes for --pcap
        # bcc's borrowed headers warn about attributes clang does not know; the noise hides
        # real errors in the load log.
        "-Wno-ignored-attributes",
        "-Wno-unused-function",
    ]
    wanted = TRACEPOINTS if cfg.tracepoints is None else cfg.tracepoints
    for tp, macro in TRACEPOINTS.items():
        on = tp in wanted and (available_tracepoints is None or tp in available_tracepoints)
        flags.append(f"-D{macro}={1 if on else 0}")
    for tp, name, macro, until in TRACEPOINT_FIELDS:
        on = (not until) if fields is None else name in fields.get(tp, ())
        flags.append(f"-D{macro}={1 if on else 0}")
    flags.extend(offset_flags)
    return flags
