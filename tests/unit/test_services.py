"""nptrace.services on real kube-proxy output (tests/fixtures/kube-proxy, see its # source: headers):
Service lookup by every frontend, the rule that drops or rejects, generic firewall rules, junk
input, and the parse cost of a 10k-Service ruleset."""
from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from nptrace.services import (KINDS, REASONS, Rule, ServiceMap, merge, parse_iptables_restore,
                              parse_iptables_save, parse_nft)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kube-proxy"
OVERALL = {
    "restore": ("iptables-overall.rules", parse_iptables_restore),
    "save": ("derived/iptables-overall.iptables-save", parse_iptables_save),
    "knft": ("nft-overall.nft", parse_nft),
    "nftlist": ("derived/nft-overall.nft-list", parse_nft),
}


def load(name: str, parser=None) -> ServiceMap:
    text = (FIX / name).read_text()
    if parser is None:
        parser = parse_nft if ".nft" in name else parse_iptables_save
    return parser(text)


@pytest.fixture(params=sorted(OVERALL), scope="module")
def overall(request):
    name, parser = OVERALL[request.param]
    return request.param, load(name, parser)


# the Services of TestOverallIPTablesRules / TestOverallNFTablesRules, from the dumps themselves
CLUSTER = {"ns1/svc1:p80": "172.30.0.41", "ns2/svc2:p80": "172.30.0.42", "ns3/svc3:p80": "172.30.0.43",
           "ns4/svc4:p80": "172.30.0.44", "ns5/svc5:p80": "172.30.0.45", "ns6/svc6:p80": "172.30.0.46"}
NODEPORT = {3001: "ns2/svc2:p80", 3002: "ns5/svc5:p80", 3003: "ns3/svc3:p80"}
EXTERNAL = {"192.168.99.22": "ns2/svc2:p80", "192.168.99.33": "ns4/svc4:p80"}
LB = {"1.2.3.4": "ns2/svc2:p80", "5.6.7.8": "ns5/svc5:p80"}
ENDPOINTS = {"ns1/svc1:p80": ("10.180.0.1:80",), "ns2/svc2:p80": ("10.180.0.2:80",),
             "ns3/svc3:p80": ("10.180.0.3:80",), "ns4/svc4:p80": ("10.180.0.4:80", "10.180.0.5:80"),
             "ns5/svc5:p80": ("10.180.0.3:80",), "ns6/svc6:p80": ()}


def test_all_services_named(overall):
    _, m = overall
    assert m.names == tuple(sorted(CLUSTER))
    assert m.ignored == 0


def test_clusterip_lookup(overall):
    _, m = overall
    for name, ip in CLUSTER.items():
        s = m.lookup(ip, 80)
        assert (s.name, s.kind) == (name, "clusterip"), ip
        assert s.endpoints == ENDPOINTS[name]
        assert s.cluster_ips == (ip,)
    assert m.lookup("172.30.0.41", 81) is None
    assert m.lookup("172.30.0.41", 80, "udp") is None


def test_nodeport_lookup(overall):
    form, m = overall
    for port, name in NODEPORT.items():
        s = m.lookup("192.168.0.2", port)
        assert (s.name, s.kind, s.node_port) == (name, "nodeport", port)
    # nft: only the nodeport-ips set answers; iptables: --dst-type LOCAL, any local address
    if form in ("knft", "nftlist"):
        assert m.lookup("192.168.0.3", 3001) is None
    else:
        assert m.lookup("127.0.0.1", 3001).name == "ns2/svc2:p80"
        assert m.with_local_addrs(["192.168.0.2"]).lookup("192.168.0.3", 3001) is None
    assert m.lookup("192.168.0.2", 3004) is None
    # a ClusterIP is never a NodePort address
    assert m.lookup("172.30.0.41", 3003) is None


def test_external_and_lb_lookup(overall):
    form, m = overall
    for ip, name in EXTERNAL.items():
        s = m.lookup(ip, 80)
        assert (s.name, s.kind) == (name, "externalip")
        assert ip in s.external_ips
    for ip, name in LB.items():
        s = m.lookup(ip, 80)
        assert s.name == name
        if form in ("knft", "nftlist") and ip == "1.2.3.4":
            # nft has no way to tell an LB IP without loadBalancerSourceRanges from an ExternalIP
            assert s.kind == "externalip"
        else:
            assert s.kind == "loadbalancer"


