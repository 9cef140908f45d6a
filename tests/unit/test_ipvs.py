"""kube-proxy's IPVS mode: the lab's rendering (lab/ipvsrules.py), the state read back from
fixture text (services/ipvs.py), nf_cause's IPVS answers and the labels of IPVS-shaped events."""
from pathlib import Path

import pytest

from nptrace import events as ev
from nptrace.classify import Context, classify
from nptrace.lab import ipvsrules, model, runner, scorecard
from nptrace.lab.errors import NotRunnable
from nptrace.lab.hostplan import host_steps
from nptrace.lab.kuberules import Endpoint, Service
from nptrace.services import ipvs, merge, nf_cause

FIX = Path(__file__).parent.parent / "fixtures" / "ipvs"
NODE_IPS = ["192.168.10.11", "172.16.21.11"]


def svc(**kw):
    d = dict(namespace="default", name="web", port_name="http", port=80, cluster_ip="10.96.0.80",
             node_port=30080, endpoints=(Endpoint("10.244.0.10", 8080, "node1"),
                                         Endpoint("10.244.1.10", 8080, "node2")))
    d.update(kw)
    return Service(**d)


# ------------------------------------------------------------------ rendering (the lab)

def test_virtual_servers_per_clusterip_and_node_address():
    vss = ipvsrules.virtual_servers([svc()], "node1", NODE_IPS)
    assert set(vss) == {("TCP", "10.96.0.80:80"), ("TCP", "192.168.10.11:30080"), ("TCP", "172.16.21.11:30080")}
    assert vss[("TCP", "192.168.10.11:30080")] == ("10.244.0.10:8080", "10.244.1.10:8080")


def test_etp_local_gets_local_real_servers_else_the_clusters():
    s = svc(etp="Local")
    assert ipvsrules.virtual_servers([s], "node1", NODE_IPS)[("TCP", "192.168.10.11:30080")] == ("10.244.0.10:8080",)
    remote = svc(etp="Local", endpoints=(Endpoint("10.244.1.10", 8080, "node2"),))
    # kubernetes#97081: no local endpoint -> the cluster's, and no masquerade mark
    assert ipvsrules.virtual_servers([remote], "node1", NODE_IPS)[("TCP", "192.168.10.11:30080")] == ("10.244.1.10:8080",)
    sets = ipvsrules.render_ipset([remote], "node1")
    assert "add KUBE-NODE-PORT-LOCAL-TCP 30080" in sets and "KUBE-LOOP-BACK 10.244" not in sets
    rules = ipvsrules.render_iptables([remote], "10.244.0.0/16")
    local = rules.index("KUBE-NODE-PORT-LOCAL-TCP dst -j RETURN")
    assert local < rules.index("KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ")


def test_no_ready_endpoints_leave_virtual_servers_empty():
    s = svc(endpoints=(Endpoint("10.244.0.10", 8080, "node1", ready=False),))
    text = ipvsrules.render_ipvsadm([s], "node1", NODE_IPS)
    assert "-A -t 192.168.10.11:30080 -s rr" in text and "-a " not in text


def test_ipset_and_iptables_text():
    sets = ipvsrules.render_ipset([svc(health_check_node_port=32080)], "node1")
    assert "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536" in sets
    for line in ("add KUBE-CLUSTER-IP 10.96.0.80,tcp:80", "add KUBE-NODE-PORT-TCP 30080",
                 "add KUBE-HEALTH-CHECK-NODE-PORT 32080", "add KUBE-LOOP-BACK 10.244.0.10,tcp:8080,10.244.0.10",
                 "add KUBE-IPVS-IPS 10.96.0.80", "flush KUBE-NODE-PORT-TCP"):
        assert line in sets.splitlines()
    rules = ipvsrules.render_iptables([svc()], "10.244.0.0/16")
    for line in ('-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000',
                 '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE',
                 '-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT',
                 '-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst -j REJECT'):
        assert line in rules.splitlines()
    assert rules.startswith("*nat\n") and rules.count("COMMIT") == 2


