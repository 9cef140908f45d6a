"""The legacy tables' digest asked of the kernel (node/xtables.py), in a namespace of our own:
traffic (counters) leaves it alone, a DNAT rewritten to another endpoint (same size, same entry
count: what a check of IPT_SO_GET_INFO alone would miss) moves it, the IPv6 tables count, and a
namespace without legacy tables gets None without having one made for it."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from nptrace.node import rules_source, xtables

pytestmark = pytest.mark.privileged
NS = f"npt-xt{os.getpid() % 10000}"


def sh(*argv):
    subprocess.run(["ip", "netns", "exec", NS, *argv], check=True, capture_output=True)


@pytest.fixture
def ns():
    if not shutil.which("iptables-legacy"):
        pytest.skip("iptables-legacy is not installed (Debian package iptables)")
    subprocess.run(["ip", "netns", "add", NS], check=True)
    try:
        sh("ip", "link", "set", "lo", "up")
        yield NS
    finally:
        subprocess.run(["ip", "netns", "del", NS], check=False)


def names(ns):
    return rules_source.in_netns(ns, lambda: (xtables.table_names("ip"), xtables.table_names("ip6")))


def test_no_legacy_tables_no_digest_and_none_made(ns):
    assert rules_source.legacy_digest(ns) is None
    assert names(ns) == ([], [])


def test_counters_do_not_move_the_digest_and_a_rewritten_dnat_does(ns):
    sh("iptables-legacy", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "127.0.0.5",
       "-j", "DNAT", "--to-destination", "127.0.0.1:9")
    d1 = rules_source.legacy_digest(ns)
    assert d1 and names(ns) == (["nat"], [])
    for _ in range(3):      # refused connections that count on the DNAT rule
        subprocess.run(["ip", "netns", "exec", ns, "bash", "-c", "echo > /dev/tcp/127.0.0.5/80"],
                       capture_output=True, timeout=5)
    out = subprocess.run(["ip", "netns", "exec", ns, "iptables-legacy", "-t", "nat", "-L", "OUTPUT", "-v", "-n", "-x"],
                         capture_output=True, text=True).stdout
    assert int(out.splitlines()[2].split()[0]) >= 3, out
    assert rules_source.legacy_digest(ns) == d1
    sh("iptables-legacy", "-t", "nat", "-R", "OUTPUT", "1", "-p", "tcp", "-d", "127.0.0.5",
       "-j", "DNAT", "--to-destination", "127.0.0.2:9")
    d2 = rules_source.legacy_digest(ns)
    assert d2 not in (None, d1)
    sh("ip6tables-legacy", "-A", "INPUT", "-j", "ACCEPT")
    assert rules_source.legacy_digest(ns) not in (None, d1, d2)
    assert names(ns) == (["nat"], ["filter"])