def test_endpoint_lookup(overall):
    _, m = overall
    for name, eps in ENDPOINTS.items():
        for ep in eps:
            ip, port = ep.split(":")
            s = m.lookup(ip, int(port))
            assert s.kind == "endpoint"
            assert name in [x.name for x in m.lookup_all(ip, int(port))]
    # 10.180.0.3:80 backs svc3 and svc5: lookup gives the first name, lookup_all both
    assert m.lookup("10.180.0.3", 80).name == "ns3/svc3:p80"
    assert [s.name for s in m.lookup_all("10.180.0.3", 80)] == ["ns3/svc3:p80", "ns5/svc5:p80"]


def test_svc2_no_local_endpoints_drop(overall):
    form, m = overall
    s = m.lookup("192.168.0.2", 3001)
    assert s.etp_local and s.no_local_endpoints and not s.no_endpoints
    assert s.local_endpoints == ()
    rules = m.verdict_rules("192.168.0.2", 3001, include_invalid=False)
    assert len(rules) == 1
    r = rules[0]
    assert (r.verdict, r.reason, r.service) == ("drop", "no_local_endpoint", "ns2/svc2:p80")
    if form in ("knft", "nftlist"):
        assert r.chain == "no-endpoint-nodeports"
        assert 'tcp . 3001 comment "ns2/svc2:p80" : drop' in r.text
    else:
        assert (r.table, r.chain) == ("filter", "KUBE-EXTERNAL-SERVICES")
        assert r.comment == "ns2/svc2:p80 has no local endpoints"
        assert "--dport 3001" in r.text and "-j DROP" in r.text
    # the ExternalIP and the LB IP of svc2 are dropped the same way
    for ip in ("192.168.99.22", "1.2.3.4"):
        assert [x.reason for x in m.verdict_rules(ip, 80, include_invalid=False)] == ["no_local_endpoint"]
        assert m.lookup(ip, 80).no_local_endpoints
    # ClusterIP traffic of svc2 is internal: eTP=Local does not apply
    assert not m.lookup("172.30.0.42", 80).no_local_endpoints
    assert m.verdict_rules("172.30.0.42", 80, include_invalid=False) == []


def test_svc6_no_endpoints_reject(overall):
    form, m = overall
    s = m.lookup("172.30.0.46", 80)
    assert (s.name, s.kind, s.no_endpoints, s.endpoints) == ("ns6/svc6:p80", "clusterip", True, ())
    r = m.verdict_rules("172.30.0.46", 80, include_invalid=False)[0]
    assert (r.verdict, r.reason, r.service) == ("reject", "no_endpoints", "ns6/svc6:p80")
    if form in ("knft", "nftlist"):
        assert "goto reject-chain" in r.text
    else:
        assert r.chain == "KUBE-SERVICES" and "-j REJECT" in r.text


def test_healthcheck_port(overall):
    form, m = overall
    s = m.lookup("192.168.0.2", 30000)
    if form in ("knft", "nftlist"):
        assert s is None  # nft mode writes no rule for the health check port
    else:
        assert (s.name, s.kind, s.health_check_port) == ("ns2/svc2:p80", "healthcheck", 30000)


def test_lb_source_range(overall):
    form, m = overall
    rules = m.verdict_rules("5.6.7.8", 80, include_invalid=False)
    assert [r.reason for r in rules] == ["lb_source_range"]
    assert rules[0].service == "ns5/svc5:p80"
    # inside loadBalancerSourceRanges 203.0.113.0/25: not dropped; outside: dropped
    assert [r for r in m.matching_drop_rules("203.0.113.2", "5.6.7.8", 80) if r.reason == "lb_source_range"] == []
    hit = [r for r in m.matching_drop_rules("203.0.113.200", "5.6.7.8", 80) if r.reason == "lb_source_range"]
    assert len(hit) == 1 and hit[0].verdict == "drop"
    # NodePorts bypass the LB firewall
    assert not [r for r in m.verdict_rules("192.168.0.2", 3002) if r.reason == "lb_source_range"]


def test_invalid_drop_iptables():
    for name in ("iptables-overall.rules", "derived/iptables-overall.iptables-save",
                 "iptables-etp-local-local-endpoint.rules", "iptables-etp-cluster-nodeport.rules"):
        m = load(name)
        inv = [r for r in m.rules if r.reason == "conntrack_invalid"]
        assert len(inv) == 1, name
        r = inv[0]
        assert (r.table, r.chain, r.verdict, r.position) == ("filter", "KUBE-FORWARD", "drop", 1)
        assert "--ctstate INVALID" in r.text
        # last in verdict_rules, left out on request
        assert m.verdict_rules("192.168.0.2", 3001)[-1] is r
        assert r not in m.verdict_rules("192.168.0.2", 3001, include_invalid=False)
        # matched for an INVALID packet only
        assert r in m.matching_drop_rules("203.0.113.2", "10.180.0.1", 80, ctstate="INVALID")
        assert r not in m.matching_drop_rules("203.0.113.2", "10.180.0.1", 80, ctstate="ESTABLISHED")
        assert r in m.matching_drop_rules("203.0.113.2", "10.180.0.1", 80, ctstate=None)  # unknown: possible