def test_missing_masquerade_jump_fault():
    jumps = ipvsrules.iptables_jumps(faults={"no-masquerade-jump"})
    assert not any("POSTROUTING" in j for j in jumps) and any("KUBE-IPVS-FILTER" in j for j in jumps)
    assert any("POSTROUTING" in j for j in ipvsrules.iptables_jumps())


def test_sync_deletes_and_adds_real_servers():
    before = [svc(endpoints=(Endpoint("10.244.0.10", 8080, "node1"),))]
    after = [svc(endpoints=(Endpoint("10.244.1.10", 8080, "node2"),))]
    cmds = ipvsrules.sync_commands(before, after, "node1", ["192.168.10.11"])
    assert ["ipvsadm", "-d", "-t", "192.168.10.11:30080", "-r", "10.244.0.10:8080"] in cmds
    assert ["ipvsadm", "-a", "-t", "10.96.0.80:80", "-r", "10.244.1.10:8080", "-m", "-w", "1"] in cmds
    assert not any(c[1] in ("-A", "-D") for c in cmds)


def test_names_table_round_trips():
    names = ipvs.parse_names(ipvsrules.service_names([svc(etp="Local")], "node1", NODE_IPS))
    assert names[("tcp", "10.96.0.80", 80)] == ipvs.Name("default/web:http", "clusterip", True)
    assert names[("tcp", "172.16.21.11", 30080)].kind == "nodeport"


def test_scenarios_compile_to_ipvs_steps():
    spec = model.compile_spec("ipvs-stale-endpoint")
    steps = host_steps(spec, "node1", "ipvs")
    argv0 = [s.argv[0] for s in steps]
    assert "ipvsadm" in argv0 and "ipset" in argv0
    assert ("ip", "link", "add", "kube-ipvs0", "type", "dummy") in [s.argv for s in steps]
    # the scenario's own sysctl comes after kube-proxy's expire_nodest_conn=1
    sysctls = [" ".join(s.argv) for s in steps if s.argv[0] == "sysctl"]
    assert sysctls[0].find("expire_nodest_conn=1") > 0 and "expire_nodest_conn=0" in sysctls[-1]
    for sc in model.load_scenarios():
        assert sc.name.startswith("ipvs-") == (sc.backends == ("ipvs",))
    assert [c[1:] for c in scorecard.cases(model.load_scenarios()) if c[0].name.startswith("ipvs-")] == \
        [("ipvs", None)] * 4


def test_no_ipvs_is_not_runnable_in_one_line(tmp_path, monkeypatch):
    assert not runner.ipvs_available(tmp_path, load=lambda: None)
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "ip_vs").write_text("")
    assert runner.ipvs_available(tmp_path, load=lambda: None)
    monkeypatch.setattr(runner.netns, "require_root", lambda: None)
    monkeypatch.setattr(runner, "ipvs_available", lambda: False)
    with pytest.raises(NotRunnable) as e:
        runner.up("ipvs-no-endpoints")
    assert str(e.value) == "not runnable here: no IPVS (ip_vs module)"


# ------------------------------------------------------------------ reading the state

def test_parse_proc_and_ipvsadm_alike():
    proc = {str(v): v for v in ipvs.parse_ipvs((FIX / "proc_net_ip_vs.txt").read_text())}
    text = {str(v): v for v in ipvs.parse_ipvs((FIX / "ipvsadm_Ln.txt").read_text())}
    np = proc["TCP 192.168.10.11:30080"]
    assert [str(r) for r in np.reals] == ["10.244.1.11:8080", "10.244.1.10:8080"]
    assert np.reals[1].active == 3 and np.reals[1].forward == "Masq"
    assert proc["TCP 192.168.10.12:30080"].reals == ()
    assert [r.weight for r in proc["TCP 10.96.0.80:80"].reals] == [1, 0]
    assert [str(r) for r in proc["TCP 10.96.0.80:80"].live_reals()] == ["10.244.1.11:8080"]
    assert set(text) == {"TCP 10.96.0.80:80", "TCP 192.168.10.11:30080", "TCP [fd00:96::50]:80"}
    assert str(text["TCP [fd00:96::50]:80"].reals[0]) == "[fd00:244::10a]:8080"


