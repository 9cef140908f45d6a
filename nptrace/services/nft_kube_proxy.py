"""kube-proxy's own nft table: its Services from its maps and chains, its drops from its vmaps.

What kube-proxy writes (pkg/proxy/nftables/proxier.go @ b0f823e6):
  * nft table ``ip|ip6 kube-proxy``: maps ``service-ips``, ``service-nodeports``,
    ``no-endpoint-services`` / ``no-endpoint-nodeports`` (``drop`` = no local endpoints,
    ``goto reject-chain`` = no endpoints), ``firewall-ips``; set ``nodeport-ips``; chains
    ``service-|local-|external-|endpoint-|firewall-HASH-ns/svc/proto/port[__ip/port]``.

Separate from nft.py, which reads the text of any ruleset: this module is the one that knows
kube-proxy's names.
"""

from __future__ import annotations

import re

from .build import Builder
from .facts import ANY_LOCAL, Chain, Entry, Scope
from .match import Match
from .model import LOCAL_ADDRS, AddrSet, Rule, canon, norm_proto, split_hostport
from .nft_rules import NftTable, generic_nft_table, parse_element, parse_nft_rule

_RE_DNAT = re.compile(r"\bdnat (?:ip6? )?to (\S+)")
# kube-proxy >= 1.35 (nftables): no endpoint chains; the service (or local) chain DNATs
# through one map, "dnat ip to numgen random mod 3 map { 0 : 10.244.0.10 . 8080, 1 : ... }"
_RE_DNAT_MAP = re.compile(r"\bdnat (?:ip6? )?to numgen \w+ mod \d+ map \{([^}]*)\}")
_RE_MAP_EP = re.compile(r"\d+\s*:\s*([0-9A-Fa-f.:]+)\s+\.\s+(\d+)")
_RE_GOTO_EP = re.compile(r"goto (endpoint-[^\s,}]+)")
_RE_KP_CHAIN = re.compile(r"^(service|local|external|endpoint|firewall)-[A-Z2-7]{8}-(.+)$")
# an eTP=Local external chain sends pod and node traffic on to all endpoints (short-circuit)
_RE_SHORT = re.compile(r"^(?:ip6? saddr (\S+)|fib saddr type local) goto ((?:service|local)-\S+)")


def _nft_name(base: str) -> tuple[str, str] | None:
    """``ns2/svc2/tcp/p80`` -> (``ns2/svc2:p80``, ``tcp``)."""
    parts = base.split("/")
    if len(parts) != 4:
        return None
    ns, svc, proto, port = parts
    return (f"{ns}/{svc}:{port}" if port else f"{ns}/{svc}"), proto


def map_endpoints(text: str) -> list[tuple[str, int]]:
    """The endpoints a service chain's DNAT map picks among (kube-proxy >= 1.35)."""
    m = _RE_DNAT_MAP.search(text)
    if m is None:
        return []
    out = []
    for host, port in _RE_MAP_EP.findall(m.group(1)):
        h = canon(host)
        if h is not None:
            out.append((h, int(port)))
    return out