def test_walk_follows_base_chain_jumps():
    # the iptables-save form carries kube-proxy's base-chain jumps: the walk starts there
    m = load("derived/iptables-overall.iptables-save")
    inv = [r for r in m.rules if r.reason == "conntrack_invalid"][0]
    # INVALID packets are dropped on the FORWARD path only, never on INPUT
    assert inv in m.matching_drop_rules("203.0.113.2", "10.180.0.3", 80, ctstate="INVALID", hook="forward")
    assert inv not in m.matching_drop_rules("203.0.113.2", "192.168.0.2", 3003, ctstate="INVALID", hook="input")
    # the eTP=Local NodePort drop is reached from INPUT through KUBE-EXTERNAL-SERVICES
    hit = m.matching_drop_rules("203.0.113.2", "192.168.0.2", 3001, hook="input")
    assert [r.reason for r in hit] == ["no_local_endpoint"]
    # the health-check ACCEPT in KUBE-NODEPORTS ends the INPUT walk before any drop
    assert m.matching_drop_rules("203.0.113.2", "192.168.0.2", 30000, hook="input") == []
    # a non-NEW packet skips the ctstate NEW jumps
    assert m.matching_drop_rules("203.0.113.2", "192.168.0.2", 3001, hook="input", ctstate="ESTABLISHED") == []


def test_v4_and_v6_sections_do_not_mix():
    v4 = "# Generated by iptables-nft-save v1.8.9\n*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -d 10.1.0.0/16 -j DROP\nCOMMIT\n"
    v6 = "# Generated by ip6tables-nft-save v1.8.9\n*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -d fd00::/8 -j DROP\nCOMMIT\n"
    m = parse_iptables_save(v4 + v6)
    assert [r.where() for r in m.rules] == ["filter/FORWARD rule 1", "ip6 filter/FORWARD rule 1"]
    assert [r.where() for r in m.matching_drop_rules("fd01::1", "fd00::5", 80)] == ["ip6 filter/FORWARD rule 1"]
    twice = parse_iptables_save(v4 + v4)
    assert [r.where() for r in twice.rules] == ["filter/FORWARD rule 1", "filter#2/FORWARD rule 1"]


def test_nft_has_no_invalid_drop_but_clusterip_checks():
    m = load("nft-overall.nft")
    assert not [r for r in m.rules if r.reason == "conntrack_invalid"]
    # wrong port on a live ClusterIP: cluster-ips-check reject; unallocated ClusterIP: drop
    r = m.verdict_rules("172.30.0.41", 81)
    assert [(x.chain, x.verdict) for x in r] == [("cluster-ips-check", "reject"), ("cluster-ips-check", "drop")]
    assert m.matching_drop_rules("203.0.113.2", "172.30.0.41", 81)[0].verdict == "reject"
    assert [x.verdict for x in m.matching_drop_rules("203.0.113.2", "172.30.0.99", 80)] == ["drop"]
    # a live Service port is DNATed before the filter hooks: nothing to drop
    assert m.matching_drop_rules("203.0.113.2", "172.30.0.41", 80) == []
    # svc6's ClusterIP has no endpoints: its reject-chain element comes first
    first = m.matching_drop_rules("203.0.113.2", "172.30.0.46", 80)[0]
    assert (first.reason, first.chain) == ("no_endpoints", "no-endpoint-services")


@pytest.mark.parametrize("name", ["iptables-etp-local-local-endpoint.rules",
                                  "derived/iptables-etp-local-local-endpoint.iptables-save"])
def test_etp_local_with_local_endpoint(name):
    m = load(name)
    s = m.lookup("192.168.0.2", 3001)
    assert (s.name, s.kind, s.etp_local) == ("ns1/svc1:p80", "nodeport", True)
    assert s.endpoints == ("10.180.0.1:80", "10.180.2.1:80")
    assert s.local_endpoints == ("10.180.2.1:80",)
    assert not s.no_local_endpoints and not s.no_endpoints
    assert s.health_check_port == 30000
    assert m.verdict_rules("192.168.0.2", 3001, include_invalid=False) == []
    assert m.lookup("192.168.99.11", 80).kind == "externalip"
    assert m.lookup("1.2.3.4", 80).kind == "loadbalancer"
    assert m.lookup("10.180.2.1", 80).name == "ns1/svc1:p80"
    assert m.lookup("192.168.0.2", 30000).kind == "healthcheck"


