"""Parse ``iptables-save`` / ``ip6tables-save`` (iptables-nft or legacy, ``-c`` too), ``iptables -S``,
and the ``iptables-restore`` input kube-proxy builds (no built-in chains, no ``/32``, kube-proxy's
match order, bare ``-j REJECT``): :func:`parse_iptables_save` (alias :func:`parse_iptables_restore`).

What kube-proxy writes, and what is read from it (pkg/proxy/iptables/proxier.go @ 531be812):
  * iptables nat ``KUBE-SERVICES``: ``"<ns/svc:port> cluster IP|external IP|loadbalancer IP"``
    with ``-d VIP --dport P``; its last rule jumps to ``KUBE-NODEPORTS`` for ``--dst-type
    LOCAL`` or for the ``--nodeport-addresses`` (``-d X``). ``KUBE-NODEPORTS``: ``"<name>"
    --dport NODEPORT``. ``KUBE-SEP-*``: ``-j DNAT --to-destination EP``. ``KUBE-SVL-*``
    (``KUBE-XLB-*`` before v1.24): the local endpoints of an eTP/iTP=Local Service.
    ``KUBE-FW-*``: the ``loadBalancerSourceRanges``.
  * iptables filter: ``"<name> has no endpoints" -j REJECT``, ``"<name> has no local
    endpoints" -j DROP`` (since v1.25; before, a nat ``-j KUBE-MARK-DROP``), the
    ``KUBE-PROXY-FIREWALL`` LB source-range drops, ``"<name> health check node port" -j
    ACCEPT``, ``KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP``.
"""

from __future__ import annotations

import re

from .build import Builder, gc_paused
from .facts import ANY_LOCAL, Chain, Entry, Info, Scope, Table
from .match import Flow, Match, family_of, parse_ports, unquote
from .model import LOCAL_ADDRS, AddrSet, Rule, canon, norm_proto, split_hostport
from .servicemap import ServiceMap

_RE_COMMENT = re.compile(r'--comment (?:"((?:[^"\\]|\\.)*)"|(\S+))')
_RE_TARGET = re.compile(r"(?:^|\s)-([jg]) (\S+)")
_RE_DST = re.compile(r"(?:^|\s)(!\s+)?(?:-d|--destination) (\S+)")
_RE_SRC = re.compile(r"(?:^|\s)(!\s+)?(?:-s|--source) (\S+)")
_RE_PROTO = re.compile(r"(?:^|\s)(?:-p|--protocol) (\S+)")
_RE_DPORT = re.compile(r"--dport (\d+)")
_RE_DPORT_HINT = re.compile(r"(!\s+)?--dport (\d+)(?:\s|$)")
_RE_TODEST = re.compile(r"--to-destination (\S+)")
_RE_CTSTATE = re.compile(r"(!\s+)?--(?:ct)?state (\S+)")
_RE_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|\S+')
_EXT_COMMENT = re.compile(
    r"^(?:pod traffic for|masquerade LOCAL traffic for|route LOCAL traffic for) (\S+) external destinations$")
_FW_COMMENT = re.compile(r"^(\S+) traffic not accepted by KUBE-FW-")
_IPT_HOOKS = {"PREROUTING": "prerouting", "INPUT": "input", "FORWARD": "forward", "OUTPUT": "output",
              "POSTROUTING": "postrouting"}


def _svc_name(comment: str | None) -> str | None:
    """``ns2/svc2:p80 has no local endpoints`` -> ``ns2/svc2:p80``."""
    if not comment:
        return None
    name = comment.split(" ", 1)[0]
    if "/" not in name or name.startswith("/"):
        return None
    return name


def _comment_of(rest: str) -> tuple[str | None, str]:
    """(comment, rule body without the comment match)."""
    m = _RE_COMMENT.search(rest)
    if m is None:
        return None, rest
    c = m.group(1)
    c = c.replace('\\"', '"') if c is not None else m.group(2)
    return c, rest[:m.start()] + rest[m.end():]


