"""The lab's offload-checksum and conntrack-table-full scenarios without root: their host keys
as commands (ethtool offloads, a filled conntrack table), the host-wide sysctl a namespace
cannot set (set at the root, the old value kept and put back), and the yardstick's hint check."""
from collections import Counter

import pytest

from nptrace.lab import hostplan, model, netns, runner, scorecard, vm
from nptrace.lab.errors import HostBusy, UsageError
from nptrace.lab.hostplan import Step
from nptrace.lab.runner import Attempt

CTMAX = "net.netfilter.nf_conntrack_max"


@pytest.fixture
def proc(tmp_path, monkeypatch):
    """A /proc/sys with the root namespace's conntrack numbers, a state dir, two namespaces."""
    root = tmp_path / "sys"
    (root / "net" / "netfilter").mkdir(parents=True)
    (root / "net" / "netfilter" / "nf_conntrack_max").write_text("262144\n")
    (root / "net" / "netfilter" / "nf_conntrack_count").write_text("3\n")
    monkeypatch.setattr(netns, "PROC_SYS", root)
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path / "state")
    counts = {"npt-x-node1": "0\n", "other-ns": "12\n"}
    monkeypatch.setattr(netns, "existing_namespaces", lambda: set(counts))

    def sh(argv, input=None, check=True, timeout=30):
        return type("R", (), {"returncode": 0, "stdout": counts[argv[3]]})()
    monkeypatch.setattr(netns, "sh", sh)
    return root / "net" / "netfilter" / "nf_conntrack_max", counts


def test_offload_checksum_turns_the_clients_tx_offload_off_and_mbox_rewrites():
    spec = model.compile_spec("offload-checksum")
    steps = hostplan.host_steps(spec, "client", "iptables")
    assert Step("run", ("ethtool", "-K", "eth1", "tx", "off")) in steps
    # after the link is up (ethtool needs the device), before its addresses
    up = steps.index(Step("run", ("ip", "link", "set", "eth1", "up")))
    assert up < steps.index(Step("run", ("ethtool", "-K", "eth1", "tx", "off")))
    (nft,) = [s for s in hostplan.host_steps(spec, "mbox", "nft") if s.argv[0] == "nft"]
    assert "@th,144,16 set 0x1" in nft.input and "hook forward" in nft.input
    assert spec.hint and "tx-checksum-ip-generic off" in spec.hint
    # on a VM, ethtool's device is the VM's NIC
    cmds = vm.role_commands(spec, "client", "iptables", {"eth0": "eth1", "eth1": "eth2"})
    assert ("ethtool", "-K", "eth2", "tx", "off") in [c.argv for c in cmds]


def test_conntrack_fill_loads_assured_entries_before_the_limit():
    spec = model.compile_spec("conntrack-table-full")
    steps = hostplan.host_steps(spec, "node1", "iptables")
    flush, fill = [s for s in steps if s.argv[0] == "conntrack"]
    # nothing but the fill: snooping off (no IGMP entry early drop could evict), then a flush
    quiet = steps.index(Step("run", ("ip", "link", "set", "cni0", "type", "bridge", "mcast_snooping", "0")))
    assert quiet < steps.index(flush) < steps.index(fill) and flush.argv == ("conntrack", "-F")
    lines = fill.input.splitlines()
    assert fill.argv == ("conntrack", "-R", "/dev/stdin") and len(lines) == 256 == len(set(lines))
    assert all(ln.startswith("-I -p tcp ") and "-u ASSURED,SEEN_REPLY" in ln and "--state ESTABLISHED" in ln
               for ln in lines)
    sysctl = next(i for i, s in enumerate(steps) if s.argv[0] == "sysctl")
    assert steps.index(fill) < sysctl and f"{CTMAX}=256" in steps[sysctl].argv
    # the namespace lab takes the host-wide key out of node1's steps
    kept, wide = netns.split_host_wide(steps)
    assert wide == {CTMAX: "256"}
    assert all(not a.startswith(CTMAX) for s in kept for a in s.argv)
    assert any(s.argv[0] == "sysctl" and "net.ipv4.ip_forward=1" in s.argv for s in kept)


