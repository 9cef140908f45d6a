"""nptrace.node.rules_source against real rules: each test builds a namespace npt-svc-<pid>-<n>, loads a
kube-proxy fixture with the iptables-nft, iptables-legacy or nft tools, reads it back and looks the
Services up. Namespaces are deleted even when a test fails; nothing outside them is touched."""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nptrace.node import rules_source as rs
from nptrace.node.rules_source import RulesSourceError

pytestmark = pytest.mark.privileged

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kube-proxy"
_seq = itertools.count()

# what kube-proxy adds outside its restore input (iptablesJumpChains + iptablesKubeletJumpChains,
# pkg/proxy/iptables/proxier.go @ 531be812), each prepended like EnsureRule(Prepend, ...)
JUMPS = [
    ("filter", "INPUT", '-m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES'),
    ("filter", "FORWARD", '-m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES'),
    ("filter", "INPUT", '-m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS'),
    ("filter", "FORWARD", '-m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES'),
    ("filter", "OUTPUT", '-m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES'),
    ("filter", "FORWARD", '-m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD'),
    ("filter", "INPUT", '-m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL'),
    ("filter", "FORWARD", '-m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL'),
    ("nat", "OUTPUT", '-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'),
    ("nat", "PREROUTING", '-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'),
    ("nat", "POSTROUTING", '-m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING'),
    ("filter", "INPUT", "-j KUBE-FIREWALL"),
    ("filter", "OUTPUT", "-j KUBE-FIREWALL"),
]


def _need(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) to build network namespaces")
    missing = [t for t in ("ip", *tools) if shutil.which(t) is None]
    if missing:
        pytest.skip(f"missing tools: {', '.join(missing)} (Debian packages iproute2, iptables, nftables)")


def sh(ns: str, *argv: str, input: str | None = None) -> str:
    r = subprocess.run(["ip", "netns", "exec", ns, *argv], input=input, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr.strip()}"
    return r.stdout


def load_fixture(ns: str, name: str, tool: str = "iptables-nft") -> None:
    """Load tests/fixtures/kube-proxy/<name> the way kube-proxy would have installed it."""
    text = (FIX / name).read_text()
    if name.endswith(".nft"):
        # the knftables dump lists rules that goto chains declared further down; nft resolves
        # references in file order, so the declarations go first
        cmds = [ln for ln in text.splitlines() if ln.startswith("add ")]
        decl = [ln for ln in cmds if ln.split()[1] in ("table", "chain", "set", "map")]
        sh(ns, "nft", "-f", "-", input="\n".join(decl + [ln for ln in cmds if ln not in decl]) + "\n")
        return
    for acct in sorted(set(re.findall(r"--nfacct-name (\S+)", text))):
        if shutil.which("nfacct"):
            sh(ns, "nfacct", "add", acct)  # kube-proxy's nfacct.Ensure; per namespace
        else:  # the match only counts: dropping it keeps the semantics
            text = text.replace(f" -m nfacct --nfacct-name {acct}", "")
    sh(ns, f"{tool}-restore", input=text)
    for table, chain, args in JUMPS:
        sh(ns, tool, "-t", table, "-I", chain, *_split(args))


