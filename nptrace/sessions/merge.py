"""`merge`: sessions of several nodes interleaved by wall time (each node's CLOCK_MONOTONIC
stamps plus that node's epoch_offset_ns; so only as aligned as the nodes' clocks, NTP keeps
that in milliseconds). A connection that crossed nodes (client -> NodePort on node A, DNAT +
SNAT to a pod on node B) is one story: verdicts are joined when they share a direction-free
4-tuple or a conntrack tuple within the classifier's window."""
from __future__ import annotations

import os
from collections import defaultdict
from heapq import merge as heap_merge
from pathlib import Path
from typing import Iterator, NamedTuple

from nptrace.classify import Verdict, flow_keys
from nptrace.sessions.header import SessionError, session_files
from nptrace.sessions.reader import read_header
from nptrace.sessions.replay import Item, Replay, settle


class Merged(NamedTuple):
    item: Item
    story: int          # the same number for every verdict of one connection, across nodes

    @property
    def verdict(self) -> Verdict:
        return self.item.verdict

    @property
    def node(self) -> str:
        return self.item.node


def _keys(v: Verdict) -> list[tuple]:
    return flow_keys(v.event)


def _by_node(paths) -> dict[str, list[str]]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    groups: dict[str, list[str]] = defaultdict(list)
    for p in map(str, paths):
        if os.path.isdir(p):
            files = [str(f) for f in session_files(Path(p))]
            if not files:
                raise SessionError(f"{p}: no session files (nptrace-*.nps) in this directory")
        elif os.path.exists(p):
            files = [p]
        else:
            raise SessionError(f"{p}: no such file or directory")
        for f in files:
            try:
                node = read_header(f).get("node", "?")
            except SessionError:
                if len(files) == 1 and not os.path.isdir(p):
                    raise
                node = "?"   # read_session reports it
            groups[node].append(f)
    return dict(groups)


def _merged_items(groups: dict[str, list[str]], problems: list) -> Iterator[Item]:
    replays = [Replay(files) for _, files in sorted(groups.items())]
    streams = [r.items() for r in replays]
    yield from heap_merge(*streams, key=lambda it: it.epoch_ns)
    for r in replays:
        problems.extend(r.problems)


def merge(paths, problems: list | None = None, window_s: float = 30.0) -> Iterator[Merged]:
    """Verdicts of several nodes' sessions in wall-clock order, each with a story number.
    Two passes over the files (bounded memory: one int per verdict), because a later verdict
    can join two stories that earlier ones started apart."""
    groups = _by_node(paths)
    window = int(window_s * 1e9)
    parent: list[int] = []

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    seen: dict[tuple, tuple[int, int]] = {}   # key -> (story, last epoch ns)
    ids: list[int] = []
    for it in _merged_items(groups, []):
        roots = set()
        for k in _keys(it.verdict):
            got = seen.get(k)
            if got is not None and it.epoch_ns - got[1] <= window:
                roots.add(find(got[0]))
        if roots:
            sid = min(roots)
            for r_ in roots:
                parent[r_] = sid
        else:
            sid = len(parent)
            parent.append(sid)
        for k in _keys(it.verdict):
            seen[k] = (sid, it.epoch_ns)
        if len(seen) > 1_000_000:   # forget keys older than the window
            seen = {k: s for k, s in seen.items() if it.epoch_ns - s[1] <= window}
        ids.append(sid)
    # The last item holds its file's header (every lookup table of it): let it go before the
    # second pass reads that header again, or a big header is held twice.
    it = None
    number: dict[int, int] = {}
    found: list = []
    for it, sid in zip(_merged_items(groups, found), ids):
        root = find(sid)
        n = number.setdefault(root, len(number) + 1)
        yield Merged(it, n)
    settle(found, problems)
