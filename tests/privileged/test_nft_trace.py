"""nf_tables tracing against the real kernel: nptrace's trace table and netlink socket in a
namespace of the test's own, then `nptrace run` over lab scenarios, where the rule behind a
drop is named from the ruleset first and by the trace once the destination is armed."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from nptrace.node import nftrace_live

pytestmark = pytest.mark.privileged
NS = f"npt-nt{os.getpid() % 100000}"
PREFIX = f"npt-nt{os.getpid() % 10000}-"


def sh(*argv, check=True):
    return subprocess.run(argv, capture_output=True, text=True, check=check)


@pytest.fixture
def netns():
    if shutil.which("nft") is None:
        pytest.skip("nft not installed (scripts/setup.sh installs nftables)")
    sh("ip", "netns", "add", NS)
    try:
        sh("ip", "-n", NS, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", NS, "nft", "table ip fw { chain in { type filter hook input "
           "priority 0; tcp dport 81 reject with tcp reset; tcp dport 82 counter drop; }; }")
        yield NS
    finally:
        sh("ip", "netns", "del", NS, check=False)


def test_trace_names_the_rule_that_dropped(netns):
    sess = nftrace_live.NsTrace.open(netns)
    try:
        now = time.monotonic()
        assert sess.arm("127.0.0.1", 82, now) and not sess.arm("127.0.0.1", 82, now)
        sh("ip", "netns", "exec", netns, "timeout", "1.5", "bash", "-c",
           "echo > /dev/tcp/127.0.0.1/82; echo > /dev/tcp/127.0.0.1/83", check=False)
        sess.drain(time.monotonic())
        d = sess.book.lookup("127.0.0.1", [("127.0.0.1", 82)], time.monotonic(), 60)
        assert d is not None and (d.family, d.table, d.chain) == ("ip", "fw", "in")
        text, pos = sess.rule_line(d, time.monotonic())
        assert pos == 2 and text.startswith("tcp dport 82 counter")
        assert sess.book.lookup("127.0.0.1", [("127.0.0.1", 83)], time.monotonic(), 60) is None
        listed = sh("ip", "netns", "exec", netns, "nft", "list", "tables").stdout
        assert f"table inet {nftrace_live.TABLE}" in listed
    finally:
        sess.close()
    listed = sh("ip", "netns", "exec", netns, "nft", "list", "tables").stdout
    assert nftrace_live.TABLE not in listed and "table ip fw" in listed


def test_open_twice_leaves_one_table(netns):
    a = nftrace_live.NsTrace.open(netns)
    b = nftrace_live.NsTrace.open(netns)     # a leftover of a killed run is replaced, not doubled
    try:
        listed = sh("ip", "netns", "exec", netns, "nft", "-a", "list", "table", "inet",
                    nftrace_live.TABLE).stdout
        assert listed.count("meta nftrace set 1") == 4
    finally:
        a.sock.close()
        b.close()


def _sources(events, cause):
    got = {"trace": [], "ruleset": []}
    for e in events:
        if e.get("cause") != cause:
            continue
        h = e.get("hint") or ""
        if "seen by nft trace" in h:
            got["trace"].append(h)
        elif "named from the ruleset" in h:
            got["ruleset"].append(h)
    return got


@pytest.mark.parametrize("scenario,backend,cause,traced_at", [
    ("etp-local-no-endpoint", "nft", "no_local_endpoint",
     "table ip kube-proxy chain nodeport-endpoints-check handle"),
    ("networkpolicy-drop", "iptables", "policy_drop",
     "table ip filter chain NETPOL-DEFAULT-WEB handle"),
])
def test_run_names_the_traced_rule_from_the_second_attempt_on(scenario, backend, cause, traced_at):
    from nptrace.lab.harness import trace_scenario
    _, _, events, err = trace_scenario(scenario, 6, backend=backend, prefix=PREFIX, rounds=2)
    got = _sources(events, cause)
    assert got["ruleset"], f"no first-drop answer from the ruleset\n{err[-800:]}"
    assert any(traced_at in h for h in got["trace"]), \
        f"no traced rule among {len(got['trace'])} traced hints\n{got['trace'][:2]}\n{err[-800:]}"
    assert "nft trace: table inet nptrace_trace added" in err


def test_run_says_legacy_rules_cannot_be_traced():
    from nptrace.lab.harness import trace_scenario
    _, _, events, err = trace_scenario("networkpolicy-drop", 4, backend="iptables-legacy",
                                       prefix=PREFIX, rounds=2)
    got = _sources(events, "policy_drop")
    assert got["ruleset"] and not got["trace"]
    assert all("iptables-legacy rules are invisible to nft trace" in h for h in got["ruleset"])
    # the drop is the policy chain's, met on FORWARD (the pods' traffic is routed, not local)
    assert all("filter/NETPOL-DEFAULT-WEB rule 2, on the FORWARD hook" in h for h in got["ruleset"]), got["ruleset"][:1]
