"""Labels for the kernel's cause keys (nptrace/kernel/causekeys.py): every record the kernel
sees is counted under a key, and each KEY is labeled here once, with the classifier's own rules
(rules.RULES through rules_for and rules.run_rules: the first match and the weak-drop fallback
correlate.py uses), on an event built from the key. So the per-cause counters are exact at any record rate and the
classifier stays the one source of truth; the records sent to user space only add evidence.

A key carries the flow's earlier causal record (prior_*, the kernel's flow_facts): the key's
cause is the better-ranked (verdict.PRIORITY) of its own label and that record's, as an
incident is named by its best label; when the prior is over a second older (prior_late: it
named an earlier incident) its strong cause wins, as the classifier keeps a flow's root cause. The prior is labeled with the key's own addresses (the
kernel keeps its type, hook, reason and SYN/ACK bits, not its tuple).

Pure: the node's lookups come through the Context, as for the classifier. Labels are cached
per key; `clear()` forgets them when the node's rules or names change (the counts keep
accruing: a relabel moves a key's later records, never what was already counted).
"""
from __future__ import annotations

from typing import NamedTuple

from nptrace.events import CtTuples, Dir, EvType, Event, Hook, IPS_DST_NAT, IPS_SRC_NAT
from nptrace.kernel.causekeys import CK_DNAT, CK_SNAT, CauseKey, encode_key, key_hash

from .rules import rules_for, run_rules
from .verdict import (EVIDENCE_ONLY, HOOKS, KIND, RANK, T_RST_RECV, T_RST_SENT, T_WIRE_RST,
                      WEAK_CAUSES, Context, reason_name)

DIRECTIONS = {T_RST_SENT: "sent", T_RST_RECV: "received", T_WIRE_RST: "forwarded"}
_TYPES = {int(m): m for m in EvType}
_HOOKS = {int(m): m for m in Hook}
_DIRS = {int(m): m for m in Dir}


class KeyLabel(NamedTuple):
    """What the counters and summary lines say about a key's records."""
    kind: str                 # rst | drop | anomaly
    cause: str
    direction: str | None     # resets: sent | received | forwarded
    iface: str | None
    service: str | None
    hook: str
    reason: str


def event_of(key: CauseKey, typ: int | None = None, hook: int | None = None,
             reason: int | None = None, tcpflags: int | None = None) -> Event:
    """An event the rules can read, from a key (optionally as another type/hook/reason: the
    flow's prior record). The client end's port is 0, its address unspecified where the
    kernel zeroed it."""
    t = key.type if typ is None else typ
    h = key.hook if hook is None else hook
    r = key.reason if reason is None else reason
    ct = None
    if key.flags & 0x01:            # F_HAS_CT
        status = (IPS_DST_NAT if key.ct_bits & CK_DNAT else 0) | \
            (IPS_SRC_NAT if key.ct_bits & CK_SNAT else 0)
        # the server end of the packet is the endpoint the reply comes from
        if key.dport == 0:          # the destination end is the client's
            cli, srv, sport = key.daddr, key.saddr, key.sport
        else:
            cli, srv, sport = key.saddr, key.daddr, key.dport
        odst, oport = (key.odst, key.oport) if key.ct_bits & CK_DNAT else (srv, sport)
        if key.ct_bits & CK_DNAT and (srv, sport) == (odst, oport):
            # the packet's server end is the frontend (the reply, translated back): the key
            # does not say which endpoint the connection went to
            srv, sport = "", 0
        ct = CtTuples(cli, 0, odst, oport, srv, sport, cli, 0, status)
    fl = key.tcpflags if tcpflags is None else tcpflags
    aux = fl if t == T_RST_SENT else 0
    tcpflags = 0 if t == T_RST_SENT else fl
    return tuple.__new__(Event, (
        0, _TYPES.get(t, t), _HOOKS.get(h, h), _DIRS.get(key.dir, key.dir), 0, key.ifindex,
        key.netns, r, key.saddr, key.sport, key.daddr, key.dport, key.family, 6, tcpflags, 0,
        key.flags, 0, aux, 0, 0, 0, 0, ct, None, None, 0, b""))


