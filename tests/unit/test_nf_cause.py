"""services.nf_cause, the one query behind every netfilter cause, and how classify/rules.py turns
its tag into a cause (pure: kube-proxy fixtures of tests/fixtures/kube-proxy, no root)."""
from __future__ import annotations

from pathlib import Path

import pytest

from nptrace import events as ev
from nptrace.classify import CAUSES, Context, classify
from nptrace.classify.rules import TAG_CAUSES
from nptrace.services import REASONS, nf_cause, parse_iptables_restore, parse_iptables_save, parse_nft

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kube-proxy"
FORMS = {"iptables": ("iptables-overall.rules", parse_iptables_restore),
         "nft": ("nft-overall.nft", parse_nft)}
FIREWALL = """*filter
:FORWARD DROP [0:0]
-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
-A FORWARD -s 10.0.0.0/16 -j ACCEPT
-A FORWARD -d 10.244.1.0/24 -p tcp -m tcp --dport 8080 -j DROP
COMMIT
"""


@pytest.fixture(params=sorted(FORMS), scope="module")
def smap(request):
    name, parser = FORMS[request.param]
    return parser((FIX / name).read_text())


def test_no_local_endpoint(smap):
    # eTP=Local NodePort 3001 of ns2/svc2 without a local endpoint: kube-proxy drops it
    got = nf_cause(smap, "203.0.113.2", "192.168.0.2", 3001, "192.168.0.2", 3001, True, False)
    assert (got["tag"], got["service"], got["to_pod"]) == ("no_local_endpoint", "ns2/svc2:p80", False)
    assert got["where"] and got["text"]


def test_no_endpoints(smap):
    got = nf_cause(smap, "203.0.113.2", "172.30.0.46", 80, "172.30.0.46", 80, True, False)
    assert (got["tag"], got["service"]) == ("no_endpoints", "ns6/svc6:p80")


def test_lb_source_range_by_the_address_the_client_used(smap):
    got = nf_cause(smap, "203.0.113.200", "5.6.7.8", 80, "5.6.7.8", 80, True, False)
    assert (got["tag"], got["service"]) == ("lb_source_range", "ns5/svc5:p80")


def test_conntrack_invalid_only_for_a_mid_connection_packet_without_conntrack():
    m = parse_iptables_restore((FIX / "iptables-overall.rules").read_text())
    got = nf_cause(m, "203.0.113.2", "10.180.0.1", 80, "10.180.0.1", 80, False, False)
    assert got["tag"] == "conntrack_invalid" and "INVALID" in got["text"]
    # a SYN is NEW, never INVALID: the ctstate INVALID drop does not match it
    assert nf_cause(m, "203.0.113.2", "10.180.0.1", 80, "10.180.0.1", 80, True, False) == {"tag": None}


def test_firewall_rule_and_whether_it_was_headed_to_a_pod():
    m = parse_iptables_save(FIREWALL)
    got = nf_cause(m, "192.168.5.5", "10.244.1.7", 8080, "10.244.1.7", 8080, True, False)
    assert (got["tag"], got["where"], got["to_pod"]) == ("other", "filter/FORWARD rule 3", False)
    # DNATed from a Service address to this one: headed to a pod
    got = nf_cause(m, "192.168.5.5", "10.244.1.7", 8080, "10.96.0.10", 80, True, True)
    assert (got["tag"], got["to_pod"]) == ("other", True)


def test_no_rule_for_the_packet():
    m = parse_iptables_save(FIREWALL)
    assert nf_cause(m, "10.0.3.3", "10.244.1.7", 8080, "10.244.1.7", 8080, True, False) == {"tag": None}


def test_every_tag_has_one_cause():
    # "other" is decided per packet (policy_drop to a pod, else netfilter_reject)
    assert set(TAG_CAUSES) == set(REASONS) - {"other"}
    assert {cause for cause, _, _ in TAG_CAUSES.values()} <= set(CAUSES)


@pytest.mark.parametrize("tag,to_pod,cause", [
    ("no_local_endpoint", False, "no_local_endpoint"), ("no_endpoints", False, "no_endpoints"),
    ("lb_source_range", False, "policy_drop"), ("conntrack_invalid", False, "conntrack_invalid"),
    ("other", True, "policy_drop"), ("other", False, "netfilter_reject"),
    (None, False, "netfilter_reject")])
def test_rules_turn_the_answer_into_the_cause(tag, to_pod, cause):
    answer = {"tag": tag, "where": "filter/FORWARD rule 3", "text": "-j DROP",
              "service": "ns/svc:p80", "to_pod": to_pod} if tag else {"tag": None}
    ctx = Context(drop_name=lambda v: "NETFILTER_DROP", nf_rule=lambda *a: answer)
    [v] = classify([ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=1,
                                        saddr="192.168.5.5", sport=4000, daddr="10.244.1.7",
                                        dport=8080, tcpflags=ev.TCP_SYN, ts_ns=1))], ctx)
    assert v.cause == cause
    if tag:
        assert "filter/FORWARD rule 3" in v.hint


def _with_node_firewall(text: str) -> str:
    """The live iptables-save of the overall fixture plus a node firewall's own INVALID drop
    in INPUT (after kube-proxy's jumps), as many distributions install one."""
    lines = text.splitlines()
    i = max(n for n, l in enumerate(lines) if l.startswith("-A INPUT "))
    lines.insert(i + 1, "-A INPUT -m conntrack --ctstate INVALID -j DROP")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("local", [False, True], ids=["addresses-unknown", "addresses-known"])
