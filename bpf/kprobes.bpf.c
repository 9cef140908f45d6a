/* Kprobe enrichment: what netfilter, the reverse-path check and IPVS did to a packet, seen
 * from inside the kernel functions that do it. Optional: every probe here adds detail the
 * tracepoints cannot give, none is needed to classify a reset.
 *
 * Hooks (kprobes are unstable API; argument positions below match the 6.18 BTF prototypes,
 * and the kprobe rows of nptrace/kernel/hooks.py try the older names where a function was
 * renamed; those alternatives are the only fallbacks here, a group with none left is skipped):
 *   nf_nat_manip_pkt(skb, ct, mtype, dir)         NAT applied (nf_nat_proto.c, 5.x+);
 *     fallback nf_nat_packet(ct, ctinfo, hooknum, skb) when manip_pkt is not probeable
 *   fib_validate_source(skb, src, dst, dscp, oif, dev, idev, itag)  kretprobe: result of the
 *     reverse-path (rp_filter) check; the only rp_filter signal before kfree_skb reasons (5.17)
 *   nf_send_reset(net, sk, oldskb, hook), nf_send_reset6(...)  iptables/nft REJECT
 *     --reject-with tcp-reset (oldskb is the 3rd argument since the sk argument was added in
 *     5.x; older kernels, nf_send_reset(net, oldskb, hook), need another program).
 *     tcp:tcp_send_reset does not fire for these resets (docs/PLATFORM.md).
 *   tcp_v4_send_reset(sk, skb), tcp_v6_send_reset(sk, skb)  the stack's reset; with sk NULL
 *     nothing listens. Since 6.10 tcp:tcp_send_reset fires inside these functions for such
 *     resets too, so the group attaches only where that tracepoint lacks `reason` (before
 *     6.10); the record is the tracepoint's (hook tcp_send_reset, reason NO_SOCKET)
 *   ip_vs_in_hook / ip_vs_out_hook(priv, skb, state)  IPVS, 6.2+ (before: ip_vs_remote_request4
 *     and ip_vs_reply4, same argument order); kretprobe gives the verdict and the conntrack
 *     entry as IPVS left it
 * Needs CONFIG_KPROBES (kprobe PMU 4.17, kprobe_events since 4.1; absent on the development VM:
 * there these programs are compiled and verified by tests/privileged/test_enrichment_compile.py,
 * never attached). Gate: -DNPT_WITH_KPROBES, set by nptrace/kernel/attach.py where
 * features.probe() finds kprobes.
 *
 * Overhead: the NAT and IPVS probes run for every packet of a NAT'd or IPVS flow; they read the
 * TCP flags first (5 probe reads) and do the full read only for SYN and RST, which are what a
 * reset diagnosis needs. fib_validate_source stores one pointer per call and emits only on
 * failure. The kretprobes stash entry state in a per-CPU slot: the probed functions run in
 * softirq or with preemption off and do not nest on one CPU.
 *
 * Events: struct npt_event with hook NPT_H_KPROBE, aux = enum npt_kfunc below, aux2 per
 * function. Types: NAT and IPVS -> NPT_T_NF_VIEW (the packet and its conntrack at that point),
 * fib_validate_source failure -> NPT_T_DROP (reason 0: kfree_skb gives the drop reason where it
 * exists), nf_send_reset -> NPT_T_RST_SENT (tuple reversed: the RST's own, as for the tracepoint).
 *
 * enum npt_kfunc (aux of NPT_H_KPROBE events; in nptrace_events.h, mirrored by events.KFunc):
 *   NPT_KF_NAT_MANIP      = 1  nf_nat_manip_pkt entry;  aux2 = mtype << 8 | dir
 *                              (mtype 0 SRC / 1 DST, dir 0 ORIGINAL / 1 REPLY)
 *   NPT_KF_NAT_PACKET     = 2  nf_nat_packet entry;     aux2 = hooknum << 8 | ctinfo
 *   NPT_KF_FIB_VALIDATE   = 3  fib_validate_source returned < 0; aux2 = the return value
 *                              (-EXDEV (-18): rp_filter; -EINVAL: martian source)
 *   NPT_KF_NF_SEND_RESET  = 4  nf_send_reset / nf_send_reset6; aux2 = netfilter hook number
 *   NPT_KF_IPVS_IN        = 5  ip_vs_in_hook return;    aux2 = verdict (0 DROP, 1 ACCEPT, 2 STOLEN)
 *   NPT_KF_IPVS_OUT       = 6  ip_vs_out_hook return;   aux2 = verdict
 */
