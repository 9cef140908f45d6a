"""kube-proxy's own test rulesets as a corpus (tests/fixtures/kube-proxy/corpus/README.md).

For every ruleset, an oracle reads what kube-proxy's rule comments say about each Service
(its ClusterIPs, NodePorts, ExternalIPs, LB IPs, endpoints and drop/reject rules) with a few
regexes of its own, independent of nptrace.services, and the test checks that the ServiceMap
answers each of those lookups the same way. The packet flows kube-proxy's TestTracePacket-style
tests assert (``*.flows.json``) are replayed through ``ServiceMap.trace``, on the iptables
ruleset and on the nft rulesets of the same Services.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nptrace.services import parse_iptables_restore, parse_nft

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kube-proxy"
CORPUS = FIX / "corpus"
NODE_IP = "192.168.0.2"          # NewFakeProxier's node IP (testNodeIP)
NODE_IP6 = "2001:db8::1"         # its IPv6 proxier's (testNodeIPv6)
LOCAL = (NODE_IP, NODE_IP6, "127.0.0.1", "::1")


def node_ip(text: str) -> str:
    """The node address NodePort lookups go to: the ruleset's family's (ip6 table, ip6tables)."""
    return NODE_IP6 if re.search(r"\bip6 kube-proxy\b|--to-destination \[", text) else NODE_IP


def rulesets() -> list[Path]:
    out = sorted(CORPUS.glob("*.rules")) + sorted(CORPUS.glob("*.nft"))
    out += sorted(FIX.glob("*.rules")) + sorted(FIX.glob("*.nft"))
    return out


def parse(path: Path):
    text = path.read_text()
    return (parse_nft if path.suffix.startswith(".nft") else parse_iptables_restore)(text)


# -- the oracle: what the rule text itself says ---------------------------------------------
_C = r'--comment (?:"([^"]+)"|(\S+))'


def _comment(line: str) -> str | None:
    m = re.search(_C, line)
    return (m.group(1) or m.group(2)) if m else None


def _opt(line: str, flag: str) -> str | None:
    m = re.search(rf"(?:^|\s){flag} (\S+)", line)
    return m.group(1) if m else None


def oracle_iptables(text: str):
    """(frontends, endpoints, drops): frontends {(addr|None, port): (name, kind)}, where addr
    None is a NodePort on any local address; endpoints {name: {ip:port}}; drops [(addr|None,
    port, name, reason)]."""
    table = None
    nat_front: dict = {}
    filt_front: dict = {}
    endpoints: dict[str, set] = {}
    drops = []
    pod_short = pod_shortcuts(text)
    allowed = allowed_sources(text)
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:]
            continue
        if not line.startswith("-A "):
            continue
        chain = line.split()[1]
        c = _comment(line) or ""
        name = c.split(" ", 1)[0] if "/" in c.split(" ", 1)[0] else None
        d, dport = _opt(line, "-d"), _opt(line, "--dport")
        if table == "nat" and chain == "KUBE-SERVICES" and name and d and dport:
            kind = {"cluster IP": "clusterip", "external IP": "externalip",
                    "loadbalancer IP": "loadbalancer"}.get(c[len(name) + 1:])
            if kind:
                nat_front.setdefault((d, int(dport)), (name, kind))
        elif table == "nat" and chain == "KUBE-NODEPORTS" and name and dport:
            nat_front.setdefault((None, int(dport)), (name, "nodeport"))
        elif table == "nat" and "DNAT" in line and name:
            endpoints.setdefault(name, set()).add(_opt(line, "--to-destination"))
        elif table == "filter" and name and dport:
            if c.endswith(" has no endpoints") or c.endswith(" has no local endpoints"):
                reason = "no_endpoints" if c.endswith(" has no endpoints") else "no_local_endpoint"
                drops.append((d, int(dport), name, reason, None))
                kind = "nodeport" if d is None else None
                filt_front.setdefault((d, int(dport)), (name, kind))
            elif chain == "KUBE-PROXY-FIREWALL" and " traffic not accepted by " in c:
                drops.append((d, int(dport), name, "lb_source_range", allowed.get(c.rsplit(" ", 1)[1])))
                filt_front.setdefault((d, int(dport)), (name, "loadbalancer"))
            elif c.endswith(" health check node port"):
                filt_front.setdefault((None, int(dport)), (name, "healthcheck"))
    # nat names what a packet is DNATed to before the filter table sees it: it wins
    front = {**filt_front, **nat_front}
    return front, endpoints, drops, pod_short


def allowed_sources(text: str) -> dict[str, str]:
    """The first source range each KUBE-FW chain sends on to its Service: {chain: CIDR}."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^-A (KUBE-FW-\w+) .*? -s (\S+) -j KUBE-(?:EXT|SVC|XLB)-", text, re.M):
        out.setdefault(m.group(1), m.group(2))
    return out


