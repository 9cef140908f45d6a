"""End to end, the walking skeleton: a lab scenario traced by the real `nptrace run --json`
(pwru's recipe: --ready-file, traffic in the netns, stop, read the output)."""
import glob
import json
import os
import subprocess

import pytest

from nptrace.lab.harness import trace_scenario

pytestmark = pytest.mark.privileged
PREFIX = f"npt-e2e{os.getpid() % 10000}-"


def held_prog_ids() -> set[int]:
    """Program ids some process holds an fd for (bpftool here cannot show owning pids)."""
    held = set()
    for fdinfo in glob.glob("/proc/[0-9]*/fdinfo/*"):
        try:
            with open(fdinfo) as f:
                for line in f:
                    if line.startswith("prog_id:"):
                        held.add(int(line.split()[1]))
        except (OSError, ValueError):
            continue
    return held


def orphan_programs() -> set[int]:
    """Our programs that no process holds: only an attachment (a tc filter, a pinned link)
    keeps such a program alive after nptrace exits, and that is a leak."""
    r = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True)
    progs = json.loads(r.stdout or "[]")
    held = held_prog_ids()
    return {p["id"] for p in progs
            if p.get("name", "").startswith(("tracepoint__", "npt_")) and p["id"] not in held}


def netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def leftovers() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [l.split()[0] for l in out.splitlines() if l.startswith(PREFIX)]


@pytest.fixture
def traced():
    before = orphan_programs()
    inodes = {}

    def run(name, count=10):
        from nptrace import lab
        info, attempts, events, err = trace_scenario(name, count, prefix=PREFIX, watch=False,
                                                     settle=0.5, inode_sink=inodes)
        return info, attempts, events, err, inodes
    yield run
    assert not leftovers(), "lab namespaces left behind"
    assert orphan_programs() <= before, "BPF programs left attached after nptrace run ended"


def test_no_listener_is_labeled(traced):
    info, attempts, events, err, inodes = traced("no-listener")
    assert attempts and all(a.outcome == "refused" for a in attempts)
    resets = [e for e in events if e["kind"] == "rst" and e["direction"] == "sent"]
    # The pod answers the DNATed (and, eTP=Cluster, masqueraded) SYN: its RST goes to the
    # node's masquerade address, keeping the client's port.
    client_ports = {a.sport for a in attempts}
    ours = [e for e in resets if e["dport"] in client_ports and e["sport"] == 8080]
    assert len(ours) >= len(attempts), (len(events), err)
    pod_inodes = {inodes[ns] for host, ns in info.namespaces.items() if host.startswith("web-")}
    for e in ours:
        assert e["cause"] == "no_listener", e
        assert e["hook"] == "tcp:tcp_send_reset" and e["reason"] == "NO_SOCKET"
        assert e["sport"] == 8080 and e["saddr"].startswith("10.244.")
        assert e["netns"] in pod_inodes
        assert e["iface"] and e["iface"].endswith("/eth0")


def test_rp_filter_drop_is_labeled(traced):
    info, attempts, events, err, inodes = traced("rp-filter-asymmetric")
    assert attempts and all(a.outcome == "timeout" for a in attempts)
    clients = {(a.src, a.sport) for a in attempts}
    drops = [e for e in events if e["kind"] == "drop" and (e["saddr"], e["sport"]) in clients]
    assert drops, (events, err)
    node_inodes = {inodes[ns] for host, ns in info.namespaces.items() if host.startswith("node")}
    for e in drops:
        assert e["cause"] == "rp_filter", e
        assert e["reason"] == "IP_RPFILTER" and e["hook"] == "skb:kfree_skb"
        assert e["netns"] in node_inodes and e["iface"]
        assert "rp_filter=2" in e["hint"]
    # each SYN (and its retransmissions) dropped: at least one drop per attempt
    assert {(e["saddr"], e["sport"]) for e in drops} == clients