@pytest.mark.parametrize("name", ["iptables-nodeport-no-endpoints.rules",
                                  "derived/iptables-nodeport-no-endpoints.iptables-save"])
def test_nodeport_no_endpoints(name):
    m = load(name)
    s = m.lookup("192.168.0.2", 3001)
    assert (s.name, s.kind, s.no_endpoints, s.endpoints) == ("ns1/svc1:p80", "nodeport", True, ())
    r = m.verdict_rules("192.168.0.2", 3001, include_invalid=False)
    assert [(x.reason, x.verdict, x.chain) for x in r] == [("no_endpoints", "reject", "KUBE-EXTERNAL-SERVICES")]
    assert r[0].comment == "ns1/svc1:p80 has no endpoints"
    c = m.lookup("172.30.0.42", 80)
    assert (c.name, c.kind, c.no_endpoints) == ("ns1/svc1:p80", "clusterip", True)
    assert m.verdict_rules("172.30.0.42", 80, include_invalid=False)[0].reason == "no_endpoints"
    assert m.lookup("192.168.0.2", 30000).health_check_port == 30000


@pytest.mark.parametrize("name", ["iptables-etp-cluster-nodeport.rules",
                                  "derived/iptables-etp-cluster-nodeport.iptables-save"])
def test_etp_cluster_nodeport(name):
    m = load(name)
    s = m.lookup("192.168.0.2", 3001)
    assert (s.name, s.kind, s.etp_local, s.endpoints) == ("ns1/svc1:p80", "nodeport", False, ("10.180.0.1:80",))
    assert not s.no_local_endpoints and not s.no_endpoints and s.health_check_port is None
    assert m.verdict_rules("192.168.0.2", 3001, include_invalid=False) == []
    assert m.lookup("10.180.0.1", 80).kind == "endpoint"


def test_restore_and_save_forms_agree():
    for base in ("iptables-overall", "iptables-etp-local-local-endpoint", "iptables-nodeport-no-endpoints",
                 "iptables-etp-cluster-nodeport"):
        a, b = load(f"{base}.rules"), load(f"derived/{base}.iptables-save")
        assert a.names == b.names
        for n in a.names:
            sa, sb = a.service(n), b.service(n)
            assert sa == sb, n
        assert [(r.chain, r.reason, r.verdict) for r in a.rules] == \
            sorted([(r.chain, r.reason, r.verdict) for r in b.rules], key=[(r.chain, r.reason, r.verdict) for r in a.rules].index)


def test_knftables_and_list_forms_agree():
    a, b = load("nft-overall.nft"), load("derived/nft-overall.nft-list")
    assert a.names == b.names
    for n in a.names:
        assert a.service(n) == b.service(n), n
    assert sorted((r.chain, r.reason, r.verdict) for r in a.rules) == \
        sorted((r.chain, r.reason, r.verdict) for r in b.rules)


# --------------------------------------------------------------------------------------------
# generic (non-kube-proxy) rules