def _inside(cidr: str) -> str:
    """An address inside ``cidr`` (its network address + 1)."""
    import ipaddress
    return str(ipaddress.ip_network(cidr, strict=False).network_address + 1)


def pod_shortcuts(text: str) -> dict[str, str]:
    """Services whose KUBE-EXT chain sends pod traffic on to KUBE-SVC: {name: pod CIDR}."""
    return {m.group(1): m.group(2) for m in re.finditer(
        r'"pod traffic for (\S+) external destinations" -s (\S+) -j KUBE-SVC-', text)}


_NFT_NAME = re.compile(r"(?:service|external|firewall)-[A-Z0-9]+-([^/ ]+)/([^/ ]+)/(\w+)/([^ }]+)")


def _nft_svc(s: str) -> str | None:
    m = _NFT_NAME.search(s)
    return f"{m.group(1)}/{m.group(2)}:{m.group(4)}" if m else None


def oracle_nft(text: str):
    cluster = set(re.findall(r"add element \S+ \S+ cluster-ips \{ (\S+) \}", text))
    # firewall-ips holds LoadBalancer IPs with loadBalancerSourceRanges: {(ip, port): chain}
    fw = {(m.group(1), int(m.group(2))): m.group(3) for m in re.finditer(
        r"add element \S+ \S+ firewall-ips \{ (\S+) \. \w+ \. (\d+) : goto (\S+) \}", text)}
    fw_allow = {m.group(1): m.group(2).split(",")[0].strip() for m in re.finditer(
        r"add rule \S+ \S+ (firewall-\S+) ip6? saddr != \{ ([^}]+) \} drop", text)}
    front: dict = {}
    endpoints: dict[str, set] = {}
    drops = []
    for line in text.splitlines():
        m = re.match(r"add element \S+ \S+ service-ips \{ (\S+) \. (\w+) \. (\d+) : goto (\S+) \}", line)
        if m:
            kind = ("clusterip" if m.group(1) in cluster else
                    "loadbalancer" if (m.group(1), int(m.group(3))) in fw else None)  # else external or LB
            front[(m.group(1), int(m.group(3)))] = (_nft_svc(m.group(4)), kind)
        m = re.match(r'add element \S+ \S+ service-nodeports \{ (\w+) \. (\d+) (?:comment "[^"]*" )?: goto (\S+) \}',
                     line)
        if m:
            front[(None, int(m.group(2)))] = (_nft_svc(m.group(3)), "nodeport")
        m = re.match(r"add rule \S+ \S+ endpoint-\w+-([^/]+)/([^/]+)/\w+/(\S+)__\S+ .*dnat to (\S+)", line)
        if m:
            endpoints.setdefault(f"{m.group(1)}/{m.group(2)}:{m.group(3)}", set()).add(m.group(4))
        m = re.match(r'add element \S+ \S+ no-endpoint-(services|nodeports) \{ (?:(\S+) \. )?\w+ \. (\d+) '
                     r'comment "([^"]+)" : (drop|goto reject-chain) \}', line)
        if m:
            reason = "no_local_endpoint" if m.group(5) == "drop" else "no_endpoints"
            drops.append((m.group(2), int(m.group(3)), m.group(4), reason, None))
            front.setdefault((m.group(2), int(m.group(3))),
                             (m.group(4), "nodeport" if m.group(2) is None else None))
    for (addr, port), chain in sorted(fw.items()):
        drops.append((addr, port, _nft_svc(chain), "lb_source_range", fw_allow.get(chain)))
    # an eTP=Local external chain's "short-circuit pod traffic": {name: pod CIDR}
    pod_short = {_nft_svc(m.group(1)): m.group(2) for m in re.finditer(
        r"add rule \S+ \S+ (external-\S+) ip6? saddr (\S+) goto service-", text)}
    return front, endpoints, drops, pod_short