def test_invalid_drop_names_the_chain_the_packet_crossed(local):
    """INVALID drops in INPUT and FORWARD: a packet to a NodePort is delivered locally (an
    INVALID packet is not DNATed) and meets INPUT's rule; a pod's late reply is forwarded and
    meets KUBE-FORWARD's. Each hint names its own chain, not the first INVALID rule found."""
    m = parse_iptables_save(_with_node_firewall(
        (FIX / "derived" / "iptables-overall.iptables-save").read_text()))
    if local:
        m = m.with_local_addrs(["192.168.0.2", "127.0.0.1"])
    to_nodeport = nf_cause(m, "203.0.113.2", "192.168.0.2", 3003, "192.168.0.2", 3003, False, False)
    assert to_nodeport["tag"] == "conntrack_invalid"
    assert to_nodeport["where"].startswith("filter/INPUT rule "), to_nodeport
    reply = nf_cause(m, "10.180.0.3", "203.0.113.2", 41234, "203.0.113.2", 41234, False, False)
    assert reply["tag"] == "conntrack_invalid"
    assert reply["where"] == "filter/KUBE-FORWARD rule 1", reply


def test_pod_traffic_to_an_etp_local_external_ip_is_not_the_no_local_endpoints_drop():
    """TestTracePacket's "LOCAL, KUBE-MARK-MASQ": pod and node clients of svc2's ExternalIP
    are DNATed to its (remote) endpoints before filter, so a drop of such a packet is not
    KUBE-EXTERNAL-SERVICES' "has no local endpoints" DROP; an external client's is."""
    m = parse_iptables_restore((FIX / "iptables-overall.rules").read_text())
    ext = nf_cause(m, "203.0.113.2", "192.168.99.22", 80, "192.168.99.22", 80, True, False)
    assert (ext["tag"], ext["service"]) == ("no_local_endpoint", "ns2/svc2:p80")
    pod = nf_cause(m, "10.0.0.2", "10.180.0.2", 80, "192.168.99.22", 80, True, True)
    assert pod["tag"] != "no_local_endpoint", pod


def test_nft_pod_and_node_traffic_to_an_etp_local_external_ip_is_not_the_no_local_endpoints_drop():
    """The same on nft (TestOverallNFTablesRules): svc2's external chain short-circuits pod
    (ip saddr 10.0.0.0/8) and node (fib saddr type local) traffic to its endpoints, so only
    an external client meets the no-endpoint-services / no-endpoint-nodeports drop."""
    m = parse_nft((FIX / "nft-overall.nft").read_text()).with_local_addrs(["192.168.0.2", "127.0.0.1"])
    for dst, port in (("192.168.99.22", 80), ("1.2.3.4", 80), ("192.168.0.2", 3001)):
        ext = nf_cause(m, "203.0.113.2", dst, port, dst, port, True, False)
        assert (ext["tag"], ext["service"]) == ("no_local_endpoint", "ns2/svc2:p80"), ext
        for src in ("10.0.0.2", "192.168.0.2"):
            got = nf_cause(m, src, "10.180.0.2", 80, dst, port, True, True)
            assert got["tag"] != "no_local_endpoint", (src, dst, port, got)


POLICY = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POLICY-IN - [0:0]
:POLICY-FWD - [0:0]
-A INPUT -j POLICY-IN
-A FORWARD -j POLICY-FWD
-A POLICY-IN -p tcp -m tcp --dport 8080 -j DROP
-A POLICY-FWD -p tcp -m tcp --dport 8080 -j REJECT --reject-with tcp-reset
COMMIT
"""


def test_a_firewall_drop_names_the_hook_it_was_met_on():
    """The same port dropped by a chain of its own on INPUT and on FORWARD: a packet to the
    node's own address meets INPUT's, one routed on to a pod FORWARD's, and the hint says
    which hook; where the node's addresses are unknown the hook is not guessed."""
    m = parse_iptables_save(POLICY).with_local_addrs(["192.168.10.11"])
    to_node = nf_cause(m, "192.168.10.100", "192.168.10.11", 8080, "192.168.10.11", 8080, True, False)
    assert (to_node["where"], to_node["hook"]) == ("filter/POLICY-IN rule 1", "INPUT"), to_node
    to_pod = nf_cause(m, "192.168.10.100", "10.244.1.10", 8080, "10.244.1.10", 8080, True, False)
    assert (to_pod["where"], to_pod["hook"]) == ("filter/POLICY-FWD rule 1", "FORWARD"), to_pod
    unknown = nf_cause(parse_iptables_save(POLICY), "192.168.10.100", "10.244.1.10", 8080, "10.244.1.10",
                       8080, True, False)
    assert unknown["hook"] is None
    from nptrace.classify.rules import nf_rule_text
    assert nf_rule_text(to_pod) == "filter/POLICY-FWD rule 1, on the FORWARD hook: " \
                                   "`-A POLICY-FWD -p tcp -m tcp --dport 8080 -j REJECT --reject-with tcp-reset`"
    assert nf_rule_text({**to_node, "where": "filter/INPUT rule 2"}).startswith("filter/INPUT rule 2: ")