def _parse_ipt_match(rest: str) -> Match:
    """Conditions of one rule body (what follows ``-A CHAIN``), up to its ``-j``/``-g``."""
    m = Match()
    toks = _RE_TOKENS.findall(rest)
    i, n, neg, module = 0, len(toks), False, ""
    while i < n:
        t = toks[i]
        if t == "!":
            neg = True
            i += 1
            continue
        if t in ("-j", "-g", "--jump", "--goto"):
            break
        has_val = i + 1 < n and toks[i + 1] != "!" and not toks[i + 1].startswith("-")
        val = unquote(toks[i + 1]) if i + 1 < n else ""
        if t in ("-s", "--source", "-d", "--destination"):
            (m.src if t in ("-s", "--source") else m.dst).append((AddrSet(val.split(","), val), neg))
        elif t in ("-p", "--protocol"):
            m.proto = (frozenset({norm_proto(val)}), neg)
        elif t in ("-i", "--in-interface"):
            m.iif = ((val,), neg)
        elif t in ("-o", "--out-interface"):
            m.oif = ((val,), neg)
        elif t in ("-m", "--match"):
            module = val
        elif t in ("--dport", "--destination-port", "--dports", "--destination-ports",
                   "--sport", "--source-port", "--sports", "--source-ports"):
            r = parse_ports(val)
            if r is None:
                m.unknown.append(f"{t} {val}")
            elif t.startswith(("--dport", "--destination")):
                m.dport = (r, neg, val)
            else:
                m.sport = (r, neg, val)
        elif t in ("--ctstate", "--state"):
            m.ctstate = (frozenset(s.upper() for s in val.split(",")), neg)
        elif t in ("--dst-type", "--src-type") and val.upper() == "LOCAL":
            (m.dst if t == "--dst-type" else m.src).append((LOCAL_ADDRS, neg))
        elif t in ("--comment", "--nfacct-name"):
            pass  # counted or commented, never a condition
        elif t.startswith("-"):
            words = [f"-m {module}" if module else "", "!" if neg else "", t, val if has_val else ""]
            m.unknown.append(" ".join(w for w in words if w))
            if not has_val:
                i -= 1
        i += 2
        neg = False
    return m


class _LazyIptMatch:
    """An iptables rule's Match, parsed on first use (a 10k-Service dump has ~10k filter rules)."""

    __slots__ = ("_rest", "_extra_src", "_m", "_suffix", "family")

    def __init__(self, rest: str, extra_src: AddrSet | None = None, suffix: str = ""):
        self._rest = rest
        self._extra_src = extra_src
        self._m: Match | None = None
        self._suffix = suffix
        self.family: int | None = None   # as Match.family, checked before the parse

    def get(self) -> Match:
        if self._m is None:
            m = _parse_ipt_match(self._rest)
            if self._extra_src is not None:
                m.src.append((self._extra_src, True))
            m.family = self.family
            self._m = m
        return self._m

    def evaluate(self, f: Flow, smap: "ServiceMap | None" = None) -> bool | None:
        if self.family is not None and family_of(f) not in (None, self.family):
            return False
        return self.get().evaluate(f, smap)

    def describe(self) -> str:
        return self.get().describe() + self._suffix