FIREWALL_IPT = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:NETPOL - [0:0]
-A FORWARD -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A FORWARD -s 10.0.0.0/16 -j ACCEPT
-A FORWARD -d 10.244.1.0/24 -p tcp -m tcp --dport 8080 -j DROP
-A FORWARD -i eth0 ! -o cni+ -p udp -m multiport --dports 53,1000:2000 -j REJECT --reject-with icmp-port-unreachable
-A FORWARD -j NETPOL
-A NETPOL -m comment --comment "deny to db" ! -s 10.244.2.0/24 -d 10.244.3.4/32 -p tcp -m tcp --dport 5432 -j DROP
-A NETPOL -m mark --mark 0x10000/0x10000 -j DROP
COMMIT
"""

FIREWALL_NFT = """table inet filter { # handle 7
\tset blocked { # handle 3
\t\ttype ipv4_addr
\t\tflags interval
\t\telements = { 1.1.1.1, 10.9.0.0/16 }
\t}

\tchain forward { # handle 1
\t\ttype filter hook forward priority filter; policy drop;
\t\tct state established,related accept # handle 4
\t\tip saddr 10.0.0.0/16 accept # handle 5
\t\tip daddr 10.244.1.0/24 tcp dport 8080 counter packets 3 bytes 180 drop # handle 6
\t\tiifname "eth0" oifname != "cni*" udp dport { 53, 1000-2000 } reject with icmp type port-unreachable # handle 8
\t\tip saddr @blocked drop comment "blocklist" # handle 9
\t\tct state invalid drop # handle 10
\t\tmeta mark 0x00010000 drop # handle 11
\t}
}
"""


@pytest.mark.parametrize("text,parser,table", [(FIREWALL_IPT, parse_iptables_save, "filter"),
                                               (FIREWALL_NFT, parse_nft, "inet filter")])
def test_generic_forward_drop(text, parser, table):
    m = parser(text)
    assert m.ignored == 0 and len(m) == 0
    hit = m.matching_drop_rules("192.168.5.5", "10.244.1.7", 8080)
    # the DROP for 10.244.1.0/24:8080 certainly matches: nothing after it in its chain counts
    assert hit[0].reason == "other" and hit[0].verdict == "drop"
    assert hit[0].where() == f"{table}/{'FORWARD' if table == 'filter' else 'forward'} rule 3"
    assert "dst 10.244.1.0/24" in hit[0].match and "dport 8080" in hit[0].match
    assert not any(r.comment == "chain policy" for r in hit)
    # no certain drop for port 80: the mark rule may match (not evaluated), then the DROP policy
    other = m.matching_drop_rules("192.168.5.5", "10.244.1.7", 80)
    assert any("not evaluated" in r.match and "mark" in r.match for r in other)
    assert any(r.comment == "chain policy" and r.verdict == "drop" for r in other)
    # accepted before the DROP: nothing (the walk stops at the certain ACCEPT)
    assert m.matching_drop_rules("10.0.3.3", "10.244.1.7", 8080) == []
    # established traffic is accepted first as well
    assert m.matching_drop_rules("192.168.5.5", "10.244.1.7", 8080, ctstate="ESTABLISHED") == []
    # another port: not that rule
    assert all("8080" not in r.text for r in m.matching_drop_rules("192.168.5.5", "10.244.1.7", 80))


def test_generic_iface_multiport_negation():
    m = parse_iptables_save(FIREWALL_IPT)
    rej = [r for r in m.matching_drop_rules("192.168.5.5", "8.8.8.8", 1500, "udp", iif="eth0", oif="ens3")
           if r.verdict == "reject"]
    assert len(rej) == 1 and rej[0].position == 4
    assert not [r for r in m.matching_drop_rules("192.168.5.5", "8.8.8.8", 1500, "udp", iif="eth0", oif="cni0")
                if r.verdict == "reject"]
    assert not [r for r in m.matching_drop_rules("192.168.5.5", "8.8.8.8", 999, "udp", iif="eth0", oif="ens3")
                if r.verdict == "reject"]
    # interface unknown: a possible match
    assert [r for r in m.matching_drop_rules("192.168.5.5", "8.8.8.8", 53, "udp") if r.verdict == "reject"]
    # custom chain, negated source
    db = [r for r in m.matching_drop_rules("10.244.9.9", "10.244.3.4", 5432) if r.comment == "deny to db"]
    assert len(db) == 1 and db[0].where() == "filter/NETPOL rule 1"
    assert not [r for r in m.matching_drop_rules("10.244.2.9", "10.244.3.4", 5432) if r.comment == "deny to db"]


def test_generic_nft_sets_handles_invalid():
    m = parse_nft(FIREWALL_NFT)
    blocked = [r for r in m.matching_drop_rules("10.9.1.1", "192.0.2.1", 443) if r.comment == "blocklist"]
    assert len(blocked) == 1 and blocked[0].handle == 9 and blocked[0].text == 'ip saddr @blocked drop comment "blocklist"'
    assert not [r for r in m.matching_drop_rules("10.8.1.1", "192.0.2.1", 443) if r.comment == "blocklist"]
    inv = [r for r in m.rules if r.reason == "conntrack_invalid"]
    assert len(inv) == 1 and inv[0].handle == 10
    assert inv[0] in m.matching_drop_rules("192.0.2.9", "192.0.2.1", 443, ctstate="INVALID")


def test_kube_proxy_plus_firewall_merge():
    kp = load("iptables-overall.rules")
    fw = parse_nft(FIREWALL_NFT)
    m = merge(kp, fw)
    assert m.names == kp.names and m.backends == ("iptables", "nft")
    assert m.lookup("192.168.0.2", 3001).no_local_endpoints
    assert [r.reason for r in m.verdict_rules("192.168.0.2", 3001, include_invalid=False)] == ["no_local_endpoint"]
    tables = {r.table for r in m.matching_drop_rules("192.168.5.5", "10.244.1.7", 8080)}
    assert tables >= {"inet filter"}
    # two dumps with the same table names (iptables-nft and legacy side by side) stay apart
    a = parse_iptables_save(FIREWALL_IPT, backend="iptables-nft")
    b = parse_iptables_save(FIREWALL_IPT.replace("10.244.1.0/24", "10.99.0.0/16"), backend="iptables-legacy")
    ab = merge(a, b)
    hit = ab.matching_drop_rules("192.168.5.5", "10.99.1.1", 8080)
    assert [(r.backend, r.where()) for r in hit if "8080" in r.text] == [("iptables-legacy", "filter/FORWARD rule 3")]
    assert len(ab.rules) == 2 * len(a.rules)
    # merging two dumps of one Service (e.g. IPv4 and IPv6) unites its facts
    v6 = parse_iptables_save(IPV6)
    both = merge(kp, v6)
    assert both.lookup("fd00:172:30::41", 80).name == "ns1/svc1:p80"
    assert both.lookup("172.30.0.41", 80).name == "ns1/svc1:p80"
    assert both.service("ns1/svc1:p80").endpoints == ("10.180.0.1:80", "[fd00:10:180::1]:80")


IPV6 = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
:KUBE-SEP-AAAAAAAAAAAAAAAA - [0:0]
-A KUBE-SERVICES -d fd00:172:30::41/128 -p tcp -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> [fd00:10:180::1]:80" -j KUBE-SEP-AAAAAAAAAAAAAAAA
-A KUBE-SEP-AAAAAAAAAAAAAAAA -p tcp -m comment --comment "ns1/svc1:p80" -m tcp -j DNAT --to-destination [fd00:10:180::1]:80
COMMIT
"""


