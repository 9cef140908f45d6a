"""The rules: one function per cause (or a family of causes decided on one lookup), each
with its hint. A rule is (event, reason name, earlier events of the flow, ctx) -> (cause,
confidence, hint) or None; RULES is ordered and the first match names the event's own label.

Pure: what a rule knows about the node comes through the Context's lookups. The netfilter causes
take one services query (Context.nf_rule, live nptrace.services.nf_rule on the namespace's
Service map) and are decided here from the tag it answers.
"""
from __future__ import annotations

from typing import Callable

from nptrace.events import Event, F_ENCAP, F_HAS_SOCK, TCP_ACK, TCP_RST, TCP_SYN
from nptrace.text import hostport

from .flowkey import nat_peer_tuple
from .verdict import (APP_RESETS, D_INGRESS, T_ASYM_IFACE, T_ASYM_SRC, T_DROP, T_ICMP,
                      T_RST_RECV, T_RST_SENT, T_SYN_RETX, T_WIRE_ICMP, T_WIRE_RST, WEAK_DROPS, Context,
                      Labeled)

Rule = Callable[[Event, str, list, Context], "tuple[str, float, str] | None"]
UNKNOWN_HINT = "no rule explains this event; the evidence lists what the kernel showed"


def applies_to(*types: int):
    """Declare the event types a rule can match: the classifier then skips it for the others
    (eight Python calls per record add up in a storm). A rule without it sees every event."""
    def mark(rule):
        rule.event_types = frozenset(int(t) for t in types)
        return rule
    return mark


def for_reasons(t: int, names):
    """Declare that a rule can match an event of type t only when its reason name is one of
    `names` (the rule's own first test, stated where the classifier can read it): the rules
    of a (type, reason name) are then picked once per pair, not tested per record. The rule
    keeps its own test; this only skips calls that would return None."""
    def mark(rule):
        rule.reasons = {**getattr(rule, "reasons", {}), int(t): frozenset(names)}
        return rule
    return mark


def rules_for(t: int, rname: str | None = None) -> list:
    """The RULES that can match an event of type t (with reason name rname, when given), in
    RULES order."""
    return [r for r in RULES if t in getattr(r, "event_types", (t,))
            and (rname is None or rname in getattr(r, "reasons", {}).get(t, (rname,)))]


def run_rules(ev: Event, rname: str, pending, ctx, rules, t: int) -> tuple:
    """(cause, confidence, hint) of the first rule that matches, else the fallback: evidence
    only for a weak drop, "unknown" otherwise (what Classifier.feed_many labels an event)."""
    for rule in rules:
        got = rule(ev, rname, pending, ctx)
        if got:
            if type(got) is tuple and len(got) == 3:
                return got
            return tuple(Labeled(ev, rname, *got)[2:])
    if t == T_DROP and rname in WEAK_DROPS:
        return (None, 0.0, "")
    return ("unknown", 0.0, UNKNOWN_HINT)


SYNACK = TCP_SYN | TCP_ACK
# kfree_skb reasons of a packet to an address nobody answers for
GONE_DROPS = ("NEIGH_FAILED", "IP_OUTNOROUTES", "IP_INADDRERRORS")
TCP_LISTEN = 10   # include/net/tcp_states.h: sk_state of a listening socket


# ICMPv6 destination unreachable (type 1, RFC 4443 3.1) code -> the ICMP type 3 code it stands
# for: no route -> net, administratively prohibited / source policy / reject route -> admin
# prohibited (13), address unreachable -> host (1), port unreachable -> port (3)
_ICMP6_UNREACH_AS_V4 = {0: 0, 1: 13, 3: 1, 4: 3, 5: 13, 6: 13}
_AF_INET6 = 10


def unreach(ev: Event) -> int:
    """An ICMP event's reason as ICMP type 3 << 8 | code; ICMPv6 type 1 codes mapped."""
    if ev.family == _AF_INET6 and ev.reason >> 8 == 1:
        return 3 << 8 | _ICMP6_UNREACH_AS_V4.get(ev.reason & 0xff, 0xff)
    return ev.reason


