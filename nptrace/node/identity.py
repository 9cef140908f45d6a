"""Which node this is, for every output: JSON lines, the session header, the pcapng section and
the metrics (nptrace_build_info{node}).

Order: --node-name, else $NODE_NAME (the DaemonSet sets it from the downward API,
spec.nodeName: the name `kubectl get nodes` shows, which is not always the host name, e.g. on
EKS ip-10-0-1-2.ec2.internal versus the kernel's ip-10-0-1-2), else the host name. Pure: no
network, no Kubernetes API; never fails.
"""
from __future__ import annotations

import os
import socket

__all__ = ["node_name"]

MAX_NAME = 253      # a DNS subdomain, as Kubernetes object names


def node_name(explicit: str | None = None, env=os.environ) -> tuple[str, str]:
    """(name, where it came from: "--node-name", "NODE_NAME" or "hostname")."""
    for value, source in ((explicit, "--node-name"), (env.get("NODE_NAME"), "NODE_NAME")):
        v = (value or "").strip()
        if v:
            return v[:MAX_NAME], source
    return (socket.gethostname() or "unknown")[:MAX_NAME], "hostname"
