"""Pods on this node, from what the node alone shows: the container runtime (crictl).

`resolve(ns, name)`: `--pod NS/NAME` -> the pod's addresses, for filters. `node_pods()`: every
ready pod sandbox's addresses -> "ns/name", for naming. Both are empty when crictl is missing
or knows no pod. `PodNames` answers "which pod is this address" from the Kubernetes API when
nptrace runs in a cluster (node/kubeapi.py: a node-scoped watch), else from crictl, refreshed
in a background thread: a lookup never waits for either.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from typing import Callable

CRICTL_REFRESH_S = 30.0
MAX_NAMESPACES = 1024     # namespaces matched to pods by address per refresh


def _inspectp(pid: str) -> dict:
    return json.loads(subprocess.run(["crictl", "inspectp", pid], capture_output=True,
                                     text=True, timeout=10).stdout or "{}")


def sandbox_ips(d: dict) -> list[str]:
    """A `crictl inspectp` document's pod addresses."""
    net = d.get("status", {}).get("network", {})
    return [a for a in [net.get("ip"), *(x.get("ip") for x in net.get("additionalIps", []))] if a]


def sandbox_netns(d: dict) -> str | None:
    """A `crictl inspectp` document's network-namespace path (containerd and CRI-O give the
    OCI runtime spec under info: /var/run/netns/cni-...), None for hostNetwork or unknown."""
    spec = (d.get("info") or {}).get("runtimeSpec") or {}
    for ns in (spec.get("linux") or {}).get("namespaces") or []:
        if ns.get("type") == "network" and ns.get("path"):
            return ns["path"]
    return None


def _sandbox_ips(pid: str) -> list[str]:
    return sandbox_ips(_inspectp(pid))


def resolve(namespace: str, name: str) -> list[str]:
    if shutil.which("crictl") is None:
        return []
    try:
        ids = subprocess.run(["crictl", "pods", "--namespace", namespace, "--name", f"^{name}$",
                              "-q"], capture_output=True, text=True, timeout=10).stdout.split()
        out = []
        for pid in ids:
            out += _sandbox_ips(pid)
        return out
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return []


def node_pods(netns: dict[int, str] | None = None) -> dict[str, str]:
    """{address: "ns/name"} of the node's ready pod sandboxes (hostNetwork ones have none);
    with `netns`, also fills it with {namespace inode: "ns/name"} from the same inspectp."""
    if shutil.which("crictl") is None:
        return {}
    try:
        doc = json.loads(subprocess.run(["crictl", "pods", "--state", "ready", "-o", "json"],
                                        capture_output=True, text=True, timeout=10).stdout or "{}")
        out = {}
        for it in doc.get("items") or []:
            m = it.get("metadata") or {}
            d = _inspectp(it["id"])
            pod = f"{m.get('namespace', '')}/{m.get('name', '')}"
            for ip in sandbox_ips(d):
                out[ip] = pod
            path = sandbox_netns(d) if netns is not None else None
            if path:
                try:
                    netns[os.stat(path).st_ino] = pod
                except OSError:
                    pass
        return out
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError):
        return {}


def netns_pods_by_address(pod_of: Callable[[str], str | None],
                          namespaces: Callable[[], dict[int, str]],
                          addresses: Callable[[str], tuple]) -> dict[int, str]:
    """{namespace inode: "ns/name"}: the pod that has one of a named namespace's addresses
    (for the API source, which knows addresses, not namespaces)."""
    out = {}
    for inode, name in list(namespaces().items())[:MAX_NAMESPACES]:
        for a in addresses(name):
            pod = pod_of(a)
            if pod is not None:
                out[inode] = pod
                break
    return out


class PodNames:
    """pod_of(addr) and pod_of_netns(inode) -> "ns/name" or None, from the cache only.
    Sources: the API watch (`api`, a node/kubeapi.py ApiConfig) when given, else crictl every
    CRICTL_REFRESH_S. Namespaces: crictl's netns paths; with the API, every CRICTL_REFRESH_S
    the named namespaces (/run/netns, where CNI plugins put pods') whose address a pod has."""

    def __init__(self, node: str, api=None, log: Callable[[str], None] = lambda m: None,
                 refresh_s: float = CRICTL_REFRESH_S, crictl: Callable[..., dict] = node_pods,
                 namespaces: Callable[[], dict[int, str]] | None = None,
                 addresses: Callable[[str], tuple] | None = None):
        self.watch = None
        self.local: dict[str, str] = {}
        self.netns: dict[int, str] = {}
        self._namespaces, self._addresses = namespaces, addresses
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self._thread = None
        self.source = "none"
        if api is not None:
            from nptrace.node.kubeapi import PodWatch
            self.watch = PodWatch(api, node, log=log, services=True)
            self.source = f"kubernetes API {api.base} (pods of node {node})"
        elif shutil.which("crictl") is not None or crictl is not node_pods:
            self._crictl = crictl
            self.source = "crictl (this node's pod sandboxes)"

    def start(self) -> "PodNames":
        if self.watch is not None:
            from nptrace.node.rules_source import set_api_names
            self.watch.start()
            set_api_names(self.watch.service_names)   # IPVS virtual servers' Service names
            target, name = self._refresh_netns, "nptrace-netns-pods"
        elif self.source.startswith("crictl"):
            target, name = self._refresh, "nptrace-crictl-pods"
        else:
            return self
        self._thread = threading.Thread(target=target, daemon=True, name=name)
        self._thread.start()
        return self

    def _refresh(self) -> None:
        while not self._stop.is_set():
            netns: dict[int, str] = {}
            local = self._crictl(netns)
            if not netns and self._namespaces is not None:   # a runtime without the paths
                netns = netns_pods_by_address(local.get, self._namespaces, self._addresses)
            self.local, self.netns = local, netns  # reference swaps: lookups see old or new
            self._stop.wait(self._refresh_s)

    def _refresh_netns(self) -> None:
        from nptrace.node.netns import named_namespaces
        from nptrace.node.rules_source import local_addresses
        namespaces = self._namespaces or named_namespaces
        addresses = self._addresses or local_addresses
        self.watch.synced.wait(self._refresh_s)
        while not self._stop.is_set():
            self.netns = netns_pods_by_address(self.watch.pod_of, namespaces, addresses)
            self._stop.wait(self._refresh_s)

    def pod_of(self, addr: str) -> str | None:
        if self.watch is not None:
            return self.watch.pod_of(addr)
        return self.local.get(addr)

    def pod_of_netns(self, inode: int) -> str | None:
        return self.netns.get(inode)

    def close(self) -> None:
        self._stop.set()
        if self.watch is not None:
            from nptrace.node.rules_source import set_api_names
            set_api_names(None)
            self.watch.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
