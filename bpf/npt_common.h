/* Maps and helpers shared by every nptrace BPF program (one bcc BPF() object holds them all,
 * so every hook family writes to one ring buffer and one set of counters).
 *
 * Kernel structs are NEVER read through header layouts: bcc compiles against borrowed Debian
 * headers whose layouts differ from the running kernel. Every offset comes from BTF at load
 * time as a -DNPT_OFF_<struct>__<member> macro (nptrace/offsets.py), and every read is a
 * bpf_probe_read_kernel() at base + offset.
 */
#ifndef NPT_COMMON_H
#define NPT_COMMON_H

#include "nptrace_events.h"

#ifndef NPT_RINGBUF_PAGES
#define NPT_RINGBUF_PAGES 4096          /* 16 MiB; must be a power of two */
#endif
/* bpf_ringbuf_output flags (include/uapi/linux/bpf.h, since 5.8) */
#define NPT_RB_NO_WAKEUP     1
#define NPT_RB_FORCE_WAKEUP  2
#ifndef NPT_WAKE_EVERY
#define NPT_WAKE_EVERY 1        /* a power of two; 1: the kernel's adaptive wake-up */
#endif
#ifndef NPT_MAX_COUNTS
#define NPT_MAX_COUNTS 16384
#endif
#ifndef NPT_MAX_REASONS
#define NPT_MAX_REASONS 1024
#endif

#define NPT_ETH_P_IP   0x0800
#define NPT_ETH_P_IPV6 0x86DD
#define NPT_AF_INET    2
#define NPT_AF_INET6   10
#define NPT_IPPROTO_TCP 6
#define NPT_IPPROTO_UDP 17
#define NPT_IPPROTO_ICMP 1
#define NPT_IPPROTO_ICMPV6 58

BPF_RINGBUF_OUTPUT(events, NPT_RINGBUF_PAGES);
BPF_PERCPU_HASH(counts, struct npt_count_key, u64, NPT_MAX_COUNTS);
BPF_PERCPU_ARRAY(stats, u64, NPT_S_MAX);
/* drop reasons worth an event (1) rather than only a count (0); filled from BTF names */
BPF_ARRAY(drop_reasons, u8, NPT_MAX_REASONS);
/* UDP destination ports that carry VXLAN (4789 IANA, 8472 Linux/flannel default) */
BPF_HASH(vxlan_ports, u16, u8, 16);

/* In-kernel filters. A gate macro keeps an unused filter free: no map lookup at all. */
#if NPT_FILTER_PORTS
BPF_HASH(filter_ports, u16, u8, 1024);
#endif
#if NPT_FILTER_HOSTS
struct npt_lpm_key { u32 prefixlen; u8 addr[16]; };
BPF_LPM_TRIE(filter_hosts, struct npt_lpm_key, u8, 256);
#endif

#ifndef NPT_MAX_RATE
#define NPT_MAX_RATE 0          /* records per second per CPU and kind sent to user space; 0: all */
#endif
#ifndef NPT_MAX_BURST
#define NPT_MAX_BURST 200       /* ...after a burst of this many */
#endif
#if NPT_MAX_RATE
/* Storm protection, a token bucket per kind (the counter key: type, hook, reason, interface,
 * netns) and CPU: a burst of NPT_MAX_BURST records goes out at once (a hundred clients failing
 * together are all labeled), then NPT_MAX_RATE a second; the rest is only counted (exactly).
 * A person needs a sample of a 100k-resets/s storm, not all of it, and each record costs user
 * space tens of us; the counts map keeps the totals, and a storm of one kind never starves the
 * records of another. User space passes the node-wide --max-rate / --max-burst divided by the
 * CPUs (config.per_cpu): per-CPU buckets need no atomics, and a 64-CPU node must not send 64
 * times what a 2-CPU one does. Credit is kept in nanoseconds: a record costs 1e9 / NPT_MAX_RATE. */
#define NPT_RATE_COST (1000000000ULL / NPT_MAX_RATE)
#define NPT_RATE_CAP (NPT_RATE_COST * NPT_MAX_BURST)
struct npt_rate {
	u64 last_ns;
	u64 credit_ns;
};
BPF_TABLE("lru_percpu_hash", struct npt_count_key, struct npt_rate, rate, 4096);
#endif

#define NPT_READ(dst, base, off) bpf_probe_read_kernel(&(dst), sizeof(dst), (void *)(base) + (off))

static __always_inline void npt_stat_inc(u32 idx)
{
	u64 *v = stats.lookup(&idx);
	if (v)
		(*v)++;
}

