"""The predictor: Facts -> what happens to the SYN and its reply, step by step, ending in the
cause nptrace would label (classify.verdict.CAUSES), or None when the connection should work.

Pure. The order follows the packet: checksum errors the namespace counted while explain ran
(the stack drops such packets on arrival), the conntrack table (full: conntrack drops a new
connection in PREROUTING, before any rule), kube-proxy's verdict on the address the client used
(no endpoints, no local endpoint, source ranges), the ingress reverse-path check (done after nat
PREROUTING, so on the DNATed packet), the forward filter per endpoint (NetworkPolicy-style
drops), the endpoint's answer (local pods' listening sockets, the node's probe connection), the
reply's source NAT and the interface the reply leaves by, then idle-connection conntrack
timeouts. A prediction's cause is the one of highest classify.verdict.PRIORITY among the steps,
which is also how an incident's cause is chosen from its events.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from nptrace.classify.rules import TAG_CAUSES, conntrack_full
from nptrace.classify.verdict import RANK
from nptrace.node.checks import CONNTRACK_FULL
from nptrace.services import ServiceMap
from nptrace.services.model import canon, fmt_ep, split_hostport

from .facts import Facts, Route

# kube-proxy sets nf_conntrack_tcp_timeout_established to 86400 s; a value this short forgets
# idle connections that applications commonly keep (keep-alive pools, long polls).
SHORT_CT_TIMEOUT_S = 300


@dataclass(frozen=True)
class Step:
    stage: str                 # ingress | service | rp_filter | forward | endpoint | snat | reply | conntrack
    text: str                  # one evidence line
    cause: str | None = None   # the cause this step predicts (None: passes)
    endpoint: str | None = None


@dataclass
class Prediction:
    cause: str | None          # None: the connection should work
    summary: str
    steps: list = field(default_factory=list)
    endpoints: dict = field(default_factory=dict)   # "ip:port" -> cause or None
    service: str | None = None

    def to_dict(self) -> dict:
        return {"cause": self.cause, "ok": self.cause is None, "summary": self.summary,
                "service": self.service, "endpoints": self.endpoints,
                "steps": [s.__dict__ for s in self.steps]}


# -- kube-proxy's masquerade, from rule text ------------------------------------------------

_IPT_RULE = re.compile(r"^-A (\S+) .*?-[jg] (\S+)")
_NFT_TABLE = re.compile(r"^\s*table (\S+) (\S+) \{")
_NFT_CHAIN = re.compile(r"^\s*chain (\S+) \{")
_NFT_JUMP = re.compile(r"\b(?:jump|goto) (\S+)")


def _reaches(edges: dict, roots, goal) -> bool:
    seen, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        if c in goal:
            return True
        todo.extend(edges.get(c, ()))
    return False


def kube_masquerade(rules) -> tuple[bool | None, str]:
    """Whether nat POSTROUTING reaches kube-proxy's MASQUERADE (iptables KUBE-POSTROUTING, nft
    table kube-proxy chain masquerading): (True/False, evidence), (None, why) when no dump holds
    kube-proxy's masquerade chain."""
    for backend, text in rules:
        if backend.startswith("iptables"):
            edges, masq, table = {}, set(), None
            for line in text.splitlines():
                if line.startswith("*"):
                    table = line[1:].strip()
                    continue
                if table != "nat":
                    continue
                m = _IPT_RULE.match(line)
                if m:
                    edges.setdefault(m.group(1), []).append(m.group(2))
                    if m.group(2) == "MASQUERADE" and m.group(1) == "KUBE-POSTROUTING":
                        masq.add("KUBE-POSTROUTING")
            if masq:
                ok = _reaches(edges, ["POSTROUTING"], masq)
                return ok, (f"{backend} nat POSTROUTING "
                            + ("-> KUBE-POSTROUTING -> MASQUERADE" if ok else
                               "does not reach KUBE-POSTROUTING's MASQUERADE (jump missing)"))
        else:
            edges, masq, roots, table, chain = {}, set(), [], None, None
            for line in text.splitlines():
                m = _NFT_TABLE.match(line)
                if m:
                    table, chain = f"{m.group(1)} {m.group(2)}", None
                    continue
                m = _NFT_CHAIN.match(line)
                if m:
                    chain = (table, m.group(1))
                    continue
                if chain is None:
                    continue
                if "hook postrouting" in line:
                    roots.append(chain)
                for j in _NFT_JUMP.findall(line):
                    edges.setdefault(chain, []).append((table, j))
                if re.search(r"\bmasquerade\b", line) and table and table.endswith(" kube-proxy") \
                        and chain[1] == "masquerading":
                    masq.add(chain)
            if masq:
                ok = _reaches(edges, roots, masq)
                return ok, ("nft " + ("postrouting -> kube-proxy masquerading -> masquerade" if ok
                                      else "no postrouting chain jumps to kube-proxy's masquerading chain"))
    return None, "no kube-proxy masquerade chain in the rules"


