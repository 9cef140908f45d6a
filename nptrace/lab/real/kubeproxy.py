"""One real kube-proxy per lab node namespace, and the wait for its rules.

Each runs inside its node's namespace (`ip netns exec`), with its own identity
(system:kube-proxy), ``--hostname-override`` the node's name, its mode, its own sync periods
(the defaults), healthz on :10256 and metrics on :10249 (reached from the root namespace over
the management link) and its Service health-check servers. ``--conntrack-max-per-core 0``:
nf_conntrack_max is read-only outside the initial namespace, and kube-proxy exits when it
cannot write it.
"""
from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

from ..errors import LabError
from .releases import Release, binary

MODES = {"iptables": "iptables", "nft": "nftables", "ipvs": "ipvs"}
HEALTHZ_PORT, METRICS_PORT = 10256, 10249
SETTLE_S = 1.0          # no change pending this long after the slices were right: synced


def argv(rel: Release, kubeconfig: Path, node: str, backend: str, cluster_cidr: str) -> list[str]:
    if backend not in MODES:
        raise LabError(f"the real tier runs kube-proxy in {', '.join(MODES)} mode, not {backend}")
    return [binary(rel, "kube-proxy"), f"--kubeconfig={kubeconfig}", f"--hostname-override={node}",
            f"--proxy-mode={MODES[backend]}", f"--cluster-cidr={cluster_cidr}",
            f"--healthz-bind-address=0.0.0.0:{HEALTHZ_PORT}",
            f"--metrics-bind-address=0.0.0.0:{METRICS_PORT}", "--conntrack-max-per-core=0", "-v=2"]


_METRIC = re.compile(r"^(kubeproxy_sync_proxy_rules_(?:last_timestamp_seconds|last_queued_timestamp_seconds|"
                     r"endpoint_changes_pending|service_changes_pending))(?:\{[^}]*\})? (\S+)$", re.M)


def sync_state(addr: str) -> dict[str, float] | None:
    """kube-proxy's own view of its syncs (its /metrics), None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{addr}:{METRICS_PORT}/metrics", timeout=2) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return None
    out: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        short = name.removeprefix("kubeproxy_sync_proxy_rules_")
        out[short] = max(out.get(short, 0.0), float(value))
    return out


def synced(state: dict[str, float] | None, since: float, now: float) -> bool:
    """Whether a proxy has applied what the API held at ``since`` (wall clock): it synced after
    it, or it has nothing pending, its last sync is at least as new as its last queued change,
    and SETTLE_S passed (an informer hears a change in milliseconds)."""
    if not state or "last_timestamp_seconds" not in state:
        return False
    if state["last_timestamp_seconds"] >= since:
        return True
    idle = (state.get("endpoint_changes_pending", 0) == 0 and state.get("service_changes_pending", 0) == 0
            and state["last_timestamp_seconds"] >= state.get("last_queued_timestamp_seconds", 0))
    return idle and now - since >= SETTLE_S and state["last_timestamp_seconds"] > 0


def wait_synced(addrs: list[str], since: float, procs, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise LabError(f"kube-proxy exited ({dead[0].returncode}); see its log in the lab's log folder")
        if all(synced(sync_state(a), since, time.time()) for a in addrs):
            return
        if time.monotonic() > deadline:
            raise LabError(f"kube-proxy did not sync within {timeout:.0f} s")
        time.sleep(0.1)
