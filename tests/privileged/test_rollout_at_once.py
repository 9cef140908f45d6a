"""A rollout that removes an endpoint and gives its address to a new pod in the same second
(rollout-in-flight's at-once variants: the rules change, web-0 goes and other-0 takes
10.244.0.10 at once): 50 long-lived connections on each rules backend whose commits nptrace
learns differently (nft: heard; iptables-legacy: its tables asked every 50 ms), among 100 and
among 2,000 Services. Every connection's reset must be labeled `proxy` naming the removed
endpoint, not the new pod's own reset: the rules the packet met, not the view's older ones."""
from __future__ import annotations

import os

import pytest

from nptrace.lab.harness import scenario_events, trace_scenario

pytestmark = pytest.mark.privileged
PREFIX = f"npt-ao{os.getpid() % 10000}-"
STALE = "to 10.244.0.10:8080, which default/web:http's rules no longer list"
# Among 2,000 Services the view's re-read after the change (`nft -a list table` and its parse,
# 0.5-1 s; iptables-legacy-save and its parse, 0.25-0.5 s) races the labeling barrier's bound
# (BARRIER_S, 300 ms): on a loaded machine the resets are labeled with the rules before the
# change, all of them or none. Applying the announced changes themselves instead of re-reading
# the whole table would remove it.
LATE = pytest.mark.xfail(strict=False, reason="2,000 Services: the rules re-read races the 300 ms barrier")


@pytest.mark.parametrize("backend", ["nft", "iptables-legacy"])
@pytest.mark.parametrize("variant", ["at-once", pytest.param("at-once-scale", marks=[LATE, pytest.mark.long])])
def test_every_reset_after_an_address_reuse_names_the_removed_endpoint(backend, variant):
    inodes: dict = {}
    _, attempts, events, err = trace_scenario("rollout-in-flight", 50, backend=backend, variant=variant,
                                              prefix=PREFIX, inode_sink=inodes, settle=4.0)
    assert sum(a.outcome == "reset" for a in attempts) == 50, [a.outcome for a in attempts]
    mine = scenario_events(attempts, events, set(inodes.values()))
    clients = {a.sport for a in attempts}
    labeled = {e["dport"] if e["dport"] in clients else e["sport"] for e in mine if e["cause"] == "proxy"
               and STALE in (e.get("hint") or "")}
    wrong = [(e["cause"], (e.get("hint") or "")[:120]) for e in mine if e["cause"] != "proxy"]
    assert labeled == clients and not wrong, f"{len(labeled)}/50 right; {wrong[:2]}\n{err[-600:]}"