static __always_inline void npt_count_key_of(struct npt_count_key *k, struct npt_event *e)
{
	k->ifindex = e->ifindex;
	k->reason = e->reason;
	k->netns = e->netns;
	k->type = e->type;
	k->hook = e->hook;
}

static __always_inline void npt_count(struct npt_event *e)
{
	struct npt_count_key k = {};
	npt_count_key_of(&k, e);
	/* bcc's lookup_or_try_init returns the map's value after inserting: start from 0 */
	u64 zero = 0, *v = counts.lookup_or_try_init(&k, &zero);
	if (v)
		(*v)++;
}

/* Port/host filter on either end of the tuple. 1 = keep. */
static __always_inline int npt_wanted(struct npt_event *e)
{
#if NPT_FILTER_PORTS
	u16 p = e->sport;
	if (!filter_ports.lookup(&p)) {
		p = e->dport;
		if (!filter_ports.lookup(&p))
			return 0;
	}
#endif
#if NPT_FILTER_HOSTS
	struct npt_lpm_key k = {.prefixlen = 128};
	__builtin_memcpy(k.addr, e->saddr, 16);
	if (!filter_hosts.lookup(&k)) {
		__builtin_memcpy(k.addr, e->daddr, 16);
		if (!filter_hosts.lookup(&k))
			return 0;
	}
#endif
	return 1;
}

/* Count the event exactly, then copy it to the ring buffer if there is room. */
static __always_inline void npt_emit(struct npt_event *e)
{
	if (!npt_wanted(e)) {
		npt_stat_inc(NPT_S_FILTERED);
		return;
	}
	npt_count(e);
#if NPT_MAX_RATE
	struct npt_count_key rk = {};
	struct npt_rate fresh = { .last_ns = e->ts_ns, .credit_ns = NPT_RATE_CAP };
	npt_count_key_of(&rk, e);
	struct npt_rate *r = rate.lookup_or_try_init(&rk, &fresh);
	if (r) {
		u64 credit = r->credit_ns;
		if (e->ts_ns > r->last_ns)
			credit += e->ts_ns - r->last_ns;
		if (credit > NPT_RATE_CAP)
			credit = NPT_RATE_CAP;
		r->last_ns = e->ts_ns;
		if (credit < NPT_RATE_COST) {
			r->credit_ns = credit;
			npt_stat_inc(NPT_S_SAMPLED);
			return;
		}
		r->credit_ns = credit - NPT_RATE_COST;
	}
#endif
	/* Wake-ups in batches (NPT_WAKE_EVERY > 1, what `nptrace run` asks for): its reader looks
	 * at the ring every 100 ms anyway (nptrace/tracer.py) and holds an incident a second, so a
	 * wake-up per record buys nothing and costs an irq_work in the sender's context plus a
	 * Python loop turn for one record (what a sampled storm cost user space most). The ring's
	 * own adaptive wake-up does not help there: a reader that keeps up is woken for every
	 * record. So this CPU wakes the reader at every NPT_WAKE_EVERY-th record it emits (bcc
	 * 0.26 has no ringbuf_query to ask how full the ring is); 2 CPUs x 256 records is 2% of
	 * the 4 MiB default ring. 1: the kernel's adaptive wake-up, for consumers that only read
	 * when woken (bcc's ring_buffer_poll). */
	u32 idx = NPT_S_EMITTED;
	u64 *n = stats.lookup(&idx);
	u64 wake = 0;
	if (NPT_WAKE_EVERY > 1)
		wake = n && (*n & (NPT_WAKE_EVERY - 1)) == NPT_WAKE_EVERY - 1 ?
			NPT_RB_FORCE_WAKEUP : NPT_RB_NO_WAKEUP;
	if (events.ringbuf_output(e, sizeof(*e), wake) == 0) {
		if (n)
			(*n)++;
	} else {
		npt_stat_inc(NPT_S_LOST);
	}
}

static __always_inline u32 npt_netns_of_dev(void *dev)
{
	void *net = 0;
	u32 inum = 0;
	if (!dev)
		return 0;
	NPT_READ(net, dev, NPT_OFF_net_device__nd_net_net);
	if (net)
		NPT_READ(inum, net, NPT_OFF_net__ns_inum);
	return inum;
}

static __always_inline u32 npt_netns_of_sk(void *sk)
{
	void *net = 0;
	u32 inum = 0;
	if (!sk)
		return 0;
	NPT_READ(net, sk, NPT_OFF_sock_common__skc_net_net);
	if (net)
		NPT_READ(inum, net, NPT_OFF_net__ns_inum);
	return inum;
}

