"""The rules view hears nf_tables commits (node/nftwatch.py, through NodeKnowledge's watch):
a change to a lab node's kube-proxy ruleset (nft backend) is re-read as soon as it is
committed, with the timed poll set out of reach (an hour), so only the kernel's announcement
can have caused the re-read. Also for iptables-nft (its commits go through nf_tables). And the
labeling barrier: right after a commit, barrier() returns only once the view has applied it."""
from __future__ import annotations

import os
import subprocess
import time
from contextlib import contextmanager

import pytest

from nptrace import lab
from nptrace.node.knowledge import NodeKnowledge

pytestmark = pytest.mark.privileged
PREFIX = f"npt-rw{os.getpid() % 10000}-"


class Names:
    def __init__(self, ns: str):
        self.ns = ns
        self.inode = os.stat(f"/run/netns/{ns}").st_ino

    def netns_name(self, inode):
        return self.ns if inode == self.inode else None


def _until(cond, deadline: float, what: str):
    end = time.monotonic() + deadline
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline} s waiting for {what}")
        time.sleep(0.01)


@contextmanager
def watched_node(backend: str):
    """A lab node1 with kube-proxy rules of `backend`, its NodeKnowledge watching with the
    timed poll out of reach (an hour) and the listener open in it."""
    lab.up("no-endpoints", backend=backend, prefix=PREFIX)
    try:
        names = Names(f"{PREFIX}node1")
        kn = NodeKnowledge(names)
        assert kn.rules(names.inode), kn.errors
        kn.start_watch(every_s=3600)
        try:
            _until(lambda: kn.nft is not None and names.inode in kn.nft.watched(), 10,
                   f"the listener in {names.ns} ({kn.nft.failed if kn.nft else 'no watch'})")
            yield names.ns, kn
        finally:
            kn.stop_watch()
    finally:
        lab.down("no-endpoints", prefix=PREFIX)


@pytest.mark.parametrize("backend,touch", [
    ("nft", ["nft", "add", "table", "ip", "npt-touch"]),
    ("iptables", ["iptables-nft", "-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", "1", "-j", "ACCEPT"]),
])
def test_a_commit_is_applied_without_waiting_for_the_poll(backend, touch):
    with watched_node(backend) as (ns, kn):
        gen = kn.generation
        subprocess.run(["ip", "netns", "exec", ns, *touch], check=True)
        _until(lambda: kn.generation > gen, 30, "the re-read after the commit")
        assert kn.heard >= 1


def test_the_barrier_returns_once_the_commit_is_applied():
    with watched_node("nft") as (ns, kn):
        for i in range(5):
            gen = kn.generation
            verb = "add" if i % 2 == 0 else "delete"
            subprocess.run(["ip", "netns", "exec", ns, "nft", verb, "table", "ip", "npt-touch"],
                           check=True)
            kn.barrier()        # what a batch of records does before it is labeled
            assert kn.generation > gen, f"commit {i}: the barrier let labeling go early"
        assert kn.barrier_late == 0


def test_a_legacy_change_is_applied_within_the_frequent_look_and_the_barrier_waits_for_it():
    """iptables-legacy announces nothing: the watch asks the kernel every LEGACY_EVERY_S, the
    timed poll (an hour) out of reach; right after a change, barrier() returns only once a look
    begun after it has ended, so the change is applied by then."""
    from nptrace.node import knowledge
    with watched_node("iptables-legacy") as (ns, kn):
        _until(lambda: kn._legacy_ns, 10, "the first look at the legacy tables")
        for i in range(5):
            gen = kn.generation
            verb = "-A" if i % 2 == 0 else "-D"
            subprocess.run(["ip", "netns", "exec", ns, "iptables-legacy", "-t", "filter", verb, "INPUT",
                            "-p", "tcp", "--dport", "1", "-j", "ACCEPT"], check=True)
            t = time.monotonic()
            kn.barrier()
            assert kn.generation > gen, f"change {i}: the barrier let labeling go early"
            assert time.monotonic() - t < knowledge.BARRIER_S
        assert kn.barrier_late == 0