def test_split_host_wide_drops_a_step_of_host_wide_keys_only():
    steps = [Step("run", ("sysctl", "-q", "-w", f"{CTMAX}=256")), Step("run", ("ip", "link"))]
    assert netns.split_host_wide(steps) == ([steps[1]], {CTMAX: "256"})
    assert netns.split_host_wide(steps[1:]) == (steps[1:], {})


def test_host_wide_sysctl_is_set_at_the_root_and_put_back(proc):
    ctmax, _ = proc
    state = {"prefix": "npt-x-", "scenario": "conntrack-table-full"}
    netns.set_host_wide({CTMAX: "256"}, state, {"npt-x-node1"})
    assert ctmax.read_text() == "256"
    assert netns.load_state("npt-x-")["host_wide"] == {CTMAX: "262144"}   # saved before the change
    # while it holds the limit, no other lab comes up
    assert "conntrack-table-full (prefix 'npt-x-')" in netns.other_holder("npt-y-")
    assert netns.other_holder("npt-x-") is None
    netns.restore_host_wide(state)
    assert ctmax.read_text() == "262144" and state["host_wide"] == {}
    netns.restore_host_wide(state)   # twice is harmless
    assert ctmax.read_text() == "262144"


def test_host_wide_limit_is_refused_while_another_namespace_is_busy(proc):
    ctmax, counts = proc
    counts["other-ns"] = "200\n"
    with pytest.raises(HostBusy, match="other-ns holds 200 conntrack entries"):
        netns.set_host_wide({CTMAX: "256"}, {"prefix": "npt-x-", "scenario": "s"}, {"npt-x-node1"})
    assert ctmax.read_text() == "262144\n"
    # the lab's own namespaces do not count
    netns.set_host_wide({CTMAX: "256"}, {"prefix": "npt-x-", "scenario": "s"}, {"npt-x-node1", "other-ns"})
    assert ctmax.read_text() == "256"


def test_teardown_restores_before_it_deletes_even_when_deleting_fails(proc, monkeypatch):
    ctmax, _ = proc
    state = {"prefix": "npt-x-", "scenario": "s", "namespaces": ["npt-x-node1"], "pids": []}
    netns.set_host_wide({CTMAX: "256"}, state, set())
    order = []

    def delete(names, pids=()):
        order.append(("delete", ctmax.read_text()))
        raise KeyboardInterrupt
    monkeypatch.setattr(netns, "delete_namespaces", delete)
    with pytest.raises(KeyboardInterrupt):
        runner._teardown("npt-x-", state)
    assert order == [("delete", "262144")]


def test_bad_host_keys_are_usage_errors(monkeypatch):
    real = model.compile_spec("offload-checksum")
    real.hosts["client"]["ifaces"]["eth1"]["offload"] = "tx off"
    with pytest.raises(UsageError, match="offload must be a table"):
        model.validate(real)
    real = model.compile_spec("conntrack-table-full")
    real.hosts["node1"]["conntrack_fill"] = "many"
    with pytest.raises(UsageError, match="conntrack_fill must be a number"):
        model.validate(real)


def _incident(sport, cause, hint):
    return {"cause": cause, "service": "default/web:http", "sport": sport, "dport": 30080, "netns": 1,
            "hint": hint, "events": 1}


def test_yardstick_counts_hints_that_lack_the_scenarios_words(monkeypatch):
    attempts = [Attempt("192.168.10.100", p, "192.168.10.11", 30080, "timeout", "", 1.5) for p in (1001, 1002)]
    events = [_incident(1001, "conntrack_full", "full (257/256 entries; conntrack's drop counter: 3) "
                                                "nf_conntrack_max=512"),
              _incident(1002, "conntrack_full", "full")]

    def trace(name, count, **kw):
        kw["inode_sink"]["ns"] = 1
        return None, attempts, events, ""
    monkeypatch.setattr(scorecard, "trace_scenario", trace)
    s = scorecard.score("conntrack-table-full", "conntrack_full", 2,
                        hint=("/256 entries", "drop counter", "nf_conntrack_max=512"))
    assert s.labels == Counter({"conntrack_full": 2}) and s.hint_missing == 1 and s.hint_example == "full"
    assert scorecard.score("conntrack-table-full", "conntrack_full", 2).hint_missing == 0