def nf_rule_text(got: dict) -> str:
    """``table/chain rule N: `rule` `` of a netfilter answer, with the hook it was met on where
    the chain is one of its own (reached from INPUT or FORWARD)."""
    where, hook = got.get("where") or "", got.get("hook")
    if hook and f"/{hook} " not in where and not where.endswith(f"/{hook}"):
        where += f", on the {hook} hook"
    return f"{where}: `{got.get('text')}`"


def _is_nf_reject(ev: Event, rname: str) -> bool:
    return (ev.type == T_DROP and rname == "NETFILTER_DROP") or \
        (ev.type in (T_ICMP, T_WIRE_ICMP) and unreach(ev) >> 8 == 3
         and unreach(ev) & 0xff in (3, 9, 10, 13))


def _orig_dst(ev: Event) -> tuple[str, int]:
    if ev.ct is not None and ev.ct.dnat:
        return ev.ct.orig_dst, ev.ct.orig_dport
    return ev.daddr, ev.dport


@applies_to(T_DROP)
@for_reasons(T_DROP, ("IP_RPFILTER",))
def rule_rp_filter(ev, rname, history, ctx):
    if ev.type == T_DROP and rname == "IP_RPFILTER":
        # an encapsulated packet is checked on its outer source (the sending node's VTEP)
        src = ev.outer_saddr if ev.flags & F_ENCAP and ev.outer_saddr else ev.saddr
        back = ctx.route_iface(ev.netns, src)
        via = f" while the route back to {src} leaves by {back}" if back else ""
        what = f"a VXLAN packet from {src} (inner {{saddr}})" if src != ev.saddr else "a packet from {saddr}"
        return ("rp_filter", 0.95,
                f"strict reverse-path filter dropped {what} arriving on {{iface}}"
                + via + ": use loose mode (sysctl -w net.ipv4.conf.all.rp_filter=2 and "
                "net.ipv4.conf.<iface>.rp_filter=2 for {iface}) or route replies back the way "
                "requests came")
    return None


ETP_FALLBACK_HINT = (
    "{service} has externalTrafficPolicy: Local, yet its endpoint {ep} answers a client whose "
    "connection another node forwarded to it without SNAT: {where}. kube-proxy in IPVS mode "
    "fills an eTP=Local NodePort of a node without a local endpoint with the cluster's "
    "endpoints and does not masquerade them (to keep the client address), so the pod's reply "
    "goes straight to the client, which never connected to it and resets it. Let the load "
    "balancer use the Service's healthCheckNodePort so it skips nodes without an endpoint, run "
    "the backend on every node (DaemonSet), or use externalTrafficPolicy: Cluster")


def etp_local_fallback(ctx, addr: str, port: int):
    """The label of a reply that left unmasqueraded because its pod's Service has
    externalTrafficPolicy: Local: the node that forwarded it had no local endpoint (the
    cause), not a missing masquerade rule; None for any other Service."""
    got = ctx.etp_local(addr, port)
    if not got:
        return None
    vs = got.get("no_local") or []
    where = (f"IPVS virtual servers without a real server on their own node send to it ({', '.join(vs)})"
             if vs else f"that node has no local endpoint of {got['service']}")
    return ("no_local_endpoint", 0.85, ETP_FALLBACK_HINT.format(
        service=got["service"], ep=hostport(addr, port), where=where))


@applies_to(T_ASYM_SRC, T_RST_SENT, T_DROP)
@for_reasons(T_RST_SENT, ("NO_SOCKET",))
@for_reasons(T_DROP, ("NO_SOCKET",))
def rule_unexpected_reply(ev, rname, history, ctx):
    """A SYN-ACK its receiver never asked for: the reply left with the pod's own source."""
    if ev.type == T_ASYM_SRC:
        fallback = etp_local_fallback(ctx, ev.saddr, ev.sport)
        if fallback:
            return fallback
        return ("snat", 0.85,
                "the reply from {saddr}:{sport} leaves without being translated back to the "
                "address the client connected to: masquerade the forwarded traffic "
                "(externalTrafficPolicy: Cluster) or keep replies on the node that DNATed them "
                "(externalTrafficPolicy: Local)")
    if rname == "NO_SOCKET" and ev.type in (T_RST_SENT, T_DROP) \
            and ev.answered_flags & SYNACK == SYNACK:
        peer = (ev.daddr, ev.dport) if ev.type == T_RST_SENT else (ev.saddr, ev.sport)
        if ctx.service_of(*peer) and not ctx.endpoint_of(*peer):
            # The SYN-ACK comes from the Service's own front end: it WAS un-NATed. It is a
            # retransmission reaching a client that already gave up on the connection (reset
            # by a middlebox, timed out), a consequence of the flow's earlier cause; saying
            # snat here outranks that cause when both land in one incident.
            return None
        fallback = etp_local_fallback(ctx, *peer)
        if fallback:
            return fallback
        return ("snat", 0.9,
                f"{peer[0]}:{peer[1]} answered a connection the client made to another address: "
                "the reply was not un-NATed (it left by another node or path than the DNAT); "
                "the client reset it. Masquerade forwarded NodePort traffic "
                "(externalTrafficPolicy: Cluster with KUBE-POSTROUTING MASQUERADE) or use "
                "externalTrafficPolicy: Local, or the PROXY protocol to keep the client address")
    return None


