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

from nptrace.node.netns import Names
from nptrace.services import nf_cause


ROUTE_LOOKUPS_PER_S = 20


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
        self._maps[inode] = (now, smap)
        return smap

    def nf_rule(self, inode: int, saddr: str, daddr: str, dport: int, odst: str, oport: int,
                syn: bool, has_ct: bool) -> dict | None:
        """Context.nf_rule: services.nf_cause on this namespace's rules (plain data,
        recordable for replay), None when no ruleset is readable."""
        smap = self.rules(inode)
        if smap is None:
            return None
        return nf_cause(smap, saddr, daddr, dport, odst, oport, syn, has_ct)

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
