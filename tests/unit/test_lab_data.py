"""Repro lab data and rule rendering, without root: scenario files, kube-proxy text, hashes."""
import socket
import threading
from pathlib import Path

import pytest

from nptrace.lab import kuberules, model
from nptrace.lab.hostplan import host_steps, pod_veth
from nptrace.lab.kuberules import Endpoint, Service
from nptrace.lab.server import hc_response

# the repository's copy first (CI), else the shared one on the development machine
FIXTURES = next((p for p in (Path(__file__).parents[1] / "fixtures" / "kube-proxy", Path("/work/shared/kube-proxy"))
                 if p.is_dir()), Path("/work/shared/kube-proxy"))
ALL_CASES = [(s.name, v) for s in model.load_scenarios() for v in (None, *s.variants)]


def fixture_lines(name):
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"kube-proxy fixture {path} not on this machine")
    return [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]


# ---------------------------------------------------------------- scenario files

def test_every_scenario_file_parses_and_names_are_unique():
    scs = model.load_scenarios()
    assert len(scs) == len(model.scenario_files()) >= 11
    names = [s.name for s in scs]
    assert len(set(names)) == len(names)
    for s in scs:
        assert s.story and "\n" not in s.story
        assert s.service == "default/web:http"


@pytest.mark.parametrize("name,variant", ALL_CASES)
def test_scenario_compiles(name, variant):
    spec = model.compile_spec(name, variant)
    assert spec.cause is None or spec.cause in model.CAUSES
    for t in spec.trigger:
        assert set(t["expect"]) <= set(model.OUTCOMES)
    for b in spec.backends:
        for host in spec.hosts:
            for step in host_steps(spec, host, b):
                assert step.argv


def test_causes_cover_the_issue_list():
    causes = {s.name: s.cause for s in model.load_scenarios()}
    assert causes == {
        "etp-local-no-endpoint": "no_local_endpoint", "no-endpoints": "no_endpoints",
        "rp-filter-asymmetric": "rp_filter", "missing-snat": "snat", "wrong-interface": "wrong_iface",
        "networkpolicy-drop": "policy_drop", "no-listener": "no_listener", "stale-endpoint": "proxy",
        "conntrack-invalid": "conntrack_invalid", "app-reset": "app_reset", "healthy": None,
        "rollout-in-flight": "proxy", "container-restart": "app_reset",
        "offload-checksum": "checksum", "conntrack-table-full": "conntrack_full",
        "ipvs-no-endpoints": "no_endpoints", "ipvs-etp-local-no-endpoint": "no_local_endpoint",
        "ipvs-missing-snat": "snat", "ipvs-stale-endpoint": "proxy",
    }


def test_rollout_steps_remove_the_endpoint_then_the_pod():
    """A rollout: the rules lose web-0 before web-0 is deleted; (b) a new pod takes its
    address; the container restart keeps web-0 an endpoint and never re-renders the rules."""
    a = model.compile_spec("rollout-in-flight")
    assert [s["kind"] for s in a.steps] == ["rules", "wait", "delete_pod", "run", "run"]
    [web] = [svc for svc in a.steps[0]["compiled"] if svc.name == "web"]
    assert "10.244.0.10" not in {e.ip for e in web.endpoints}
    assert all(t.get("then") for t in a.trigger)
    assert "other-0" not in a.pods() and "other-0" not in model.compile_spec("rollout-in-flight").hosts
    b = model.compile_spec("rollout-in-flight", "address-reused")
    assert b.steps[-1] == {"kind": "add_pod", "host": "other-0"}
    assert b.hosts["other-0"]["ifaces"]["eth0"]["addrs"][0].startswith("10.244.0.10/")
    assert "other-0" in b.pods(pending=True) and "other-0" not in b.pods()
    r = model.compile_spec("container-restart")
    assert "rules" not in {s["kind"] for s in r.steps} and r.steps[-1]["host"] == "web-0"