def service_map(facts: Facts) -> ServiceMap:
    from nptrace.services import merge, parse_iptables_save, parse_nft
    maps = [parse_nft(t, backend=b) if b == "nft" else parse_iptables_save(t, backend=b)
            for b, t in facts.rules]
    return merge(*maps).with_local_addrs(facts.local_addrs())


# -- the prediction -------------------------------------------------------------------------

def _best(causes) -> str | None:
    causes = [c for c in causes if c]
    return min(causes, key=lambda c: RANK.get(c, 99)) if causes else None


def _rp_effective(facts: Facts, iface: str | None) -> int | None:
    a, i = facts.rp_filter.get("all"), facts.rp_filter.get(iface) if iface else None
    vals = [v for v in (a, i) if v is not None]
    return max(vals) if vals else None


def _route_text(r: Route | None) -> str:
    if r is None:
        return "not looked up"
    if not r.ok:
        return f"`{r.cmd}`: {r.error}"
    return f"`{r.cmd}` -> {r.type + ' ' if r.type != 'unicast' else ''}dev {r.dev}" + \
        (f" via {r.via}" if r.via else "")


def predict(facts: Facts, smap: ServiceMap | None = None) -> Prediction:
    smap = smap if smap is not None else service_map(facts)
    steps: list[Step] = []
    add = steps.append
    client, dst, port, iif = facts.client, facts.dst, facts.port, facts.iif
    how = {"given": "as given", "address": f"it holds {dst}",
           "route": f"the route toward {client} leaves by it"}.get(facts.iif_source, "")
    add(Step("ingress", f"SYN {fmt_ep(client, 0)[:-2]} > {fmt_ep(dst, port)} arrives on "
                        f"{iif or '?'}" + (f" ({how})" if how else "")))

    csum = _checksum(facts)
    if csum is not None:
        add(csum)

    svc = smap.lookup(dst, port) if smap else None
    if svc is None:
        add(Step("service", f"no kube-proxy Service answers on {fmt_ep(dst, port)} in this "
                            f"namespace's rules ({len(smap)} Service ports known)"))
    else:
        add(Step("service", f"{fmt_ep(dst, port)} is {svc.name} ({svc.kind}), "
                            f"externalTrafficPolicy {'Local' if svc.etp_local else 'Cluster'}; "
                            f"endpoints {', '.join(svc.endpoints) or 'none'}"
                            + (f"; local {', '.join(svc.local_endpoints)}" if svc.etp_local else "")))

    table = _conntrack_table(facts)
    if table is not None:
        add(table)
        if table.cause:
            return _finish(steps, {}, svc)

    # kube-proxy's own verdict for the address the client used
    if smap:
        for r in smap.verdict_rules(dst, port, include_invalid=False):
            if r.reason in TAG_CAUSES:
                cause = TAG_CAUSES[r.reason][0]
                add(Step("service", f"kube-proxy drops or rejects it: {r.where()}: `{r.text}`", cause))
                return _finish(steps, {}, svc)

    # reverse-path filter on the ingress interface (ip_rcv_finish, after nat PREROUTING)
    back = facts.route_to_client
    rp = _rp_effective(facts, iif)
    back_dev = back.dev if back is not None and back.ok else None
    if rp in (1, 2) and iif:
        mode = "strict" if rp == 1 else "loose"
        if (rp == 1 and back_dev is not None and back_dev != iif) or (back is not None and not back.ok):
            add(Step("rp_filter", f"rp_filter {rp} ({mode}, max of conf/all and conf/{iif}) on {iif}; "
                                  f"route back to {client}: {_route_text(back)}: the SYN is dropped "
                                  f"(IP_RPFILTER)", "rp_filter"))
            return _finish(steps, {}, svc)
        add(Step("rp_filter", f"rp_filter {rp} ({mode}) on {iif}; route back: {_route_text(back)}: passes"))
    elif iif:
        add(Step("rp_filter", f"rp_filter {rp if rp is not None else '?'} on {iif}: no reverse-path check"))

    global_causes: list[str | None] = []
    if back_dev is not None and iif and back_dev != iif:
        add(Step("reply", f"the reply to {client} leaves by {back_dev}, not {iif} where the SYN came "
                          f"in ({_route_text(back)}): a stateful device on the {iif} path never sees "
                          f"it", "wrong_iface"))
        global_causes.append("wrong_iface")
    elif back_dev is not None:
        add(Step("reply", f"the reply to {client} leaves by {back_dev}, the interface the SYN came in on"))

    ct_to = facts.sysctl.get("nf_conntrack_tcp_timeout_established")
    if svc is not None and ct_to is not None and ct_to < SHORT_CT_TIMEOUT_S:
        loose = facts.sysctl.get("nf_conntrack_tcp_loose")
        add(Step("conntrack", f"nf_conntrack_tcp_timeout_established = {ct_to} s"
                              + (f", nf_conntrack_tcp_loose = {loose}" if loose is not None else "")
                              + f": a connection idle longer than {ct_to} s loses its entry and its "
                                f"next packets are INVALID (dropped, not un-NATed)", "conntrack_invalid"))
        global_causes.append("conntrack_invalid")

    per_ep: dict[str, str | None] = {}
    if svc is not None:
        eps = svc.local_endpoints if svc.etp_local and svc.kind != "clusterip" else svc.endpoints
        masq, masq_why = kube_masquerade(facts.rules)
        for ep in eps:
            per_ep[ep] = _endpoint(facts, smap, svc, ep, masq, masq_why, add)
    if svc is not None and facts.inflight is not None:
        new = _best([*global_causes, *per_ep.values(), *(s.cause for s in steps)])
        held = _inflight(facts, svc, add)
        if held:
            global_causes.append(held[0])
            if _best([new, held[0]]) == held[0] != new:
                    return _finish(steps, per_ep, svc, global_causes,
                               f" ({held[1]} of {len(facts.inflight)} open connections; new "
                               f"connections: {new or 'they work'})")
    return _finish(steps, per_ep, svc, global_causes)