#include <uapi/linux/ptrace.h>  /* struct pt_regs for PT_REGS_PARM*; bcc tools do the same */
#include "npt_common.h"

#if NPT_WITH_KPROBES

/* enum npt_kfunc (which function an event comes from, in aux) is in nptrace_events.h */

#define NPT_TCP_SYN 0x02
#define NPT_TCP_RST 0x04

/* Entry state a kretprobe needs: slot 0 fib_validate_source (the skb), slots 1/2 the IPVS
 * in/out event read at entry (at return an NF_STOLEN skb may already be freed) and its
 * conntrack entry, read again at return. */
struct npt_kp_slot {
	u64 skb;
	u64 ct;
	u32 armed;
	u32 _pad;
	struct npt_event e;
};
BPF_PERCPU_ARRAY(npt_kp_stash, struct npt_kp_slot, 3);

/* TCP flags of an IPv4/IPv6 packet, or 0: the cheap test before a full npt_read_skb. */
static __always_inline u8 npt_kp_tcpflags(void *skb)
{
	void *head = 0;
	u16 nh = 0, th = 0, proto = 0;
	u8 b = 0, fl = 0;

	NPT_READ(head, skb, NPT_OFF_sk_buff__head);
	NPT_READ(nh, skb, NPT_OFF_sk_buff__network_header);
	NPT_READ(th, skb, NPT_OFF_sk_buff__transport_header);
	NPT_READ(proto, skb, NPT_OFF_sk_buff__protocol);
	if (!head || nh == 0xffff)
		return 0;
	proto = bpf_ntohs(proto);
	if (proto == NPT_ETH_P_IP) {
		NPT_READ(b, head + nh, 0);
		if (th == 0xffff || th <= nh)
			th = nh + (b & 0xf) * 4;
		NPT_READ(b, head + nh, 9);
	} else if (proto == NPT_ETH_P_IPV6) {
		if (th == 0xffff || th <= nh)
			th = nh + 40;
		NPT_READ(b, head + nh, 6);
	} else {
		return 0;
	}
	if (b != NPT_IPPROTO_TCP)
		return 0;
	NPT_READ(fl, head + th, 13);
	return fl;
}

/* A NATed connection's first SYN, as the NAT or IPVS hook saw it with its conntrack entry:
 * its two tuples into conn_slots (npt_common.h npt_nat_store_pair), as the netfilter-hook
 * program stores nf_nat's. */
static __always_inline void npt_kp_nat_store(const struct npt_event *e)
{
#if NPT_NAT_VIEW
	if (!(e->flags & NPT_F_HAS_CT) || (e->tcpflags & 0x12) != 0x02 ||
	    !(e->ct_status & (NPT_IPS_SRC_NAT | NPT_IPS_DST_NAT)))
		return;
	struct npt_nat_key orig = {}, reply = {};
	__builtin_memcpy(orig.src, e->ct_osrc, 16);
	__builtin_memcpy(orig.dst, e->ct_odst, 16);
	orig.sport = e->ct_osport;
	orig.dport = e->ct_odport;
	__builtin_memcpy(reply.src, e->ct_rsrc, 16);
	__builtin_memcpy(reply.dst, e->ct_rdst, 16);
	reply.sport = e->ct_rsport;
	reply.dport = e->ct_rdport;
	npt_nat_store_pair(&orig, &reply);
#endif
}