def test_parse_ipset_save_and_list():
    save = ipvs.parse_ipset_save((FIX / "ipset_save.txt").read_text())
    assert save["KUBE-NODE-PORT-LOCAL-TCP"] == ["30080"] and save["KUBE-LOOP-BACK"] == []
    lst = ipvs.parse_ipset_save((FIX / "ipset_list.txt").read_text())
    assert lst == {"KUBE-NODE-PORT-LOCAL-TCP": ["30080"], "KUBE-LOOP-BACK": ["10.244.0.10,tcp:8080,10.244.0.10"]}


NAMES = "TCP 10.96.0.80:80 default/web:http clusterip\nTCP 192.168.10.11:30080 default/web:http nodeport local\n"


def _state(proc, **kw):
    return ipvs.state_of(proc, names_text=NAMES, ipset_text=(FIX / "ipset_save.txt").read_text(), **kw)


def test_service_named_from_the_virtual_server():
    m = ipvs.build_map(_state((FIX / "ipvsadm_Ln.txt").read_text()))
    assert m.lookup("192.168.10.11", 30080).name == "default/web:http"
    assert m.lookup("192.168.10.11", 30080).kind == "nodeport"
    assert m.lookup("10.96.0.80", 80).kind == "clusterip"
    assert m.lookup("10.244.1.11", 8080).kind == "endpoint"
    assert m.lookup("192.168.10.12", 30080) is None   # no name for it
    assert merge(m).ipvs and m.with_local_addrs(["192.168.10.11"]).ipvs


EMPTY = "TCP  192.168.10.11:30080 rr\nTCP  10.96.0.80:80 rr\n"


def test_nf_cause_no_endpoints_and_no_local_endpoint():
    plain = ipvs.state_of(EMPTY, names_text=NAMES.replace(" local", ""))
    got = nf_cause(ipvs.build_map(plain), "192.168.10.100", "192.168.10.11", 30080, "192.168.10.11", 30080, True, False)
    assert got["tag"] == "no_endpoints" and got["service"] == "default/web:http"
    assert got["virtual_server"] == "TCP 192.168.10.11:30080" and got["real_servers"] == []
    got = nf_cause(ipvs.build_map(_state(EMPTY)), "192.168.10.100", "192.168.10.11", 30080,
                   "192.168.10.11", 30080, True, False)
    assert got["tag"] == "no_local_endpoint"


def test_nf_cause_deleted_real_server_needs_expire_nodest_conn_0():
    proc = (FIX / "ipvsadm_Ln.txt").read_text()
    args = ("192.168.10.100", "192.168.10.11", 30080, "192.168.10.11", 30080, False, True)
    got = nf_cause(ipvs.build_map(_state(proc, sysctl={"expire_nodest_conn": 0, "conn_reuse_mode": 1})), *args)
    assert got["tag"] == "ipvs_nodest" and got["conn_reuse_mode"] == 1
    assert nf_cause(ipvs.build_map(_state(proc, sysctl={"expire_nodest_conn": 1})), *args)["tag"] is None
    # without a conntrack entry the packet was INVALID, not IPVS's drop
    no_ct = args[:-1] + (False,)
    assert nf_cause(ipvs.build_map(_state(proc, sysctl={"expire_nodest_conn": 0})), *no_ct)["tag"] is None


# ------------------------------------------------------------------ classification

CTX_NAMES = {12: "NETFILTER_DROP"}


def E(**kw):
    kw.setdefault("ts_ns", 1_000)
    return ev.decode(ev.encode(**kw))


def _ctx(state):
    smap = ipvs.build_map(state)
    return Context(drop_name=lambda v: CTX_NAMES.get(v, f"REASON_{v}"),
                   service_of=lambda a, p: (s.name if (s := smap.lookup(a, p)) else None),
                   nf_rule=lambda ns, *a: nf_cause(smap, *a))