def oracle(path: Path):
    text = path.read_text()
    return oracle_nft(text) if path.suffix == ".nft" else oracle_iptables(text)


# -- the checks -----------------------------------------------------------------------------
_STAGE = re.compile(r"^(Test\w+?)(?:-\d+|-input)?\.(rules|nft)$")


def gone_frontends(path: Path, front: dict) -> list:
    """Frontends another stage of the same test names that this stage does not: a Service
    deleted (or not yet added) there, which must not look up. kube-proxy rewrites its
    dispatch (KUBE-SERVICES / KUBE-NODEPORTS, nft's maps) whole on every sync, partial or not."""
    m = _STAGE.match(path.name)
    if m is None or path.parent != CORPUS:
        return []
    others: set = set()
    for sib in CORPUS.glob(f"{m.group(1)}*.{m.group(2)}"):
        sm = _STAGE.match(sib.name)
        if sib != path and sm is not None and sm.group(1) == m.group(1):
            others |= set(oracle(sib)[0])
    return sorted(others - set(front), key=str)


def check_ruleset(path: Path) -> tuple[int, list[str]]:
    """(lookups checked, failures) for one ruleset."""
    smap = parse(path).with_local_addrs(LOCAL)
    front, endpoints, drops, pod_short = oracle(path)
    NODE = node_ip(path.read_text())
    n, fails = 0, []

    def expect(cond: bool, what: str) -> None:
        nonlocal n
        n += 1
        if not cond:
            fails.append(f"{path.name}: {what}")

    for (addr, port), (name, kind) in sorted(front.items(), key=str):
        s = smap.lookup(addr or NODE, port)
        got = (s.name, s.kind) if s else None
        ok = s is not None and s.name == name and (kind is None or s.kind == kind)
        expect(ok, f"lookup {addr or NODE}:{port} -> {got}, want {(name, kind)}")
    for addr, port in gone_frontends(path, front):
        s = smap.lookup(addr or NODE, port)
        expect(s is None or s.kind == "endpoint",
               f"lookup {addr or NODE}:{port} -> {(s.name, s.kind) if s else None}, want none "
               f"(another stage's Service)")
    for name, eps in sorted(endpoints.items()):
        svc = smap.service(name)
        expect(svc is not None and set(svc.endpoints) == eps,
               f"{name} endpoints {svc.endpoints if svc else None}, want {sorted(eps)}")
        for ep in sorted(eps):
            host, _, port = ep.rpartition(":")
            names = {s.name for s in smap.lookup_all(host, int(port)) if s.kind == "endpoint"}
            expect(name in names, f"endpoint {ep} -> {sorted(names)}, want {name}")
    for addr, port, name, reason, allowed in drops:
        rules = smap.verdict_rules(addr or NODE, port, include_invalid=False)
        named = [(r.service, r.reason) for r in rules if r.reason != "other"]
        expect((name, reason) in named, f"drop rule for {addr or NODE}:{port}: {named}, "
                                        f"want {(name, reason)}")
        if allowed:
            # a client inside loadBalancerSourceRanges is let through; one outside is dropped
            for src, want in ((_inside(allowed), False), ("198.51.100.7", True)):
                for what, got in (
                        ("verdict_rules", smap.verdict_rules(addr, port, include_invalid=False, saddr=src)),
                        ("matching_drop_rules", smap.matching_drop_rules(src, addr, port))):
                    hit = [(r.service, r.reason) for r in got if r.reason != "other"]
                    expect(((name, reason) in hit) == want,
                           f"{what} {src} -> {addr}:{port}: {hit}, want the {reason} drop: {want}")
        if reason == "no_local_endpoint" and name in pod_short:
            # pod traffic is DNATed past the frontend's DROP (KUBE-EXT "pod traffic for ...")
            pod = pod_short[name].split("/")[0].rsplit(".", 1)[0] + ".2"
            for who, src in (("pod", pod), ("node", NODE)):
                rules = smap.verdict_rules(addr or NODE, port, include_invalid=False, saddr=src)
                expect(not [r for r in rules if r.service == name and r.reason == reason],
                       f"{who} {src} -> {addr or NODE}:{port} is DNATed, yet meets "
                       f"{[r.where() for r in rules]}")
                hit = smap.matching_drop_rules(src, addr or NODE, port)
                expect(not [r for r in hit if r.service == name and r.reason == reason],
                       f"{who} {src} -> {addr or NODE}:{port} matches {[r.where() for r in hit]}")
            rules = smap.verdict_rules(addr or NODE, port, include_invalid=False, saddr="203.0.113.2")
            expect((name, reason) in [(r.service, r.reason) for r in rules],
                   f"external client -> {addr or NODE}:{port} must still meet the DROP")
    return n, fails


