"""The Context lookup answers a session holds, per lookup, bounded (LookupTables): the
recorder's, and replay's from a session's header and lookup records.

Lookup answers are bounded (LOOKUP_CACHE per lookup, oldest written first out), so a scanner's
ever-new client tuples cannot grow the recorder: an answer is written again when it was
forgotten, and replay keeps twice as many, so it always holds what the recorder assumed.
"""
from __future__ import annotations

from collections import OrderedDict

# Lookup answers the recorder keeps per lookup (and repeats in each rotated file's header):
# keyed by client addresses, they would otherwise grow forever (2M distinct client tuples
# measured +440 MB). Replay keeps REPLAY_FACTOR times as many (see LookupTables).
LOOKUP_CACHE = 4096
REPLAY_FACTOR = 2


class LookupTables:
    """The answers a session holds, per lookup: {name: {key: value}}, bounded.

    An absent key means the answer None (replay answers None for what it was never told), so
    None answers of unknown keys are never stored or written. Each table keeps its newest
    `cap` written answers; the oldest go when an event is written (trim(), between two
    events' lookups, so a span of lookups for one event never loses what it just used).

    The recorder's tables hold `cap`, replay's REPLAY_FACTOR * cap: both apply the same writes
    in the same order, so replay's hold everything the recorder's do, whenever replay asks
    (also for flows a live tick reported between two events). A key the recorder forgot
    but replay may still hold is kept in `ghost` (keys only): its None answer is written, so
    replay forgets it too.
    """

    def __init__(self, cap: int | None, ghost: bool = False):
        self.cap = cap                       # None: unbounded (sessions of older writers)
        self.tabs: dict[str, OrderedDict] = {}
        self.ghosts: dict[str, OrderedDict] | None = {} if ghost else None

    def get(self, name: str, key, default=None):
        tab = self.tabs.get(name)
        return default if tab is None else tab.get(key, default)

    def table(self, name: str) -> OrderedDict:
        tab = self.tabs.get(name)
        if tab is None:
            tab = self.tabs[name] = OrderedDict()
        return tab

    def needs_write(self, name: str, key, value) -> bool:
        """Does the answer differ from what a replay of the session would answer?"""
        tab = self.tabs.get(name)
        if tab is not None and key in tab:
            return tab[key] != value
        if value is not None:
            return True
        g = self.ghosts.get(name) if self.ghosts is not None else None
        return g is not None and key in g

    def put(self, name: str, key, value) -> None:
        tab = self.table(name)
        if value is None:
            tab.pop(key, None)
        else:
            tab[key] = value
            tab.move_to_end(key)
        if self.ghosts is not None and name in self.ghosts:
            self.ghosts[name].pop(key, None)

    def trim(self) -> None:
        if self.cap is None:
            return
        for name, tab in self.tabs.items():
            if len(tab) <= self.cap:
                continue
            g = None
            if self.ghosts is not None:
                g = self.ghosts.setdefault(name, OrderedDict())
            while len(tab) > self.cap:
                k, _v = tab.popitem(last=False)
                if g is not None:
                    g[k] = None
            if g is not None:
                while len(g) > self.cap * (REPLAY_FACTOR - 1):
                    g.popitem(last=False)

    def replace(self, name: str, rows) -> None:
        """A header's copy of one table (in its order) becomes the table."""
        tab = self.tabs[name] = OrderedDict()
        for k, v in rows:
            if v is not None:
                tab[k] = v

    def merge(self, name: str, rows) -> None:
        tab = self.table(name)
        for k, v in rows:
            tab[k] = v

    def size(self) -> int:
        return sum(len(t) for t in self.tabs.values())


# Table names of the two lookups that have record kinds of their own (names, services).
IFACE, SERVICE = "iface_name", "service_of"


def ifnames_rows(ifnames: dict) -> list:
    """{netns: {ifindex: name}} as table rows ((netns, ifindex), name), in its order."""
    return [((int(ns), int(i)), n) for ns, m in ifnames.items() for i, n in m.items()]