def _window(facts: Facts, name: str) -> str:
    """" (+N in S s)" when the counter moved while explain ran, else ""."""
    m = facts.moved or {}
    return f" (+{m[name]} in {m['seconds']:g} s)" if m.get(name) else ""


def _conntrack_table(facts: Facts) -> Step | None:
    """The namespace's conntrack table, judged by the tracer's own rule (classify.rules
    conntrack_full: at its limit, or conntrack's drop counter moved while explain ran): full,
    a new connection's SYN is dropped in nf_conntrack_in; above CONNTRACK_FULL, a warning."""
    c = facts.counters
    count, cmax = c.get("nf_conntrack_count"), c.get("nf_conntrack_max")
    if count is None or not cmax:
        return None
    drop_new = (facts.moved or {}).get("drop", 0)
    stats = ", ".join(f"{k} {c[k]}{_window(facts, k)}" for k in ("drop", "insert_failed", "early_drop")
                      if k in c)
    table = f"conntrack table {count}/{cmax} entries ({100 * count // cmax}%)" + \
        (f"; conntrack -S: {stats}" if stats else "")
    timeout = facts.sysctl.get("nf_conntrack_tcp_timeout_established")
    remedy = (f"raise the limit (sysctl -w net.netfilter.nf_conntrack_max={cmax * 2}) or shorten "
              f"the timeouts that fill it (`conntrack -L | awk '{{print $4}}' | sort | uniq -c` "
              f"counts the entries by state"
              + (f"; nf_conntrack_tcp_timeout_established is {timeout} s" if timeout else "") + ")")
    if conntrack_full({"ct_count": count, "ct_max": cmax, "ct_drop_new": drop_new}):
        why = f"conntrack dropped {drop_new} new connections while explain ran, its own probes " \
            f"included" if drop_new else "at its limit"
        return Step("conntrack", f"{table}: full ({why}): a new connection's SYN is dropped in "
                                 f"nf_conntrack_in before any rule sees it (the kernel's "
                                 f"'nf_conntrack: table full, dropping packet'); connections "
                                 f"already in the table still pass. Remedy: {remedy}",
                    "conntrack_full")
    if count / cmax > CONNTRACK_FULL:
        return Step("conntrack", f"{table}: nearly full; at the limit new connections are dropped "
                                 f"(conntrack_full): {remedy}")
    return Step("conntrack", table)