class _IptState:
    """Per-parse state: nat lines are digested at once, other tables kept for finish()."""

    def __init__(self, b: Builder):
        self.b = b
        self.lines: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (table, chain) -> [(text, rest)]
        self.policy: dict[tuple[str, str], str] = {}
        self.np_scopes: list[Scope] = []
        self.nat_nodeports: list[Info] = []
        self.markdrops: list[tuple[str, str, str, str, str | None]] = []
        self.kind: dict[str, str] = {}  # table label ("filter", "ip6 filter") -> table name
        self.sections: set[str] = set()
        self.nat_lines: dict[tuple[str, str], list[str]] = {}  # (table, chain) -> [rest], for nat.py
        self.seps: list[tuple[str, str, str | None, tuple[str, int]]] = []  # (chain, svc, proto, ep)
        self.sep_jumps: set[str] = set()   # KUBE-SEP-<suffix> chains some rule jumps to

    def open_table(self, name: str, family: str, new: bool = False) -> str:
        """The label of a table section: ``filter``, ``ip6 filter``; a repeated section of the
        same family (two v4 dumps concatenated) becomes ``filter#2`` so chains do not mix."""
        label = name if family == "ip" else f"{family} {name}"
        if new and label in self.sections:
            n = 2
            while f"{label}#{n}" in self.sections:
                n += 1
            label = f"{label}#{n}"
        if new or label not in self.kind:
            self.sections.add(label)
            self.kind[label] = name
        return label

    def nat(self, table: str, chain: str, rest: str, text: str) -> None:
        """One nat rule. About ten per Service, so cheap substring tests come before any regex."""
        if not chain.startswith("KUBE-"):
            return
        b = self.b
        if "-j KUBE-SEP-" in rest:
            self.sep_jumps.add(rest.partition("-j KUBE-SEP-")[2].partition(" ")[0])
        if "KUBE-MARK-DROP" in rest:
            comment, _ = _comment_of(rest)
            self.markdrops.append((table, chain, text, rest, comment))
        if chain == "KUBE-SERVICES":
            comment, body = _comment_of(rest)
            if " KUBE-NODEPORTS" in body:
                d = _RE_DST.search(body)
                if d is not None and not d.group(1):
                    self.np_scopes.append(Scope(False, AddrSet([d.group(2)], d.group(2))))
                else:
                    self.np_scopes.append(ANY_LOCAL)
                return
            name = _svc_name(comment)
            if name is None:
                return
            d = _RE_DST.search(body)
            dp = _RE_DPORT.search(body)
            addr = canon(d.group(2)) if d is not None else None
            if addr is None or dp is None:
                return
            pm = _RE_PROTO.search(body)
            inf = b.info(name, norm_proto(pm.group(1)) if pm else None)
            what = comment[len(name) + 1:]
            key = (addr, int(dp.group(1)))
            if what == "cluster IP":
                inf.cluster[key] = None
            elif what == "external IP":
                inf.external[key] = None
            elif what == "loadbalancer IP":
                inf.lb[key] = None
        elif chain == "KUBE-NODEPORTS":
            comment, body = _comment_of(rest)
            name = _svc_name(comment)
            dp = _RE_DPORT.search(body)
            if name is None or dp is None:
                return
            pm = _RE_PROTO.search(body)
            inf = b.info(name, norm_proto(pm.group(1)) if pm else None)
            if inf.node_port is None:
                inf.node_port = int(dp.group(1))
                self.nat_nodeports.append(inf)
        elif chain.startswith("KUBE-SEP-"):
            if "DNAT" not in rest:
                return
            comment, body = _comment_of(rest)
            name = _svc_name(comment)
            to = _RE_TODEST.search(body)
            hp = split_hostport(to.group(1)) if to is not None else None
            if name is None or hp is None:
                return
            pm = _RE_PROTO.search(body)
            # an endpoint only while a Service chain still jumps here (finish()): a chain left
            # behind by a restore that re-rendered the Service without it is not one
            self.seps.append((chain, name, norm_proto(pm.group(1)) if pm else None, hp))
        elif chain.startswith(("KUBE-SVC-", "KUBE-SVL-", "KUBE-XLB-")):
            if " -> " not in rest and not chain.startswith("KUBE-XLB-"):
                return
            comment, _ = _comment_of(rest)
            if comment is None:
                return
            name, arrow, ep = comment.partition(" -> ")
            if arrow:
                hp = split_hostport(ep.strip())
                if hp is None or "/" not in name:
                    return
                inf = b.info(name)
                inf.endpoints[hp] = None
                if not chain.startswith("KUBE-SVC-"):
                    inf.local_eps[hp] = None
                    inf.etp_local = True
            else:
                n = _svc_name(comment)
                if n is not None:
                    b.info(n).etp_local = True
        elif chain.startswith("KUBE-EXT-"):
            if "external destinations" not in rest:
                return
            comment, _ = _comment_of(rest)
            m = _EXT_COMMENT.match(comment or "")
            if m is not None:
                b.info(m.group(1)).etp_local = True
        elif chain.startswith("KUBE-FW-"):
            comment, body = _comment_of(rest)
            name = _svc_name(comment)
            s = _RE_SRC.search(body)
            if name is not None and s is not None and not s.group(1) and " -j KUBE-" in f" {body}":
                b.info(name).lb_sources.append(s.group(2))

    def finish(self) -> None:
        b = self.b
        # a dump with no jump to any KUBE-SEP chain is partial (one chain listed): keep them all
        for chain, name, proto, hp in self.seps:
            if not self.sep_jumps or chain[len("KUBE-SEP-"):] in self.sep_jumps:
                b.info(name, proto).endpoints[hp] = None
        scope = None
        for s in self.np_scopes:
            scope = s if scope is None else scope.union(s)
        for inf in self.nat_nodeports:
            inf.np_scope = (scope or ANY_LOCAL).union(inf.np_scope)
        # before v1.25, "no local endpoints" and LB source-range drops were nat -j KUBE-MARK-DROP
        # and kubelet's KUBE-FIREWALL dropped the 0x8000 mark
        for table, chain, text, rest, comment in self.markdrops:
            name = _svc_name(comment)
            if chain.startswith("KUBE-FW-"):
                reason, where = "lb_source_range", "lb"
            elif comment and comment.endswith("has no local endpoints"):
                reason, where = "no_local_endpoint", "ext"
                if name is not None:
                    b.info(name).ext_no_local = b.info(name).etp_local = True
            else:
                reason, where = "other", None
            cond = _LazyIptMatch(rest, suffix=" (marked for drop; kubelet's KUBE-FIREWALL drops it)")
            rule = Rule(table, chain, text, "drop", reason, comment, None, 0, name, cond, b.backend)
            if name is not None and where is not None:
                b.kp.append((where, name, rule))
        # every chain of the other tables is kept (lazily parsed): the walk needs the jumps
        for (table, chain), lines in self.lines.items():
            if self.kind.get(table) == "filter" and chain == "KUBE-NODEPORTS":
                self._hc_rules(lines)
            pol = self.policy.get((table, chain))
            entries = [self._entry(table, chain, pos, text, rest) for pos, (text, rest) in enumerate(lines, 1)]
            policy = None
            if pol in ("DROP", "REJECT"):
                policy = Rule(table, chain, f"-P {chain} {pol}", pol.lower(), "other", "chain policy",
                              backend=b.backend)
            b.chains.append(Chain(table, chain, entries, policy, _IPT_HOOKS.get(chain)))

    def _hc_rules(self, lines) -> None:
        for _, rest in lines:
            if " health check node port" not in rest:
                continue
            comment, body = _comment_of(rest)
            name = _svc_name(comment)
            dp = _RE_DPORT.search(body)
            if name and dp and comment.endswith(" health check node port"):
                inf = self.b.info(name)
                inf.hc_port = int(dp.group(1))
                inf.etp_local = True

    def _entry(self, table: str, chain: str, pos: int, text: str, rest: str) -> Entry:
        comment, body = _comment_of(rest)
        tm = _RE_TARGET.search(body)
        target = tm.group(2) if tm else None
        d = _RE_DST.search(body)
        hint_dst = canon(d.group(2)) if d is not None and not d.group(1) else None
        dp = _RE_DPORT_HINT.search(body)
        hint_port = int(dp.group(2)) if dp is not None and not dp.group(1) else None
        if target in ("DROP", "REJECT"):
            verdict = target.lower()
            rule = self._drop_rule(table, chain, pos, text, rest, comment, body, verdict, hint_dst, hint_port)
            return Entry(rule.cond, verdict, rule, hint_dst, hint_port)
        if target == "KUBE-MARK-DROP":  # a mark: the packet goes on through the chain
            rule = self._drop_rule(table, chain, pos, text, rest, comment, body, "drop", hint_dst, hint_port)
            return Entry(rule.cond, "other", rule, hint_dst, hint_port)
        if target in ("ACCEPT", "RETURN"):
            action = target.lower()
        elif target is None or (table, target) not in self.lines:
            action = "other"  # a target extension (MARK, LOG, DNAT ...): processing goes on
        else:
            action = "goto" if tm.group(1) == "g" else "jump"
        return Entry(_LazyIptMatch(rest), action, None, hint_dst, hint_port, target)

    def _drop_rule(self, table, chain, pos, text, rest, comment, body, verdict, hint_dst, hint_port) -> Rule:
        b = self.b
        name = _svc_name(comment)
        cs = _RE_CTSTATE.search(body)
        invalid = cs is not None and not cs.group(1) and "INVALID" in cs.group(2).upper().split(",")
        extra_src = None
        if comment and comment.endswith(" has no local endpoints"):
            reason = "no_local_endpoint"
        elif comment and comment.endswith(" has no endpoints"):
            reason = "no_endpoints"
        elif chain == "KUBE-PROXY-FIREWALL" or (comment and _FW_COMMENT.match(comment)):
            reason = "lb_source_range"
            # sources inside loadBalancerSourceRanges were DNATed by nat KUBE-FW-* before filter
            srcs = b.infos[name].lb_sources if name in b.infos else []
            if srcs:
                extra_src = AddrSet(srcs, ",".join(srcs))
        elif invalid:
            reason = "conntrack_invalid"
        else:
            reason = "other"
        rule = Rule(table, chain, text, verdict, reason, comment, None, pos, name, _LazyIptMatch(rest, extra_src),
                    b.backend)
        if not chain.startswith("KUBE-"):
            return rule
        # kube-proxy's own rules, indexed for verdict_rules()
        pm = _RE_PROTO.search(body)
        proto = norm_proto(pm.group(1)) if pm else "tcp"
        if hint_port is not None and hint_dst is not None:
            b.kp.append(("dst", (hint_dst, hint_port, proto), rule))
            if name is not None and reason == "lb_source_range":
                # KUBE-PROXY-FIREWALL names the LB IP even when no nat rule does
                inf = b.info(name, proto)
                key = (hint_dst, hint_port)
                if key not in inf.lb and key not in inf.external and key not in inf.cluster:
                    inf.lb[key] = None
                    inf.filter_keys.add(key)
                return rule
            if name is None or reason not in ("no_endpoints", "no_local_endpoint"):
                return rule
            inf = b.info(name, proto)
            key = (hint_dst, hint_port)
            if chain == "KUBE-SERVICES":  # internal (ClusterIP) traffic
                if key not in inf.external and key not in inf.lb and key not in inf.cluster:
                    inf.cluster[key] = None
                    inf.filter_keys.add(key)
                if reason == "no_local_endpoint":
                    inf.int_no_local = inf.itp_local = True
            else:
                if key not in inf.external and key not in inf.lb and key not in inf.cluster:
                    inf.ext_unknown[key] = None
                if reason == "no_local_endpoint":
                    inf.ext_no_local = inf.etp_local = True
            if reason == "no_endpoints":
                inf.no_endpoints = True
        elif hint_port is not None:
            d = _RE_DST.search(body)
            if d is not None and not d.group(1):
                scope = Scope(False, AddrSet([d.group(2)], d.group(2)))
            else:
                scope = ANY_LOCAL  # -m addrtype --dst-type LOCAL
            b.kp.append(("port", ((hint_port, proto), scope), rule))
            if name is None or reason not in ("no_endpoints", "no_local_endpoint"):
                return rule
            inf = b.info(name, proto)
            if inf.node_port is None:
                inf.node_port = hint_port
            inf.np_scope = scope.union(inf.np_scope)
            if reason == "no_endpoints":
                inf.no_endpoints = True
            else:
                inf.ext_no_local = inf.etp_local = True
        else:
            b.kp.append(("global", None, rule))
        return rule