/* The skb's conntrack entry: skb->_nfct with the ctinfo bits (low 3) masked off. */
static __always_inline void npt_read_ct(struct npt_event *e, void *skb)
{
#if NPT_HAVE_sk_buff___nfct
	unsigned long nfct = 0;
	NPT_READ(nfct, skb, NPT_OFF_sk_buff___nfct);
	void *ct = (void *)(nfct & ~7UL);
	if (!ct)
		return;
	void *t0 = ct + NPT_OFF_nf_conn__tuplehash + NPT_OFF_nf_conntrack_tuple_hash__tuple;
	void *t1 = t0 + NPT_SIZEOF_nf_conntrack_tuple_hash;
	u16 p;
	u32 status = 0;
	bpf_probe_read_kernel(e->ct_osrc, 16, t0 + NPT_OFF_nf_conntrack_tuple__src_u3);
	bpf_probe_read_kernel(e->ct_odst, 16, t0 + NPT_OFF_nf_conntrack_tuple__dst_u3);
	bpf_probe_read_kernel(e->ct_rsrc, 16, t1 + NPT_OFF_nf_conntrack_tuple__src_u3);
	bpf_probe_read_kernel(e->ct_rdst, 16, t1 + NPT_OFF_nf_conntrack_tuple__dst_u3);
	NPT_READ(p, t0, NPT_OFF_nf_conntrack_tuple__src_u_all); e->ct_osport = bpf_ntohs(p);
	NPT_READ(p, t0, NPT_OFF_nf_conntrack_tuple__dst_u_all); e->ct_odport = bpf_ntohs(p);
	NPT_READ(p, t1, NPT_OFF_nf_conntrack_tuple__src_u_all); e->ct_rsport = bpf_ntohs(p);
	NPT_READ(p, t1, NPT_OFF_nf_conntrack_tuple__dst_u_all); e->ct_rdport = bpf_ntohs(p);
	NPT_READ(status, ct, NPT_OFF_nf_conn__status);
	e->ct_status = status;
	e->flags |= NPT_F_HAS_CT;
#endif
}

/* Fill the tuple, interface, netns, mark and conntrack from an skb pointer.
 * Returns the L4 protocol, or -1 when the packet is not IP or the header cannot be read. */
