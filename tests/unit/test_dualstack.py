"""Dual-stack: the lab's IPv6 twin of a scenario, kube-proxy's IPv6 rules (ip6tables, nft ip6)
rendered and parsed back, family-scoped rules, ICMPv6 unreachables as causes.

The fixtures under tests/fixtures/dualstack/ are node1's real `iptables-save`, `ip6tables-save`
(iptables-nft 1.8.9) and `nft list ruleset` of the lab's dual-stack forms (`nptrace lab up
SCENARIO --variant ipv6`)."""
from pathlib import Path

import pytest

from nptrace.classify.rules import unreach
from nptrace.lab import dualstack, hostplan, kuberules, model
from nptrace.lab.errors import UsageError
from nptrace.services import merge, parse_iptables_restore, parse_iptables_save, parse_nft

FIX = Path(__file__).parent.parent / "fixtures" / "dualstack"
MAP = dualstack.Mapper(model.load_topology()["ipv6"])
DUAL = ("no-listener", "networkpolicy-drop", "etp-local-no-endpoint", "no-endpoints", "missing-snat",
        "wrong-interface", "stale-endpoint", "app-reset", "healthy", "conntrack-invalid",
        "rollout-in-flight", "container-restart")


def test_twin_keeps_the_offset_and_grows_the_prefix():
    assert MAP.addr("192.168.10.100") == "fd00:10::64"
    assert MAP.addr("10.244.1.10/24") == "fd00:244::10a/120"
    assert MAP.addr("10.244.0.16/28") == "fd00:244::10/124"
    assert MAP.addr("10.96.0.80") == "fd00:96::50"
    assert MAP.addr("192.168.50.11") is None          # the underlay stays IPv4
    assert MAP.line("default via 192.168.10.1") == "::/0 via fd00:10::1"
    assert MAP.line("192.168.50.0/24 dev ul0") is None
    with pytest.raises(UsageError, match="192.168.50.1 has no IPv6 twin"):
        MAP.text("-s 192.168.50.1", "host x")


def test_scenarios_with_an_ipv6_form():
    got = {s.name for s in model.load_scenarios() if dualstack.VARIANT in s.variants}
    assert got == set(DUAL)
    with pytest.raises(UsageError, match="no variant 'ipv6'"):   # no reverse-path filter for IPv6
        model.compile_spec("rp-filter-asymmetric", "ipv6")


def test_a_variant_with_its_own_dual_stack_form():
    """rp-filter's underlay variant: IPv6 pod traffic inside the IPv4 VXLAN underlay meets the
    IPv4 rp_filter, so it has a form `underlay+ipv6` (the variant, then the twins)."""
    assert model.get("rp-filter-asymmetric").variants == ("underlay", "underlay+ipv6")
    sp = model.compile_spec("rp-filter-asymmetric", "underlay+ipv6")
    assert sp.ipv6 and sp.trigger[0]["dst"] == "fd00:10::b"
    assert sp.hosts["node1"]["ifaces"]["flannel.1"]["local"] == "192.168.10.11"   # the variant's
    assert [e.ip for e in sp.services6[0].endpoints] == ["fd00:244::10a", "fd00:244::10b"]
    assert sp.hosts["node2"]["sysctl"]["net.ipv4.conf.all.rp_filter"] == 1


@pytest.mark.parametrize("name", DUAL)
def test_dual_stack_spec(name):
    sp = model.compile_spec(name, "ipv6")
    assert sp.ipv6 and all(":" in t["dst"] for t in sp.trigger)
    assert sp.cluster_cidr6 == "fd00:244::/112" and sp.service_cidr6 == "fd00:96::/112"
    web = next(s for s in sp.services6 if s.name == "web")
    assert web.cluster_ip == "fd00:96::50" and all(":" in e.ip for e in web.endpoints)
    n1 = sp.hosts["node1"]
    assert "fd00:10::b/120" in n1["ifaces"]["eth0"]["addrs"]
    assert n1["ifaces"]["flannel.1"]["addrs"] == ["10.244.0.0/32"]      # no anycast twin
    assert "fd00:244::100/120 via fd00:244::100 dev flannel.1 onlink" in n1["routes"]
    assert n1["sysctl"]["net.ipv6.conf.all.forwarding"] == 1
    v4 = model.compile_spec(name)
    assert [s.cluster_ip for s in v4.services] == [s.cluster_ip for s in sp.services]   # IPv4 kept


def test_steps_get_their_ipv6_twins():
    """A held-connection scenario's commands reach the IPv6 side too: the neighbour flush of
    the dead address is followed by its twin's, a neighbour sysctl gets its IPv6 key."""
    assert model.get("rollout-in-flight").variants == ("across-nodes", "address-reused", "at-once",
                                                       "at-once-scale", "ipv6", "address-reused+ipv6")
    runs = [st["argv"] for st in model.compile_spec("rollout-in-flight", "ipv6").steps if st["kind"] == "run"]
    assert runs == [["sysctl", "-qw", "net.ipv4.neigh.cni0.retrans_time_ms=250",
                     "net.ipv6.neigh.cni0.retrans_time_ms=250"],
                    ["ip", "neigh", "flush", "to", "10.244.0.10", "dev", "cni0"],
                    ["ip", "neigh", "flush", "to", "fd00:244::a", "dev", "cni0"]]
    sp = model.compile_spec("rollout-in-flight", "address-reused+ipv6")
    assert [st["kind"] for st in sp.steps] == ["rules", "wait", "delete_pod", "run", "run", "add_pod"]
    assert "fd00:244::a/120" in sp.hosts["other-0"]["ifaces"]["eth0"]["addrs"]
    assert [e.ip for e in sp.steps[0]["compiled6"][0].endpoints] == ["fd00:244::10a", "fd00:244::10b"]
    kept = [{"kind": "run", "host": "node1", "argv": ["ip", "route", "add", "192.168.50.0/24", "dev", "ul0"]}]
    assert dualstack.twin_steps(MAP, kept) == kept     # the underlay has no twin: no copy