def test_steps_need_held_connections(tmp_path, monkeypatch):
    raw = (model.DATA / "scenarios" / "12-container-restart.toml").read_text()
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "topology.toml").write_text((model.DATA / "topology.toml").read_text())
    (tmp_path / "scenarios" / "x.toml").write_text(raw.replace('then = {', 'x_then = {'))
    monkeypatch.setattr(model, "DATA", tmp_path)
    with pytest.raises(model.UsageError, match="held connections"):
        model.compile_spec("container-restart")


def test_nft_backend_for_required_scenarios():
    by = {s.name: s.backends for s in model.load_scenarios()}
    for name in ("etp-local-no-endpoint", "no-endpoints", "missing-snat", "no-listener"):
        assert "nft" in by[name]
    # every scenario has an iptables form but the ipvs-* ones, which are kube-proxy's IPVS mode
    assert all("iptables" in b for n, b in by.items() if not n.startswith("ipvs-"))
    assert all(b == ("ipvs",) for n, b in by.items() if n.startswith("ipvs-"))


def test_deep_merge_tables_merge_and_lists_replace():
    base = {"a": {"x": 1, "y": [1, 2]}, "b": 1}
    assert model.deep_merge(base, {"a": {"y": [3]}, "c": 2}) == {"a": {"x": 1, "y": [3]}, "b": 1, "c": 2}
    assert base["a"]["y"] == [1, 2]


def test_unknown_scenario_and_variant_are_usage_errors():
    with pytest.raises(model.UsageError, match="unknown scenario"):
        model.compile_spec("nope")
    with pytest.raises(model.UsageError, match="no variant"):
        model.compile_spec("no-listener", "nope")


def test_interface_names_fit_and_hosts_are_separable():
    for name, variant in ALL_CASES:
        spec = model.compile_spec(name, variant)
        for h, d in spec.hosts.items():
            assert all(len(i) <= 15 for i in d.get("ifaces", {}))
        assert all(len(pod_veth(p)) <= 15 for p in spec.pods())
        # a node's plan is commands for that node only: no namespace names leak into it
        for step in host_steps(spec, "node1", "iptables"):
            assert "netns" not in step.argv


# ---------------------------------------------------------------- kube-proxy hashes and text

def test_chain_hashes_match_kube_proxy():
    svc3 = Service("ns3", "svc3", "p80", 80, "172.30.0.43", node_port=3003,
                   endpoints=(Endpoint("10.180.0.3", 80, "x"),))
    svc2 = Service("ns2", "svc2", "p80", 80, "172.30.0.42")
    assert kuberules.svc_chain(svc3) == "KUBE-SVC-X27LE4BHSL4DOUIK"
    assert kuberules.ext_chain(svc3) == "KUBE-EXT-X27LE4BHSL4DOUIK"
    assert kuberules.sep_chain(svc3, svc3.endpoints[0]) == "KUBE-SEP-OYPFS5VJICHGATKP"
    assert kuberules.svc_chain(svc2) == "KUBE-SVC-GNZBNJ2PO5MGZ6GT"
    svc1 = Service("ns1", "svc1", "p80", 80, "172.30.0.41")
    assert kuberules.nft_chain_base(svc1) == "ULMVA6XW-ns1/svc1/tcp/p80"
    assert kuberules.nft_endpoint_chain(svc1, Endpoint("10.180.0.1", 80, "x")) == \
        "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"


# TestNodePort's expected dump (danwinship/kubernetes 07fb8ceb), as in the shared fixtures.
ETP_CLUSTER_NODEPORT = """\
*filter
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
*nat
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXT-XPGD46QRK7WJZT7O - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
-A KUBE-NODEPORTS -m comment --comment ns1/svc1:p80 -m tcp -p tcp --dport 3001 -j KUBE-EXT-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-EXT-XPGD46QRK7WJZT7O -m comment --comment "masquerade traffic for ns1/svc1:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-XPGD46QRK7WJZT7O -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE
-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -s 10.180.0.1 -j KUBE-MARK-MASQ
-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80" -j KUBE-SEP-SXIVWICOYRO3J4NJ
COMMIT
"""


