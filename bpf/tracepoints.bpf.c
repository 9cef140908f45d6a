/* Socket- and drop-level view: which packets the kernel freed with a drop reason, which resets
 * the local TCP stack sent or received, which ICMP errors it sent about TCP, and which SYN-ACKs
 * it had to retransmit.
 *
 * Hooks (stable tracepoints, one row each in nptrace/kernel/hooks.py; probed by
 * nptrace/kernel/features.py, chosen by nptrace/kernel/attach.py; gate -DNPT_TP_<NAME>):
 *   skb:kfree_skb            since 2.6.30, REQUIRED; reason field since Linux 5.17 (rx_sk since
 *                            6.12, unused); IPv6's reasonless neighbour-failure frees named
 *                            NEIGH_FAILED by call site (gate -DNPT_REASON_NEIGH_FAILED)
 *   tcp:tcp_send_reset       since 4.15; sk_rst_reason and skb-only resets since 6.10 (a
 *                            reset from a LISTEN socket takes its tuple from the packet)
 *   tcp:tcp_receive_reset    since 4.15
 *   icmp:icmp_send           since 6.10
 *   tcp:tcp_retransmit_synack since 4.15
 * Fallback where a tracepoint is missing: none. A missing optional tracepoint is skipped and
 * costs what its hooks.py row says; kprobes.bpf.c adds detail, it replaces no tracepoint (bcc
 * tools/tcpdrop.py's kprobe tcp_drop is not built: kfree_skb exists on every kernel with BTF).
 * Overhead: kfree_skb is hit by every freed-as-dropped skb on the node;
 * the reason filter (drop_reasons map) runs before any skb read, so an uninteresting drop costs
 * one array lookup.
 *
 * bcc builds each tracepoint's args struct from tracefs `format`, i.e. from this kernel. The
 * enums those formats name are not defined by the borrowed headers: declare stand-ins.
 */
enum skb_drop_reason { NPT_SKB_DROP_REASON_STANDIN };
enum sk_rst_reason { NPT_SK_RST_REASON_STANDIN };

#include "npt_common.h"
#include "npt_packet.h"

/* The socket tracepoints (tcp_receive_reset, tcp_retransmit_synack, and tcp_send_reset before
 * 6.10) carry the socket's addresses in two layouts: __u8 saddr[4] / saddr_v6[16]. The family
 * is read from saddr_v6, which holds an IPv4 socket's address v4-mapped (TP_STORE_ADDRS):
 * the `family` field arrived only in 5.11. `swap` puts the local side as the destination (a
 * received RST travels remote -> local). */
static __always_inline u16 npt_family_of_v6(const u8 *a6)
{
	u32 w[3] = {};
	bpf_probe_read_kernel(w, sizeof(w), a6);
	return (w[0] == 0 && w[1] == 0 && w[2] == bpf_htonl(0xffff)) ? NPT_AF_INET : NPT_AF_INET6;
}

#define NPT_SOCK_TUPLE(e, args, swap) do {					\
	(e).family = npt_family_of_v6((args)->saddr_v6);			\
	if ((e).family == NPT_AF_INET6) {					\
		bpf_probe_read_kernel((e).saddr, 16, swap ? (args)->daddr_v6 : (args)->saddr_v6); \
		bpf_probe_read_kernel((e).daddr, 16, swap ? (args)->saddr_v6 : (args)->daddr_v6); \
	} else {								\
		bpf_probe_read_kernel((e).saddr, 4, swap ? (args)->daddr : (args)->saddr); \
		bpf_probe_read_kernel((e).daddr, 4, swap ? (args)->saddr : (args)->daddr); \
	}									\
	(e).sport = swap ? (args)->dport : (args)->sport;			\
	(e).dport = swap ? (args)->sport : (args)->dport;			\
	(e).l4proto = NPT_IPPROTO_TCP;						\
} while (0)

#define NPT_SOCKADDR_FAMILY 0
#define NPT_SOCKADDR_PORT   2
#define NPT_SOCKADDR_IN4    4   /* struct sockaddr_in.sin_addr */
#define NPT_SOCKADDR_IN6    8   /* struct sockaddr_in6.sin6_addr */
#define NPT_TCP_LISTEN     10   /* include/net/tcp_states.h */

#if NPT_TP_KFREE_SKB
/* IPv6's failed neighbour: neigh_invalidate hands each queued packet to ndisc_error_report,
 * which frees it with plain kfree_skb (NOT_SPECIFIED, a tail call: `location` is in
 * neigh_invalidate), where IPv4's arp_error_report says NEIGH_FAILED. A NOT_SPECIFIED free
 * at either site is named NEIGH_FAILED; the ranges come from kallsyms
 * (nptrace/kernel/kallsyms.py), absent where it hides addresses. Two compares per drop. */
