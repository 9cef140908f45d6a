"""Pods on this node, from what the node alone shows: the container runtime (crictl).

`resolve(ns, name)`: `--pod NS/NAME` -> the pod's addresses, for filters. `node_pods()`: every
ready pod sandbox's addresses -> "ns/name", for naming. Both are empty when crictl is missing
or knows no pod. `PodNames` answers "which pod is this address" from the Kubernetes API when
nptrace runs in a cluster (node/kubeapi.py: a node-scoped watch), else from crictl, refreshed
in a background thread: a lookup never waits for either.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
from typing import Callable

CRICTL_REFRESH_S = 30.0


def _sandbox_ips(pid: str) -> list[str]:
    d = json.loads(subprocess.run(["crictl", "inspectp", pid], capture_output=True,
                                  text=True, timeout=10).stdout or "{}")
    net = d.get("status", {}).get("network", {})
    return [a for a in [net.get("ip"), *(x.get("ip") for x in net.get("additionalIps", []))] if a]


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


def node_pods() -> dict[str, str]:
    """{address: "ns/name"} of the node's ready pod sandboxes (hostNetwork ones have none)."""
    if shutil.which("crictl") is None:
        return {}
    try:
        doc = json.loads(subprocess.run(["crictl", "pods", "--state", "ready", "-o", "json"],
                                        capture_output=True, text=True, timeout=10).stdout or "{}")
        out = {}
        for it in doc.get("items") or []:
            m = it.get("metadata") or {}
            for ip in _sandbox_ips(it["id"]):
                out[ip] = f"{m.get('namespace', '')}/{m.get('name', '')}"
        return out
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError):
        return {}


class PodNames:
    """pod_of(addr) -> "ns/name" or None, from the cache only. Sources: the API watch
    (`api`, a node/kubeapi.py ApiConfig) when given, else crictl every CRICTL_REFRESH_S."""

    def __init__(self, node: str, api=None, log: Callable[[str], None] = lambda m: None,
                 refresh_s: float = CRICTL_REFRESH_S, crictl: Callable[[], dict] = node_pods):
        self.watch = None
        self.local: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = None
        self.source = "none"
        if api is not None:
            from nptrace.node.kubeapi import PodWatch
            self.watch = PodWatch(api, node, log=log)
            self.source = f"kubernetes API {api.base} (pods of node {node})"
        elif shutil.which("crictl") is not None or crictl is not node_pods:
            self._crictl, self._refresh_s = crictl, refresh_s
            self.source = "crictl (this node's pod sandboxes)"

    def start(self) -> "PodNames":
        if self.watch is not None:
            self.watch.start()
        elif self.source.startswith("crictl"):
            self._thread = threading.Thread(target=self._refresh, daemon=True,
                                            name="nptrace-crictl-pods")
            self._thread.start()
        return self

    def _refresh(self) -> None:
        while not self._stop.is_set():
            self.local = self._crictl()       # one reference swap: lookups see old or new
            self._stop.wait(self._refresh_s)

    def pod_of(self, addr: str) -> str | None:
        if self.watch is not None:
            return self.watch.pod_of(addr)
        return self.local.get(addr)

    def close(self) -> None:
        self._stop.set()
        if self.watch is not None:
            self.watch.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
