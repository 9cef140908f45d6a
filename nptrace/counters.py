"""Exact counters from the kernel maps, and the ring buffer's loss accounting.

The BPF side counts every event in the per-CPU `counts` map BEFORE it tries the ring buffer
(npt_common.h npt_emit), so the counts stay exact when the ring is full and records are lost;
the `stats` array says how many records were emitted, lost (ring full) and filtered. For the
events that passed the filters:  sum(counts) == emitted + lost.

Everything here is pure, over the plain dicts loader.Probes.counts() and .stats() return
({(type, hook, reason, ifindex, netns): n}, {"emitted": n, "lost": n, "filtered": n}), so it
is unit-tested without bcc or root. Keys are named by nptrace.names (count-key form); names
for reasons come from the kernel's BTF tables (nptrace.reasons.load_tables); without a table a
reason shows as its number.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nptrace.names import count_reason, hook_id, type_name

# (type, hook, reason, ifindex, netns), the order loader.Probes.counts() uses
RawKey = tuple[int, int, int, int, int]


@dataclass(frozen=True, slots=True, order=True)
class CountKey:
    type: str     # EvType name, e.g. "RST_SENT"
    hook: str     # Hook name, e.g. "TCP_SEND_RST"
    reason: str   # drop/reset reason name, "icmp 3/3", or "" where the type has none
    ifindex: int
    netns: int


@dataclass(frozen=True)
class CounterSnapshot:
    counts: Mapping[CountKey, int] = field(default_factory=dict)
    emitted: int = 0    # records written to the ring buffer
    lost: int = 0       # records the ring buffer had no room for (the events are counted)
    filtered: int = 0   # events the in-kernel port/host filters rejected (not counted)
    sampled: int = 0    # counted, not sent: over --max-rate (the kernel's token bucket)

    @property
    def counted(self) -> int:
        return sum(self.counts.values())

    @property
    def unaccounted(self) -> int:
        """counted - (emitted + lost + sampled): 0 when read at rest. While events are in
        flight a snapshot can see a count whose ring outcome is not yet recorded (a few, per CPU)."""
        return self.counted - self.emitted - self.lost - self.sampled

    def total(self, **match) -> int:
        """Sum of counts whose key fields equal `match`, e.g. total(type="RST_SENT", netns=n)."""
        for k in match:
            if k not in CountKey.__slots__:
                raise TypeError(f"no count key field {k!r}")
        return sum(v for k, v in self.counts.items()
                   if all(getattr(k, f) == want for f, want in match.items()))

    def by(self, *fields: str) -> dict[tuple, int]:
        """Counts summed over the other key fields, e.g. by("type", "reason")."""
        out: dict[tuple, int] = {}
        for k, v in self.counts.items():
            kk = tuple(getattr(k, f) for f in fields)
            out[kk] = out.get(kk, 0) + v
        return out

    def nonzero(self) -> "CounterSnapshot":
        return CounterSnapshot({k: v for k, v in self.counts.items() if v},
                               self.emitted, self.lost, self.filtered)


def snapshot(counts: Mapping[RawKey, int], stats: Mapping[str, int],
             drops=None, resets=None) -> CounterSnapshot:
    """From Probes.counts() and Probes.stats(). Raw keys differing only in a reason value
    that has no name in the tables stay apart (REASON_<n>)."""
    out: dict[CountKey, int] = {}
    for (typ, hook, reason, ifindex, netns), n in counts.items():
        k = CountKey(type_name(typ), hook_id(hook), count_reason(typ, reason, drops, resets),
                     int(ifindex), int(netns))
        out[k] = out.get(k, 0) + int(n)
    return CounterSnapshot(out, int(stats.get("emitted", 0)), int(stats.get("lost", 0)),
                           int(stats.get("filtered", 0)), int(stats.get("sampled", 0)))


def _sub(new: int, old: int) -> int:
    # The kernel counters only grow; a smaller value means the map was recreated (a restart
    # of the probes): count from zero again rather than report a negative rate.
    return new - old if new >= old else new


def delta(old: CounterSnapshot, new: CounterSnapshot) -> CounterSnapshot:
    """What happened between two snapshots; keys that did not move are left out."""
    counts = {}
    for k, v in new.counts.items():
        d = _sub(v, old.counts.get(k, 0))
        if d:
            counts[k] = d
    return CounterSnapshot(counts, _sub(new.emitted, old.emitted), _sub(new.lost, old.lost),
                           _sub(new.filtered, old.filtered), _sub(new.sampled, old.sampled))


def merge(snaps: Iterable[CounterSnapshot]) -> CounterSnapshot:
    """Sum of snapshots (e.g. successive deltas)."""
    counts: dict[CountKey, int] = {}
    em = lo = fi = sa = 0
    for s in snaps:
        for k, v in s.counts.items():
            counts[k] = counts.get(k, 0) + v
        em, lo, fi, sa = em + s.emitted, lo + s.lost, fi + s.filtered, sa + s.sampled
    return CounterSnapshot(counts, em, lo, fi, sa)


def loss_line(d: CounterSnapshot) -> str | None:
    """One stderr line when records were lost in a delta (STYLE.md: lost events go to stderr
    and to nptrace_events_lost_total), None otherwise."""
    if not d.lost:
        return None
    total = d.emitted + d.lost
    return (f"nptrace: lost {d.lost} of {total} event records (ring buffer full); the counters "
            f"still have every event: raise --ring-pages or narrow the filters")