#ifdef NPT_REASON_NEIGH_FAILED
static __always_inline u32 npt_neigh_failed(u32 reason, u64 at)
{
	if (reason == NPT_REASON_NOT_SPECIFIED &&
	    ((at >= NPT_NEIGH_FAIL_LO0 && at < NPT_NEIGH_FAIL_HI0) ||
	     (at >= NPT_NEIGH_FAIL_LO1 && at < NPT_NEIGH_FAIL_HI1)))
		return NPT_REASON_NEIGH_FAILED;
	return reason;
}
#else
#define npt_neigh_failed(reason, at) (reason)
#endif

/* Before 5.17 kfree_skb has no reason: a drop is named by the function that freed it, from
 * kallsyms ranges (-DNPT_DROP_SITE_*, nptrace/kernel/kallsyms.py) with the values of the
 * reason table nptrace uses on such kernels (nptrace/reasons.py LEGACY_DROPS). nf_hook_slow
 * frees what a netfilter rule dropped; a failed neighbour's queued packets are then named as
 * above (npt_neigh_failed); anything else is NOT_SPECIFIED, which is not sent (the
 * reverse-path check and the reset sender have their own kprobes there). */
#ifndef NPT_DROP_NOT_SPECIFIED
#define NPT_DROP_NOT_SPECIFIED 1
#endif
static __always_inline u32 npt_drop_site(u64 at)
{
#ifdef NPT_DROP_SITE_NF_LO
	if (at >= NPT_DROP_SITE_NF_LO && at < NPT_DROP_SITE_NF_HI)
		return NPT_DROP_NETFILTER_DROP;
#endif
	return NPT_DROP_NOT_SPECIFIED;
}

TRACEPOINT_PROBE(skb, kfree_skb)
{
#if NPT_TPF_KFREE_SKB_REASON
	u32 reason = npt_neigh_failed((u32)args->reason, (u64)args->location);
#else
	/* before 5.17: by call site, the failed neighbour's frees among them */
	u32 reason = npt_neigh_failed(npt_drop_site((u64)args->location), (u64)args->location);
#endif
	u32 kreason = reason;
	u16 proto = args->protocol;   /* the tracepoint stores ntohs(skb->protocol) */
	if (proto != NPT_ETH_P_IP && proto != NPT_ETH_P_IPV6)
		return 0;
	if (reason >= NPT_MAX_REASONS)
		reason = NPT_MAX_REASONS - 1;
	u8 *want = drop_reasons.lookup(&reason);
	if (!want || !*want)
		return 0;

	struct npt_event e;
	npt_init(&e, NPT_T_DROP, NPT_H_KFREE_SKB);
	int l4 = npt_read_skb(&e, args->skbaddr);
	if (l4 != NPT_IPPROTO_TCP && !(e.flags & NPT_F_ICMP_QUOTE))
		return 0;
	e.reason = kreason;  /* after npt_read_skb: an ICMP quote stores type/code */
	e.location = (u64)args->location;
	e.dir = NPT_D_UNKNOWN;  /* freed on input, forward or output: the location tells */
	npt_emit_skb_packet(&e, args->skbaddr);   /* npt_packet.h: + its bytes with --pcap */
	return 0;
}
#endif