/* ---- NAT ---------------------------------------------------------------------------- */
/* The packet a NAT function was handed, if it is a SYN or RST: aux names the function,
 * aux2 its two small arguments. */
static __always_inline int npt_kp_nat_view(void *skb, u32 kfunc, u32 hi, u32 lo)
{
	if (!(npt_kp_tcpflags(skb) & (NPT_TCP_SYN | NPT_TCP_RST)))
		return 0;
	struct npt_event e;
	npt_init(&e, NPT_T_NF_VIEW, NPT_H_KPROBE);
	if (npt_read_skb(&e, skb) != NPT_IPPROTO_TCP)
		return 0;
	e.aux = kfunc;
	e.aux2 = (hi & 0xff) << 8 | (lo & 0xff);
#if !NPT_WITH_NF_HOOK
	npt_kp_nat_store(&e);       /* where no netfilter-hook program stores it (before 6.4) */
#endif
	npt_emit(&e);
	return 0;
}

int npt_kp_nat_manip(struct pt_regs *ctx)
{
	/* nf_nat_manip_pkt(skb, ct, mtype, dir) */
	return npt_kp_nat_view((void *)PT_REGS_PARM1(ctx), NPT_KF_NAT_MANIP,
			       (u32)PT_REGS_PARM3(ctx), (u32)PT_REGS_PARM4(ctx));
}

int npt_kp_nat_packet(struct pt_regs *ctx)
{
	/* nf_nat_packet(ct, ctinfo, hooknum, skb) */
	return npt_kp_nat_view((void *)PT_REGS_PARM4(ctx), NPT_KF_NAT_PACKET,
			       (u32)PT_REGS_PARM3(ctx), (u32)PT_REGS_PARM2(ctx));
}

/* ---- reverse-path check --------------------------------------------------------------- */
int npt_kp_fib_validate_entry(struct pt_regs *ctx)
{
	u32 slot = 0;
	struct npt_kp_slot *s = npt_kp_stash.lookup(&slot);
	if (!s)
		return 0;
	s->skb = PT_REGS_PARM1(ctx);
	s->armed = 1;
	return 0;
}

int npt_kp_fib_validate_ret(struct pt_regs *ctx)
{
	u32 slot = 0;
	struct npt_kp_slot *s = npt_kp_stash.lookup(&slot);
	if (!s || !s->armed)
		return 0;
	s->armed = 0;
	int ret = (int)PT_REGS_RC(ctx);
	if (ret >= 0 || !s->skb)
		return 0;
	struct npt_event e;
	npt_init(&e, NPT_T_DROP, NPT_H_KPROBE);
	int l4 = npt_read_skb(&e, (void *)s->skb);
	if (l4 != NPT_IPPROTO_TCP && !(e.flags & NPT_F_ICMP_QUOTE))
		return 0;
#ifdef NPT_KP_RPF_REASON
	/* no kfree_skb reason on this kernel (before 5.17): this is the rp_filter drop's name */
	e.reason = ret == -18 ? NPT_KP_RPF_REASON : 0;   /* -EXDEV */
#else
	e.reason = 0;
#endif
	e.aux = NPT_KF_FIB_VALIDATE;
	e.aux2 = (u32)ret;
	e.dir = NPT_D_INGRESS;
	npt_emit(&e);
	return 0;
}

/* ---- the stack's reset without a socket (nothing listens) -------------------------------- */
#ifndef NPT_RST_NO_SOCKET
#define NPT_RST_NO_SOCKET 0
#endif
int npt_kp_tcp_reset(struct pt_regs *ctx)
{
	void *sk = (void *)PT_REGS_PARM1(ctx), *skb = (void *)PT_REGS_PARM2(ctx);
	if (sk || !skb)
		return 0;     /* a socket's reset: tcp:tcp_send_reset fires for it */
	return npt_emit_skb_reset(skb, 0, 0, NPT_RST_NO_SOCKET);
}

