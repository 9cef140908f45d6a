"""On the real kernel: every incident line of a lab scenario names the client's
own address and port (`client`, before masquerade), also the lines of the endpoint's node
(node2) when node1 DNATed and masqueraded the connection over the overlay: there the mapping
is only in node1's NAT map, which the one `nptrace run` tracing both nodes reads. And each
line's `client` is its own connection's (a VXLAN tunnel's shared outer conntrack entry once
joined every connection over it into one incident, naming one client for all)."""
import os

import pytest

from nptrace import lab
from nptrace.lab.harness import scenario_events, trace_scenario

pytestmark = pytest.mark.privileged
PREFIX = f"npt-cl{os.getpid() % 10000}-"
CASES = [("stale-endpoint", None), ("stale-endpoint", "ipv6"), ("no-listener", None),
         ("no-listener", "ipv6")]


def _hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


@pytest.mark.parametrize("name,variant", CASES, ids=[f"{n}{'/' + v if v else ''}" for n, v in CASES])
def test_every_line_names_its_client(name, variant):
    sc = next(s for s in lab.scenarios() if s.name == name)
    inodes: dict = {}
    info, attempts, events, err = trace_scenario(name, 20, prefix=PREFIX, variant=variant, settle=sc.observe,
                                                 inode_sink=inodes, extra_args=("--max-rate", "0"))
    mine = scenario_events(attempts, events, set(inodes.values()))
    clients = {a.sport: _hostport(a.src, a.sport) for a in attempts}
    names = {v: k for k, v in inodes.items()}
    assert mine, f"no incidents of the scenario's connections\n{err[-800:]}"
    # node2 and its pods (web-1, web-2: no-listener's resets come from the pod's own stack)
    on_node2 = tuple(f"{PREFIX}{h}" for h in ("node2", "web-1", "web-2"))
    node2 = [e for e in mine if names.get(e["netns"], "").split("@")[0] in on_node2]
    assert node2, "no line from the endpoints' node"
    for e in mine:
        where = f"{names.get(e['netns'])} {e['hook']} {e['reason']} {e['saddr']}:{e['sport']}"
        assert "client" in e, f"no client on {where}"
        own = {e["sport"], e["dport"]} & set(clients)
        # the masquerade keeps the client's port here: the line's own port says whose it is
        assert e["client"] in clients.values() and (not own or e["client"] in {clients[p] for p in own}), \
            f"{where}: client {e['client']}"
    # one incident per connection on node2 (no tunnel-wide merge)
    assert len({e["client"] for e in node2}) == len(node2)


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