def test_ipv6_iptables_and_nft():
    m = parse_iptables_save(IPV6)
    assert m.lookup("fd00:172:30:0::41", 80).kind == "clusterip"  # any spelling of the address
    assert m.lookup("fd00:10:180::1", 80).kind == "endpoint"
    nft = """table ip6 kube-proxy {
\tmap service-ips {
\t\ttype ipv6_addr . inet_proto . inet_service : verdict
\t\telements = { fd00:172:30::41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }
\t}
\tchain service-ULMVA6XW-ns1/svc1/tcp/p80 {
\t\tnumgen random mod 1 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__fd00.10.180..1/80 }
\t}
\tchain endpoint-5OJB2KTY-ns1/svc1/tcp/p80__fd00.10.180..1/80 {
\t\tmeta l4proto tcp dnat ip6 to [fd00:10:180::1]:80
\t}
}
"""
    n = parse_nft(nft)
    s = n.lookup("fd00:172:30::41", 80)
    assert (s.name, s.kind, s.endpoints) == ("ns1/svc1:p80", "clusterip", ("[fd00:10:180::1]:80",))


def test_pre_v125_mark_drop_rules():
    # the "no local endpoints" shape of kube-proxy before kubernetes/kubernetes#110290 (v1.25):
    # a nat KUBE-XLB chain ending in KUBE-MARK-DROP, dropped by kubelet's KUBE-FIREWALL
    text = """*nat
:KUBE-NODEPORTS - [0:0]
:KUBE-XLB-GNZBNJ2PO5MGZ6GT - [0:0]
-A KUBE-NODEPORTS -p tcp -m comment --comment "ns2/svc2:p80" -m tcp --dport 3001 -j KUBE-XLB-GNZBNJ2PO5MGZ6GT
-A KUBE-XLB-GNZBNJ2PO5MGZ6GT -m comment --comment "ns2/svc2:p80 has no local endpoints" -j KUBE-MARK-DROP
COMMIT
*filter
:KUBE-FIREWALL - [0:0]
-A KUBE-FIREWALL -m comment --comment "kubernetes firewall for dropping marked packets" -m mark --mark 0x8000/0x8000 -j DROP
COMMIT
"""
    m = parse_iptables_save(text)
    s = m.lookup("192.168.0.2", 3001)
    assert s.name == "ns2/svc2:p80" and s.etp_local and s.no_local_endpoints
    r = m.verdict_rules("192.168.0.2", 3001)
    assert r[0].reason == "no_local_endpoint" and r[0].chain == "KUBE-XLB-GNZBNJ2PO5MGZ6GT"
    assert "KUBE-FIREWALL" in r[0].match


def test_iptables_S_and_counters_forms():
    text = FIREWALL_IPT
    s_form = "\n".join(ln for ln in text.splitlines() if ln.startswith("-A"))
    s_form = "-P INPUT ACCEPT\n-P FORWARD DROP\n-N NETPOL\n" + s_form
    a = parse_iptables_save(s_form)
    assert a.ignored == 0
    assert [r.where() for r in a.matching_drop_rules("192.168.5.5", "10.244.1.7", 8080)][0] == "filter/FORWARD rule 3"
    c_form = re.sub(r"^-A", "[12:720] -A", text, flags=re.M)
    b = parse_iptables_save(c_form)
    assert b.ignored == 0 and [r.text for r in b.rules] == [r.text for r in parse_iptables_save(text).rules]


