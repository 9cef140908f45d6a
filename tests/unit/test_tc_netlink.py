"""Namespace naming for --iface NETNS/IFNAME, and the import boundary of nptrace.kernel.tc."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nptrace.errors import InterfaceError

netlink = pytest.importorskip("nptrace.kernel.netlink", reason="pyroute2 is not installed")


@pytest.mark.parametrize("spec, path", [
    (None, "/proc/self/ns/net"),
    ("blue", "/run/netns/blue"),
    ("/proc/1234/ns/net", "/proc/1234/ns/net"),
    ("/var/run/netns/cni-1f2e", "/var/run/netns/cni-1f2e"),
])
def test_netns_path(spec, path):
    assert netlink.netns_path(spec) == path


def test_netns_inode():
    assert netlink.netns_inode(None) == os.stat("/proc/self/ns/net").st_ino


def test_missing_netns_is_one_line_interface_error():
    with pytest.raises(InterfaceError) as ei:
        netlink.netns_inode("npt-surely-absent-ns")
    msg = str(ei.value)
    assert "'npt-surely-absent-ns' not found" in msg and "\n" not in msg


def test_tc_module_imports_without_pyroute2_or_bcc():
    code = ("import sys, nptrace.kernel.tc; "
            "bad = [m for m in ('pyroute2', 'bcc') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
