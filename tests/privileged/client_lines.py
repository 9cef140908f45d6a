"""Every incident line of a lab case names its client's own address and port (`client`,
before masquerade), also the lines of the endpoint's node (node2) when node1 DNATed and
masqueraded the connection over the overlay: there the mapping is only in node1's NAT map,
which the one `nptrace run` tracing both nodes reads. And each line's `client` is its own
connection's (a VXLAN tunnel's shared outer conntrack entry once joined every connection over
it into one incident, naming one client for all). The yardstick checks it on the cases of
SCENARIOS (test_attribution.py), with the incidents it traced."""

# the scenarios whose lines come from both nodes: node2's stack (no-listener's pod resets)
# and node2's drops of node1's DNATed, masqueraded packets (stale-endpoint)
SCENARIOS = ("stale-endpoint", "no-listener")
VARIANTS = (None, "ipv6")
# The rules backends whose masquerade keeps the client's port. nft's kube-proxy masquerades
# fully-random: a pod-side line then finds the connection's other tuple in the kernel's NAT
# map, but not which of the two is the client's (classify/flowkey.py nat_mapping), and names
# no client (measured: 94 of 100 of stale-endpoint@nft's node2 lines). Not yet done.
BACKENDS = ("iptables", "iptables-legacy")


def hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def check_client_lines(s, prefix: str) -> None:
    """``s``: the case's scorecard.Score (its attempts, incidents and namespaces)."""
    mine = s.incidents
    clients = {a.sport: hostport(a.src, a.sport) for a in s.tries}
    names = {v: k for k, v in s.netns.items()}
    assert mine, "no incidents of the scenario's connections"
    # node2 and its pods (web-1, web-2: no-listener's resets come from the pod's own stack)
    on_node2 = tuple(f"{prefix}{h}" for h in ("node2", "web-1", "web-2"))
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