def test_render_matches_kube_proxy_nodeport_dump_exactly():
    svc1 = Service("ns1", "svc1", "p80", 80, "172.30.0.41", node_port=3001,
                   endpoints=(Endpoint("10.180.0.1", 80, "other"),))
    assert kuberules.render_iptables([svc1], "node", "10.0.0.0/8") == ETP_CLUSTER_NODEPORT


def test_render_matches_shared_fixtures_exactly():
    svc_local = Service("ns1", "svc1", "p80", 80, "172.30.0.41", node_port=3001, etp="Local",
                        health_check_node_port=30000, external_ips=("192.168.99.11",), lb_ips=("1.2.3.4",),
                        endpoints=(Endpoint("10.180.0.1", 80, "other"), Endpoint("10.180.2.1", 80, "node")))
    got = kuberules.render_iptables([svc_local], "node", "10.0.0.0/8").splitlines()
    assert got == fixture_lines("iptables-etp-local-local-endpoint.rules")
    svc_none = Service("ns1", "svc1", "p80", 80, "172.30.0.42", node_port=3001, etp="Local",
                       health_check_node_port=30000)
    got = kuberules.render_iptables([svc_none], "node", "10.0.0.0/8", nodeport_addresses=("127.0.0.1",))
    assert got.splitlines() == fixture_lines("iptables-nodeport-no-endpoints.rules")


def _overall_services():
    svc2 = Service("ns2", "svc2", "p80", 80, "172.30.0.42", node_port=3001, etp="Local",
                   health_check_node_port=30000, external_ips=("192.168.99.22",), lb_ips=("1.2.3.4",),
                   endpoints=(Endpoint("10.180.0.2", 80, "other"),))
    svc3 = Service("ns3", "svc3", "p80", 80, "172.30.0.43", node_port=3003,
                   endpoints=(Endpoint("10.180.0.3", 80, "other"),))
    return svc2, svc3


def test_render_lines_appear_in_overall_iptables_dump():
    want = set(fixture_lines("iptables-overall.rules"))
    got = kuberules.render_iptables(_overall_services(), "node", "10.0.0.0/8").splitlines()
    # 531be812 counts INVALID drops with nfacct; everything else must be verbatim
    missing = [ln for ln in got if ln not in want and "INVALID" not in ln]
    assert missing == []


def test_render_lines_appear_in_overall_nft_dump():
    want = set(fixture_lines("nft-overall.nft"))
    got = kuberules.render_nft(_overall_services(), "node", "10.0.0.0/8", service_cidr="172.30.0.0/16",
                               nodeport_ips=("192.168.0.2",)).splitlines()
    missing = [ln for ln in got if ln and not ln.startswith("#") and ln not in want]
    assert missing == []


def test_seed_service_rules_have_kube_proxy_structure():
    spec = model.compile_spec("healthy")
    text = kuberules.render_iptables(spec.services, "node1", spec.cluster_cidr)
    web = next(s for s in spec.services if s.name == "web")
    ext, svc = kuberules.ext_chain(web), kuberules.svc_chain(web)
    assert "-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS" in text
    assert f"-A KUBE-NODEPORTS -m comment --comment default/web:http -m tcp -p tcp --dport 30080 -j {ext}" in text
    assert f'-A {ext} -m comment --comment "masquerade traffic for default/web:http external destinations" -j KUBE-MARK-MASQ' in text
    assert f"-A {ext} -j {svc}" in text
    assert "--probability 0.3333333333" in text and "--probability 0.5000000000" in text
    assert "-j DNAT --to-destination 10.244.1.11:8080" in text
    assert '-m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE' in text
    assert "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP" in text
    # eTP=Local on node2 (local endpoints) vs node1 (none) for the etp scenario
    spec = model.compile_spec("etp-local-no-endpoint")
    n1 = kuberules.render_iptables(spec.services, "node1", spec.cluster_cidr)
    n2 = kuberules.render_iptables(spec.services, "node2", spec.cluster_cidr)
    assert ('-A KUBE-EXTERNAL-SERVICES -m comment --comment "default/web:http has no local endpoints" '
            "-m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30080 -j DROP") in n1
    assert "KUBE-SVL-" not in n1 and "KUBE-SVL-" in n2
    for t in (n1, n2):
        assert '"default/web:http health check node port" -m tcp -p tcp --dport 32080 -j ACCEPT' in t
    nft1 = kuberules.render_nft(spec.services, "node1", spec.cluster_cidr, service_cidr=spec.service_cidr)
    assert 'no-endpoint-nodeports { tcp . 30080 comment "default/web:http" : drop }' in nft1


