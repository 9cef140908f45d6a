"""Names for what the kernel reports as numbers: network namespace inodes and ifindexes.

Events carry the netns inode and the ifindex; a person wants `npt-node1` and `eth1`. Named
namespaces are the bind mounts under /run/netns (ip netns, CNI plugins); unnamed ones (container
runtimes) are found through /proc/<pid>/ns/net. Lookups are cached and refreshed on a miss at
most once per `refresh_s`, so a flood of events from an unknown netns costs one scan.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

RUN_NETNS = Path("/run/netns")


def inode_of(path: str | os.PathLike) -> int:
    return os.stat(path).st_ino


def host_inode() -> int:
    return inode_of("/proc/1/ns/net")


def named_namespaces() -> dict[int, str]:
    out = {}
    try:
        for p in RUN_NETNS.iterdir():
            try:
                out[inode_of(p)] = p.name
            except OSError:
                continue
    except OSError:
        pass
    return out


def _links(cmd: list[str]) -> dict[int, str]:
    try:
        r = subprocess.run(cmd + ["-j", "link", "show"], capture_output=True, text=True, timeout=5)
        return {int(l["ifindex"]): l["ifname"] for l in json.loads(r.stdout or "[]")}
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


class Names:
    def __init__(self, refresh_s: float = 2.0):
        self.refresh_s = refresh_s
        self._ns: dict[int, str] = {}
        self._links: dict[int, dict[int, str]] = {}
        self._last_scan: dict[int, float] = {}
        try:
            self.host = host_inode()
        except OSError:
            self.host = 0
        self._rescan_ns()

    def _rescan_ns(self) -> None:
        self._ns = named_namespaces()
        if self.host:
            self._ns.setdefault(self.host, "")

    def netns_name(self, inode: int) -> str | None:
        if inode not in self._ns:
            self._rescan_ns()
        name = self._ns.get(inode)
        return "host" if name == "" else name

    def _pid_in(self, inode: int) -> int | None:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.stat(d / "ns/net").st_ino == inode:
                        return int(d.name)
                except OSError:
                    continue
        return None

    def _load_links(self, inode: int) -> dict[int, str]:
        name = self._ns.get(inode)
        if name == "":
            return _links(["ip"])
        if name:
            return _links(["ip", "-n", name])
        pid = self._pid_in(inode)
        return _links(["nsenter", "-t", str(pid), "-n", "ip"]) if pid else {}

    def iface(self, netns: int, ifindex: int) -> str | None:
        links = self._links.get(netns)
        if links is None or ifindex not in links:
            now = time.monotonic()
            if now - self._last_scan.get(netns, 0.0) >= self.refresh_s or links is None:
                self._last_scan[netns] = now
                if netns not in self._ns:
                    self._rescan_ns()
                links = self._links[netns] = self._load_links(netns)
        name = links.get(ifindex) if links else None
        if name is None:
            return None
        ns = self._ns.get(netns)
        return f"{ns}/{name}" if ns else name