def _split(args: str) -> list[str]:
    return [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', args)]


@pytest.fixture
def netns():
    _need()
    name = f"npt-svc-{os.getpid()}-{next(_seq)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        assert not os.path.exists(f"/run/netns/{name}")


def check_overall(m) -> None:
    """The Services of the overall fixtures, read back from a live namespace."""
    assert m.names == tuple(f"ns{i}/svc{i}:p80" for i in range(1, 7))
    for i in range(1, 7):
        s = m.lookup(f"172.30.0.4{i}", 80)
        assert (s.name, s.kind) == (f"ns{i}/svc{i}:p80", "clusterip")
    assert m.lookup("192.168.0.2", 3003).name == "ns3/svc3:p80"
    assert m.lookup("192.168.99.33", 80).name == "ns4/svc4:p80"
    assert m.lookup("5.6.7.8", 80).kind == "loadbalancer"
    assert m.lookup("10.180.0.5", 80).kind == "endpoint"
    s = m.lookup("192.168.0.2", 3001)
    assert (s.name, s.no_local_endpoints, s.etp_local) == ("ns2/svc2:p80", True, True)
    r = m.verdict_rules("192.168.0.2", 3001, include_invalid=False)
    assert [(x.reason, x.verdict) for x in r] == [("no_local_endpoint", "drop")]
    s6 = m.lookup("172.30.0.46", 80)
    assert s6.no_endpoints
    assert m.verdict_rules("172.30.0.46", 80, include_invalid=False)[0].verdict == "reject"


@pytest.mark.parametrize("tool,backend", [("iptables-nft", "iptables-nft"), ("iptables-legacy", "iptables-legacy")])
def test_iptables_backends(netns, tool, backend):
    _need(f"{tool}-restore", f"{tool}-save")
    load_fixture(netns, "iptables-overall.rules", tool)
    # a firewall-style rule next to kube-proxy's, to be found by matching_drop_rules
    sh(netns, tool, "-A", "FORWARD", "-d", "10.244.1.0/24", "-p", "tcp", "--dport", "8080", "-j", "DROP")
    assert rs.detect_backend(netns) == backend
    d = rs.read_rules(netns)
    assert d.backend == backend and d.netns == netns
    assert "KUBE-EXTERNAL-SERVICES" in d.text and len(d.digest) == 64
    assert (d.generation is not None) == (backend == "iptables-nft")
    m = rs.load_service_map(netns)
    assert m.backends == (backend,) and m.ignored == 0
    check_overall(m)
    # the live dump is iptables-save's canonical form
    r = m.verdict_rules("192.168.0.2", 3001, include_invalid=False)[0]
    assert r.text.startswith("-A KUBE-EXTERNAL-SERVICES -p tcp -m comment")
    hit = m.matching_drop_rules("203.0.113.2", "10.244.1.9", 8080, hook="forward")
    assert [x.where() for x in hit if x.reason == "other"] == ["filter/FORWARD rule 5"]
    inv = [x for x in m.matching_drop_rules("203.0.113.2", "10.180.0.3", 80, ctstate="INVALID") if x.reason == "conntrack_invalid"]
    assert len(inv) == 1 and "nfacct" in inv[0].text


def test_nft_backend(netns):
    _need("nft")
    load_fixture(netns, "nft-overall.nft")
    assert rs.detect_backend(netns) == "nft"
    d = rs.read_rules(netns, backend="auto")
    assert d.backend == "nft" and "# handle" in d.text and d.generation is not None
    m = rs.load_service_map(netns)
    assert m.backends == ("nft",) and m.ignored == 0
    check_overall(m)
    fw = m.verdict_rules("5.6.7.8", 80, include_invalid=False)[0]
    assert fw.reason == "lb_source_range" and isinstance(fw.handle, int)
    # the element rule names the Service even in the live (list) form
    assert m.verdict_rules("192.168.0.2", 3001)[0].service == "ns2/svc2:p80"


def test_fork_fixtures_live(netns):
    _need("iptables-nft-restore")
    load_fixture(netns, "iptables-etp-local-local-endpoint.rules")
    s = rs.load_service_map(netns).lookup("192.168.0.2", 3001)
    assert (s.etp_local, s.local_endpoints, s.health_check_port) == (True, ("10.180.2.1:80",), 30000)
    sh(netns, "iptables-nft", "-t", "nat", "-F")
    sh(netns, "iptables-nft", "-F")
    load_fixture(netns, "iptables-nodeport-no-endpoints.rules")
    m = rs.load_service_map(netns)
    assert m.lookup("192.168.0.2", 3001).no_endpoints
    assert m.verdict_rules("192.168.0.2", 3001, include_invalid=False)[0].text.endswith(
        "-j REJECT --reject-with icmp-port-unreachable")


def _traffic(ns: str) -> None:
    """A refused TCP connect on the namespace's loopback: moves OUTPUT/INPUT counters."""
    sh(ns, sys.executable, "-c",
       "import socket; s = socket.socket(); s.settimeout(1); s.connect_ex(('127.0.0.1', 9))")


@pytest.mark.parametrize("tool", ["iptables-nft", "iptables-legacy"])
def test_change_detection(netns, tool):
    _need(f"{tool}-restore")
    load_fixture(netns, "iptables-etp-cluster-nodeport.rules", tool)
    ticks = itertools.count()
    cache = rs.ServiceMapCache(netns, min_interval=0, clock=lambda: next(ticks))
    m1 = cache.get()
    assert m1.names == ("ns1/svc1:p80",) and cache.reloads == 1
    fp = rs.fingerprint(netns)
    if tool == "iptables-nft":
        assert fp[0] == rs.nft_generation(netns) and fp[0] is not None
    else:
        assert fp[1] is not None
    # counters move, rules do not: same fingerprint, no reload
    _traffic(netns)
    assert re.search(r"^\[[1-9]\d*:\d+\] -A OUTPUT -j KUBE-FIREWALL", sh(netns, f"{tool}-save", "-c"), re.M)
    assert rs.fingerprint(netns) == fp
    assert cache.get() is m1 and cache.reloads == 1
    # a new Service: new fingerprint, reload
    sh(netns, tool, "-t", "nat", "-A", "KUBE-SERVICES", "-m", "comment", "--comment", "ns7/svc7:p80 cluster IP",
       "-p", "tcp", "-d", "172.30.0.47", "--dport", "80", "-j", "KUBE-SVC-XPGD46QRK7WJZT7O")
    assert rs.fingerprint(netns) != fp
    m2 = cache.get()
    assert cache.reloads == 2 and m2.lookup("172.30.0.47", 80).name == "ns7/svc7:p80"


def test_nft_generation_moves(netns):
    _need("nft")
    g0 = rs.nft_generation(netns)
    sh(netns, "nft", "add", "table", "inet", "npt")
    g1 = rs.nft_generation(netns)
    assert isinstance(g0, int) and g1 != g0


def test_mixed_backends_merge(netns):
    # kube-proxy in nft mode; a legacy firewall rule next to it (e.g. an older CNI)
    _need("nft", "iptables-legacy")
    load_fixture(netns, "nft-overall.nft")
    sh(netns, "iptables-legacy", "-A", "FORWARD", "-s", "198.51.100.0/24", "-j", "DROP")
    assert rs.detect_backend(netns) == "nft"
    assert [d.backend for d in rs.read_all(netns)] == ["nft", "iptables-legacy"]
    m = rs.load_service_map(netns)
    assert m.backends == ("nft", "iptables-legacy")
    assert m.lookup("172.30.0.43", 80).name == "ns3/svc3:p80"
    hit = m.matching_drop_rules("198.51.100.7", "10.180.0.3", 80, hook="forward")
    assert [r.where() for r in hit] == ["filter/FORWARD rule 1"]


def test_empty_namespace_and_errors(netns):
    _need()
    assert rs.detect_backend(netns) == "none"
    assert rs.read_rules(netns).text == ""
    m = rs.load_service_map(netns)
    assert len(m) == 0 and not m.rules
    with pytest.raises(RulesSourceError, match="not found"):
        rs.read_rules(f"npt-svc-{os.getpid()}-missing")
    with pytest.raises(RulesSourceError, match="invalid network namespace"):
        rs.load_service_map("../etc")
    with pytest.raises(RulesSourceError, match="unknown rules backend"):
        rs.read_rules(netns, backend="ipvs")
    assert str(RulesSourceError("x")).count("\n") == 0


def test_cache_without_generation_falls_back_to_digests(netns, monkeypatch):
    _need("iptables-nft-restore")
    load_fixture(netns, "iptables-etp-cluster-nodeport.rules")
    monkeypatch.setattr(rs, "nft_generation", lambda ns=None: None)  # as without CAP_SYS_ADMIN
    cache = rs.ServiceMapCache(netns, min_interval=0)
    m1 = cache.get()
    _traffic(netns)
    assert cache.get() is m1 and cache.reloads == 1
    sh(netns, "iptables-nft", "-t", "nat", "-A", "KUBE-SERVICES", "-m", "comment", "--comment",
       "ns8/svc8:p80 cluster IP", "-p", "tcp", "-d", "172.30.0.48", "--dport", "80", "-j", "KUBE-SVC-XPGD46QRK7WJZT7O")
    assert cache.get().lookup("172.30.0.48", 80).name == "ns8/svc8:p80" and cache.reloads == 2
    # min_interval: no re-check at all within it
    slow = rs.ServiceMapCache(netns, min_interval=3600)
    first = slow.get()
    sh(netns, "iptables-nft", "-t", "nat", "-F", "KUBE-SERVICES")
    assert slow.get() is first
    slow.invalidate()
    assert slow.get().lookup("172.30.0.48", 80) is None


def test_digest_ignores_counters_and_timestamps():
    a = "# Generated by iptables-save v1.8.9 on Mon\n*filter\n:INPUT ACCEPT [0:0]\n[1:60] -A INPUT -j DROP\nCOMMIT\n"
    b = "# Generated by iptables-save v1.8.9 on Tue\n*filter\n:INPUT ACCEPT [7:420]\n[9:540] -A INPUT -j DROP\nCOMMIT\n"
    assert rs.dump_digest(a) == rs.dump_digest(b)
    assert rs.dump_digest(a) != rs.dump_digest(a.replace("DROP", "ACCEPT"))
    n1 = "ip daddr 10.0.0.1 counter packets 0 bytes 0 drop\nelements = { 1.2.3.4 timeout 3h expires 2h59m }"
    n2 = "ip daddr 10.0.0.1 counter packets 5 bytes 300 drop\nelements = { 1.2.3.4 timeout 3h expires 1h2m }"
    assert rs.dump_digest(n1) == rs.dump_digest(n2)