def test_nft_handles_from_list_a():
    text = (FIX / "derived/nft-overall.nft-list").read_text()
    # what `nft -a list ruleset` adds: "# handle N" after tables, chains, sets and rules
    n = iter(range(1, 10_000))
    with_handles = re.sub(r"(\{|[^{}\s])$", lambda mm: f"{mm.group(1)} # handle {next(n)}", text, flags=re.M)
    m = parse_nft(with_handles)
    assert m.names == load("derived/nft-overall.nft-list").names and m.ignored == 0
    fw = m.verdict_rules("5.6.7.8", 80, include_invalid=False)[0]
    assert fw.handle is not None and "# handle" not in fw.text
    assert m.lookup("192.168.0.2", 3001).no_local_endpoints


def test_rule_and_service_types():
    m = load("iptables-overall.rules")
    for r in m.rules:
        assert isinstance(r, Rule) and r.reason in REASONS and r.verdict in ("drop", "reject")
        assert r.match
    for n in m.names:
        for kind in KINDS:
            s = m.service(n, kind)
            assert s.name == n and s.kind == kind
    hash(m.lookup("192.168.0.2", 3001))  # frozen: usable as a dict key
    with pytest.raises(Exception):
        m.lookup("192.168.0.2", 3001).name = "x"


# --------------------------------------------------------------------------------------------
# junk input

JUNK = [
    "",
    "\x00\xff garbage \x01",
    "*filter\n-A\n-A FORWARD -m comment --comment \"unterminated -j DROP\nCOMMIT\n",
    "*nat\n-A KUBE-SERVICES -m comment --comment \"ns/s:p cluster IP\" -d not-an-ip --dport x -j KUBE-SVC-X\nCOMMIT",
    "*nat\n-A KUBE-SEP-X -m comment --comment ns/s:p -j DNAT --to-destination 10.1.1.1:port\n:\nCOMMIT",
    ":FOO DROP\n-P\n-N\n[12:34\n",
    "table ip kube-proxy {\n map service-ips {\n elements = { 1.2.3 . tcp . 80 : goto service-XX-a/b/c/d,\n",
    "add\nadd rule\nadd rule ip\nadd element ip kube-proxy service-ips { x . y : goto nowhere }\n"
    "add element ip kube-proxy no-endpoint-nodeports { tcp . abc comment \"n/s:p\" : drop }\n}\n}\n",
    "table ip t {\n chain c {\n ip saddr { 1.2.3.4, drop\n }\n}\n flush ruleset\n",
]


@pytest.mark.parametrize("text", JUNK)
def test_junk_does_not_crash(text):
    for parser in (parse_iptables_save, parse_nft):
        m = parser(text)
        m.lookup("1.2.3.4", 80)
        m.verdict_rules("1.2.3.4", 80)
        m.matching_drop_rules("1.2.3.4", "5.6.7.8", 80)
        m.matching_drop_rules(None, None, None, ctstate=None)
        _ = m.rules


def test_junk_lines_are_counted():
    text = (FIX / "iptables-overall.rules").read_text()
    bad = text.replace("COMMIT\n*nat", "this is not iptables\n-A\nCOMMIT\n*nat", 1)
    m = parse_iptables_save(bad)
    assert m.ignored == 2 and m.names == load("iptables-overall.rules").names
    nft = (FIX / "nft-overall.nft").read_text() + "bogus line\nadd widget ip kube-proxy x\n"
    assert parse_nft(nft).ignored == 2


def test_mutated_fixtures_do_not_crash():
    rng = random.Random(1234)
    for name in ("iptables-overall.rules", "nft-overall.nft", "derived/nft-overall.nft-list",
                 "derived/iptables-overall.iptables-save"):
        lines = (FIX / name).read_text().splitlines()
        for _ in range(40):
            ls = list(lines)
            for _ in range(5):
                i = rng.randrange(len(ls))
                op = rng.randrange(4)
                if op == 0:
                    ls[i] = ls[i][: rng.randrange(len(ls[i]) + 1)]
                elif op == 1:
                    del ls[i]
                elif op == 2:
                    ls.insert(i, ls[rng.randrange(len(ls))])
                else:
                    ls[i] = ls[i].replace(rng.choice(['"', "{", "}", " ", "."]), "", 1)
            text = "\n".join(ls)
            for parser in (parse_iptables_save, parse_nft):
                m = parser(text)
                m.lookup("192.168.0.2", 3001)
                m.verdict_rules("172.30.0.46", 80)
                m.matching_drop_rules("203.0.113.2", "5.6.7.8", 80)


