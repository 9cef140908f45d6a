"""node/ifwatch.py where_now: where a watched --iface device is now."""
import os

from nptrace.config import IfaceSpec
from nptrace.node.ifwatch import where_now


def test_an_interface_of_our_own_namespace_is_found_where_pid_1_is_not_ours():
    """--iface lo names the namespace nptrace runs in: found there, whoever PID 1 is (a
    sandbox's PID 1 may be unreadable, and was taken for the device being gone)."""
    got = where_now(IfaceSpec(None, "lo"))
    assert got is not None and got[0] == os.stat("/proc/self/ns/net").st_ino