@applies_to(T_DROP, T_WIRE_RST)
@for_reasons(T_DROP, ("NETFILTER_DROP",))
def rule_client_answers_endpoint(ev, rname, history, ctx):
    """The node that DNATed a client's connection to an endpoint on another node sees the
    client address that endpoint directly, from the port of that connection: the endpoint's
    reply reached the client un-NATed (it left by its own node, not masqueraded), and the
    client answers it, most often with a reset. This node's conntrack knows no such
    connection: a rule drops it INVALID (iptables mode's KUBE-FORWARD), or it is forwarded
    to the pod (nftables mode). The cause is the missing masquerade, seen from the side that
    DNATed."""
    # a reset a rule dropped (conntrack INVALID) or one coming in: a storm's other drops and
    # the resets it sends never ask the NAT map (their labels stay memoized, labelmemo.py)
    if not ev.tcpflags & TCP_RST or (ev.type == T_DROP and rname != "NETFILTER_DROP") \
            or (ev.type == T_WIRE_RST and ev.dir != D_INGRESS):
        return None
    got = nat_peer_tuple(ctx.nat_peer(ev.daddr, ev.dport, ev.saddr, ev.sport))
    if got is None or (got[0], got[1]) != (ev.saddr, ev.sport) \
            or (got[2], got[3]) == (ev.daddr, ev.dport):
        return None
    fallback = etp_local_fallback(ctx, ev.daddr, ev.dport)
    if fallback:
        return fallback
    client, ep, front = hostport(ev.saddr, ev.sport), hostport(ev.daddr, ev.dport), hostport(got[2], got[3])
    return ("snat", 0.85,
            f"{client} connected to {front}, which this node DNATed to {ep}, and now sends to "
            f"{ep} itself: the endpoint's reply reached the client with the pod's own address "
            "(it left by the endpoint's node, not masqueraded), and the client answers that "
            "reply, which this node's conntrack does not know. Masquerade forwarded NodePort "
            "traffic (KUBE-POSTROUTING MASQUERADE, externalTrafficPolicy: Cluster) or use "
            "externalTrafficPolicy: Local")


@applies_to(T_ASYM_IFACE)
def rule_wrong_iface(ev, rname, history, ctx):
    if ev.type != T_ASYM_IFACE:
        return None
    back = ctx.iface_name(ev.netns, ev.in_ifindex) or f"ifindex {ev.in_ifindex}"
    if ctx.endpoint_of(ev.saddr, ev.sport):
        # The reply comes from a pod's own address: nothing un-DNATs it here, so the request
        # was DNATed on another node and forwarded without masquerade.
        fallback = etp_local_fallback(ctx, ev.saddr, ev.sport)
        if fallback:
            return fallback
        return ("snat", 0.85,
                f"the pod {hostport(ev.saddr, ev.sport)} answers a client whose request arrived on {back} "
                "(from another node, not masqueraded) and its reply leaves by {iface} with the "
                "pod's own address: the client never connected to it and resets or drops it. "
                "Masquerade forwarded NodePort traffic (KUBE-POSTROUTING MASQUERADE, "
                "externalTrafficPolicy: Cluster) or use externalTrafficPolicy: Local")
    return ("wrong_iface", 0.85,
            f"the request came in on {back} but the reply leaves by {{iface}}: a stateful "
            "middlebox or the peer on the other path will drop or reset it. Add policy "
            "routing (ip rule from <secondary address> table N) so replies leave by the "
            "interface the request came in on")