static __always_inline int npt_read_skb(struct npt_event *e, void *skb)
{
	void *dev = 0, *head = 0;
	u16 nh = 0, th = 0, proto = 0;
	u8 l4 = 0;

	e->skb = (u64)skb;
	NPT_READ(dev, skb, NPT_OFF_sk_buff__dev);
	if (dev) {
		NPT_READ(e->ifindex, dev, NPT_OFF_net_device__ifindex);
		e->netns = npt_netns_of_dev(dev);
	} else {
		void *sk = 0;
		NPT_READ(sk, skb, NPT_OFF_sk_buff__sk);
		e->netns = npt_netns_of_sk(sk);
	}
	NPT_READ(e->mark, skb, NPT_OFF_sk_buff__mark);
	NPT_READ(head, skb, NPT_OFF_sk_buff__head);
	NPT_READ(nh, skb, NPT_OFF_sk_buff__network_header);
	NPT_READ(th, skb, NPT_OFF_sk_buff__transport_header);
	NPT_READ(proto, skb, NPT_OFF_sk_buff__protocol);
	proto = bpf_ntohs(proto);
	if (!head || nh == 0xffff)
		return -1;

	void *ip = head + nh;
	if (proto == NPT_ETH_P_IP) {
		u8 vihl = 0;
		NPT_READ(vihl, ip, 0);
		if ((vihl >> 4) != 4)
			return -1;
		NPT_READ(l4, ip, 9);
		bpf_probe_read_kernel(e->saddr, 4, ip + 12);
		bpf_probe_read_kernel(e->daddr, 4, ip + 16);
		e->family = NPT_AF_INET;
		/* transport_header is unset (~0) or still equal to the network header before
		 * ip_rcv_core() runs; compute it from IHL instead. */
		if (th == 0xffff || th <= nh)
			th = nh + (vihl & 0xf) * 4;
	} else if (proto == NPT_ETH_P_IPV6) {
		NPT_READ(l4, ip, 6);
		bpf_probe_read_kernel(e->saddr, 16, ip + 8);
		bpf_probe_read_kernel(e->daddr, 16, ip + 24);
		e->family = NPT_AF_INET6;
		/* extension headers are not walked: TCP must follow the fixed header */
		if (th == 0xffff || th <= nh)
			th = nh + 40;
	} else {
		return -1;
	}
	e->l4proto = l4;
	void *l4h = head + th;
	if (l4 == NPT_IPPROTO_TCP) {
		u16 p = 0;
		u8 fl = 0;
		u32 s = 0;
		NPT_READ(p, l4h, 0); e->sport = bpf_ntohs(p);
		NPT_READ(p, l4h, 2); e->dport = bpf_ntohs(p);
		NPT_READ(s, l4h, 4); e->seq = bpf_ntohl(s);
		NPT_READ(s, l4h, 8); e->ack_seq = bpf_ntohl(s);
		NPT_READ(fl, l4h, 13); e->tcpflags = fl;
	} else if (l4 == NPT_IPPROTO_ICMP) {
		/* An ICMP error quotes the offending IP header + 8 bytes: the event's tuple becomes
		 * the quoted TCP packet (the flow it is about); the ICMP packet's own addresses move
		 * to outer_*. Only destination-unreachable (3) and time-exceeded (11) quote. */
		u8 type = 0, code = 0, inner_l4 = 0, ihl = 0;
		NPT_READ(type, l4h, 0);
		NPT_READ(code, l4h, 1);
		e->reason = (u32)type << 8 | code;
		if (type != 3 && type != 11)
			return -1;
		void *qip = l4h + 8;
		NPT_READ(ihl, qip, 0);
		NPT_READ(inner_l4, qip, 9);
		if (inner_l4 != NPT_IPPROTO_TCP)
			return -1;
		__builtin_memcpy(e->outer_saddr, e->saddr, 16);
		__builtin_memcpy(e->outer_daddr, e->daddr, 16);
		bpf_probe_read_kernel(e->saddr, 4, qip + 12);
		bpf_probe_read_kernel(e->daddr, 4, qip + 16);
		u16 p = 0;
		void *qth = qip + (ihl & 0xf) * 4;
		NPT_READ(p, qth, 0); e->sport = bpf_ntohs(p);
		NPT_READ(p, qth, 2); e->dport = bpf_ntohs(p);
		e->flags |= NPT_F_ICMP_QUOTE;
	} else if (l4 == NPT_IPPROTO_UDP && e->family == NPT_AF_INET) {
		/* VXLAN over an IPv4 underlay (an overlay node dropping encapsulated pod traffic,
		 * e.g. rp_filter on the underlay): report the inner TCP tuple, outer in outer_*. */
		u16 p = 0;
		NPT_READ(p, l4h, 2);
		p = bpf_ntohs(p);
		if (!vxlan_ports.lookup(&p))
			return l4;
		void *vx = l4h + 8, *inner = vx + 8;
		u8 vni[3] = {};
		u16 etype = 0;
		u8 vihl = 0, il4 = 0;
		bpf_probe_read_kernel(vni, 3, vx + 4);
		NPT_READ(etype, inner, 12);
		if (bpf_ntohs(etype) != NPT_ETH_P_IP)
			return l4;
		void *iip = inner + 14;
		NPT_READ(vihl, iip, 0);
		NPT_READ(il4, iip, 9);
		if (il4 != NPT_IPPROTO_TCP)
			return l4;
		__builtin_memcpy(e->outer_saddr, e->saddr, 16);
		__builtin_memcpy(e->outer_daddr, e->daddr, 16);
		bpf_probe_read_kernel(e->saddr, 4, iip + 12);
		bpf_probe_read_kernel(e->daddr, 4, iip + 16);
		void *ith = iip + (vihl & 0xf) * 4;
		u32 s = 0;
		u8 fl = 0;
		NPT_READ(p, ith, 0); e->sport = bpf_ntohs(p);
		NPT_READ(p, ith, 2); e->dport = bpf_ntohs(p);
		NPT_READ(s, ith, 4); e->seq = bpf_ntohl(s);
		NPT_READ(fl, ith, 13); e->tcpflags = fl;
		e->vni = (u32)vni[0] << 16 | (u32)vni[1] << 8 | vni[2];
		e->flags |= NPT_F_ENCAP;
		e->l4proto = NPT_IPPROTO_TCP;
		l4 = NPT_IPPROTO_TCP;
	} else {
		return -1;
	}
	npt_read_ct(e, skb);
	return l4;
}

static __always_inline void npt_init(struct npt_event *e, u16 type, u8 hook)
{
	__builtin_memset(e, 0, sizeof(*e));
	e->ts_ns = bpf_ktime_get_ns();
	e->type = type;
	e->abi = NPT_ABI_VERSION;
	e->hook = hook;
}

#endif /* NPT_COMMON_H */
