"""An event's own label (the first RULES match, correlate.Classifier.feed_many), remembered by
the values the rules read for it (caching per key).

A reset storm repeats one label: every record has the same type, reason, flags and server end,
and only the client's address and port, the time and the skb differ. The rules read a handful
of fields and name the client nowhere, so the label is a function of those few values. Which
ones is not declared but observed: on a miss the rules run on a traced copy of the event (every
field read through its name is noted, every other access taints the run), with a traced
Context and history (any use taints it). A run that read fields F and nothing else gives the
same label for every event with the same values of F (the rules are pure functions of the
event, the reason name, the history and the Context: with equal values read, the same branches
are taken), so its label is kept under (type, reason name) -> the values of F. A run that read
another field of the same key's events than an earlier one (another branch) gets a node of its
own below (a small decision tree), and a run that asked the Context or the history is never
kept: such events (rp_filter's route, netfilter's rule, a lost state's endpoint) go through
the rules every time, as before. The memo holds no answer of the node's lookups, so a change
of rules or names never makes it stale; it is bounded (cleared when full).

What it saves: a storm's record costs one dict look-up on (type, reason name) and one on a
tuple of ~5 values taken with operator.itemgetter, instead of 2-4 rule calls: ~1.2 us a record
on the lab VM (pipeline bench in CPU time, memo off -> on: single 105k -> 121k records/s, mix
138k -> 152k). Misses cost a traced run (~10x a plain one) once per new value tuple.

Caveat: the traced run gets a copy of the history, so a rule that changed it would change the
copy (it taints the run all the same); rules only read their arguments.
"""
from __future__ import annotations

from operator import itemgetter

from nptrace.events import Event

from .rules import run_rules

NO_MEMO = object()        # a value tuple whose rules asked the Context or the history
MAX_ENTRIES = 4096        # value tuples kept, all keys together; then the memo starts anew
_TAINT = -1
_READS: list[int] = []    # field indexes a traced run read (_TAINT: something else)
_FIELD = {name: i for i, name in enumerate(Event._fields)}
# properties read other fields through the event's own names: those reads are noted
_PROPS = frozenset(n for n, a in vars(Event).items() if isinstance(a, property))
_get = tuple.__getattribute__
_new = tuple.__new__


class _Traced(Event):
    """The event, noting what is read of it."""
    __slots__ = ()

    def __getattribute__(self, name):
        i = _FIELD.get(name)
        if i is not None:
            _READS.append(i)
        elif name not in _PROPS:
            _READS.append(_TAINT)
        return _get(self, name)


def _tainting(cls, name):
    base = getattr(cls, name)

    def method(self, *args):
        _READS.append(_TAINT)
        return base(self, *args)
    return method


# whatever reads the event or the history other than by a field's name (indexing, iteration,
# comparison, printing) taints the run
for _n in ("__getitem__", "__iter__", "__len__", "__contains__", "__eq__", "__ne__", "__lt__",
           "__le__", "__gt__", "__ge__", "__hash__", "__repr__", "__str__", "__format__",
           "__reduce__", "__reduce_ex__", "__getnewargs__"):
    setattr(_Traced, _n, _tainting(Event, _n))


class _TracedList(list):
    """The flow's history: any use taints."""
    __slots__ = ()

    def __getattribute__(self, name):
        _READS.append(_TAINT)
        return list.__getattribute__(self, name)


for _n in ("__getitem__", "__iter__", "__len__", "__contains__", "__reversed__", "__eq__",
           "__ne__", "__repr__", "__str__", "__format__"):
    setattr(_TracedList, _n, _tainting(list, _n))


class _TracedCtx:
    """The Context: any look-up taints (its answers are the node's, not the event's)."""
    __slots__ = ("_ctx",)

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)

    def __getattr__(self, name):
        _READS.append(_TAINT)
        return getattr(object.__getattribute__(self, "_ctx"), name)


def _no_fields(_ev) -> tuple:
    return ()


def _getter(idx: tuple):
    return itemgetter(*idx) if idx else _no_fields


def _node(idx: tuple) -> list:
    """[values getter, the fields read in order, {values: label | NO_MEMO | node}, shorts]:
    shorts holds (getter, fields, {values: ...}) of runs that read only a first part of those fields
    (another branch that stopped sooner), so their label is not kept per value of the rest."""
    return [_getter(idx), idx, {}, []]


class LabelMemo:
    """roots: (type, reason name) -> node. Classifier.feed_many walks it inline (the hit path);
    label() is the rest: a miss (traced run, kept) or a NO_MEMO value (a plain run).

    Why a node's label is exact: with the type and reason name fixed, the rules first read
    the same field; which field they read next depends only on the values read so far. So
    every event that has a kept run's values on the fields that run read, in that order, takes
    the same branches and ends with the same label."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.roots: dict[tuple, list] = {}
        self.entries = 0
        self.max_entries = max_entries
        self.misses = 0

    def label(self, ev: Event, rname: str, pending, ctx, rules, t: int, node, key, val) -> tuple:
        """The label of ev when the walk found no kept one: node/key are where it stopped
        (node None: no root for (t, rname) yet), val what it found there (None or NO_MEMO)."""
        if val is NO_MEMO:
            return run_rules(ev, rname, pending, ctx, rules, t)
        self.misses += 1
        reads = _READS
        reads.clear()
        try:
            got = run_rules(_new(_Traced, ev), rname, _TracedList(pending), _TracedCtx(ctx),
                            rules, t)
        finally:
            seen = reads[:]
            reads.clear()
        keep = NO_MEMO if _TAINT in seen else got
        seq = tuple(dict.fromkeys(i for i in seen if i != _TAINT))    # first reads, in order
        if self.entries >= self.max_entries:
            self.roots.clear()
            self.entries = 0
            node = None
        try:
            self._keep(ev, t, rname, node, key, seq, keep)
        except TypeError:            # an unhashable value: not kept
            pass
        return got

    def _keep(self, ev, t, rname, node, key, seq, keep) -> None:
        self.entries += 1
        if node is None:
            node = self.roots[(t, rname)] = _node(seq)
            node[2][node[0](ev)] = keep
            return
        idx = node[1]
        if seq == idx:
            node[2][key] = keep
        elif len(seq) < len(idx) and idx[:len(seq)] == seq:
            for getter, fields, table in node[3]:
                if fields == seq:
                    break
            else:
                getter, table = _getter(seq), {}
                node[3].append((getter, seq, table))
            table[getter(ev)] = keep
        else:                        # read further, or another branch: a node below
            child = node[2][key] = _node(seq)
            child[2][child[0](ev)] = keep