# the nft renderings of a flow list's Services: TestOverallNFTablesRules writes the Services
# (names, IPs, ports, endpoints) TestOverallIPTablesRules / TestTracePacket write for iptables,
# and knftables' kube-proxy example holds them in a later kube-proxy layout; derived/ has the
# iptables-save and `nft list ruleset` forms a live node prints of the overall rulesets
NFT_TWINS = {"TestTracePacket": (FIX / "nft-overall.nft", CORPUS / "knftables-kube-proxy-ipv4.nft",
                                 FIX / "derived" / "nft-overall.nft-list",
                                 FIX / "derived" / "iptables-overall.iptables-save")}


def flow_cases(twins: bool = True):
    """(ruleset, flow, expected output, masq, node addresses) per flow and ruleset; a flow may
    say what a backend's tracer prints instead (``"nft": {"output": ...}``, with a note)."""
    for f in sorted(CORPUS.glob("*.flows.json")):
        doc = json.loads(f.read_text())
        stem = f.name[: -len(".flows.json")]
        rules = [next(CORPUS.glob(stem + ".*[!n]"))]
        if twins:
            rules += list(NFT_TWINS.get(stem, ()))
        local = tuple(doc.get("nodeIPs", ())) or LOCAL
        for r in rules:
            for fl in doc["flows"]:
                want = {**fl, **fl.get("nft" if r.suffix.startswith(".nft") else "iptables", {})}
                yield pytest.param(r, fl, want["output"], bool(want.get("masq")), local,
                                   id=f"{r.name}:{fl['name']}")


@pytest.mark.parametrize("path", rulesets(), ids=lambda p: p.name)
def test_corpus_lookups(path):
    n, fails = check_ruleset(path)
    assert n > 0
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("rules,flow,output,masq,local", list(flow_cases()))
def test_corpus_packet_flows(rules, flow, output, masq, local):
    """kube-proxy's tracePacket: nat DNAT (all endpoints a probabilistic choice may give,
    joined by ", ") or a filter ACCEPT/DROP/REJECT, and whether the packet is marked for
    masquerade; on iptables (nat.py's walk) and nft (nft_trace.py's) alike."""
    smap = parse(rules).with_local_addrs(local)
    t = smap.trace(flow["sourceIP"], flow["destIP"], flow["destPort"], flow.get("protocol", "tcp"))
    assert (t.output, t.masq) == (output, masq), t


