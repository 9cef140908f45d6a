"""On the real kernel: an overlay's outer checksum drop is reported as the inner
connection's, with its client. (Every line of stale-endpoint's and no-listener's cases naming
its own client is checked by the yardstick: client_lines.py.)"""
import os

import pytest

from client_lines import hostport as _hostport
from nptrace.lab.harness import trace_scenario

pytestmark = pytest.mark.privileged
PREFIX = f"npt-cl{os.getpid() % 10000}-"


def test_an_overlay_outer_checksum_drop_carries_the_inner_flow():
    """node2 drops node1's VXLAN packets for their outer UDP checksum (offload-checksum's
    overlay form): each line is the inner connection's, with its client, the frontend it
    used, the endpoint it was DNATed to and that Service, not the tunnel's outer addresses."""
    info, attempts, events, err = trace_scenario("offload-checksum", 6, prefix=PREFIX, variant="overlay",
                                                 extra_args=("--max-rate", "0"))
    drops = [e for e in events if e.get("cause") == "checksum"]
    assert drops, f"no checksum drop\n{err[-800:]}"
    clients = {_hostport(a.src, a.sport) for a in attempts}
    frontends = {_hostport(a.dst, a.dport) for a in attempts}
    for e in drops:
        assert e["iface"] == f"{PREFIX}node2/ul0", e
        assert e["service"] == "default/web:http", e
        assert e["client"] in clients and e["frontend"] in frontends, e
        assert e["endpoint"].startswith("10.244.1.") and e["endpoint"].endswith(":8080"), e
        assert e["hint"].startswith("a VXLAN packet from 192.168.50.11 (inner "), e["hint"]
