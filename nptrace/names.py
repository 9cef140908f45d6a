"""The one namer of hooks, event types and reasons: every output that prints one asks here.

Two forms exist, because both are published contracts:
  * labels, for people and dashboards (Verdict.hook and .reason, JSON lines, the Prometheus
    `hook`/`type`/`reason` labels, the session report): hook "skb:kfree_skb", type "RST_SENT",
    reason "NO_SOCKET" or "ICMP_3_3"; a value this nptrace does not know is "hook_<n>" /
    "TYPE_<n>";
  * count keys (counters.CountKey, the Python API of the kernel's exact counts): hook by its
    enum name "KFREE_SKB" ("HOOK_<n>"), reason "icmp 3/3", a bare number where no reason table
    is given, "" where the type carries no reason.

What `reason` means depends on the event type (bpf/nptrace_events.h, struct npt_event): a drop
reason (enum skb_drop_reason), a reset reason (enum sk_rst_reason), ICMP type << 8 | code.
The names of the two kernel enums come from BTF (nptrace.reasons), passed in as callables.
Pure and cheap: dict lookups on plain ints, no Enum calls (the JSON sink names every evidence).
"""
from __future__ import annotations

from typing import Callable

from nptrace.events import HOOK_NAMES, EvType, Hook

HOOKS = {int(h): n for h, n in HOOK_NAMES.items()}   # int -> "skb:kfree_skb"
TYPES = {int(t): t.name for t in EvType}              # int -> "RST_SENT"
HOOK_IDS = {int(h): h.name for h in Hook}             # int -> "KFREE_SKB"
_DROP, _RST_SENT = int(EvType.DROP), int(EvType.RST_SENT)
_ICMP = frozenset({int(EvType.ICMP_UNREACH), int(EvType.WIRE_ICMP)})


def hook_name(hook: int) -> str:
    return HOOKS.get(hook) or f"hook_{hook}"


def type_name(typ: int) -> str:
    return TYPES.get(typ) or f"TYPE_{typ}"


def reason_name(typ: int, reason: int, drop_name: Callable[[int], str],
                rst_name: Callable[[int], str]) -> str:
    """The reason label of an event or count key; types without a reason are named by type."""
    if typ == _DROP:
        return drop_name(reason)
    if typ == _RST_SENT:
        return rst_name(reason)
    if typ in _ICMP:
        return f"ICMP_{reason >> 8}_{reason & 0xff}"
    return type_name(typ)


# -- count keys (counters.CountKey) -------------------------------------------------------
def hook_id(hook: int) -> str:
    return HOOK_IDS.get(hook) or f"HOOK_{hook}"


def count_reason(typ: int, reason: int, drops=None, resets=None) -> str:
    """A count key's reason: the name from a reasons.ReasonTable when one is given."""
    if typ == _DROP:
        return drops.name(reason) if drops is not None else str(reason)
    if typ == _RST_SENT:
        return resets.name(reason) if resets is not None else str(reason)
    if typ in _ICMP:
        return f"icmp {reason >> 8}/{reason & 0xFF}"
    return str(reason) if reason else ""
