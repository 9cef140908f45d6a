"""IPv6 neighbour failure on the real kernel: node2's packets queued for a deleted pod's IPv6
address are freed by ndisc_error_report with no drop reason (NOT_SPECIFIED, IPv4's
arp_error_report says NEIGH_FAILED); the kfree_skb program names such a free NEIGH_FAILED by
its call site (nptrace/kernel/kallsyms.py). With ICMPv6's rate limits at their defaults (a
few address-unreachables a second, so most connections get none), every connection of
stale-endpoint's dual-stack form is still labeled proxy by its own NEIGH_FAILED drop: before,
18% of its events (42 of 230, 100 attempts) were, the rest came out unknown."""
import os
from pathlib import Path

import pytest

from nptrace import lab
from nptrace.kernel import kallsyms
from nptrace.lab import model
from nptrace.lab.harness import scenario_events, trace_scenario

pytestmark = pytest.mark.privileged
PREFIX = f"npt-nf{os.getpid() % 10000}-"


def test_ipv6_stale_endpoint_lines_keep_their_cause_at_default_icmpv6_rate_limits():
    text = Path("/proc/kallsyms").read_bytes()
    if not kallsyms.text_ranges(text, kallsyms.NEIGH_FAIL_SITES):
        pytest.skip("/proc/kallsyms shows no addresses (needs CAP_SYSLOG, kptr_restrict < 2)")
    spec = model.compile_spec("stale-endpoint", "ipv6")
    assert not any(k.startswith(("net.ipv6.icmp.", "net.ipv4.icmp_msgs"))
                   for k in spec.hosts["node2"].get("sysctl", {})), "ICMP rate limits must stay at their defaults"
    sc = next(s for s in lab.scenarios() if s.name == "stale-endpoint")
    inodes: dict = {}
    info, attempts, events, err = trace_scenario("stale-endpoint", 30, prefix=PREFIX, variant="ipv6",
                                                 settle=sc.observe, inode_sink=inodes,
                                                 extra_args=("--max-rate", "0"))
    mine = scenario_events(attempts, events, set(inodes.values()))
    assert mine, err[-800:]
    assert {e["cause"] for e in mine} == {"proxy"}, [(e["cause"], e["reason"]) for e in mine if e["cause"] != "proxy"]
    failed = {int(e["client"].rsplit(":", 1)[1]) for e in mine
              if any(x["hook"] == "skb:kfree_skb" and x["what"] == "NEIGH_FAILED" for x in e["evidence"])}
    assert failed == {a.sport for a in attempts}, f"{len(failed)} of {len(attempts)} connections"