def parse_iptables_save(text: str, *, backend: str = "iptables") -> ServiceMap:
    """Parse ``iptables-save`` (``-c`` too), ``iptables -S`` or kube-proxy's restore input.

    IPv4 and IPv6 dumps may be concatenated. Lines no form explains are counted in
    ``ServiceMap.ignored``; ``backend`` only labels the result (``ServiceMap.backends``).
    """
    with gc_paused():
        return _parse_iptables(text, backend)


def _parse_iptables(text: str, backend: str) -> ServiceMap:
    b = Builder(backend)
    st = _IptState(b)
    table: str | None = None  # label of the open table: "filter", "ip6 filter", "filter#2" ...
    family, headed = "ip", False   # headed: a "# Generated by" line said the family
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            # concatenated v4 + v6 dumps: each starts with "# Generated by ip[6]tables-...-save"
            if line.startswith("# Generated by ip6tables"):
                family, headed = "ip6", True
            elif line.startswith("# Generated by iptables"):
                family, headed = "ip", True
            continue
        if line[0] == "[":  # iptables-save -c: "[pkts:bytes] -A ..."
            end = line.find("]")
            if end < 0:
                b.ignored += 1
                continue
            line = line[end + 1:].lstrip()
            if not line:            # a bare "[0:0]": a counter with no rule after it
                b.ignored += 1
                continue
        c = line[:3]
        if c in ("-A ", "-I "):
            parts = line.split(None, 2)
            if len(parts) < 2 or line.count('"') % 2:
                b.ignored += 1
                continue
            chain = parts[1]
            rest = parts[2] if len(parts) > 2 else ""
            tbl = table or st.open_table("filter", family)  # iptables -S: one table, no header
            if c == "-I ":
                head, _, tail = rest.partition(" ")
                if head.isdigit():
                    rest = tail
                line = f"-A {chain} {rest}".rstrip()
            if st.kind[tbl] == "nat":
                st.nat(tbl, chain, rest, line)
                st.nat_lines.setdefault((tbl, chain), []).append(rest)
            else:
                lst = st.lines.setdefault((tbl, chain), [])
                if c == "-I ":
                    lst.insert(0, (line, rest))
                else:
                    lst.append((line, rest))
        elif line[0] == "*":
            name = line[1:].strip()
            table = st.open_table(name, family, new=True) if name else None
            if table and (headed or family == "ip6"):
                b.families[table] = 6 if family == "ip6" else 4
        elif line[0] == ":":
            parts = line[1:].split()
            if table is None or not parts:
                b.ignored += 1
                continue
            if len(parts) > 1 and parts[1] != "-":
                st.policy[(table, parts[0])] = parts[1].upper()
            if st.kind[table] != "nat":
                st.lines.setdefault((table, parts[0]), [])
            else:
                st.nat_lines.setdefault((table, parts[0]), [])
        elif c in ("-P ", "-N "):  # iptables -S
            parts = line.split()
            if len(parts) < 2 or (c == "-P " and len(parts) < 3):
                b.ignored += 1
                continue
            tbl = table or st.open_table("filter", family)
            if c == "-P ":
                st.policy[(tbl, parts[1])] = parts[2].upper()
            if st.kind[tbl] != "nat":
                st.lines.setdefault((tbl, parts[1]), [])
        elif line == "COMMIT":
            table = None
        else:
            b.ignored += 1
    st.finish()
    if st.nat_lines:
        b.nat.append(LazyNat(st.nat_lines))
    return b.finish()