def test_networkpolicy_text_is_twinned_for_ip6tables():
    sp = model.compile_spec("networkpolicy-drop", "ipv6")
    text = sp.hosts["node1"]["ip6tables_restore"]
    assert "-d fd00:244::a/128" in text and "-s fd00:244::10/124" in text
    steps = [s.argv[0] for s in hostplan.firewall_steps(sp, "node1", "iptables-legacy")]
    assert steps == ["iptables-legacy-restore", "ip6tables-legacy-restore"]


@pytest.mark.parametrize("backend", ["iptables", "iptables-legacy", "nft"])
def test_both_proxiers_are_loaded(backend):
    sp = model.compile_spec("no-listener", "ipv6")
    tools = [s.argv[0] for s in hostplan.kube_proxy_steps(sp, "node1", backend) if s.input]
    if backend == "nft":
        ins = [s.input.splitlines()[0] for s in hostplan.kube_proxy_steps(sp, "node1", backend)]
        assert ins == ['add table ip kube-proxy { comment "rules for kube-proxy" ; }',
                       'add table ip6 kube-proxy { comment "rules for kube-proxy" ; }']
    else:
        six = "ip6tables-legacy" if backend == "iptables-legacy" else "ip6tables"
        assert tools == [f"{six.replace('ip6', 'ip')}-restore", f"{six}-restore"]


def test_ipv6_endpoint_strings_and_chain_names():
    ep = kuberules.Endpoint("fd00:244::a", 8080, "node1")
    assert str(ep) == "[fd00:244::a]:8080"
    svc = kuberules.Service("default", "web", "http", 80, "fd00:96::50", endpoints=(ep,))
    assert ":" not in kuberules.nft_endpoint_chain(svc, ep)   # not valid in an nft identifier


def _rendered(name, backend):
    sp = model.compile_spec(name, "ipv6")
    if backend == "nft":
        return parse_nft("".join(s.input for s in hostplan.kube_proxy_steps(sp, "node1", "nft")))
    return merge(*(parse_iptables_restore(s.input) for s in hostplan.kube_proxy_steps(sp, "node1", backend)
                   if s.input))


@pytest.mark.parametrize("backend", ["iptables", "nft"])
def test_rendered_ipv6_rules_name_the_service(backend):
    m = _rendered("no-listener", backend)
    for addr, port, kind in (("fd00:10::b", 30080, "nodeport"), ("fd00:96::50", 80, "clusterip"),
                             ("fd00:244::10a", 8080, "endpoint"), ("192.168.10.11", 30080, "nodeport")):
        s = m.lookup(addr, port)
        assert s is not None and (s.name, s.kind) == ("default/web:http", kind), addr


def _fixture(name, kind):
    if kind == "nft":
        return parse_nft((FIX / f"{name}.node1.nft-list").read_text())
    v4, v6 = ((FIX / f"{name}.node1.{t}-save").read_text() for t in ("iptables", "ip6tables"))
    return parse_iptables_save(v4 + v6)


@pytest.mark.parametrize("kind", ["iptables", "nft"])
@pytest.mark.parametrize("name,reason", [("no-endpoints", "no_endpoints"),
                                         ("etp-local-no-endpoint", "no_local_endpoint")])
def test_each_family_meets_its_own_tables_rule(name, reason, kind):
    """A dual-stack node has a rule per family: a packet's hint names its own family's."""
    m = _fixture(name, kind)
    for client, node, table in (("192.168.10.100", "192.168.10.11", {"iptables": "filter", "nft": "ip kube-proxy"}),
                                ("fd00:10::64", "fd00:10::b", {"iptables": "ip6 filter", "nft": "ip6 kube-proxy"})):
        assert m.lookup(node, 30080).name == "default/web:http"
        rules = [r for r in m.verdict_rules(node, 30080, include_invalid=False) if r.reason != "other"]
        assert [(r.reason, r.table) for r in rules] == [(reason, table[kind])]
        drops = m.matching_drop_rules(client, node, 30080)
        assert drops and {r.table for r in drops} == {table[kind]}


class _Ev:
    def __init__(self, family, reason):
        self.family, self.reason = family, reason


def test_icmpv6_unreachables_stand_for_their_icmp_codes():
    assert unreach(_Ev(10, 1 << 8 | 3)) == 3 << 8 | 1    # address unreachable: host unreachable
    assert unreach(_Ev(10, 1 << 8 | 4)) == 3 << 8 | 3    # port unreachable
    assert unreach(_Ev(10, 1 << 8 | 1)) == 3 << 8 | 13   # administratively prohibited
    assert unreach(_Ev(2, 3 << 8 | 1)) == 3 << 8 | 1


def test_the_vm_plan_keeps_ipv6_on_for_the_dual_stack_form():
    from nptrace.lab import vm
    for variant, off in ((None, "1"), ("ipv6", "0")):
        cmds = vm.prepare_cmds(model.compile_spec("no-listener", variant), "node1", {"eth0": "ens5"},
                               "netns", "npt-")
        text = " ".join(" ".join(c.argv) for c in cmds)
        assert f"net.ipv6.conf.ens5.disable_ipv6={off}" in text
        assert f"net.ipv6.conf.all.disable_ipv6={off}" in text
