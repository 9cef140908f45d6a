/* Netfilter-hook view: the packet and its conntrack entry at an exact netfilter hook and
 * priority, e.g. just after DNAT (PRE_ROUTING, NF_IP_PRI_NAT_DST + 1) and just after SNAT
 * (POST_ROUTING, NF_IP_PRI_NAT_SRC + 1). It shows what NAT did to a connection's first packet
 * whatever the rule set (iptables, nftables, kube-proxy in either mode).
 *
 * Hook: BPF_PROG_TYPE_NETFILTER (32), expected attach type BPF_NETFILTER (45), Linux 6.4+
 * (commit fd9c663b9ad6, CONFIG_NETFILTER_BPF_LINK). Attached per network namespace with
 * BPF_LINK_CREATE (pf, hooknum, priority) by nptrace/nfhook.py; the link is made in the
 * namespace of the calling thread. Fallback where missing: conntrack tuples read at the
 * tracepoints (npt_read_ct), which show the NAT decision but not the hook it was made at.
 * Gate: -DNPT_WITH_NF_HOOK.
 *
 * The program always returns NF_ACCEPT: it observes, never decides. It runs for every IPv4
 * packet through the hooks it is linked at in that namespace; it reads the TCP flags first
 * (5 probe reads) and builds an event only for SYN and RST segments.
 *
 * Context (include/linux/filter.h): struct bpf_nf_ctx { const struct nf_hook_state *state;
 * struct sk_buff *skb; }. nf_hook_state.hook / .pf offsets come from BTF (nfhook.py cflags).
 * The link's priority is not in the context: NPT_NF_PRIO_<hook> say which priority
 * nfhook.py links each hook at. aux = pf << 24 | hooknum << 16 | (prio & 0xffff).
 */
#include "npt_common.h"

#if NPT_WITH_NF_HOOK

#define NPT_NF_ACCEPT 1
#ifndef NPT_NF_NAT_ONLY
#define NPT_NF_NAT_ONLY 1
#endif
#ifndef NPT_NF_EVENTS
#define NPT_NF_EVENTS 0         /* also send each NATed SYN's view to user space */
#endif
#ifndef NPT_NAT_PEERS
#define NPT_NAT_PEERS 131072    /* two entries per connection */
#endif
/* Priority each hook number is linked at (nfhook.py sets the ones it links). */
#ifndef NPT_NF_PRIO_H0
#define NPT_NF_PRIO_H0 (-99)  /* PRE_ROUTING: NF_IP_PRI_NAT_DST + 1, just after DNAT */
#endif
#ifndef NPT_NF_PRIO_H1
#define NPT_NF_PRIO_H1 0      /* LOCAL_IN */
#endif
#ifndef NPT_NF_PRIO_H2
#define NPT_NF_PRIO_H2 0      /* FORWARD */
#endif
#ifndef NPT_NF_PRIO_H3
#define NPT_NF_PRIO_H3 (-99)  /* LOCAL_OUT: just after DNAT of locally generated packets */
#endif
#ifndef NPT_NF_PRIO_H4
#define NPT_NF_PRIO_H4 101    /* POST_ROUTING: NF_IP_PRI_NAT_SRC + 1, just after SNAT */
#endif
#ifndef NPT_OFF_nf_hook_state__hook
#define NPT_OFF_nf_hook_state__hook 0
#endif
#ifndef NPT_OFF_nf_hook_state__pf
#define NPT_OFF_nf_hook_state__pf 1
#endif

struct npt_nf_ctx {
	void *state;
	void *skb;
};

/* TCP flags of an IPv4 packet, 0 for anything else: the cheap test before npt_read_skb. */
static __always_inline u8 npt_nf_tcpflags(void *skb)
{
	void *head = 0;
	u16 nh = 0, th = 0, proto = 0;
	u8 b = 0, fl = 0;

	NPT_READ(proto, skb, NPT_OFF_sk_buff__protocol);
	if (bpf_ntohs(proto) != NPT_ETH_P_IP)
		return 0;
	NPT_READ(head, skb, NPT_OFF_sk_buff__head);
	NPT_READ(nh, skb, NPT_OFF_sk_buff__network_header);
	NPT_READ(th, skb, NPT_OFF_sk_buff__transport_header);
	if (!head || nh == 0xffff)
		return 0;
	NPT_READ(b, head + nh, 0);
	/* PRE_ROUTING runs before ip_rcv_core() has set the transport header */
	if (th == 0xffff || th <= nh)
		th = nh + (b & 0xf) * 4;
	NPT_READ(b, head + nh, 9);
	if (b != NPT_IPPROTO_TCP)
		return 0;
	NPT_READ(fl, head + th, 13);
	return fl;
}