def kp_nft_table(t: NftTable, b: Builder) -> None:
    """kube-proxy's own nft table: Services from its maps and chains, drops from its vmaps."""
    tname = f"{t.family} {t.name}"

    def elements(name: str):
        for e in t.sets.get(name, ()):
            yield (e, *parse_element(e))

    def addrset(name: str) -> AddrSet:
        return AddrSet([parse_element(e)[0][0] for e in t.sets.get(name, ())], f"@{name}")

    def np_scope(vmap: str) -> Scope:
        # "ip daddr @nodeport-ips ... vmap @X" or "fib daddr type local [ip daddr != 127.0.0.0/8] ... vmap @X"
        for cname in ("services", "nodeport-endpoints-check", "endpoints-check", "service-endpoints-check"):
            for text, _ in t.chains.get(cname, ()):
                if f"@{vmap}" not in text:
                    continue
                if "@nodeport-ips" in text:
                    return Scope(False, addrset("nodeport-ips"))
                excl = re.search(r"daddr != (\S+)", text)
                return Scope(True, None, AddrSet([excl.group(1)], excl.group(1)) if excl else None)
        return ANY_LOCAL

    svc_scope = np_scope("service-nodeports")
    noep_scope = np_scope("no-endpoint-nodeports")
    cluster_set = addrset("cluster-ips")
    svc_cidrs = [m.group(1) for text, _ in t.chains.get("cluster-ips-check", ())
                 for m in [re.search(r"daddr (?:\{ )?([0-9a-fA-F.:]+/\d+)", text)] if m]
    svc_cidr_set = AddrSet(svc_cidrs)

    fw_keys: dict[tuple[str, int, str], str] = {}
    for _, key, _, value in elements("firewall-ips"):
        a = canon(key[0]) if len(key) == 3 else None
        if a is not None and _digits(key[2]) and value and value.startswith("goto "):
            fw_keys[(a, int(key[2]), norm_proto(key[1]))] = value[5:].strip()

    # endpoint chains hold the DNAT targets; service-/local- chains pick among them
    ep_of_chain: dict[str, tuple[str, int]] = {}
    policy_chains = []
    # {(name, proto): [(source set, service chain)]}: the sources an external chain DNATs past
    # the frontend (so its "no local endpoints" drop cannot meet them)
    shortcuts: dict[tuple[str, str], list[tuple[AddrSet, str]]] = {}
    for cname, lst in t.chains.items():
        m = _RE_KP_CHAIN.match(cname)
        if m is None:
            continue
        prefix, base = m.group(1), m.group(2)
        nm = _nft_name(base.split("__", 1)[0])
        if nm is None:
            continue
        inf = b.info(*nm)
        if prefix == "endpoint":
            for text, _ in lst:
                dm = _RE_DNAT.search(text)
                hp = split_hostport(dm.group(1)) if dm is not None else None
                if hp is not None:
                    inf.endpoints[hp] = None
                    ep_of_chain[cname] = hp
        elif prefix in ("service", "local"):
            policy_chains.append((prefix, inf, lst))
        elif prefix == "external":
            if any("short-circuit" in text or "fib saddr type local" in text or "goto local-" in text
                   for text, _ in lst):
                inf.etp_local = True
            for text, _ in lst:
                sm = _RE_SHORT.match(text)
                if sm is not None:
                    src = AddrSet([sm.group(1)], sm.group(1)) if sm.group(1) else LOCAL_ADDRS
                    shortcuts.setdefault(nm, []).append((src, sm.group(2)))
    for prefix, inf, lst in policy_chains:
        for text, _ in lst:
            eps = [ep_of_chain[c] for c in _RE_GOTO_EP.findall(text) if c in ep_of_chain]
            for hp in eps + map_endpoints(text):
                inf.endpoints[hp] = None
                if prefix == "local":
                    inf.local_eps[hp] = None

    # service dispatch maps
    for _, key, _, value in elements("service-ips"):
        a = canon(key[0]) if len(key) == 3 else None
        m = _RE_KP_CHAIN.match(value.split()[-1]) if value else None
        nm = _nft_name(m.group(2)) if m else None
        if a is None or nm is None or not _digits(key[2]):
            b.ignored += 1
            continue
        inf = b.info(*nm)
        k = (a, int(key[2]))
        if m.group(1) in ("service", "local"):
            inf.cluster[k] = None
            inf.itp_local = inf.itp_local or m.group(1) == "local"
        elif (a, k[1], norm_proto(key[1])) in fw_keys:
            inf.lb[k] = None
        else:
            inf.external[k] = None
    for _, key, _, value in elements("service-nodeports"):
        m = _RE_KP_CHAIN.match(value.split()[-1]) if value else None
        nm = _nft_name(m.group(2)) if m else None
        if nm is None or len(key) != 2 or not _digits(key[1]):
            b.ignored += 1
            continue
        inf = b.info(*nm)
        inf.node_port = int(key[1])
        # a dual-stack node has an ip and an ip6 table: the NodePort is open on both's addresses
        inf.np_scope = svc_scope if inf.np_scope is None else inf.np_scope.union(svc_scope)

    # no-endpoint verdict maps: kube-proxy's drops and rejects
    for mapname in ("no-endpoint-services", "no-endpoint-nodeports"):
        nodeport = mapname == "no-endpoint-nodeports"
        entries: list[Entry] = []
        for elem, key, comment, value in elements(mapname):
            if len(key) != (2 if nodeport else 3) or not value or not _digits(key[-1]):
                b.ignored += 1
                continue
            verdict = "drop" if value == "drop" else "reject" if "reject" in value else None
            if verdict is None:
                continue
            reason = "no_local_endpoint" if verdict == "drop" else "no_endpoints"
            port, proto = int(key[-1]), norm_proto(key[-2])
            cond = Match()
            cond.proto = (frozenset({proto}), False)
            cond.dport = (((port, port),), False, str(port))
            text = f"add element {tname} {mapname} {{ {elem} }}"
            name = comment if comment and "/" in comment else None
            a = None
            if reason == "no_local_endpoint":
                for src, chain in shortcuts.get((name, proto), ()):
                    if any(any(ep in ep_of_chain for ep in _RE_GOTO_EP.findall(text)) or map_endpoints(text)
                           for text, _ in t.chains.get(chain, ())):
                        cond.src.append((src, True))     # DNATed to an endpoint before the drop
            if nodeport:
                if noep_scope.addrs is not None:
                    cond.dst.append((noep_scope.addrs, False))
                elif noep_scope.any_local:
                    cond.dst.append((LOCAL_ADDRS, False))
                    if noep_scope.exclude is not None:
                        cond.dst.append((noep_scope.exclude, True))
                rule = Rule(tname, mapname, text, verdict, reason, comment, None, 0, name, cond, b.backend)
                b.kp.append(("port", ((port, proto), noep_scope), rule))
            else:
                a = canon(key[0])
                if a is None:
                    b.ignored += 1
                    continue
                cond.dst.append((AddrSet.host(a), False))
                rule = Rule(tname, mapname, text, verdict, reason, comment, None, 0, name, cond, b.backend)
                b.kp.append(("dst", (a, port, proto), rule))
                b.vip_only.add((a, port, proto))
            entries.append(Entry(cond, verdict, rule, a, port))
            if name is None:
                continue
            inf = b.info(name, proto)
            inf.no_endpoints = inf.no_endpoints or reason == "no_endpoints"
            if nodeport:
                if inf.node_port is None:
                    inf.node_port = port
                inf.np_scope = noep_scope if inf.np_scope is None else inf.np_scope.union(noep_scope)
                if reason == "no_local_endpoint":
                    inf.ext_no_local = inf.etp_local = True
            elif a in cluster_set.hosts or svc_cidr_set.contains(a):
                inf.cluster.setdefault((a, port), None)
                if reason == "no_local_endpoint":
                    inf.int_no_local = inf.itp_local = True
            else:
                if (a, port, proto) in fw_keys:
                    inf.lb.setdefault((a, port), None)
                elif (a, port) not in inf.lb:
                    inf.external.setdefault((a, port), None)
                if reason == "no_local_endpoint":
                    inf.ext_no_local = inf.etp_local = True
        if entries:
            b.chains.append(Chain(tname, mapname, entries, None))

    # loadBalancerSourceRanges: firewall-ips element -> firewall chain "ip saddr != {...} drop";
    # one pseudo chain for all of them, each entry carries its own destination
    fw_entries: list[Entry] = []
    for (a, port, proto), fw_chain in fw_keys.items():
        m = _RE_KP_CHAIN.match(fw_chain)
        nm = _nft_name(m.group(2)) if m else None
        name = nm[0] if nm else None
        for pos, (text, handle) in enumerate(t.chains.get(fw_chain, ()), 1):
            cond, action, comment, _ = parse_nft_rule(text, t)
            cond.dst.append((AddrSet.host(a), False))
            cond.proto = (frozenset({proto}), False)
            cond.dport = (((port, port),), False, str(port))
            rule = None
            if action in ("drop", "reject"):
                rule = Rule(tname, fw_chain, text, action, "lb_source_range", comment, handle, pos, name, cond,
                            b.backend)
                b.kp.append(("dst", (a, port, proto), rule))
            fw_entries.append(Entry(cond, action, rule, a, port))
            if name is not None:
                for aset, neg in cond.src:
                    if neg:
                        b.info(name, proto).lb_sources.extend(sorted(aset.hosts) + [str(x) for x in aset.nets])
        if name is not None:
            b.info(name, proto).lb.setdefault((a, port), None)
    if fw_entries:
        b.chains.append(Chain(tname, "firewall-*", fw_entries, None))

    # cluster-ips-check: reject a wrong port on a live ClusterIP, drop an unallocated ClusterIP
    lst = t.chains.get("cluster-ips-check")
    if lst:
        entries = []
        for pos, (text, handle) in enumerate(lst, 1):
            cond, action, comment, _ = parse_nft_rule(text, t)
            cond.not_vip = True
            rule = None
            if action in ("drop", "reject"):
                rule = Rule(tname, "cluster-ips-check", text, action, "other", comment, handle, pos, None, cond,
                            b.backend)
                b.kp.append(("global", None, rule))
            entries.append(Entry.of(cond, action, rule))
        b.chains.append(Chain(tname, "cluster-ips-check", entries, None))

    # anything else that drops and is not kube-proxy's own plumbing
    plumbing = {"reject-chain", "cluster-ips-check", "services", "masquerading", "mark-for-masquerade",
                "firewall-check", "nodeport-endpoints-check", "service-endpoints-check", "endpoints-check"}
    generic_nft_table(t, b, [c for c in t.order if not (
        c in plumbing or _RE_KP_CHAIN.match(c) or c.startswith(("filter-", "nat-")))])


def _digits(s: str) -> bool:
    """ASCII digits only: "²".isdigit() is True and int("²") raises."""
    return s.isascii() and s.isdigit()