def label_event(ev: Event, ctx: Context) -> tuple[str | None, str]:
    """(cause or None for evidence only, reason name): the classifier's per-event label
    (correlate.Classifier.feed_many, `_label` inlined there)."""
    rname = reason_name(ev, ctx)
    t = int(ev.type)
    if t in EVIDENCE_ONLY:
        return None, rname
    return run_rules(ev, rname, [], ctx, rules_for(t, rname), t)[0], rname


def _service(ev: Event, ctx: Context) -> str | None:
    cands = [(ev.daddr, ev.dport), (ev.saddr, ev.sport)]
    if ev.ct is not None:
        cands[:0] = [(ev.ct.orig_dst, ev.ct.orig_dport), (ev.ct.reply_src, ev.ct.reply_sport)]
    for addr, port in cands:
        if port:
            s = ctx.service_of(addr, port)
            if s:
                return s
    return None


class KeyLabeler:
    """label(key) -> KeyLabel, or None for a key whose records are evidence only."""

    def __init__(self, ctx: Context | None = None, load_netns=None):
        self.ctx = ctx or Context()
        # netns inode -> None: the node's rules of that namespace read before its first key is
        # labeled (NodeKnowledge.rules), so a key is not named without a Service because no
        # record of its namespace has been labeled yet
        self.load_netns = load_netns
        self._loaded: set[int] = set()
        self.cache: dict[CauseKey, KeyLabel | None] = {}
        self.by_hash: dict[int, CauseKey] = {}     # key_hash -> key: the priors' own keys
        self.hashes: dict[CauseKey, int] = {}

    def register(self, keys) -> None:
        """Keys the kernel map holds (before labeling a read of it): a key's prior_key names
        one of them."""
        hashes, by_hash = self.hashes, self.by_hash
        for k in keys:
            if k is not None and k not in hashes:
                h = hashes[k] = key_hash(encode_key(k))
                by_hash[h] = k

    def unregister(self, keys) -> None:
        for k in keys:
            h = self.hashes.pop(k, None)
            if h is not None and self.by_hash.get(h) == k:
                del self.by_hash[h]

    def clear(self) -> None:
        self.cache.clear()

    def label(self, key: CauseKey) -> KeyLabel | None:
        try:
            return self.cache[key]
        except KeyError:
            pass
        got = self.cache[key] = self._label(key)
        return got

    def cause_of(self, key: CauseKey) -> tuple[str | None, str]:
        ctx = self.ctx
        ev = event_of(key)
        cause, rname = label_event(ev, ctx)
        if key.prior_type:
            pkey = self.by_hash.get(key.prior_key) if key.prior_key else None
            if pkey is not None and pkey != key and not pkey.prior_type:
                pcause, _ = label_event(event_of(pkey), ctx)    # by its own key: exact
            else:                    # its key is gone: its kind with this key's tuple
                pcause, _ = label_event(event_of(key, key.prior_type, key.prior_hook,
                                                 key.prior_reason, key.prior_tcpflags), ctx)
            if pcause is not None and (cause is None or RANK[pcause] < RANK[cause]
                                       or (key.prior_late and pcause not in WEAK_CAUSES)):
                cause = pcause
        return cause, rname

    def _label(self, key: CauseKey) -> KeyLabel | None:
        if self.load_netns is not None and key.netns not in self._loaded:
            self._loaded.add(key.netns)
            self.load_netns(key.netns)
        cause, rname = self.cause_of(key)
        if cause is None:
            return None
        ctx = self.ctx
        ev = event_of(key)
        iface = ctx.iface_name(key.netns, key.ifindex) if key.ifindex else None
        return KeyLabel(KIND.get(key.type, "drop"), cause, DIRECTIONS.get(key.type), iface,
                        _service(ev, ctx), HOOKS.get(key.hook, str(key.hook)),
                        rname)