def test_confusion_matrix_round_trips_and_merges_in_yardstick_order():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "confusion.md").read_text()
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    old = scorecard.parse_markdown(text)
    assert len(old) >= 60 and [ln for ln in scorecard.matrix_markdown(old).splitlines()
                               if ln.startswith("| ")] == table
    order = [scorecard.row_name(sc.name, b, v) for sc, b, v in scorecard.cases(model.load_scenarios())]
    assert len(order) == len(set(order)) and set(s.scenario for s in old) <= set(order)
    old = [s for s in old if s.scenario != "offload-checksum@nft"]   # a row not there yet
    new = scorecard.Score("offload-checksum@nft", "checksum", 100, Counter(), Counter({"checksum": 300}))
    again = scorecard.Score(old[0].scenario, old[0].expected, 100, Counter(), Counter({"unknown": 3}))
    merged = scorecard.merge(old, [new, again], order)
    assert len(merged) == len(old) + 1 and merged[0] is again
    names = [s.scenario for s in merged]
    assert names == sorted(names, key=order.index)
    # a scenario's rows together, its backends before its variants (scorecard.runs)
    at = names.index("offload-checksum@nft")
    assert names[at - 2:at + 1] == ["offload-checksum", "offload-checksum@iptables-legacy",
                                    "offload-checksum@nft"] or "offload-checksum" not in names
    assert " checksum |" in scorecard.matrix_markdown(merged).splitlines()[0]


def test_overlay_checksums_the_vxlan_packets_and_rewrites_them_on_every_backend():
    spec = model.compile_spec("offload-checksum", "overlay")
    n1 = hostplan.host_steps(spec, "node1", "iptables")
    (vx,) = [s for s in n1 if "vxlan" in s.argv]
    assert vx.argv[-1] == "udpcsum" and Step("run", ("ethtool", "-K", "ul0", "tx", "off")) in n1
    assert "udpcsum" not in next(s for s in hostplan.host_steps(spec, "node2", "nft") if "vxlan" in s.argv).argv
    for backend in spec.backends:   # the wire's rewrite is not a kube-proxy rule
        (wire,) = [s for s in hostplan.host_steps(spec, "node2", backend)
                   if s.argv[0] == "nft" and "netdev" in (s.input or "")]
        assert 'device "ul0"' in wire.input and "@th,544,16 set" in wire.input
    assert not [s for s in hostplan.host_steps(spec, "mbox", "iptables") if s.argv[0] == "nft"]
    assert {e.node for e in spec.services[0].endpoints} == {"node2"}
    # on a VM the netdev chain's device is the VM's NIC
    cmds = vm.role_commands(spec, "node2", "iptables", {"eth0": "eth1", "ul0": "eth2"})
    assert any(c.input and 'device "eth2"' in c.input for c in cmds)


def test_sysctls_global_on_older_kernels_are_left_out_there(monkeypatch):
    """5.10 has net.ipv4.icmp_msgs_burst/per_sec only in the root namespace: a node's step
    that sets them keeps its other keys and drops those, where this kernel lacks them."""
    from nptrace.lab.hostplan import Step
    step = Step("run", ("sysctl", "-q", "-w", "net.ipv4.ip_forward=1",
                        "net.ipv4.icmp_msgs_burst=10000", "net.ipv4.icmp_msgs_per_sec=10000"))
    monkeypatch.setattr(netns, "namespaced", lambda key: False)
    kept, wide = netns.split_host_wide([step])
    assert kept == [Step("run", ("sysctl", "-q", "-w", "net.ipv4.ip_forward=1"))] and wide == {}
    monkeypatch.setattr(netns, "namespaced", lambda key: True)
    assert netns.split_host_wide([step]) == ([step], {})
