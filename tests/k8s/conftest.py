"""The real tier's tests (`make test-k8s`): a real control plane built by `make k8s`. They
skip, with the reason, without root or without the built release."""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from nptrace.lab.errors import NotRunnable
from nptrace.lab.real import controlplane, releases
from nptrace.lab.real.api import Api
from nptrace.lab.real.controlplane import Plan

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")


@dataclass
class Cluster:
    plan: Plan
    api: Api
    rel: releases.Release

    def kubectl(self) -> list[str]:
        pki = controlplane.pki_of(self.plan)
        cfg = controlplane.write_kubeconfig(self.plan, pki, "admin", self.plan.local_server)
        return [releases.binary(self.rel, "kubectl"), f"--kubeconfig={cfg}"]


def _kill_all(marker: str) -> None:
    """Every process whose command line names ``marker`` (the control plane's folder): the
    API server restarted by a test included."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if marker in p.joinpath("cmdline").read_bytes().decode(errors="replace"):
                    os.kill(int(p.name), signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """etcd, kube-apiserver (its watch cache off, so a watch from a compacted revision meets
    etcd's compaction) and kube-controller-manager in lab slot 7 (ports of their own)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the control plane's ports and files)")
    rel = releases.get("current")
    try:
        for c in COMPONENTS:
            releases.binary(rel, c)
    except NotRunnable as e:
        pytest.skip(str(e))
    plan = Plan(slot=7, dir=tmp_path_factory.mktemp("k8s"))
    pids: list[int] = []
    try:
        controlplane.link_up(plan, [])      # the bridge the API server listens on
        api = controlplane.start(plan, rel, "10.96.0.0/16", pids.append,
                                 apiserver_extra=("--watch-cache=false",))
        yield Cluster(plan, api, rel)
    finally:
        controlplane.stop(pids)
        _kill_all(str(plan.dir))
        controlplane.link_down(plan.slot)