@pytest.mark.parametrize("rules,flow,output,masq,local", list(flow_cases()))
def test_corpus_packet_flows_by_lookup(rules, flow, output, masq, local):
    """The same flows through the lookups: the Service the destination looks up to and its
    endpoints (the DNAT targets), and the first drop/reject rule the packet meets.
    Masquerading is not checked."""
    smap = parse(rules).with_local_addrs(local)
    src, dst, port = flow["sourceIP"], flow["destIP"], flow["destPort"]
    proto = flow.get("protocol", "tcp")
    drops = [r for r in smap.matching_drop_rules(src, dst, port, proto) if r.reason != "conntrack_invalid"]
    svc = smap.lookup(dst, port, proto)
    if output in ("DROP", "REJECT"):
        assert drops and drops[0].verdict == output.lower(), [r.where() for r in drops]
    else:
        assert not drops, [(r.where(), r.cond.describe()) for r in drops]
        if output in ("", "ACCEPT"):
            assert svc is None or svc.kind == "healthcheck", svc
        else:
            assert svc is not None and set(svc.endpoints) == set(output.split(", ")), svc


def test_corpus_trace_names_the_rule():
    """A drop or reject the nft walk meets is reported with the Rule the parse made for it:
    the map element with its Service and reason, the LB source-range rule."""
    smap = parse(FIX / "nft-overall.nft").with_local_addrs(LOCAL)
    t = smap.trace("203.0.113.2", "192.168.99.22", 80)
    assert (t.verdict, t.rule.service, t.rule.reason) == ("drop", "ns2/svc2:p80", "no_local_endpoint")
    t = smap.trace("10.0.0.2", "172.30.0.46", 80)
    assert (t.verdict, t.rule.service, t.rule.reason) == ("reject", "ns6/svc6:p80", "no_endpoints")
    t = smap.trace("203.0.113.130", "5.6.7.8", 80)      # outside loadBalancerSourceRanges
    assert (t.output, t.rule.service, t.rule.reason) == ("DROP", "ns5/svc5:p80", "lb_source_range")
    t = smap.trace("203.0.113.2", "5.6.7.8", 80)        # inside: DNATed, masqueraded
    assert (t.output, t.masq) == ("10.180.0.3:80", True)
    t = smap.trace("10.0.0.2", "172.30.0.99", 80)       # an unallocated ClusterIP
    assert (t.output, t.rule.chain) == ("DROP", "cluster-ips-check")


def test_corpus_totals():
    """The numbers the corpus README quotes."""
    paths = rulesets()
    total = sum(check_ruleset(p)[0] for p in paths)
    names = set()
    for p in paths:
        names |= set(parse(p).names)
    assert len(paths) >= 29 and total >= 360, (len(paths), total)


def test_trace_takes_a_base_chains_drop_policy():
    """A live node's dump: the forward hook's DROP policy is the verdict when no rule decides."""
    text = (FIX / "derived" / "iptables-overall.iptables-save").read_text().replace(
        ":FORWARD ACCEPT", ":FORWARD DROP", 1)
    smap = parse_iptables_restore(text).with_local_addrs(LOCAL)
    t = smap.trace("203.0.113.2", "10.99.0.9", 80)      # routed, matches nothing
    assert (t.output, t.verdict, t.rule.text) == ("DROP", "drop", "-P FORWARD DROP")
    t = smap.trace("203.0.113.2", "192.168.99.33", 80)  # svc4's ExternalIP: DNATed, policy
    assert t.dests[0] in ("10.180.0.4:80", "10.180.0.5:80") and t.masq


