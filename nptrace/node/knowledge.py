"""What the live classifier may ask about the node: kube-proxy services and netfilter rules per
network namespace, and which interface a route leaves by. Each answer is cached and refreshed
on a timer, so the per-event cost is a dict lookup; the I/O (iptables-save, nft, ip route)
happens at most once per `refresh_s` per namespace.

The classifier only sees plain callables built from this (classify.Context), so the same
classifier runs over recorded sessions with the rules the recording kept.
"""
from __future__ import annotations

import subprocess
import time

from nptrace.kernel import nsenter
from nptrace.node.netns import Names
from nptrace.services import nf_cause


ROUTE_LOOKUPS_PER_S = 20
MAX_NAMESPACES = 1024    # namespaces whose ServiceMap is kept (each a few hundred kB at most)


class NodeKnowledge:
    def __init__(self, names: Names, refresh_s: float = 10.0, clock=time.monotonic):
        self.names = names
        self.refresh_s = refresh_s
        self.clock = clock
        self._maps: dict[int, tuple[float, object | None]] = {}
        self._routes: dict[tuple[int, str], tuple[float, str | None]] = {}
        self.errors: dict[int, str] = {}
        self._route_window = 0.0
        self._route_budget = ROUTE_LOOKUPS_PER_S
        self._ct: dict[int, tuple[float, dict | None]] = {}
        self._ct_drop: dict[int, int] = {}

    # -- netfilter rules ---------------------------------------------------------------
    def _netns_arg(self, inode: int) -> str | None | bool:
        """The `ip netns` name, None for the host namespace, False when unknown."""
        name = self.names.netns_name(inode)
        if name is None:
            return False
        return None if name == "host" else name

    def rules(self, inode: int):
        now = self.clock()
        hit = self._maps.get(inode)
        if hit is not None and now - hit[0] < self.refresh_s:
            return hit[1]
        ns = self._netns_arg(inode)
        smap = None
        if ns is not False:
            try:
                from nptrace.node.rules_source import load_service_map, local_addresses
                smap = load_service_map(ns)
                # the namespace's own addresses: which filter hook a packet crossed (INPUT or
                # FORWARD) and whether `--src/--dst-type LOCAL` matches
                addrs = local_addresses(ns)
                if addrs:
                    smap = smap.with_local_addrs(addrs)
                self.errors.pop(inode, None)
            except Exception as e:   # no rules readable: the classifier says so in its hint
                self.errors[inode] = str(e).splitlines()[0] if str(e) else type(e).__name__
        while len(self._maps) >= MAX_NAMESPACES:         # pod churn: oldest first
            old = next(iter(self._maps))
            del self._maps[old]
            self.errors.pop(old, None)
        self._maps.pop(inode, None)                      # re-inserted last: oldest stays first
        self._maps[inode] = (now, smap)
        return smap

    def prune(self, alive) -> int:
        """Forget the rules and routes of namespaces not in `alive` (netns.live_namespaces()):
        a deleted pod's namespace must not keep its ServiceMap. Returns how many went."""
        gone = [i for i in self._maps if i not in alive]
        for i in gone:
            del self._maps[i]
        for i in [i for i in self.errors if i not in alive]:
            del self.errors[i]
        for k in [k for k in self._routes if k[0] not in alive]:
            del self._routes[k]
        return len(gone)

    def nf_rule(self, inode: int, saddr: str, daddr: str, dport: int, odst: str, oport: int,
                syn: bool, has_ct: bool) -> dict | None:
        """Context.nf_rule: services.nf_cause on this namespace's rules (plain data,
        recordable for replay), None when no ruleset is readable. A connection's first packet
        dropped without a conntrack entry also gets the namespace's conntrack table at that
        moment (``ct_count``, ``ct_max``, ``ct_drop``: conntrack's own drop counter,
        ``ct_drop_new``: its increase since the previous reading): conntrack drops a new
        connection when the table is full, before any rule."""
        smap = self.rules(inode)
        ct = self.conntrack_table(inode) if syn and not has_ct else None
        if smap is None:
            if ct is None:
                return None
            got = {"tag": None, "no_ruleset": True}  # the classifier still sees the table
        else:
            got = nf_cause(smap, saddr, daddr, dport, odst, oport, syn, has_ct)
        if ct is not None:
            got = {**got, **ct}
        return got

    def conntrack_table(self, inode: int) -> dict | None:
        """{ct_count, ct_max, ct_drop, ct_drop_new} of a namespace, read at most every 0.1 s."""
        now = self.clock()
        hit = self._ct.get(inode)
        if hit is not None and now - hit[0] < 0.1:
            return hit[1]
        ns = self._netns_arg(inode)
        got = None
        if ns is not False:
            try:
                vals = nsenter.run_in(nsenter.path_of(ns), _read_conntrack, "npt-ct")
            except OSError:
                vals = None
            if vals is not None:
                count, cmax, drop = vals
                last = self._ct_drop.get(inode)
                self._ct_drop[inode] = drop
                got = {"ct_count": count, "ct_max": cmax, "ct_drop": drop,
                       "ct_drop_new": max(0, drop - last) if last is not None else 0}
        self._ct[inode] = (now, got)
        return got

    def preload(self, inodes) -> None:
        for i in inodes:
            self.rules(i)

    def _lookup(self, addr: str, port: int, kind: str | None = None) -> str | None:
        for _, smap in self._maps.values():
            if smap is None:
                continue
            try:
                s = smap.lookup(addr, port)
            except Exception:
                continue
            if s is not None and (kind is None or s.kind == kind):
                return s.name
        return None

    def service_of(self, addr: str, port: int) -> str | None:
        return self._lookup(addr, port)

    def endpoint_of(self, addr: str, port: int) -> str | None:
        return self._lookup(addr, port, "endpoint")

    # -- routes ------------------------------------------------------------------------
    def route_iface(self, inode: int, addr: str) -> str | None:
        now = self.clock()
        key = (inode, addr)
        hit = self._routes.get(key)
        if hit is not None and now - hit[0] < self.refresh_s:
            return hit[1]
        ns = self._netns_arg(inode)
        dev = None
        # A flood of distinct (spoofed) sources must not fork `ip` per event: a few a second.
        if now - self._route_window >= 1.0:
            self._route_window, self._route_budget = now, ROUTE_LOOKUPS_PER_S
        if self._route_budget <= 0:
            return None
        self._route_budget -= 1
        if ns is not False:
            cmd = (["ip", "-n", ns] if ns else ["ip"]) + ["-o", "route", "get", addr]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=3).stdout.split()
                if "dev" in out:
                    dev = out[out.index("dev") + 1]
            except (OSError, subprocess.TimeoutExpired):
                pass
        if len(self._routes) > 4096:
            self._routes.clear()
        self._routes[key] = (now, dev)
        return dev


def _read_conntrack() -> tuple[int, int, int] | None:
    """(count, max, drop) of the calling thread's network namespace. /proc/sys/net follows the
    thread's namespace, /proc/net the process's: hence /proc/thread-self/net."""
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_count") as f:
            count = int(f.read())
        with open("/proc/sys/net/netfilter/nf_conntrack_max") as f:
            cmax = int(f.read())
    except (OSError, ValueError):
        return None
    return count, cmax, conntrack_drops("/proc/thread-self/net/stat/nf_conntrack") or 0


def conntrack_drops(path) -> int | None:
    """The sum over CPUs of the ``drop`` column of /proc/net/stat/nf_conntrack (hex): new
    connections conntrack dropped because the table was full and nothing could be evicted."""
    try:
        with open(path) as f:
            head, *rows = f.read().split("\n")
    except OSError:
        return None
    cols = head.split()
    if "drop" not in cols:
        return None
    i = cols.index("drop")
    return sum(int(r.split()[i], 16) for r in rows if len(r.split()) > i)