#if NPT_NF_NAT_ONLY
/* The two tuples of every NATed connection, written at its first packet and looked up by
 * user space only when an incident needs them (classify.Context.nat_peer): linking a client's
 * tuple to its pod's costs nothing per healthy connection in user space. Keyed by each side's
 * tuple in its packet direction; the value is the other side's. LRU: old mappings go first. */
struct npt_nat_key {
	u8  src[16];
	u8  dst[16];
	u16 sport;
	u16 dport;
};
BPF_TABLE("lru_hash", struct npt_nat_key, struct npt_nat_key, nat_peers, NPT_NAT_PEERS);

static __always_inline void npt_tuple_key(struct npt_nat_key *k, u8 *src, u16 sport, u8 *dst, u16 dport)
{
	__builtin_memcpy(k->src, src, 16);
	__builtin_memcpy(k->dst, dst, 16);
	k->sport = sport;
	k->dport = dport;
}

/* Only a connection's first packet with a NAT decision: the entry is not confirmed before
 * POST_ROUTING's conntrack confirm hook. Two reads decide it for every other packet. */
static __always_inline int npt_nf_first_nat_packet(void *skb)
{
	unsigned long nfct = 0;
	u32 status = 0;
	NPT_READ(nfct, skb, NPT_OFF_sk_buff___nfct);
	void *ct = (void *)(nfct & ~7UL);
	if (!ct)
		return 0;
	NPT_READ(status, ct, NPT_OFF_nf_conn__status);
	return (status & (NPT_IPS_SRC_NAT | NPT_IPS_DST_NAT)) && !(status & NPT_IPS_CONFIRMED);
}
#endif

int npt_nf_view(struct npt_nf_ctx *ctx)
{
	void *skb = ctx->skb, *state = ctx->state;
#if NPT_NF_NAT_ONLY
	if (!npt_nf_first_nat_packet(skb))
		return NPT_NF_ACCEPT;
#endif
	if (!(npt_nf_tcpflags(skb) & 0x06))  /* SYN or RST */
		return NPT_NF_ACCEPT;

	struct npt_event e;
	npt_init(&e, NPT_T_NF_VIEW, NPT_H_NF_HOOK);
	if (npt_read_skb(&e, skb) != NPT_IPPROTO_TCP)
		return NPT_NF_ACCEPT;
#if NPT_NF_NAT_ONLY
	if ((e.tcpflags & 0x12) != 0x02 || !(e.flags & NPT_F_HAS_CT))
		return NPT_NF_ACCEPT;
	struct npt_nat_key orig = {}, reply = {};
	npt_tuple_key(&orig, e.ct_osrc, e.ct_osport, e.ct_odst, e.ct_odport);
	npt_tuple_key(&reply, e.ct_rsrc, e.ct_rsport, e.ct_rdst, e.ct_rdport);
	nat_peers.update(&orig, &reply);
	nat_peers.update(&reply, &orig);
#if !NPT_NF_EVENTS
	return NPT_NF_ACCEPT;   /* the map is enough; NF_VIEW records only when asked for */
#endif
#endif
	u8 hook = 0, pf = 0;
	NPT_READ(hook, state, NPT_OFF_nf_hook_state__hook);
	NPT_READ(pf, state, NPT_OFF_nf_hook_state__pf);
	int prio = hook == 0 ? NPT_NF_PRIO_H0 : hook == 1 ? NPT_NF_PRIO_H1 :
		   hook == 2 ? NPT_NF_PRIO_H2 : hook == 3 ? NPT_NF_PRIO_H3 : NPT_NF_PRIO_H4;
	e.aux = (u32)pf << 24 | (u32)hook << 16 | ((u32)prio & 0xffff);
	/* PRE_ROUTING / LOCAL_IN: skb->dev is the input device; the others: the output one */
	e.dir = hook <= 1 ? NPT_D_INGRESS : NPT_D_EGRESS;
	npt_emit(&e);
	return NPT_NF_ACCEPT;
}

#endif /* NPT_WITH_NF_HOOK */