def _checksum(facts: Facts) -> Step | None:
    """Bad checksums on arrival leave the node's state as it was: only the namespace's
    TcpInCsumErrors / UdpInCsumErrors moving while explain ran (its probes; --confirm's trace)
    show them. The counters are the namespace's, not only this client's."""
    c, m = facts.counters, facts.moved or {}
    names = [k for k in ("TcpInCsumErrors", "UdpInCsumErrors") if k in c]
    if not names:
        return None
    seen = ", ".join(f"{k} {c[k]}{_window(facts, k)}" for k in names)
    if not any(m.get(k) for k in names):
        quiet = f"none in the last {m['seconds']:g} s" if "seconds" in m else "read once"
        return Step("ingress", f"{seen} in this namespace, {quiet}: no bad checksum arrived "
                               f"while explain ran (a fault on another host shows only while "
                               f"packets flow: --confirm)")
    return Step("ingress", f"{seen} in this namespace: packets arrive with a bad checksum and the "
                           f"kernel drops them on arrival (TCP_CSUM / UDP_CSUM), before any "
                           f"socket; a device on the sender's path computed or offloaded the "
                           f"checksum before the packet was rewritten (NAT, VXLAN). Turn its TX "
                           f"checksum offload off (`ethtool -K <dev> tx-checksum-ip-generic off`, "
                           f"or the CNI's setting); --confirm names the interface they arrive by",
                "checksum")


NO_INFLIGHT = ("the causes of connections in flight show in the node's state only while they "
               "are open (proxy: a conntrack entry still DNATs to an endpoint a rollout removed; "
               "app_reset: the endpoint's pod was re-created and lost their sockets): run "
               "explain while they are, or trace them (--confirm)")


def _inflight(facts, svc, add) -> tuple[str, int] | None:
    """The client's open connections (facts.inflight): each is steered by its conntrack
    entry, not by the rules a new SYN meets. (cause, how many) of the worst, or None."""
    flows = facts.inflight
    src = f"{facts.client} > {fmt_ep(facts.dst, facts.port)}"
    if not flows:
        add(Step("inflight", f"no open connection {src} in the node's conntrack: {NO_INFLIGHT}"))
        return None
    by: dict[tuple, list] = {}
    for x in flows:
        if x["ep"] not in svc.endpoints:
            k = ("proxy", x["ep"])
        elif x.get("socket") is False:
            k = ("app_reset", x["ep"])
        else:
            k = (None, x["ep"])
        by.setdefault(k, []).append(x)
    worst = None
    for (cause, ep), xs in sorted(by.items(), key=lambda kv: RANK.get(kv[0][0], 99)):
        ports = ", ".join(str(x["sport"]) for x in xs[:5]) + (", ..." if len(xs) > 5 else "")
        what = f"{len(xs)} open connection{'s' if len(xs) > 1 else ''} {src} (client ports {ports})"
        if cause == "proxy":
            text = (f"{what} are DNATed by their conntrack entries to {ep}, no longer an endpoint "
                    f"of {svc.name} (now: {', '.join(svc.endpoints) or 'none'}): kube-proxy's new "
                    f"rules do not touch established entries, so their next packets still go "
                    f"to the removed endpoint")
        elif cause == "app_reset":
            pod = facts.local_pods.get(split_hostport(ep)[0], {})
            text = (f"{what} are DNATed to {ep}, still an endpoint, but its pod (netns "
                    f"{pod.get('netns', '?')}) holds no socket of them: its TCP stack was "
                    f"re-created (a restart) and answers their next segment with a RST")
        else:
            held = "held by the endpoint's socket" if xs[0].get("socket") else "to a current endpoint"
            text = f"{what} go to {ep}, {held}"
        add(Step("inflight", text, cause, ep))
        if cause and worst is None:
            worst = (cause, len(xs))
    return worst