# --------------------------------------------------------------------------------------------
# scale: ~10k Services in the fixture pattern

_HASH = re.compile(r"(KUBE-(?:SVC|SEP|EXT|FW|SVL|XLB)-)([A-Z0-9]{16})")
_NAME = re.compile(r"\bns(\d)/svc(\d)\b")
_IP = re.compile(r"\b(172\.30\.0\.4(\d)|10\.180\.0\.(\d)|10\.180\.2\.1|192\.168\.99\.(\d\d)|1\.2\.3\.4|5\.6\.7\.8)\b")
_NP = re.compile(r"(--dport |tcp \. )(300[123])\b")


def _copy(line: str, k: int) -> str:
    """Service k of the synthetic ruleset: unique names, chain hashes, addresses and ports."""
    a, b = divmod(k, 250)

    def ip(m):
        s = m.group(1)
        if s.startswith("172.30"):
            return f"172.{30 + a}.{b}.4{m.group(2)}"
        if s.startswith("10.180.0"):
            return f"10.{100 + a}.{b}.{m.group(3)}"
        if s == "10.180.2.1":
            return f"10.{100 + a}.{b}.9"
        if s.startswith("192.168.99"):
            return f"192.{100 + a}.{b}.{m.group(4)}"
        return f"11.{a}.{b}.{4 if s == '1.2.3.4' else 8}"

    line = _HASH.sub(lambda m: f"{m.group(1)}{m.group(2)[:10]}{k:06d}", line)
    line = _NAME.sub(lambda m: f"ns{m.group(1)}-{k}/svc{m.group(2)}", line)
    line = _IP.sub(ip, line)
    line = _NP.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + 3 * k + 3000}", line)
    return line.replace("--dport 30000 ", f"--dport {40000 + k} ")


def synth_iptables(text: str, copies: int) -> str:
    out, decl, rules, tail = [], [], [], []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if line.startswith("*"):
            out.append(line)
        elif line == "COMMIT":
            for group in (decl, rules):
                for k in range(copies):
                    out.extend(_copy(x, k) for x in group if _NAME.search(x) or _HASH.search(x))
                out.extend(x for x in group if not (_NAME.search(x) or _HASH.search(x)))
            out.extend(tail)
            out.append(line)
            decl, rules, tail = [], [], []
        elif line.startswith(":"):
            decl.append(line)
        else:
            (rules if _NAME.search(line) or _HASH.search(line) else tail).append(line)
    return "\n".join(out) + "\n"


def synth_nft(text: str, copies: int) -> str:
    lines = [x for x in text.splitlines() if x.startswith("add ")]
    base = [x for x in lines if not _NAME.search(x) or "nodeport-ips" in x]
    svc = [x for x in lines if _NAME.search(x) and "nodeport-ips" not in x]
    return "\n".join(base + [_copy(x, k) for k in range(copies) for x in svc]) + "\n"


COPIES = 1667  # x 6 Services = 10,002


@pytest.mark.parametrize("name,synth,parser", [
    ("derived/iptables-overall.iptables-save", synth_iptables, parse_iptables_save),
    ("iptables-overall.rules", synth_iptables, parse_iptables_restore),
    ("nft-overall.nft", synth_nft, parse_nft),
])
def test_10k_services_parse_fast(name, synth, parser):
    text = synth((FIX / name).read_text(), COPIES)
    best = float("inf")
    for _ in range(2):
        t0 = time.process_time()
        m = parser(text)
        best = min(best, time.process_time() - t0)
    assert len(m) == 6 * COPIES and m.ignored == 0
    # speed is measured, not asserted (CI machines are shared): print it for the log
    print(f"parsed {len(text.splitlines())} lines in {best:.2f} s")
    k = 1234
    a, b = divmod(k, 250)
    s = m.lookup("192.168.0.2", 3001 + 3 * k + 3000)
    assert (s.name, s.kind, s.no_local_endpoints) == (f"ns2-{k}/svc2:p80", "nodeport", True)
    assert m.lookup(f"172.{30 + a}.{b}.46", 80).no_endpoints
    t0 = time.perf_counter()
    for _ in range(10_000):
        m.lookup(f"172.{30 + a}.{b}.43", 80)
    print(f"lookups: {time.perf_counter() - t0:.3f} s")  # dict hits, not a scan
    t0 = time.perf_counter()
    for _ in range(200):
        r = m.matching_drop_rules("203.0.113.2", f"172.{30 + a}.{b}.46", 80)
    print(f"verdict rules: {time.perf_counter() - t0:.3f} s")  # indexed, not a 10k-rule walk
    assert r[0].reason == "no_endpoints" and r[0].service == f"ns6-{k}/svc6:p80"
