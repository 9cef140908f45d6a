"""Interface names read in-process from another network namespace (netns.link_names), as the
classifier's Names and the session header use them."""
import os
import subprocess

import pytest

from nptrace.node import netns

pytestmark = pytest.mark.privileged


def test_link_names_of_a_named_namespace_and_of_a_missing_one():
    ns = f"npt-links{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "vx-a", "type", "veth", "peer", "name",
                        "vx-b"], check=True)
        got = netns.link_names(f"/run/netns/{ns}")
        assert sorted(got.values()) == ["lo", "vx-a", "vx-b"]
        names = netns.Names()
        inode = os.stat(f"/run/netns/{ns}").st_ino
        idx = {v: k for k, v in got.items()}["vx-a"]
        assert names.iface(inode, idx) == f"{ns}/vx-a"
    finally:
        subprocess.run(["ip", "netns", "del", ns])
    assert netns.link_names_or_none(f"/run/netns/{ns}") == {}