# -- the lab's IPv6 rendering (nptrace/lab/kuberules.py) against real kube-proxy IPv6 rules -----
def _nft_objects(text: str) -> dict[str, set]:
    """What an nft dump declares, by kind: chains (with their headers), sets and maps (with their
    types), rules, and the elements of each set or map one by one (no comments)."""
    out: dict[str, set] = {"chain": set(), "set": set(), "map": set(), "rule": set(), "element": set()}
    for line in text.splitlines():
        m = re.match(r"add (chain|set|map|rule|element) (\S+ \S+) (.*)$", line)
        if m is None:
            continue
        kind, table, rest = m.groups()
        if kind == "element":
            name, _, body = rest.partition(" ")
            for e in body.strip()[1:-1].split(","):
                key, _, value = e.partition(" : ")
                key = re.sub(r' comment "[^"]*"', "", key).strip()
                out[kind].add((table, name, key, value.strip()))
        elif kind in ("set", "map"):
            out[kind].add((table, re.sub(r' ; comment "[^"]*"', "", rest)))
        else:
            out[kind].add((table, rest))
    return out


def test_lab_ipv6_nft_names_are_kube_proxys():
    """The lab's ``nft ip6 kube-proxy`` rendering of TestNodePorts' IPv6 Service names its
    table, sets, maps, service/external/endpoint chains and elements as kube-proxy does
    (knftables-kube-proxy-ipv6.nft). Two differences are kube-proxy versions, not family: the
    lab follows 81810de6 (``filter-prerouting-pre-dnat`` and the other base chains of
    nft-overall.nft; no ``tcp dport`` in the service chain's masquerade rule)."""
    from nptrace.lab.kuberules import Endpoint, Service, render_nft
    svc = Service("ns1", "svc1", "p80", 80, "fd00:172:30::41", node_port=3001,
                  endpoints=(Endpoint("fd00:10:180::1", 80, "node-a"), Endpoint("fd00:10:180::2:1", 80, "test-node")))
    lab = _nft_objects(render_nft([svc], "test-node", "fd00:10::/64", service_cidr="fd00:10:96::/112",
                                  nodeport_ips=("2001:db8::1", "2001:db8:1::2")))
    real = _nft_objects((CORPUS / "knftables-kube-proxy-ipv6.nft").read_text())
    for kind in ("set", "map", "element"):
        assert lab[kind] == real[kind], (kind, lab[kind] ^ real[kind])
    per_svc = re.compile(r"^(?:service|external|endpoint|local|firewall)-[A-Z2-7]{8}-")
    svc_chains = {c for c in real["chain"] if per_svc.match(c[1])}
    assert svc_chains == {c for c in lab["chain"] if per_svc.match(c[1])}
    assert {c[1] for c in svc_chains} == {
        "service-ULMVA6XW-ns1/svc1/tcp/p80", "external-ULMVA6XW-ns1/svc1/tcp/p80",
        "endpoint-ZVRFLKHO-ns1/svc1/tcp/p80__fd00.10.180..1/80",
        "endpoint-2CRNCTTE-ns1/svc1/tcp/p80__fd00.10.180..2.1/80"}
    norm = {(t, r.replace(" tcp dport 80 ", " ")) for t, r in real["rule"] if per_svc.match(r)}
    assert norm == {r for r in lab["rule"] if per_svc.match(r[1])}
    # the base chains are 81810de6's, in the ip6 family
    v4 = _nft_objects((FIX / "nft-overall.nft").read_text())
    base = {(t.replace("ip ", "ip6 "), r.replace("ip daddr", "ip6 daddr").replace("172.30.0.0/16", "fd00:10:96::/112"))
            for kind in ("chain", "rule") for t, r in v4[kind] if not per_svc.match(r)}
    assert {x for kind in ("chain", "rule") for x in lab[kind] if not per_svc.match(x[1])} == base