def _endpoint(facts, smap, svc, ep, masq, masq_why, add) -> str | None:
    hp = split_hostport(ep)
    if hp is None:
        return None
    ip, eport = hp
    causes = []
    r = facts.syn_routes.get(ip)
    pod = facts.local_pods.get(ip)
    add(Step("forward", f"DNAT to {ep}: {_route_text(r)}" + (f" (local pod, netns {pod['netns']})"
                                                            if pod else " (on another node)"), None, ep))
    oif = r.dev if r is not None and r.ok else None
    drops = [d for d in smap.matching_drop_rules(facts.client, ip, eport, hook="forward",
                                                 iif=facts.iif, oif=oif) if d.reason == "other"]
    if drops:
        d = drops[0]
        add(Step("forward", f"a filter rule drops {facts.client} > {ep}: {d.where()}: `{d.text}`",
                 "policy_drop", ep))
        return "policy_drop"
    if pod is not None and eport not in pod.get("listen", []):
        ports = ", ".join(str(p) for p in pod.get("listen", [])) or "none"
        add(Step("endpoint", f"nothing listens on {ep} in {pod['netns']} (TCP listening ports: "
                             f"{ports}): the pod answers the SYN with a RST", "no_listener", ep))
        causes.append("no_listener")
    pr = facts.probes.get(ep)
    if pr is not None:
        outcome = pr.get("outcome")
        cause = {"refused": "no_listener", "timeout": "proxy", "unreachable": "proxy",
                 "reset": "app_reset"}.get(outcome)
        what = {"refused": "refused (RST): nothing listens there",
                "timeout": "no answer: a stale endpoint (deleted pod), or a drop on its node",
                "unreachable": "host unreachable: the endpoint is gone",
                "reset": "connected, then reset by the application",
                "ok": "connected and answered", "connected": "connected (no reply in time)"}.get(
                    outcome, outcome)
        if cause != "no_listener" or "no_listener" not in causes:
            add(Step("endpoint", f"probe from the node to {ep}: {what}"
                                 + (f" ({pr['error']})" if pr.get("error") else ""), cause, ep))
        if cause and cause not in causes:
            causes.append(cause)
    if not svc.etp_local:
        if masq is False and pod is None:
            add(Step("snat", f"not masqueraded ({masq_why}): {ep} answers {facts.client} directly "
                             f"from its node, un-NATed, and the client resets the unknown reply",
                     "snat", ep))
            causes.append("snat")
        elif masq:
            add(Step("snat", f"masqueraded to the node's address ({masq_why})", None, ep))
    return _best(causes)


def _finish(steps, per_ep, svc, global_causes=(), where: str | None = None) -> Prediction:
    cause = _best([*global_causes, *per_ep.values(), *(s.cause for s in steps)])
    if cause is None:
        summary = "predicted: the connection works"
    else:
        bad = [e for e, c in per_ep.items() if c]
        if where is None:
            where = f" ({len(bad)} of {len(per_ep)} endpoints)" if per_ep and bad and \
                any(s.cause == cause and s.endpoint and s.stage != "inflight" for s in steps) else ""
        summary = f"predicted: {cause}{where}"
    return Prediction(cause, summary, steps, per_ep, svc.name if svc is not None else None)