#if NPT_TP_TCP_SEND_RESET
TRACEPOINT_PROBE(tcp, tcp_send_reset)
{
	void *skb = (void *)args->skbaddr, *sk = (void *)args->skaddr;
#if NPT_TPF_TCP_SEND_RESET_REASON
	u32 why = (u32)args->reason;
#else
	u32 why = 0;      /* sk_rst_reason: 6.10 */
#endif
	/* The tracepoint fills its tuple from a full socket first (include/trace/events/tcp.h,
	 * `if (sk && sk_fullsock(sk))`), else from the skb reversed. A LISTEN socket is a full
	 * socket bound to 0.0.0.0:port and connected to nobody: its tuple reads
	 * "0.0.0.0:8080 > 0.0.0.0:0" (a rollout's new pod answering an old connection's segment).
	 * Then the RST's own tuple is the offending packet's, reversed. */
	if (skb && (!sk || args->state == NPT_TCP_LISTEN))
		return npt_emit_skb_reset(skb, sk, (u8)args->state, why);

	struct npt_event e;
	npt_init(&e, NPT_T_RST_SENT, NPT_H_TCP_SEND_RST);
	if (skb) {
		npt_read_skb(&e, skb);    /* interface, netns and conntrack of the offending packet */
		e.aux = e.tcpflags;       /* what was answered: a SYN-ACK from a stranger means an
					     un-NATed reply */
	}
	if (!e.netns)
		e.netns = npt_netns_of_sk(sk);
	if (sk)
		e.flags |= NPT_F_HAS_SOCK;
	/* Otherwise the tracepoint's tuple is the RST's own (a socket's, or the skb's reversed). */
	__builtin_memset(e.saddr, 0, 16);
	__builtin_memset(e.daddr, 0, 16);
#if NPT_TPF_TCP_SEND_RESET_SADDR_V6
	NPT_SOCK_TUPLE(e, args, 0);       /* before 6.10: the socket layout */
#else
	/* 6.10+: saddr/daddr are a sockaddr_in or sockaddr_in6 */
	u16 fam = 0, p = 0;
	bpf_probe_read_kernel(&fam, 2, args->saddr + NPT_SOCKADDR_FAMILY);
	if (fam != NPT_AF_INET && fam != NPT_AF_INET6)
		return 0;
	if (fam == NPT_AF_INET) {
		bpf_probe_read_kernel(e.saddr, 4, args->saddr + NPT_SOCKADDR_IN4);
		bpf_probe_read_kernel(e.daddr, 4, args->daddr + NPT_SOCKADDR_IN4);
	} else {
		bpf_probe_read_kernel(e.saddr, 16, args->saddr + NPT_SOCKADDR_IN6);
		bpf_probe_read_kernel(e.daddr, 16, args->daddr + NPT_SOCKADDR_IN6);
	}
	bpf_probe_read_kernel(&p, 2, args->saddr + NPT_SOCKADDR_PORT); e.sport = bpf_ntohs(p);
	bpf_probe_read_kernel(&p, 2, args->daddr + NPT_SOCKADDR_PORT); e.dport = bpf_ntohs(p);
	e.family = fam;
	e.l4proto = NPT_IPPROTO_TCP;
#endif
	e.tcpflags = 0x04;
	e.state = (u8)args->state;
	e.reason = why;
	e.dir = NPT_D_LOCAL;
	npt_emit(&e);
	return 0;
}
#endif

#if NPT_TP_TCP_RECEIVE_RESET
TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
	struct npt_event e;
	npt_init(&e, NPT_T_RST_RECV, NPT_H_TCP_RECV_RST);
	void *sk = (void *)args->skaddr;
	e.netns = npt_netns_of_sk(sk);
	e.flags |= NPT_F_HAS_SOCK;
	NPT_SOCK_TUPLE(e, args, 1);   /* the socket's local address is the RST's destination */
	e.tcpflags = 0x04;
	u8 st = 0;
	if (sk)
		NPT_READ(st, sk, NPT_OFF_sock_common__skc_state);
	e.state = st;
#if NPT_HAVE_sock__sk_rx_dst_ifindex
	if (sk)
		NPT_READ(e.ifindex, sk, NPT_OFF_sock__sk_rx_dst_ifindex);
#endif
	e.dir = NPT_D_LOCAL;
	npt_emit(&e);
	return 0;
}
#endif

#if NPT_TP_ICMP_SEND
TRACEPOINT_PROBE(icmp, icmp_send)
{
	/* REJECT (kube-proxy's "has no endpoints"), no route, port unreachable for UDP...:
	 * only errors about TCP are kept; the tuple is the offending packet's. */
	if (args->type != 3 && args->type != 11)
		return 0;
	struct npt_event e;
	npt_init(&e, NPT_T_ICMP_UNREACH, NPT_H_ICMP_SEND);
	if (npt_read_skb(&e, (void *)args->skbaddr) != NPT_IPPROTO_TCP)
		return 0;
	e.reason = (u32)args->type << 8 | (u32)args->code;
	e.dir = NPT_D_INGRESS;
	npt_emit_skb_packet(&e, args->skbaddr);   /* the packet the error is about */
	return 0;
}
#endif

#if NPT_TP_TCP_RETRANSMIT_SYNACK
TRACEPOINT_PROBE(tcp, tcp_retransmit_synack)
{
	struct npt_event e;
	npt_init(&e, NPT_T_SYNACK_RETX, NPT_H_SYNACK_RETX);
	e.netns = npt_netns_of_sk((void *)args->skaddr);
	NPT_SOCK_TUPLE(e, args, 0);
	e.tcpflags = 0x12;
	e.dir = NPT_D_LOCAL;
	npt_emit(&e);
	return 0;
}
#endif
