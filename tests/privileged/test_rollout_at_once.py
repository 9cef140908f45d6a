"""A rollout that removes an endpoint and gives its address to a new pod in the same second
(rollout-in-flight's at-once variants: the rules change, web-0 goes and other-0 takes
10.244.0.10 at once): 50 long-lived connections on each rules backend whose commits nptrace
learns differently (nft: heard; iptables-legacy: its tables asked every 50 ms), among 100 and
among 2,000 Services. Every connection's reset must be labeled `proxy` naming the removed
endpoint, not the new pod's own reset: the rules the packet met, not the view's older ones."""
from __future__ import annotations

import os

import pytest

from nptrace import lab
from nptrace.lab.harness import scenario_events, trace_scenario

pytestmark = pytest.mark.privileged
PREFIX = f"npt-ao{os.getpid() % 10000}-"
STALE = "to 10.244.0.10:8080, which default/web:http's rules no longer list"
# the scenario's own watch after its trigger (the resets came before the trigger returned)
OBSERVE = next(s.observe for s in lab.scenarios() if s.name == "rollout-in-flight")
# Among 2,000 Services the view's re-read after the change (`nft -a list table` and its parse,
# 0.45-0.5 s here; the legacy tables asked of the kernel and parsed, 0.2-0.4 s) is what the
# labeling barrier waits for (BARRIER_S): the scale variant is the one that tells whether it
# waits long enough.


@pytest.mark.parametrize("backend", ["nft", "iptables-legacy"])
@pytest.mark.parametrize("variant", ["at-once", "at-once-scale"])
def test_every_reset_after_an_address_reuse_names_the_removed_endpoint(backend, variant):
    inodes: dict = {}
    _, attempts, events, err = trace_scenario("rollout-in-flight", 50, backend=backend, variant=variant,
                                              prefix=PREFIX, inode_sink=inodes, settle=OBSERVE)
    assert sum(a.outcome == "reset" for a in attempts) == 50, [a.outcome for a in attempts]
    mine = scenario_events(attempts, events, set(inodes.values()))
    clients = {a.sport for a in attempts}
    labeled = {e["dport"] if e["dport"] in clients else e["sport"] for e in mine if e["cause"] == "proxy"
               and STALE in (e.get("hint") or "")}
    wrong = [(e["cause"], (e.get("hint") or "")[:120]) for e in mine if e["cause"] != "proxy"]
    assert labeled == clients and not wrong, f"{len(labeled)}/50 right; {wrong[:2]}\n{err[-600:]}"