/* ---- REJECT --reject-with tcp-reset ----------------------------------------------------- */
int npt_kp_nf_send_reset(struct pt_regs *ctx)
{
	void *oldskb = (void *)PT_REGS_PARM3(ctx);
	u32 hook = (u32)PT_REGS_PARM4(ctx);
	struct npt_event e;
	npt_init(&e, NPT_T_RST_SENT, NPT_H_KPROBE);
	if (npt_read_skb(&e, oldskb) != NPT_IPPROTO_TCP)
		return 0;
	/* oldskb is the packet being rejected: its tuple reversed is the RST's own */
	npt_reverse(&e);
	e.tcpflags = NPT_TCP_RST;
	e.seq = 0;
	e.ack_seq = 0;
	e.aux = NPT_KF_NF_SEND_RESET;
	e.aux2 = hook;
	e.dir = NPT_D_LOCAL;
	npt_emit(&e);
	return 0;
}

/* ---- IPVS ------------------------------------------------------------------------------ */
static __always_inline int npt_kp_ipvs_entry(struct pt_regs *ctx, u32 slot, u32 kf)
{
	struct npt_kp_slot *s = npt_kp_stash.lookup(&slot);
	if (!s)
		return 0;
	s->armed = 0;
	void *skb = (void *)PT_REGS_PARM2(ctx);
	if (!(npt_kp_tcpflags(skb) & (NPT_TCP_SYN | NPT_TCP_RST)))
		return 0;
	npt_init(&s->e, NPT_T_NF_VIEW, NPT_H_KPROBE);
	if (npt_read_skb(&s->e, skb) != NPT_IPPROTO_TCP)
		return 0;
	s->e.aux = kf;
	s->skb = (u64)skb;
	s->ct = (u64)npt_ct_of(skb);
	s->armed = 1;
	return 0;
}

static __always_inline int npt_kp_ipvs_ret(struct pt_regs *ctx, u32 slot)
{
	struct npt_kp_slot *s = npt_kp_stash.lookup(&slot);
	if (!s || !s->armed)
		return 0;
	s->armed = 0;
	s->e.aux2 = (u32)PT_REGS_RC(ctx);
	/* IPVS binds the connection to its real server inside the hook (ip_vs_update_conntrack
	 * with net.ipv4.vs.conntrack=1, as kube-proxy sets it): the entry's reply tuple now names
	 * the real server, which links the client's tuple to the pod's as nf_nat's does. The
	 * entry outlives a stolen skb: IPVS's connection holds it. */
	npt_read_ct_of(&s->e, (void *)s->ct);
	/* nf_conntrack_alter_reply sets none of nf_nat's status bits: an entry whose reply no
	 * longer comes from the original destination had its destination translated, and is
	 * recorded as DST_NAT so that every reader of the record (cause keys, correlation) sees
	 * IPVS's NAT as it sees nf_nat's */
	const u64 *rs = (const u64 *)s->e.ct_rsrc, *od = (const u64 *)s->e.ct_odst;
	if ((s->e.flags & NPT_F_HAS_CT) &&
	    (rs[0] != od[0] || rs[1] != od[1] || s->e.ct_rsport != s->e.ct_odport))
		s->e.ct_status |= NPT_IPS_DST_NAT;
	npt_kp_nat_store(&s->e);    /* IPVS's NAT: no netfilter-hook program sees it as NAT */
	npt_emit(&s->e);
	return 0;
}

int npt_kp_ipvs_in_entry(struct pt_regs *ctx)  { return npt_kp_ipvs_entry(ctx, 1, NPT_KF_IPVS_IN); }
int npt_kp_ipvs_in_ret(struct pt_regs *ctx)    { return npt_kp_ipvs_ret(ctx, 1); }
int npt_kp_ipvs_out_entry(struct pt_regs *ctx) { return npt_kp_ipvs_entry(ctx, 2, NPT_KF_IPVS_OUT); }
int npt_kp_ipvs_out_ret(struct pt_regs *ctx)   { return npt_kp_ipvs_ret(ctx, 2); }

#endif /* NPT_WITH_KPROBES */
