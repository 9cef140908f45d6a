/* Netfilter-hook view: the packet and its conntrack entry at an exact netfilter hook and
 * priority, e.g. just after DNAT (PRE_ROUTING, NF_IP_PRI_NAT_DST + 1) and just after SNAT
 * (POST_ROUTING, NF_IP_PRI_NAT_SRC + 1). It shows what NAT did to a connection's first packet
 * whatever the rule set (iptables, nftables, kube-proxy in either mode).
 *
 * Hook: BPF_PROG_TYPE_NETFILTER (32), expected attach type BPF_NETFILTER (45), Linux 6.4+
 * (commit fd9c663b9ad6, CONFIG_NETFILTER_BPF_LINK). Attached per network namespace with
 * BPF_LINK_CREATE (pf, hooknum, priority) by nptrace/kernel/nfhook.py; the link is made in the
 * namespace of the calling thread. Fallback where missing: conntrack tuples read at the
 * tracepoints (npt_read_ct), which show the NAT decision but not the hook it was made at.
 * Gate: -DNPT_WITH_NF_HOOK.
 *
 * The program always returns NF_ACCEPT: it observes, never decides. It runs for every IPv4
 * and IPv6 packet through the hooks it is linked at in that namespace (one link per family). In the default NAT-only mode a
 * packet that is not its connection's first costs one load (skb->_nfct: its ctinfo bits say
 * ESTABLISHED/REPLY), within the noise of an empty program; the first packet of a NATed TCP
 * connection costs two probe reads (its conntrack tuples and status in one, the TCP flags)
 * and one conn_slots write, two with SNAT (measured in-program with bpf_ktime on the 6.18
 * VM: the record was 0.9 us with two slot writes of 0.33 us each, most of it cache and TLB
 * misses; it was 1.5 us with two LRU-hash inserts). Where tc watched the SYN come in, the
 * slot is the one tc ingress took for it microseconds before on the same CPU: the write adds
 * the reply tuple to a line already in cache (npt_common.h conn_slots).
 * With -DNPT_NF_NAT_ONLY=0 it reads the TCP flags (5 probe reads) of every packet and builds
 * an event for each SYN and RST segment.
 *
 * Context (include/linux/filter.h): struct bpf_nf_ctx { const struct nf_hook_state *state;
 * struct sk_buff *skb; }. nf_hook_state.hook / .pf offsets come from BTF (nfhook.py cflags).
 * The link's priority is not in the context: NPT_NF_PRIO_<hook> say which priority
 * nfhook.py links each hook at. aux = pf << 24 | hooknum << 16 | (prio & 0xffff).
 */
#include "npt_common.h"

#if NPT_WITH_NF_HOOK

#define NPT_NF_ACCEPT 1
#ifndef NPT_NF_EVENTS
#define NPT_NF_EVENTS 0         /* also send each NATed SYN's view to user space */
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

/* TCP flags of an IPv4 or IPv6 packet, 0 for anything else: the cheap test before
 * npt_read_skb. IPv6 extension headers are not walked (TCP must follow the fixed header). */
static __always_inline u8 npt_nf_tcpflags(void *skb)
{
	void *head = 0;
	u16 nh = 0, th = 0, proto = 0;
	u8 b = 0, fl = 0, v6;

	NPT_READ(proto, skb, NPT_OFF_sk_buff__protocol);
	v6 = bpf_ntohs(proto) == NPT_ETH_P_IPV6;
	if (bpf_ntohs(proto) != NPT_ETH_P_IP && !v6)
		return 0;
	NPT_READ(head, skb, NPT_OFF_sk_buff__head);
	NPT_READ(nh, skb, NPT_OFF_sk_buff__network_header);
	NPT_READ(th, skb, NPT_OFF_sk_buff__transport_header);
	if (!head || nh == 0xffff)
		return 0;
	NPT_READ(b, head + nh, 0);
	/* PRE_ROUTING runs before ip_rcv_core() has set the transport header */
	if (th == 0xffff || th <= nh)
		th = nh + (v6 ? 40 : (b & 0xf) * 4);
	NPT_READ(b, head + nh, v6 ? 6 : 9);
	if (b != NPT_IPPROTO_TCP)
		return 0;
	NPT_READ(fl, head + th, 13);
	return fl;
}

#if NPT_NF_NAT_ONLY
/* conn_slots, its slots, hash and store: npt_common.h (the storm sampler and the kprobes use
 * them too) */

/* skb->_nfct carries enum ip_conntrack_info in its low 3 bits (include/linux/skbuff.h
 * NFCT_INFOMASK): a connection's first packet is NEW, or RELATED for an expected one; every
 * later packet is ESTABLISHED (0) or a reply (3, 4), an untracked one 7. */
#define NPT_IP_CT_RELATED 1
#define NPT_IP_CT_NEW     2

#if NPT_HAVE_sk_buff___nfct && NPT_HAVE_nf_conn__status && NPT_HAVE_nf_conn__tuplehash && \
    NPT_HAVE_SIZEOF_nf_conntrack_tuple_hash && NPT_HAVE_nf_conntrack_tuple__dst_protonum
#define NPT_NF_CT 1
#else
#define NPT_NF_CT 0     /* no conntrack BTF (module not loaded): nothing is NATed that we see */
#endif

/* nf_conn.status follows tuplehash[] (6.18; checked from BTF at compile time): one probe
 * read then fetches both tuples and the status, 120 bytes, instead of two reads. */
#if NPT_NF_CT && NPT_OFF_nf_conn__status == \
	NPT_OFF_nf_conn__tuplehash + 2 * NPT_SIZEOF_nf_conntrack_tuple_hash
