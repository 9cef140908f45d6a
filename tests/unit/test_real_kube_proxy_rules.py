"""Rules a real kube-proxy wrote on the lab's real tier (tests/fixtures/kube-proxy/real: the
lab node's table as `nft list table` printed it, nptrace/lab/real/): nptrace's Service map
must read them as it reads the generated tier's. kube-proxy 1.35+ in nftables mode writes no
endpoint chains (the service chain DNATs through one numgen map) and marks for masquerade in
place (no mark-for-masquerade chain): both read here."""
from __future__ import annotations

from pathlib import Path

import pytest

from nptrace.services import parse_nft

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "kube-proxy" / "real"
CLIENT, NODE1, NODE2 = "192.168.10.100", "192.168.10.11", "192.168.10.12"
PODS = {"web-0": "10.244.0.10", "web-1": "10.244.1.10", "web-2": "10.244.1.11"}


def smap(name: str, local: str):
    return parse_nft((REAL / name).read_text()).with_local_addrs([local, "127.0.0.1"])


def test_v136_nft_endpoints_from_the_dnat_map():
    m = smap("v1.36.3-nft-node1-no-listener.nft", NODE1)
    svc = m.lookup(NODE1, 30080)
    assert svc is not None and svc.name == "default/web:http"
    for ip in PODS.values():           # an endpoint names its Service (a pod's reply, a reset)
        assert m.lookup(ip, 8080).name == "default/web:http"
    t = m.trace(CLIENT, NODE1, 30080)
    assert sorted(t.output.split(", ")) == sorted(f"{ip}:8080" for ip in PODS.values())
    assert t.masq                       # eTP=Cluster: marked in the external chain itself


def test_v136_nft_cluster_ip_from_outside_is_masqueraded():
    m = smap("v1.36.3-nft-node1-no-listener.nft", NODE1)
    t = m.trace(CLIENT, "10.96.0.80", 80)
    assert t.masq and "10.244.1.10:8080" in t.output


@pytest.mark.parametrize("node,local,local_eps", [("node1", NODE1, []),
                                                  ("node2", NODE2, ["10.244.1.10:8080", "10.244.1.11:8080"])])
def test_v136_nft_etp_local(node, local, local_eps):
    m = smap(f"v1.36.3-nft-{node}-etp-local-no-endpoint.nft", local)
    t = m.trace(CLIENT, local, 30080)
    if not local_eps:                   # no local endpoint: kube-proxy's drop, named
        assert t.output == "DROP" and not t.masq
        assert t.rule is not None and t.rule.service == "default/web:http"
    else:                               # the local endpoints, the client address kept
        assert sorted(t.output.split(", ")) == local_eps and not t.masq
    # pods and the node itself short-circuit to every endpoint
    assert "10.244.1.10:8080" in m.trace("10.244.0.10", local, 30080).output