TAG_CAUSES = {
    "no_local_endpoint": ("no_local_endpoint", 0.95,
                          "{service} has externalTrafficPolicy: Local and no ready endpoint on "
                          "this node, so kube-proxy drops NodePort traffic here ({rule}). Let the "
                          "load balancer use the Service's healthCheckNodePort so it skips this "
                          "node, run the backend on every node (DaemonSet), or use "
                          "externalTrafficPolicy: Cluster"),
    "no_endpoints": ("no_endpoints", 0.95,
                     "{service} has no ready endpoints: kube-proxy rejects with ICMP port "
                     "unreachable ({rule}); the client sees connection refused. Check the "
                     "Deployment's replicas and readiness probes (kubectl get endpointslices)"),
    "lb_source_range": ("policy_drop", 0.85,
                        "{saddr} is outside {service}'s loadBalancerSourceRanges ({rule}): add "
                        "the client range to spec.loadBalancerSourceRanges"),
    "conntrack_invalid": ("conntrack_invalid", 0.85,
                          "conntrack marked a mid-connection packet INVALID (out of window, or "
                          "its connection was already forgotten) and {rule} dropped it. Look for "
                          "asymmetric paths, conntrack timeouts shorter than the app's idle time "
                          "and table pressure; net.netfilter.nf_conntrack_tcp_be_liberal=1 makes "
                          "conntrack accept such packets"),
}