#define NPT_NF_CT_READ (2 * NPT_SIZEOF_nf_conntrack_tuple_hash + 4)
#elif NPT_NF_CT
#define NPT_NF_CT_READ (2 * NPT_SIZEOF_nf_conntrack_tuple_hash)
#else
#define NPT_NF_CT_READ 8
#endif

/* The conntrack entry of a connection's first packet with a NAT decision, else 0; th[] then
 * holds its tuplehash[] (and status). The entry is not confirmed before POST_ROUTING's
 * conntrack confirm hook (priority INT_MAX, after ours), so a retransmitted SYN (NEW,
 * confirmed) does not pass either. One load for every other packet. */
static __always_inline void *npt_nf_first_nat_packet(void *skb, u8 *th)
{
#if !NPT_NF_CT
	return 0;
#else
	unsigned long nfct = 0;
	u32 status = 0;
	/* ctx->skb is a trusted BTF pointer in netfilter programs: a direct load of a member is
	 * a verifier-checked PROBE_MEM load, about 25 ns cheaper than the probe_read helper */
	nfct = *(volatile unsigned long *)(skb + NPT_OFF_sk_buff___nfct);
	if ((u32)(nfct & 7) - NPT_IP_CT_RELATED > NPT_IP_CT_NEW - NPT_IP_CT_RELATED)
		return 0;
	void *ct = (void *)(nfct & ~7UL);
	if (!ct)
		return 0;
	if (bpf_probe_read_kernel(th, NPT_NF_CT_READ, ct + NPT_OFF_nf_conn__tuplehash))
		return 0;
#if NPT_NF_CT_READ > 2 * NPT_SIZEOF_nf_conntrack_tuple_hash
	status = *(u32 *)(th + 2 * NPT_SIZEOF_nf_conntrack_tuple_hash);
#else
	NPT_READ(status, ct, NPT_OFF_nf_conn__status);
#endif
	if (!(status & (NPT_IPS_SRC_NAT | NPT_IPS_DST_NAT)) || (status & NPT_IPS_CONFIRMED))
		return 0;
	return ct;
#endif
}

/* TCP flags of the IPv4 or IPv6 packet at skb (its protocol already known to be TCP). head
 * and the header offsets are direct loads from the trusted skb (see above); the flags byte in
 * the packet needs the helper. */
static __always_inline u8 npt_nf_l4_flags(void *skb)
{
	void *head = *(void *volatile *)(skb + NPT_OFF_sk_buff__head);
	u16 nh = *(volatile u16 *)(skb + NPT_OFF_sk_buff__network_header);
	u16 th = *(volatile u16 *)(skb + NPT_OFF_sk_buff__transport_header);
	u8 b = 0, fl = 0;
	if (!head || nh == 0xffff)
		return 0;
	/* before ip_rcv_core() the transport header is unset or equal to the network header */
	if (th == 0xffff || th <= nh) {
		NPT_READ(b, head + nh, 0);
		th = nh + ((b >> 4) == 6 ? 40 : (b & 0xf) * 4);   /* IPv6: no extension headers */
	}
	NPT_READ(fl, head + th, 13);
	return fl;
}

/* Both tuples of ct from th[] (npt_nf_first_nat_packet's read); then, for a TCP SYN, the
 * pair in the set of its client end, and in the set of the SNAT address too when SNAT moved
 * the client end of the reply tuple. */
static __always_inline void npt_nf_nat_record(void *skb, u8 *th)
{
#if NPT_NF_CT
	u8 *t0 = th + NPT_OFF_nf_conntrack_tuple_hash__tuple;
	u8 *t1 = t0 + NPT_SIZEOF_nf_conntrack_tuple_hash;
	if (t0[NPT_OFF_nf_conntrack_tuple__dst_protonum] != NPT_IPPROTO_TCP)
		return;
	if ((npt_nf_l4_flags(skb) & 0x12) != 0x02)   /* SYN without ACK */
		return;
	struct npt_nat_key orig = {}, reply = {};
	__builtin_memcpy(orig.src, t0 + NPT_OFF_nf_conntrack_tuple__src_u3, 16);
	__builtin_memcpy(orig.dst, t0 + NPT_OFF_nf_conntrack_tuple__dst_u3, 16);
	orig.sport = bpf_ntohs(*(u16 *)(t0 + NPT_OFF_nf_conntrack_tuple__src_u_all));
	orig.dport = bpf_ntohs(*(u16 *)(t0 + NPT_OFF_nf_conntrack_tuple__dst_u_all));
	__builtin_memcpy(reply.src, t1 + NPT_OFF_nf_conntrack_tuple__src_u3, 16);
	__builtin_memcpy(reply.dst, t1 + NPT_OFF_nf_conntrack_tuple__dst_u3, 16);
	reply.sport = bpf_ntohs(*(u16 *)(t1 + NPT_OFF_nf_conntrack_tuple__src_u_all));
	reply.dport = bpf_ntohs(*(u16 *)(t1 + NPT_OFF_nf_conntrack_tuple__dst_u_all));
	npt_nat_store_pair(&orig, &reply);
#endif
}
#endif

int npt_nf_view(struct npt_nf_ctx *ctx)
{
	void *skb = ctx->skb, *state = ctx->state;
#if NPT_NF_NAT_ONLY
	u8 th[NPT_NF_CT_READ] __attribute__((aligned(8)));
	if (!npt_nf_first_nat_packet(skb, th))
		return NPT_NF_ACCEPT;
	npt_nf_nat_record(skb, th);
#if !NPT_NF_EVENTS
	return NPT_NF_ACCEPT;   /* the map is enough; NF_VIEW records only when asked for */
#endif
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