def test_lab_ipv6_iptables_names_are_kube_proxys():
    """The lab's ip6tables rendering of TestEnableLocalhostNodePortsIPv6's Service: the same nat
    chains (KUBE-SVC/SVL/EXT/SEP hashes of ``[ff06::c1]:80``) and rules, the NodePorts jump
    with kube-proxy's ``! -d ::1/128``. The lab's extra lines come from its pod CIDR (the test's
    proxier has no local-traffic detector: no "pod traffic" and ``! -s`` masquerade rules); its
    KUBE-FIREWALL chain is the 531be812 layout's."""
    from nptrace.lab.kuberules import Endpoint, Service, render_iptables
    svc = Service("ns1", "svc1", "p80", 80, "fd00:ab34::20", node_port=30001, etp="Local",
                  endpoints=(Endpoint("ff06::c1", 80, "node-a"), Endpoint("ff06::c2", 80, "test-node")))
    lab = render_iptables([svc], "test-node", "fd00:10::/64")
    real = (CORPUS / "TestEnableLocalhostNodePortsIPv6.rules").read_text()

    def tables(text):
        out, tab = {}, None
        for line in text.splitlines():
            if line.startswith("*"):
                tab = line[1:]
            elif line.startswith((":", "-A")):
                out.setdefault(tab, set()).add(line)
        return out
    lab_t, real_t = tables(lab), tables(real)
    detector = ("pod traffic for", "! -s fd00:10::/64 -j KUBE-MARK-MASQ")
    assert {x for x in lab_t["nat"] if not any(d in x for d in detector)} == real_t["nat"]
    assert lab_t["filter"] - {":KUBE-FIREWALL - [0:0]"} == real_t["filter"]


def test_ipv6_nodeports_and_dual_stack_trace():
    """kube-proxy's ip6 table: the NodePort answers on each ``nodeport-ips`` address (TestNodePorts'
    secondary node IP too) and on no other node address; endpoints look up back to the
    Service. Merged with an ip table (a dual-stack node), each family's packets take their
    own table's walk."""
    from nptrace.services import merge
    doc = json.loads((CORPUS / "knftables-kube-proxy-ipv6.flows.json").read_text())
    v6 = parse(CORPUS / "knftables-kube-proxy-ipv6.nft").with_local_addrs(doc["nodeIPs"] + ["2001:db8:2::9"])
    for addr in ("2001:db8::1", "2001:db8:1::2"):
        s = v6.lookup(addr, 3001)
        assert (s.name, s.kind, s.node_port) == ("ns1/svc1:p80", "nodeport", 3001), addr
    assert v6.lookup("2001:db8:2::9", 3001) is None          # a node address outside nodeport-ips
    assert v6.trace("2600:5200::1", "2001:db8:2::9", 3001).output == ""
    for ep in ("fd00:10:180::1", "fd00:10:180::2:1"):
        assert [s.name for s in v6.lookup_all(ep, 80)] == ["ns1/svc1:p80"]
    both = merge(parse(CORPUS / "knftables-kube-proxy-ipv4.nft"), v6).with_local_addrs(LOCAL)
    assert both.trace("fd00:10::2", "fd00:172:30::41", 80).output == "[fd00:10:180::1]:80, [fd00:10:180::2:1]:80"
    assert both.trace("10.0.0.2", "172.30.0.41", 80).output == "10.180.0.1:80"
    assert both.trace("10.0.0.2", "172.30.0.46", 80).output == "REJECT"