def conntrack_full(got: dict) -> bool:
    """The conntrack table of nf_rule's answer was full when the packet was dropped: at its
    limit (within 1%), or conntrack's own drop counter moved since the previous reading."""
    cmax, count = got.get("ct_max"), got.get("ct_count")
    if not cmax or count is None:
        return False
    return count >= cmax - max(1, cmax // 100) or bool(got.get("ct_drop_new"))


CONNTRACK_FULL_HINT = (
    "the conntrack table is full ({count}/{cmax} entries; conntrack's drop counter: {drop}, "
    "{new} since the previous reading): conntrack dropped this new connection before any rule "
    "saw it. Raise the limit (sysctl -w net.netfilter.nf_conntrack_max={twice}) or shorten the "
    "timeouts that fill it (`conntrack -L | awk '{{print $4}}' | sort | uniq -c` shows which "
    "states hold the entries; e.g. net.netfilter.nf_conntrack_tcp_timeout_time_wait)")


@applies_to(T_DROP, T_ICMP, T_WIRE_ICMP)
@for_reasons(T_DROP, ("NETFILTER_DROP",))
def rule_netfilter(ev, rname, history, ctx):
    if not _is_nf_reject(ev, rname):
        return None
    odst, oport = _orig_dst(ev)
    got = ctx.nf_rule(ev.netns, ev.saddr, ev.daddr, ev.dport, odst, oport,
                      bool(ev.tcpflags & TCP_SYN), ev.ct is not None)
    if got is not None and ev.type == T_DROP and conntrack_full(got):
        cmax = got["ct_max"]
        return ("conntrack_full", 0.9, CONNTRACK_FULL_HINT.format(
            count=got["ct_count"], cmax=cmax, drop=got.get("ct_drop", "?"),
            new=got.get("ct_drop_new", 0), twice=cmax * 2))
    if got is None or got.get("no_ruleset"):
        return ("netfilter_reject", 0.5,
                "a netfilter rule dropped or rejected this packet; the rule could not be named "
                "(no readable ruleset for this namespace): run `iptables-save -c` / "
                "`nft list ruleset` in the namespace")
    tag = got.get("tag")
    if got.get("virtual_server"):
        return _ipvs_label(ev, got)
    rule = nf_rule_text(got)
    if got.get("source"):
        # nftrace_live: whether nf_tables tracing saw this rule drop the flow, or why not
        rule += (", seen by nft trace" if got["source"] == "nft trace"
                 else f", named from the ruleset; {got.get('note') or 'not traced'}")
    if tag in TAG_CAUSES:
        cause, conf, hint = TAG_CAUSES[tag]
        return (cause, conf, hint.replace("{rule}", rule)
                .replace("{service}", got.get("service") or "{service}"))
    if tag == "other" and got.get("to_pod"):
        return ("policy_drop", 0.85,
                f"a netfilter rule dropped traffic from {{saddr}} to the pod {{daddr}}:{{port}} "
                f"({rule}). If it is a NetworkPolicy, allow the clients it should admit on "
                f"port {ev.dport}: {ev.saddr} is the source the pod sees, a client's own "
                "address or, for NodePort traffic another node forwarded with masquerade, that "
                "node's (an ipBlock for it admits every client through that node; "
                "externalTrafficPolicy: Local keeps the clients' addresses to allow by ipBlock)")
    if tag == "other":
        return ("netfilter_reject", 0.75, f"netfilter dropped or rejected the packet at {rule}")
    return ("netfilter_reject", 0.5,
            "netfilter dropped or rejected this packet but no rule in the namespace's ruleset "
            "matches it as far as nptrace evaluates rules, so the rule cannot be known from the "
            "ruleset" + (f"; {got['note']}" if got.get("note") else
                         ": trace it with `nft monitor trace` / `iptables -j TRACE`"))


IPVS_HINTS = {
    "no_endpoints": ("no_endpoints", 0.95,
                     "{service}'s IPVS virtual server {vs} has no real servers ({state}): IPVS "
                     "itself answers the SYN with ICMP port unreachable and the client sees "
                     "connection refused. Check the Deployment's replicas and readiness probes "
                     "(kubectl get endpointslices -l kubernetes.io/service-name=<name>)"),
    "no_local_endpoint": ("no_local_endpoint", 0.95,
                          "{service} has externalTrafficPolicy: Local and its IPVS virtual "
                          "server {vs} has no real server on this node ({state}). Let the load "
                          "balancer use the Service's healthCheckNodePort so it skips this node, "
                          "run the backend on every node (DaemonSet), or use "
                          "externalTrafficPolicy: Cluster"),
    "ipvs_nodest": ("proxy", 0.9,
                    "IPVS dropped a packet of this established connection to virtual server {vs} "
                    "of {service}: its real server {rs} was deleted from the virtual server while "
                    "the connection was in flight (an endpoint removed by a rollout; now {state}), "
                    "and with net.ipv4.vs.expire_nodest_conn=0 IPVS drops the connection's packets "
                    "silently until its entry expires (ipvsadm -Lnc). Set "
                    "net.ipv4.vs.expire_nodest_conn=1 (kube-proxy's own setting: the entry goes at "
                    "the next packet and the client reconnects), and drain before deleting pods "
                    "(graceful termination longer than the clients' idle time). "
                    "net.ipv4.vs.conn_reuse_mode={reuse} decides whether a new SYN from the same "
                    "client port reuses such an entry"),
}


def _ipvs_label(ev: Event, got: dict):
    """A drop IPVS made itself (services/ipvs.py ipvs_cause): its virtual server, the real
    servers it has, and for a deleted real server the one this connection is bound to (the
    conntrack entry's reply source: IPVS rewrites it to the real server, net.ipv4.vs.conntrack=1)."""
    tag = got["tag"]
    cause, conf, hint = IPVS_HINTS.get(tag, IPVS_HINTS["no_endpoints"])
    reals = got.get("real_servers") or []
    state = "real servers " + ", ".join(reals) if reals else "no real servers"
    c = ev.ct
    # the map may be read just before kube-proxy's sync removed the real server: its list is
    # shown, not used to overrule the kernel's drop
    rs = hostport(c.reply_src, c.reply_sport) if c is not None and c.reply_src else "?"
    return (cause, conf, hint.format(service=got.get("service") or "the Service", vs=got["virtual_server"],
                                     state=state, rs=rs, reuse=got.get("conn_reuse_mode", "?")))


@applies_to(T_DROP, T_ICMP, T_WIRE_ICMP)
@for_reasons(T_DROP, GONE_DROPS)
def rule_stale_endpoint(ev, rname, history, ctx):
    """DNAT to an address nobody answers for: the endpoint is gone, the rules are not."""
    gone = (ev.type == T_DROP and rname in GONE_DROPS) \
        or (ev.type in (T_ICMP, T_WIRE_ICMP) and unreach(ev) in (3 << 8 | 1, 3 << 8 | 0))
    if gone and (ev.ct is not None and ev.ct.dnat or ctx.service_of(ev.daddr, ev.dport)):
        c = ev.ct
        if c is not None and c.dnat and c.reply_src:
            # the endpoint conntrack sends it to: an event before the DNAT (the NodePort's
            # own interface) has the frontend as its destination, which answers for nobody
            via = f"{hostport(c.orig_dst, c.orig_dport)} to the endpoint "
            ep = hostport(c.reply_src, c.reply_sport)
        else:
            via, ep = "to the endpoint ", "{daddr}:{port}"
        return ("proxy", 0.8,
                "the service proxy DNATs " + via + ep + ", which does not answer: no host has "
                "that address on the network any more. kube-proxy's rules are stale (endpoint "
                "deleted, sync failed or lagging). Check kube-proxy's logs and sync metrics, "
                "and the EndpointSlice of {service}")
    if gone and (ev.ct is None or not ev.ct.dnat):
        # No DNAT here, and the rules no longer list the address: another node's conntrack
        # still steers a connection it DNATed before the rollout removed this endpoint.
        removed = ctx.removed_endpoint(ev.daddr, ev.dport)
        if removed:
            ep = hostport(ev.daddr, ev.dport)
            return ("proxy", 0.8,
                    f"{ep} was an endpoint of {removed} until the rules stopped listing it (a "
                    "rollout), and nobody has that address any more; this packet of an "
                    f"established connection still goes to it, from {ev.saddr}: the node that "
                    "DNATed the connection keeps steering it by its conntrack entry, which "
                    "kube-proxy does not flush for TCP. Drain before deleting pods (graceful "
                    "termination, a preStop sleep longer than the clients' idle time) or flush "
                    f"the entries on the node that DNATed: conntrack -D --dst-nat {ev.daddr}")
    return None


STALE_CONNTRACK_HINT = (
    "conntrack still steers this established connection ({frontend} of {service}) to {ep}, "
    "which {service}'s rules no longer list as an endpoint: the endpoint was removed (a "
    "rollout) while the connection was in flight, and kube-proxy does not flush TCP conntrack "
    "entries. {what} Drain before deleting pods (graceful termination, a preStop sleep longer "
    "than the clients' idle time) or flush the removed endpoint's entries: "
    "conntrack -D --orig-dst {odst} --dst-nat {epaddr}")


@applies_to(T_WIRE_RST, T_DROP, T_ICMP, T_WIRE_ICMP)
@for_reasons(T_DROP, GONE_DROPS)
def rule_stale_conntrack(ev, rname, history, ctx):
    """A rollout's in-flight connections: conntrack DNATs an established connection to an
    address the rules no longer list as one of its Service's endpoints; either nobody has the
    address (neighbour failure, host unreachable) or a new pod has it and resets."""
    c = ev.ct
    if c is None or not c.dnat or not c.orig_dport or not c.reply_src:
        return None        # no endpoint known (a cause key's translated-back reply)
    if ev.type == T_DROP:
        if rname not in GONE_DROPS:
            return None
        what = "Nobody has that address any more (the packets fail at the neighbour lookup)."
    elif ev.type in (T_ICMP, T_WIRE_ICMP):
        if unreach(ev) not in (3 << 8 | 1, 3 << 8 | 0):
            return None
        what = "Nobody has that address any more (host unreachable)."
    else:
        what = "A new pod has that address now and its kernel reset the old connection."
    service = ctx.service_of(c.orig_dst, c.orig_dport)
    if not service or ctx.endpoint_of(c.reply_src, c.reply_sport) == service:
        return None
    ep = hostport(c.reply_src, c.reply_sport)
    return ("proxy", 0.85, STALE_CONNTRACK_HINT.format(
        frontend=hostport(c.orig_dst, c.orig_dport), service=service, ep=ep, what=what,
        odst=c.orig_dst, epaddr=c.reply_src))


@applies_to(T_RST_SENT)
def rule_lost_state(ev, rname, history, ctx):
    """A listening socket reset a mid-connection segment of an endpoint the rules still list:
    the endpoint lost the connection's state (a container restart keeps the pod and its
    address), which is not the proxy's fault."""
    if ev.type != T_RST_SENT or not ev.flags & F_HAS_SOCK or ev.state != TCP_LISTEN \
            or ev.answered_flags & TCP_SYN:
        return None
    service = ctx.endpoint_of(ev.saddr, ev.sport)
    if not service:
        return None
    return ("app_reset", 0.75,
            "{saddr}:{sport} is still an endpoint of " + service + ", but its TCP stack no longer "
            "knows this connection and its listening socket reset the client's segment: the "
            "endpoint lost the connection's state (a container restart keeps the pod and its "
            "address). Not a proxy fault: clients must reconnect; make the app close connections "
            "before it stops")


@applies_to(T_RST_SENT, T_DROP)
@for_reasons(T_RST_SENT, ("NO_SOCKET",))
@for_reasons(T_DROP, ("NO_SOCKET",))
def rule_no_listener(ev, rname, history, ctx):
    if rname == "NO_SOCKET" and ev.type in (T_RST_SENT, T_DROP) \
            and ev.answered_flags & (TCP_SYN | TCP_ACK) == TCP_SYN:
        host, port = (ev.saddr, ev.sport) if ev.type == T_RST_SENT else (ev.daddr, ev.dport)
        return ("no_listener", 0.9,
                f"nothing listens on {hostport(host, port)}: compare {{service}}'s targetPort with the "
                "port the container really listens on (ss -ltn in the pod)")
    return None


@applies_to(T_WIRE_RST)
def rule_reset_from_endpoint(ev, rname, history, ctx):
    """A reset coming in from an endpoint the rules list, seen on the node that forwarded the
    connection to a pod on another node; that node's own trace names it exactly. Sequence
    number 0 with ACK answers the connection attempt itself (what a TCP stack sends back for
    a SYN, RFC 9293 3.10.7.1): the endpoint refused it, most often nothing listening on the
    port. Any other is the endpoint's TCP stack aborting an established connection: its
    application's abort or a lost state, the endpoint's doing either way, not the path's."""
    if ev.type != T_WIRE_RST or ev.dir != D_INGRESS:
        return None
    service = ctx.endpoint_of(ev.saddr, ev.sport)
    if not service:
        return None
    ep = hostport(ev.saddr, ev.sport)
    if ev.seq == 0 and ev.tcpflags & TCP_ACK:
        return ("no_listener", 0.7,
                f"{ep}, an endpoint of {service}, refused the connection (its reset answers the "
                "SYN, arriving on {iface}): nothing listens on that port in the pod, or a reject "
                f"rule on its node. Compare {service}'s targetPort with the port the container "
                "listens on (ss -ltn in the pod); `nptrace run` on the endpoint's node names "
                "which")
    return ("app_reset", 0.6,
            f"{ep}, an endpoint of {service}, reset an established connection (its reset "
            "arrives on {iface}): its application aborted it (close with unread data, SO_LINGER "
            "0) or its pod lost the connection's state (a container restart); not a network "
            "fault. The pod's own reset, in the evidence where it runs on this node (else in "
            "`nptrace run` on its node), tells which; look at the app's logs and restarts")


@applies_to(T_SYN_RETX)
def rule_unanswered_syn(ev, rname, history, ctx):
    """A SYN seen again: nothing answered the first. Where this node DNATs it to an endpoint
    that another node has, the loss is past this node, and only that node's trace can name it
    (a policy drop, a dead endpoint): said, with where the endpoint is reached, and left
    unknown here (a weak label: a cause the flow shows later, such as host unreachable coming
    back, names the incident instead)."""
    if ev.type != T_SYN_RETX:
        return None
    got = nat_peer_tuple(ctx.nat_peer(ev.saddr, ev.sport, ev.daddr, ev.dport))
    if got is None or (got[0], got[1]) == (ev.daddr, ev.dport):
        return None
    ep = hostport(got[0], got[1])
    dev = ctx.route_iface(ev.netns, got[0])
    via = f" by {dev}" if dev else ""
    return ("unknown", 0.0,
            f"the SYN {hostport(ev.saddr, ev.sport)} > {hostport(ev.daddr, ev.dport)} was sent "
            f"again: nothing answered it. This node DNATs it to {ep}, reached{via}; the packet "
            f"is lost past this node. `nptrace run` on the node that has {got[0]} names the "
            "drop there (a NetworkPolicy, a pod that is gone); `nptrace merge` of both nodes' "
            "sessions shows the connection as one story")


@applies_to(T_RST_SENT)
@for_reasons(T_RST_SENT, APP_RESETS)
def rule_app_reset(ev, rname, history, ctx):
    if ev.type == T_RST_SENT and ev.flags & F_HAS_SOCK and rname in APP_RESETS:
        return ("app_reset", 0.8,
                "the application on {saddr}:{sport} aborted the connection itself (close with "
                "unread data or SO_LINGER 0): not a network fault; look at the app's logs")
    return None


@applies_to(T_RST_RECV, T_WIRE_RST)
def rule_peer_reset(ev, rname, history, ctx):
    if ev.type == T_RST_RECV or (ev.type == T_WIRE_RST and ev.dir == D_INGRESS):
        return ("peer_reset", 0.5,
                "{saddr}:{sport} reset the connection and no local cause was seen on this node")
    return None


# kfree_skb reasons of a packet whose checksum did not verify where it was received
CSUM_DROPS = {"TCP_CSUM": "TCP", "UDP_CSUM": "UDP", "IP_CSUM": "IP header", "SKB_CSUM": "",
              "ICMP_CSUM": "ICMP"}


@applies_to(T_DROP)
@for_reasons(T_DROP, CSUM_DROPS)
def rule_checksum(ev, rname, history, ctx):
    """A bad checksum on arrival: a device computed it before the packet was changed, or was
    to offload it and did not (TX checksum offload on a VXLAN device after NAT is the classic)."""
    proto = CSUM_DROPS.get(rname)
    if proto is None:
        return None
    what = f"a {proto} packet" if proto else "a packet"
    if ev.flags & F_ENCAP and ev.outer_saddr:
        what = f"a VXLAN packet from {ev.outer_saddr} (inner {{saddr}}:{{sport}})"
    else:
        what += " from {saddr}:{sport} to {daddr}:{port}"
    peer = ctx.iface_peer(ev.netns, ev.ifindex) if ev.ifindex else None
    count = "count the errors with `nstat -az TcpInCsumErrors UdpInCsumErrors`"
    if not peer:
        return ("checksum", 0.9,
                what + " arrived on {iface} with a bad checksum and the kernel dropped it "
                f"({rname}): the device that sent it (the peer of {{iface}} for a veth, the "
                "VXLAN device of the sending node for an overlay) computed or offloaded the "
                "checksum before the packet was rewritten. Turn its TX checksum offload off "
                "(`ethtool -K <dev> tx-checksum-ip-generic off`, or the CNI's setting) and "
                + count)
    # the path shows the sender: the veth's other end, and what its offload is set to now
    ns, _, dev = peer.rpartition("/")
    where = f"ip netns exec {ns} " if ns else ""
    offload = ctx.peer_tx_csum(ev.netns, ev.ifindex)
    head = (what + " arrived on {iface} with a bad checksum and the kernel dropped it "
            f"({rname}); it was sent by {peer}, the other end of the veth {{iface}}")
    if offload is False:
        return ("checksum", 0.9,
                head + ", whose TX checksum offload is off (`ethtool -k` tx-checksumming: off): "
                "its stack computed the checksum, so the packet was changed after it left "
                f"{peer} (a rewrite on the path, or a sender writing raw packets); {count}")
    state = (", whose TX checksum offload is on (`ethtool -k` tx-checksumming: on)"
             if offload else "")
    return ("checksum", 0.9,
            head + state + f": {peer} offloaded or computed the checksum before the packet "
            f"was rewritten. Turn its TX checksum offload off (`{where}ethtool -K {dev} "
            f"tx-checksum-ip-generic off`, or the CNI's setting) and {count}")


RULES: list[Rule] = [rule_checksum, rule_rp_filter, rule_unexpected_reply,
                     rule_client_answers_endpoint, rule_wrong_iface, rule_netfilter,
                     rule_stale_conntrack, rule_stale_endpoint, rule_lost_state, rule_no_listener,
                     rule_reset_from_endpoint, rule_app_reset, rule_peer_reset,
                     rule_unanswered_syn]