class LazyNat:
    """The nat chains of one dump for nat.py, built on the first walk: a 10k-Service dump has
    ~100k nat rules, and most maps are never asked where a packet is DNATed to."""

    __slots__ = ("_lines", "_tables")

    def __init__(self, lines: dict[tuple[str, str], list[str]]):
        self._lines = lines
        self._tables: list[Table] | None = None

    def tables(self) -> list[Table]:
        if self._tables is None:
            by_label: dict[str, Table] = {}
            for (label, chain), rests in self._lines.items():
                t = by_label.setdefault(label, Table())
                entries = [self._entry(label, r) for r in rests]
                t.chains[chain] = Chain(label, chain, entries, None, _IPT_HOOKS.get(chain))
            self._tables = list(by_label.values())
            self._lines = {}
        return self._tables

    def _entry(self, label: str, rest: str) -> Entry:
        _, body = _comment_of(rest)
        tm = _RE_TARGET.search(body)
        target = tm.group(2) if tm else None
        d = _RE_DST.search(body)
        hint_dst = canon(d.group(2)) if d is not None and not d.group(1) else None
        dp = _RE_DPORT_HINT.search(body)
        hint_port = int(dp.group(2)) if dp is not None and not dp.group(1) else None
        if target == "DNAT":
            to = _RE_TODEST.search(body)
            action, target = "dnat", (to.group(1) if to else "?")
        elif target == "KUBE-MARK-MASQ":
            action = "masq"
        elif target == "RETURN":
            action = "return"
        elif target is not None and (label, target) in self._lines:
            action = "goto" if tm.group(1) == "g" else "jump"
        else:
            action = "other"
        return Entry(_LazyIptMatch(rest), action, None, hint_dst, hint_port, target)


# kube-proxy's restore input is the same language: one parser reads both
parse_iptables_restore = parse_iptables_save
