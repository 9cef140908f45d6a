"""A lab's address plan moved to another slot, so that several labs can be up at once under
one tracer and each stays its own cluster.

A tracer answers "which Service has this address" over every namespace whose rules it read,
as on a node where pod and Service addresses are unique in the cluster. Labs up together
under one address plan break that: one lab's removed endpoint is another's live one, and the
tracer labels the first with the second's rules. Slot N (0 is the plan as written, 1..SLOTS-1
others) moves every address the scenario data names by N in one octet of its private range,
its IPv6 twin's ``fd00::/16`` to ``fd00+N``: 10.244.0.10 -> 10.245.0.10, 10.96.0.80 ->
10.97.0.80, 172.16.21.11 -> 172.17.21.11, 192.168.10.11 -> 192.168.11.11, fd00:244::a ->
fd01:244::a. The move is applied to the raw scenario and topology data before anything is
derived from them, so addresses, prefixes, routes, rules text, triggers, steps and hints move
together; a prefix wider than the moved octet (192.168.0.0/16) covers every slot and stays.
"""
from __future__ import annotations

import ipaddress
import re

from .errors import UsageError

SLOTS = 8
# private IPv4 range -> (the octet that moves, the highest value it may reach)
_MOVES = ((ipaddress.ip_network("10.0.0.0/8"), 1, 255),
          (ipaddress.ip_network("172.16.0.0/12"), 1, 31),
          (ipaddress.ip_network("192.168.0.0/16"), 2, 255))
_V4 = re.compile(r"(?<![\w.:])(\d{1,3}(?:\.\d{1,3}){3})(/\d{1,2})?(?![\w.])")
_V6 = re.compile(r"(?<![\w:])fd00:", re.IGNORECASE)


def check(slot: int) -> int:
    if not isinstance(slot, int) or not 0 <= slot < SLOTS:
        raise UsageError(f"lab slot must be 0 to {SLOTS - 1}, got {slot!r}")
    return slot


def move_v4(addr: str, plen: str, slot: int) -> str:
    """``addr`` (with ``plen``, "/N" or "") in slot ``slot``."""
    ip = ipaddress.ip_address(addr)
    for net, octet, top in _MOVES:
        if ip not in net or (plen and int(plen[1:]) < 8 * (octet + 1)):
            continue
        parts = [int(p) for p in addr.split(".")]
        parts[octet] += slot
        if parts[octet] > top:
            raise UsageError(f"{addr}{plen} has no place in lab slot {slot}")
        return ".".join(map(str, parts)) + plen
    return addr + plen


def move_text(text: str, slot: int) -> str:
    """Every address token of ``text`` in slot ``slot``."""
    if not slot:
        return text
    text = _V4.sub(lambda m: move_v4(m.group(1), m.group(2) or "", slot), text)
    return _V6.sub(f"fd{slot:02x}:", text)


def move(data, slot: int):
    """A copy of scenario or topology data (TOML tables: dicts, lists, strings, numbers) with
    every address in its strings and table keys in slot ``slot``."""
    if not check(slot):
        return data
    if isinstance(data, dict):
        return {move_text(k, slot) if isinstance(k, str) else k: move(v, slot)
                for k, v in data.items()}
    if isinstance(data, list):
        return [move(v, slot) for v in data]
    if isinstance(data, str):
        return move_text(data, slot)
    return data