# -- kube-proxy's flow tests on the lab's renderings of their Services --------------------------
# pkg/proxy/nftables/proxier_test.go @ 81810de6 (kubernetes/kubernetes, Apache-2.0): the Services
# and the runPacketFlowTests of TestExternalTrafficPolicyLocal / -Cluster and TestNodePorts
# ("ipv6": --nodeport-addresses left to NewFakeProxier's, so 2001:db8::1 only). kube-proxy runs
# them on the rules its proxier generates inside the test; here they run on the rules the lab
# renders for the same Services (kuberules.py), iptables and nft, through ServiceMap.trace.
_KP_NODE_IPS = ("192.168.0.2", "192.168.1.2", "192.168.99.11", "2001:db8::1", "2001:db8:1::2")
_EXT, _POD = "203.0.113.2", "10.0.0.2"
_BOTH, _LOCAL_EP = "10.180.0.1:80, 10.180.2.1:80", "10.180.2.1:80"
_V6_BOTH = "[fd00:10:180::1]:80, [fd00:10:180::2:1]:80"
KP_FLOW_TESTS = {
    "TestExternalTrafficPolicyLocal": ("Local", [
        (_POD, "172.30.0.41", 80, _BOTH, False), (_POD, "192.168.99.11", 80, _BOTH, False),
        (_EXT, "192.168.99.11", 80, _LOCAL_EP, False), (_POD, "1.2.3.4", 80, _BOTH, False),
        (_EXT, "1.2.3.4", 80, _LOCAL_EP, False), (_POD, "192.168.0.2", 3001, _BOTH, False),
        (_EXT, "192.168.0.2", 3001, _LOCAL_EP, False)]),
    "TestExternalTrafficPolicyCluster": ("Cluster", [
        (_POD, "172.30.0.41", 80, _BOTH, False), (_POD, "192.168.99.11", 80, _BOTH, True),
        (_EXT, "192.168.99.11", 80, _BOTH, True), (_POD, "1.2.3.4", 80, _BOTH, True),
        (_EXT, "1.2.3.4", 80, _BOTH, True), (_POD, "192.168.0.2", 3001, _BOTH, True),
        (_EXT, "192.168.0.2", 3001, _BOTH, True)]),
    "TestNodePorts-ipv6": ("Cluster", [
        ("fd00:10::2", "fd00:172:30::41", 80, _V6_BOTH, False),
        ("2600:5200::1", "2001:db8::1", 3001, _V6_BOTH, True),
        ("2001:db8::1", "2001:db8::1", 3001, _V6_BOTH, True),
        ("2600:5200::1", "2001:db8:1::2", 3001, "", False)]),   # "secondary nodeIP ignores NodePorts"
}


def _kp_test_rules(test: str, backend: str) -> str:
    from nptrace.lab.kuberules import Endpoint, Service, render_iptables, render_nft
    etp, _ = KP_FLOW_TESTS[test]
    if test.endswith("ipv6"):
        svc = Service("ns1", "svc1", "p80", 80, "fd00:172:30::41", node_port=3001, etp=etp,
                      endpoints=(Endpoint("fd00:10:180::1", 80, ""), Endpoint("fd00:10:180::2:1", 80, "test-node")))
        pods, svc_cidr, np_ips = "fd00:10::/64", "fd00:10:96::/112", ("2001:db8::1",)
    else:
        svc = Service("ns1", "svc1", "p80", 80, "172.30.0.41", node_port=3001, etp=etp,
                      health_check_node_port=30000 if etp == "Local" else 0,
                      external_ips=("192.168.99.11",), lb_ips=("1.2.3.4",),
                      endpoints=(Endpoint("10.180.0.1", 80, ""), Endpoint("10.180.2.1", 80, "test-node")))
        pods, svc_cidr, np_ips = "10.0.0.0/8", "172.30.0.0/16", ("192.168.0.2",)
    if backend == "nft":
        return render_nft([svc], "test-node", pods, service_cidr=svc_cidr, nodeport_ips=np_ips)
    return render_iptables([svc], "test-node", pods, nodeport_addresses=np_ips)


@pytest.mark.parametrize("backend", ["iptables", "nft"])
@pytest.mark.parametrize("test", sorted(KP_FLOW_TESTS))
def test_kube_proxy_flows_on_lab_rules(test, backend):
    text = _kp_test_rules(test, backend)
    smap = (parse_nft if backend == "nft" else parse_iptables_restore)(text).with_local_addrs(_KP_NODE_IPS)
    got = [(s, d, p, *(lambda t: (t.output, t.masq))(smap.trace(s, d, p))) for s, d, p, _, _ in KP_FLOW_TESTS[test][1]]
    assert got == KP_FLOW_TESTS[test][1]
