"""The one netfilter question the classifier asks: which rule dropped or rejected this packet,
and what kind of drop is it (its cause tag)?

``nf_cause`` is pure over a ServiceMap and answers plain data, so a recording keeps the answer
and a replay needs no rules: None is for "no ruleset" and is the caller's to say (the map is
None); ``{"tag": None}`` when the ruleset has no rule for the packet; else ``{"tag", "where",
"text", "service", "to_pod"}`` (a firewall drop adds "hook", the filter hook it was met on,
INPUT or FORWARD, where it can be told; an IPVS answer adds "virtual_server" and
"real_servers").
Tags are ``model.REASONS``, and "ipvs_nodest" for IPVS's drop of a deleted real server's
connection; classify/rules.py turns a tag into a
cause and its hint, and nothing else decides a netfilter cause.
"""

from __future__ import annotations

from .ipvs import ipvs_cause
from .servicemap import ServiceMap


def nf_cause(smap: ServiceMap, saddr: str, daddr: str, dport: int, odst: str, oport: int,
             syn: bool, has_ct: bool) -> dict:
    """The rule behind a drop or reject of saddr -> daddr:dport, whose connection was made to
    odst:oport (the address before DNAT, else daddr:dport). `syn`: the packet opens a
    connection; `has_ct`: it carried a conntrack entry.

    Order: kube-proxy's own verdict for the address the client used (no endpoints, no local
    endpoint, source ranges; not for a client kube-proxy's nat rules DNAT past them); a mid-connection packet without conntrack against the
    conntrack-INVALID drop; then the firewall rules that match the packet, "other" (not
    kube-proxy's) first. `to_pod`: the packet was headed to a Service's endpoint."""
    def out(r, tag=None, to_pod=False):
        return {"tag": tag or r.reason, "where": r.where(), "text": r.text,
                "service": r.service, "to_pod": to_pod}
    # IPVS takes a virtual server's packets at LOCAL_IN, after the filter rules let them in:
    # what it drops itself is decided from its own table (ipvs.py)
    for st in smap.ipvs:
        got = ipvs_cause(st, odst, oport, syn, has_ct)
        if got is not None:
            return got
    for r in smap.verdict_rules(odst, oport, include_invalid=False, saddr=saddr):
        if r.reason != "other":
            return out(r)
    if not syn and not has_ct:
        # conntrack clears skb->_nfct for a packet it deems INVALID. The rule that dropped it is
        # on the hook it crossed: INPUT for the node's own address (an INVALID packet is not
        # DNATed, so one to a NodePort is delivered locally), FORWARD for a routed one
        for hook in _hooks(smap, daddr, dport):
            for r in smap.matching_drop_rules(saddr, daddr, dport, ctstate="INVALID", hook=hook):
                if r.reason == "conntrack_invalid":
                    return out(r)
        for r in smap.verdict_rules(daddr, dport):
            if r.reason == "conntrack_invalid":
                return out(r)
    rules, hook = _drop_rules(smap, saddr, daddr, dport, "NEW" if syn else None)
    rules = [r for r in rules if r.reason == "other"] or rules
    if not rules:
        return {"tag": None}
    ep = smap.lookup(daddr, dport)
    to_pod = (ep is not None and ep.kind == "endpoint") or (daddr, dport) != (odst, oport)
    return {**out(rules[0], to_pod=to_pod), "hook": hook.upper() if hook else None}


def _drop_rules(smap: ServiceMap, saddr: str, daddr: str, dport: int, ctstate) -> tuple[list, str | None]:
    """The drop rules the packet may meet on the filter hook it crosses (INPUT for the node's
    own address, FORWARD for one routed on, after kube-proxy's DNAT), and that hook; every
    hook's, and None, when that one has none (or the hook cannot be told)."""
    if smap.local_addrs is not None or smap.lookup(daddr, dport) is not None:
        hooks = _hooks(smap, *(smap.dnat_dest(saddr, daddr, dport) or (daddr, dport)))
        if len(hooks) == 1:
            rules = smap.matching_drop_rules(saddr, daddr, dport, ctstate=ctstate, hook=hooks[0])
            if rules:
                return rules, hooks[0]
    return smap.matching_drop_rules(saddr, daddr, dport, ctstate=ctstate), None


def _hooks(smap: ServiceMap, daddr: str, dport: int) -> tuple[str, ...]:
    """The filter hook(s) a packet to daddr:dport crosses, most likely first."""
    if smap.local_addrs is not None:
        return ("input",) if daddr in smap.local_addrs else ("forward",)
    s = smap.lookup(daddr, dport)
    if s is not None and s.kind in ("nodeport", "healthcheck"):
        return ("input",)
    if s is not None:
        return ("forward",)
    return ("forward", "input")