def test_no_endpoints_rejects_and_fault_drops_the_masquerade_jump():
    spec = model.compile_spec("no-endpoints")
    text = kuberules.render_iptables(spec.services, "node1", spec.cluster_cidr)
    assert '"default/web:http has no endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30080 -j REJECT' in text
    assert "KUBE-SEP-" not in text
    nft = kuberules.render_nft(spec.services, "node1", spec.cluster_cidr, service_cidr=spec.service_cidr)
    assert 'no-endpoint-nodeports { tcp . 30080 comment "default/web:http" : goto reject-chain }' in nft
    jumps = kuberules.iptables_jumps(faults={"no-masquerade-jump"})
    assert not any("KUBE-POSTROUTING" in a for a in jumps) and len(jumps) == 13
    nft = kuberules.render_nft([], "n", "10.0.0.0/8", service_cidr="10.96.0.0/16", faults={"no-masquerade-jump"})
    assert "nat-postrouting jump masquerading" not in nft


# ---------------------------------------------------------------- servers and probe (loopback only)

def test_health_check_answer_is_kube_proxys():
    r = hc_response("default", "web", 0).decode()
    assert r.startswith("HTTP/1.1 503 ") and "X-Load-Balancing-Endpoint-Weight: 0" in r
    assert '"localEndpoints": 0' in r and '"serviceProxyHealthy": true' in r
    assert hc_response("default", "web", 2).startswith(b"HTTP/1.1 200 OK")


def test_probe_classifies_ok_and_refused_on_loopback():
    from nptrace.lab import probe
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]

    def serve():
        for _ in range(3):
            c, _ = srv.accept()
            c.recv(100)
            c.sendall(b"ok test\n")
            c.close()
    threading.Thread(target=serve, daemon=True).start()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    res = probe.run([{"dst": "127.0.0.1", "port": port, "count": 3, "timeout": 2},
                     {"dst": "127.0.0.1", "port": dead_port, "count": 2, "timeout": 2}])
    srv.close()
    assert [r["outcome"] for r in res] == ["ok"] * 3 + ["refused"] * 2
    assert all(r["sport"] for r in res) and res[0]["reply"] == "ok test"


def test_apply_role_is_what_a_provisioner_runs():
    from nptrace.lab.hostplan import apply_role
    ran = []
    daemons = apply_role("etp-local-no-endpoint", "node1", lambda argv, input=None: ran.append((argv, input)),
                         backend="nft")
    cmds = [" ".join(a) for a, _ in ran]
    assert "ip link add cni0 type bridge" in cmds
    assert any(c.startswith("ip link add flannel.1 ") and "vxlan id 1" in c for c in cmds)
    nft = next(i for a, i in ran if a[:2] == ["nft", "-f"])
    assert 'no-endpoint-nodeports { tcp . 30080 comment "default/web:http" : drop }' in nft
    assert len(daemons) == 1 and "32080:hc:default/web:0" in daemons[0]
    with pytest.raises(model.UsageError, match="no host"):
        apply_role("healthy", "node9", lambda *a: None)


def test_a_variant_builds_on_its_base_variant():
    """rollout-in-flight's at-once-scale: at-once's steps (no grace period) over
    address-reused's trigger and pod, with its own scale."""
    spec = model.compile_spec("rollout-in-flight", "at-once-scale")
    assert [s["kind"] for s in spec.steps] == ["rules", "delete_pod", "run", "add_pod"]
    assert spec.trigger[0]["expect"] == ["reset"] and "other-0" in spec.hosts
    assert len(spec.services) == 2001
    assert len(model.compile_spec("rollout-in-flight", "at-once").services) == 101
