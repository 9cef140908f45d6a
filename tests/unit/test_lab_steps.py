"""The runner's [[step]]s as commands, without root: netns calls recorded, nothing run."""
from __future__ import annotations

import pytest

from nptrace.lab import model, netns, runner


@pytest.fixture
def calls(monkeypatch):
    got = []

    def sh(argv, input=None, **kw):
        got.append((list(argv), input))
        if any(str(a).endswith("-save") for a in argv):     # the node's rules before the sync
            from nptrace.lab import kuberules
            before = model.compile_spec("rollout-in-flight", "address-reused")
            return type("R", (), {"stdout": kuberules.render_iptables(
                before.services, "node1", before.cluster_cidr)})()
    monkeypatch.setattr(netns, "sh", sh)
    monkeypatch.setattr(netns, "delete_namespaces", lambda names, pids=(): got.append((["delns", *names], None)))
    monkeypatch.setattr(netns, "make_namespaces", lambda names, ipv6=False: got.append((["mkns", *names], None)))
    monkeypatch.setattr(netns, "save_state", lambda prefix, st: None)
    monkeypatch.setattr(netns, "run_batched", lambda ns, steps: got.append((["batch", ns], None)) or [])
    monkeypatch.setattr(netns, "wait_ready", lambda procs: None)
    return got


@pytest.mark.parametrize("backend", ["iptables", "nft"])
def test_rollout_steps(calls, backend):
    spec = model.compile_spec("rollout-in-flight", "address-reused")
    state = {"prefix": "t-", "backend": backend, "namespaces": ["t-web-0", "t-node1"], "pids": []}
    runner.run_steps(spec, state, "t-")
    rules = [(a, i) for a, i in calls if i and ("restore" in " ".join(a) or "nft" in a)]
    assert len(rules) == 2                      # node1 and node2 re-rendered
    for argv, text in rules:
        assert "10.244.0.10" not in text and "10.244.1.10:8080" in text
        if backend == "nft":
            assert text.startswith("delete table ip kube-proxy\n")
        else:
            assert "--noflush" in argv
            # web-0's endpoint chain goes, as kube-proxy deletes it: --noflush would keep it
            stale = [x for x in text.splitlines() if x.startswith("-X KUBE-SEP-")]
            assert len(stale) == 1, text
            assert text.index(stale[0]) < text.index("COMMIT", text.index("*nat"))
    order = [a[0] if a[0] != "ip" else " ".join(a[:5]) for a, _ in calls]
    i_del_veth = next(i for i, (a, _) in enumerate(calls) if a[:5] == ["ip", "-n", "t-node1", "link", "del"])
    i_delns = order.index("delns")
    assert i_del_veth < i_delns                  # the veth goes first: no FIN from dying sockets
    assert ["mkns", "t-other-0"] in [a for a, _ in calls]
    assert "t-web-0" not in state["namespaces"] and "t-other-0" in state["namespaces"]


def test_container_restart_keeps_the_rules(calls):
    spec = model.compile_spec("container-restart")
    state = {"prefix": "t-", "backend": "iptables", "namespaces": ["t-web-0"], "pids": []}
    runner.run_steps(spec, state, "t-")
    assert not [a for a, i in calls if i]        # no rules loaded
    assert ["mkns", "t-web-0"] in [a for a, _ in calls] and state["namespaces"] == ["t-web-0"]