def test_syn_to_an_empty_virtual_server_is_no_endpoints_naming_it():
    ctx = _ctx(ipvs.state_of(EMPTY, names_text=NAMES.replace(" local", "")))
    [v] = classify([E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12, tcpflags=ev.TCP_SYN,
                      saddr="192.168.10.100", sport=40000, daddr="192.168.10.11", dport=30080)], ctx)
    assert v.cause == "no_endpoints" and v.service == "default/web:http"
    assert "TCP 192.168.10.11:30080" in v.hint and "no real servers" in v.hint


def test_deleted_real_server_in_flight_is_proxy_naming_both_and_the_sysctl():
    proc = (FIX / "ipvsadm_Ln.txt").read_text()   # 10.244.0.10 is not a real server any more
    ctx = _ctx(_state(proc, sysctl={"expire_nodest_conn": 0, "conn_reuse_mode": 1}))
    drop = E(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12, tcpflags=ev.TCP_ACK, flags=ev.F_HAS_CT,
             saddr="192.168.10.100", sport=40000, daddr="192.168.10.11", dport=30080,
             ct_osrc="192.168.10.100", ct_osport=40000, ct_odst="192.168.10.11", ct_odport=30080,
             ct_rsrc="10.244.0.10", ct_rsport=8080, ct_rdst="192.168.10.100", ct_rdport=40000)
    [v] = classify([drop], ctx)
    assert v.cause == "proxy" and v.service == "default/web:http"
    for word in ("TCP 192.168.10.11:30080", "10.244.0.10:8080", "expire_nodest_conn=1", "conn_reuse_mode"):
        assert word in v.hint


def test_etp_local_virtual_server_without_local_reals_is_the_fallback_named_by_knowledge():
    from nptrace.node.knowledge import NodeKnowledge
    node1 = _state((FIX / "ipvsadm_Ln.txt").read_text())     # KUBE-LOOP-BACK empty: no local pod
    assert ipvs.without_local(node1, "10.244.1.10", 8080) == ["TCP 192.168.10.11:30080"]
    assert ipvs.without_local(node1, "10.244.9.9", 8080) == []
    loop = "create KUBE-LOOP-BACK hash:ip,port,ip\nadd KUBE-LOOP-BACK 10.244.1.10,tcp:8080,10.244.1.10\n"
    node2 = ipvs.state_of((FIX / "ipvsadm_Ln.txt").read_text(), names_text=NAMES,
                          ipset_text=(FIX / "ipset_save.txt").read_text() + loop)
    assert ipvs.without_local(node2, "10.244.1.10", 8080) == []     # it has a local endpoint
    kn = NodeKnowledge(names=None)
    kn._smaps = (ipvs.build_map(node2), ipvs.build_map(node1))
    assert kn.etp_local("10.244.1.10", 8080) == {"service": "default/web:http",
                                                  "no_local": ["TCP 192.168.10.11:30080"]}
    kn._smaps = (ipvs.build_map(ipvs.state_of((FIX / "ipvsadm_Ln.txt").read_text(),
                                              names_text=NAMES.replace(" local", ""))),)
    assert kn.etp_local("10.244.1.10", 8080) is None                 # a Cluster-policy Service


def test_etp_local_is_found_whichever_view_is_read_first():
    """Another namespace's view may hold the same pod address as an endpoint of a Cluster-policy
    Service (an address reused by a later pod, a namespace not yet pruned): the Local
    Service's view still answers, in either order."""
    from nptrace.node.knowledge import NodeKnowledge
    proc = (FIX / "ipvsadm_Ln.txt").read_text()
    local = ipvs.build_map(_state(proc))
    cluster = ipvs.build_map(ipvs.state_of(proc, names_text=NAMES.replace(" local", "")))
    for order in ((cluster, local), (local, cluster)):
        kn = NodeKnowledge(names=None)
        kn._smaps = order
        assert kn.etp_local("10.244.1.10", 8080)["service"] == "default/web:http"
