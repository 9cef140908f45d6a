/* Wire view: what TCP packets actually cross the watched interfaces.
 *
 * Hook: tc, one program per direction (npt_tc_ingress, npt_tc_egress), attached by
 * nptrace/kernel/tc.py to each --iface as tcx links (Linux 6.6+, nptrace/kernel/tcx.py) or, on older
 * kernels, as clsact direct-action filters (clsact 4.5, direct-action 4.4); bpf_ktime/ring
 * buffer as the rest (5.8). Fallback: none (tc is optional: without --iface nothing here is
 * compiled, -DNPT_WITH_TC=0).
 *
 * Events (everything else costs a parse and at most one map operation, no event):
 *   WIRE_RST    any TCP RST, either direction; seq/ack_seq of the RST
 *   WIRE_ICMP   ICMP/ICMPv6 destination-unreachable quoting a TCP packet: tuple = the quoted
 *               packet, outer_* = the ICMP packet's addresses (IPv6 ones when l4proto is 58),
 *               reason = type << 8 | code (ICMPv6 numbering when l4proto is 58)
 *   SYN_RETX    the same SYN (same ISN) arrived again >= 10 ms later: 2nd and 3rd time;
 *               aux = copies seen, aux2 = the first copy's ingress ifindex
 *   ASYM_IFACE  a SYN-ACK leaves by an interface its SYN did not come in on (same netns);
 *               ifindex = egress, aux = the SYN's ingress ifindex, aux2 = a second one (below)
 *   ASYM_SRC    a SYN-ACK's source is not the address:port the client's SYN was sent to
 *               (un-NATed reply); tuple = the reply, outer_saddr = the address the SYN was
 *               sent to (tuple's family), aux2 = its port, aux = the SYN's ingress ifindex
 * VXLAN (UDP dst port in vxlan_ports, IPv4 underlay) is decapsulated: the event tuple is the
 * inner TCP packet, NPT_F_ENCAP set, outer_* = underlay IPv4 addresses, vni.
 *
 * Verdict: always TC_ACT_UNSPEC (-1), not TC_ACT_OK. In direct-action mode TC_ACT_OK ends the
 * filter chain (cls_bpf_classify: only UNSPEC continues), so an observer returning OK would
 * skip other tc programs on the same hook (a CNI's, for instance); UNSPEC lets them run and,
 * with no filter left, passes the packet as OK does (sch_handle_ingress/egress default case).
 * Under tcx the same -1 is TCX_NEXT: the next tcx program, then legacy tc, still run.
 *
 * Packets are read with direct packet access (skb->data/data_end, uapi): only the linear head
 * is parsed. SYNs, RSTs and ICMP errors are small and linear in practice; a VXLAN packet whose
 * inner headers were left in page fragments (GRO on a real NIC) is skipped, not pulled
 * (bpf_skb_pull_data would modify the skb).
 *
 * netns and conntrack: the tc context pointer is the kernel sk_buff itself (cls_bpf and
 * tcx_run both run the program on the skb; __sk_buff is the verifier's view of it), so with
 * -DNPT_TC_KSKB=1 the device's netns inode and the skb's conntrack entry are read with
 * bpf_probe_read_kernel at BTF offsets, as the tracepoints do. That needs probe_read_kernel in tc programs
 * (bpf_base_func_proto, CAP_PERFMON; checked on 6.18). Conntrack is attached only on egress:
 * on ingress tc runs before PREROUTING, and a veth crossing resets it (skb_scrub_packet).
 * With -DNPT_TC_KSKB=0 the netns comes from tc_ifaces {ifindex -> netns inode}, filled at
 * attach time (ambiguous when two watched namespaces reuse an ifindex, unknown for a device
 * whose slot another ifindex took: npt_tc_netns), and ct stays empty.
 *
 * Flow state (conn_slots, npt_common.h: one 2-way set-associative array of connections that
 * the netfilter hook adds its NAT tuples to): a SYN's slot is found by its CLIENT end (source
 * address and port) and the netns, so that an un-NATed reply still finds its SYN (its server
 * side differs by definition), and ifindexes are only compared within one namespace. SYNs are
 * recorded on ingress only and SYN-ACKs checked on egress only: a forwarded SYN leaving by the
 * pod's veth is not a second request. The same SYN crossing two stacked devices (bridge port
 * then bridge, slave then VLAN/VXLAN device) within 10 ms records both ifindexes; deeper
 * stacks (bond slaves with the bond) can report a false ASYM_IFACE: watch either the upper or
 * the lower devices.
 * Why an array and not an LRU hash: every new connection's SYN writes one flow, and an LRU
 * insert (free-list pop, bucket lock, cold element; an eviction once full) cost about 0.9 us
 * per SYN under bpf_stats on the 6.18 VM, a few percent of a NodePort's connection rate. A
 * slot write touches one cold cache line (the SYN's half of the slot). A new flow takes the
 * empty or the older of its set's two slots: at R new connections/s a flow survives t seconds
 * with probability e^-x (1 + x), x = 2 R t / slots (99.9% for a SYN retransmitted 1 s later at
 * 1k conn/s with 65536 slots, 96% at 10k/s; the LRU kept every flow younger than 65536
 * inserts). Slots are written without a lock: two CPUs writing one slot for two new flows at
 * the same instant can leave it mixed, and a key compare catches most of that.
 */
#include "npt_common.h"
#include "npt_packet.h"

#if NPT_WITH_TC

#ifndef NPT_TC_KSKB
#define NPT_TC_KSKB 1
#endif
#ifndef NPT_TC_VXLAN
#define NPT_TC_VXLAN 1
#endif
#ifndef NPT_TC_IF_SLOTS
#define NPT_TC_IF_SLOTS 4096     /* tc_ifaces: a power of 2 (nptrace/kernel/tc.py TC_IF_SLOTS) */
#endif

#define NPT_TC_PASS        (-1)          /* TC_ACT_UNSPEC: see the header comment */
/* A SYN with the same ISN seen again sooner than this is the same packet on a stacked device
 * (a VXLAN underlay, then its overlay: 10 ms was too short on a loaded TCG guest, which
 * counted the decapsulated SYN a retransmission and its reply an asymmetric one); later, a
 * retransmission (Linux's first SYN RTO is 1 s, TCP_TIMEOUT_INIT, and no RTO is below
 * TCP_RTO_MIN, 200 ms, unless a route lowers rto_min). */
#define NPT_SYN_SAME_NS    100000000ULL

#define NPT_ETH_HLEN       14
#define NPT_ETH_P_8021Q    0x8100
#define NPT_ETH_P_8021AD   0x88A8
#define NPT_IPPROTO_UDP    17
#define NPT_TCPF_FIN       0x01
#define NPT_TCPF_SYN       0x02
#define NPT_TCPF_RST       0x04
#define NPT_TCPF_ACK       0x10
#define NPT_VXLAN_HLEN     8
#define NPT_VXLAN_F_VNI    0x08          /* "I" flag: the VNI field is valid (RFC 7348) */

#define NPT_REPORTED_IFACE 0x01
#define NPT_REPORTED_SRC   0x02

struct npt_tc_iface {
	u32 ifindex;        /* the watched device this slot is for; 0: none */
	u32 netns;
	u32 flags;          /* NPT_TC_IF_*, written by nptrace/kernel/tc.py iface_map_filler */
};
/* watched devices of several namespaces have this ifindex, or two ifindexes share the slot */
#define NPT_TC_IF_AMBIGUOUS 0x01

/* UDP destination ports (host order) that carry VXLAN: 4789 (IANA), 8472 (Linux default) */
/* vxlan_ports (UDP ports carrying VXLAN) is in npt_common.h: the tracepoints decapsulate too */
/* Watched ifindex -> netns inode (npt_tc_netns), in slot ifindex % NPT_TC_IF_SLOTS: an array,
 * whose lookup the verifier inlines, where a hash lookup cost ~50 ns on each SYN and SYN-ACK
 * (6.18 VM, bpf_stats: ~100 ns of a NodePort connection's ~900). */
BPF_ARRAY(tc_ifaces, struct npt_tc_iface, NPT_TC_IF_SLOTS);

/* Where the headers of one packet are (packet pointers, bounds-checked as noted). */
struct npt_tc_pkt {
	void *ip;           /* IPv4 (>= 20 bytes checked) or IPv6 (40) header */
	void *l4;           /* first byte after the IP header; not checked */
	u32 osaddr;         /* VXLAN outer IPv4 addresses, network order */
	u32 odaddr;
	u32 vni;
	u16 family;
	u8  l4proto;
	u8  encap;
};

/* Skip Ethernet and up to two VLAN tags (802.1Q, 802.1ad). The outer tag is usually already
 * in skb->vlan_tci at tc ingress (skb_vlan_untag runs first), but not on devices without the
 * offload, nor for the second tag. Returns the L3 offset from p, or -1. */
static __always_inline int npt_tc_l2(void *p, void *end, u16 *proto)
{
	if (p + NPT_ETH_HLEN > end)
		return -1;
	u16 h = bpf_ntohs(*(u16 *)(p + 12));
	int off = NPT_ETH_HLEN;
	if (h == NPT_ETH_P_8021Q || h == NPT_ETH_P_8021AD) {
		if (p + NPT_ETH_HLEN + 4 > end)
			return -1;
		h = bpf_ntohs(*(u16 *)(p + NPT_ETH_HLEN + 2));
		off += 4;
		if (h == NPT_ETH_P_8021Q || h == NPT_ETH_P_8021AD) {
			if (p + NPT_ETH_HLEN + 8 > end)
				return -1;
			h = bpf_ntohs(*(u16 *)(p + NPT_ETH_HLEN + 6));
			off += 4;
		}
	}
	*proto = h;
	return off;
}

/* IPv4/IPv6 header at p. 0, or -1 when not IP, truncated, or a non-first fragment.
 * IPv6 extension headers are not walked: TCP/ICMPv6 must follow the fixed header. */
static __always_inline int npt_tc_l3(void *p, void *end, u16 proto, struct npt_tc_pkt *k)
{
	if (proto == NPT_ETH_P_IP) {
		if (p + 20 > end)
			return -1;
		u8 vihl = *(u8 *)p;
		u32 ihl = (vihl & 0xf) * 4;
		if ((vihl >> 4) != 4 || ihl < 20)
			return -1;
		if (*(u16 *)(p + 6) & bpf_htons(0x1fff))
			return -1;
		k->ip = p;
		k->l4 = p + ihl;
		k->family = NPT_AF_INET;
		k->l4proto = *(u8 *)(p + 9);
		return 0;
	}
	if (proto == NPT_ETH_P_IPV6) {
		if (p + 40 > end)
			return -1;
		if ((*(u8 *)p >> 4) != 6)
			return -1;
		k->ip = p;
		k->l4 = p + 40;
		k->family = NPT_AF_INET6;
		k->l4proto = *(u8 *)(p + 6);
		return 0;
	}
	return -1;
}

/* The netns inode of the device the program runs on: its tc_ifaces slot, where that slot is
 * its ifindex's and not NPT_TC_IF_AMBIGUOUS (tc.py marks an ifindex that devices of several
 * watched namespaces have, and a slot two ifindexes share); else, with -DNPT_TC_KSKB=1, from
 * the kernel sk_buff (three dependent probe reads: skb->dev, dev->nd_net, net->ns.inum, ~95 ns
 * on the 6.18 VM, paid on each SYN and SYN-ACK before the map did). Without it a device whose
 * slot another took gets netns 0 (unknown). */
static __always_inline u32 npt_tc_netns(struct __sk_buff *skb)
{
	u32 idx = skb->ifindex;
	u32 slot = idx & (NPT_TC_IF_SLOTS - 1);
	struct npt_tc_iface *v = tc_ifaces.lookup(&slot);
	int mine = v && v->ifindex == idx;
	if (mine && !(v->flags & NPT_TC_IF_AMBIGUOUS))
		return v->netns;
#if NPT_TC_KSKB
	void *dev = 0;
	NPT_READ(dev, skb, NPT_OFF_sk_buff__dev);
	return npt_netns_of_dev(dev);
#else
	return mine ? v->netns : 0;
#endif
}

/* Source and destination address of the IP header at ip into 16-byte fields. */
static __always_inline void npt_tc_addrs(void *ip, void *end, u16 family, u8 *s, u8 *d)
{
	if (family == NPT_AF_INET) {
		if (ip + 20 > end)
			return;
		__builtin_memcpy(s, ip + 12, 4);
		__builtin_memcpy(d, ip + 16, 4);
	} else {
		if (ip + 40 > end)
			return;
		__builtin_memcpy(s, ip + 8, 16);
		__builtin_memcpy(d, ip + 24, 16);
	}
}

/* Start an event about this packet: header, interface, netns, tuple addresses, encap. */
static __always_inline void npt_tc_event(struct npt_event *e, u16 type, struct __sk_buff *skb,
					 struct npt_tc_pkt *k, void *end, u8 egress, u32 netns)
{
	npt_init(e, type, egress ? NPT_H_TC_EGRESS : NPT_H_TC_INGRESS);
	e->dir = egress ? NPT_D_EGRESS : NPT_D_INGRESS;
	e->ifindex = skb->ifindex;
	e->mark = skb->mark;
	e->netns = netns;
	e->family = k->family;
	e->l4proto = k->l4proto;
	npt_tc_addrs(k->ip, end, k->family, e->saddr, e->daddr);
	if (k->encap) {
		e->flags |= NPT_F_ENCAP;
		__builtin_memcpy(e->outer_saddr, &k->osaddr, 4);
		__builtin_memcpy(e->outer_daddr, &k->odaddr, 4);
		e->vni = k->vni;
	}
#if NPT_TC_KSKB
	e->skb = (u64)skb;    /* same value as the tracepoints' skbaddr for this skb */
	npt_read_ct(e, skb);
#endif
}

static __always_inline int npt_addr_eq(const u8 *a, const u8 *b)
{
	return *(u64 *)a == *(u64 *)b && *(u64 *)(a + 8) == *(u64 *)(b + 8);
}

/* The slot of the flow whose SYN came from client:cport in netns, else 0 and *victim = the
 * slot a new flow of it takes (the empty or the older one of its set). Slots the netfilter
 * hook took alone (syns 0) are not tc's. */
static __always_inline int npt_tc_mine(const struct npt_conn_slot *s, const u8 *client,
				       u16 cport, u32 netns, u8 family)
{
	return s->syns && s->netns == netns && s->key.sport == cport && s->family == family &&
	       npt_addr_eq(s->key.src, client);
}

static __always_inline struct npt_conn_slot *npt_tc_find(const u8 *client, u16 cport, u32 netns,
							 u8 family, struct npt_conn_slot **victim)
{
	u32 i = npt_conn_set_of(client, cport);
	struct npt_conn_set *c = conn_slots.lookup(&i);
	*victim = 0;
	if (!c)
		return 0;
	struct npt_conn_slot *a = &c->way[0], *b = &c->way[1];
	if (npt_tc_mine(a, client, cport, netns, family))
		return a;
	if (npt_tc_mine(b, client, cport, netns, family))
		return b;
	*victim = a->syn_ns <= b->syn_ns ? a : b;
	return 0;
}

/* A new flow's SYN into slot s: its first line, all of it (nat 0: a NAT pair of the slot's
 * earlier connection no longer applies; the netfilter hook adds this one's). */
static __always_inline void npt_tc_take(struct npt_conn_slot *s, const u64 *saddr,
					const u64 *daddr, u16 sport, u16 dport, u32 netns,
					u8 family, u32 seq, u32 ifindex, u64 now)
{
	__builtin_memcpy(s->key.src, saddr, 16);
	__builtin_memcpy(s->key.dst, daddr, 16);
	s->key.sport = sport;
	s->key.dport = dport;
	s->netns = netns;
	s->syn_ns = now;
	s->isn = seq;
	s->in_ifindex = ifindex;
	s->in_ifindex2 = 0;
	s->family = family;
	s->nat = 0;
	s->syns = 1;
	s->reported = 0;
}

/* An ingress SYN: record or refresh the flow; 1 when a SYN_RETX event was prepared in e. */
static __always_inline int npt_tc_syn(struct npt_event *e, struct __sk_buff *skb,
				      struct npt_tc_pkt *k, void *end, u32 netns,
				      u16 sport, u16 dport, u32 seq)
{
	u64 saddr[2] = {}, daddr[2] = {};
	npt_tc_addrs(k->ip, end, k->family, (u8 *)saddr, (u8 *)daddr);

	u64 now = bpf_ktime_get_ns();
	u32 ifindex = skb->ifindex;
	struct npt_conn_slot *victim;
	struct npt_conn_slot *f = npt_tc_find((u8 *)saddr, sport, netns, k->family, &victim);
	if (!f) {              /* a new connection's SYN, the common case */
		if (victim)
			npt_tc_take(victim, saddr, daddr, sport, dport, netns, k->family, seq,
				    ifindex, now);
		return 0;
	}
	if (f->isn == seq && f->key.dport == dport && npt_addr_eq(f->key.dst, (u8 *)daddr)) {
		if (now - f->syn_ns < NPT_SYN_SAME_NS) {
			if (ifindex != f->in_ifindex)
				f->in_ifindex2 = ifindex;
			return 0;
		}
		f->syn_ns = now;
		if (f->syns < 255)
			f->syns++;
		u8 n = f->syns;
		if (n != 2 && n != 3)
			return 0;
		npt_tc_event(e, NPT_T_SYN_RETX, skb, k, end, 0, netns);
		e->aux = n;
		e->aux2 = f->in_ifindex;
		return 1;
	}
	/* the client port now carries another connection */
	npt_tc_take(f, saddr, daddr, sport, dport, netns, k->family, seq, ifindex, now);
	return 0;
}

/* An egress SYN-ACK: compare with its SYN; 1 when an ASYM_* event was prepared in e. */
static __always_inline int npt_tc_synack(struct npt_event *e, struct __sk_buff *skb,
					 struct npt_tc_pkt *k, void *end, u32 netns,
					 u16 sport, u16 dport)
{
	u64 saddr[2] = {}, daddr[2] = {};
	npt_tc_addrs(k->ip, end, k->family, (u8 *)saddr, (u8 *)daddr);

	struct npt_conn_slot *victim;
	struct npt_conn_slot *f = npt_tc_find((u8 *)daddr, dport, netns, k->family, &victim);
	if (!f)
		return 0;
	u32 ifindex = skb->ifindex;

	if (f->key.dport != sport || !npt_addr_eq(f->key.dst, (u8 *)saddr)) {
		if (f->reported & NPT_REPORTED_SRC)
			return 0;
		f->reported |= NPT_REPORTED_SRC;
		npt_tc_event(e, NPT_T_ASYM_SRC, skb, k, end, 1, netns);
		/* outer_* carry the expected source here, so the VXLAN outer header is dropped */
		e->flags &= ~NPT_F_ENCAP;
		__builtin_memcpy(e->outer_saddr, f->key.dst, 16);
		__builtin_memset(e->outer_daddr, 0, 16);
		e->aux = f->in_ifindex;
		e->aux2 = f->key.dport;
		return 1;
	}
	if (ifindex == f->in_ifindex || ifindex == f->in_ifindex2)
		return 0;
	if (f->reported & NPT_REPORTED_IFACE)
		return 0;
	f->reported |= NPT_REPORTED_IFACE;
	npt_tc_event(e, NPT_T_ASYM_IFACE, skb, k, end, 1, netns);
	e->aux = f->in_ifindex;
	e->aux2 = f->in_ifindex2;
	return 1;
}

static __always_inline int npt_tc_tcp(struct npt_event *e, struct __sk_buff *skb,
				      struct npt_tc_pkt *k, void *end, u8 egress)
{
	void *th = k->l4;
	if (th + 20 > end)
		return 0;
	u8 fl = *(u8 *)(th + 13);
	if (!(fl & (NPT_TCPF_SYN | NPT_TCPF_RST)))
		return 0;          /* the hot path: data and ACKs */
	u16 sport = bpf_ntohs(*(u16 *)th);
	u16 dport = bpf_ntohs(*(u16 *)(th + 2));
	u32 seq = bpf_ntohl(*(u32 *)(th + 4));
	u32 ack = bpf_ntohl(*(u32 *)(th + 8));

	if (fl & NPT_TCPF_RST) {
		npt_tc_event(e, NPT_T_WIRE_RST, skb, k, end, egress, npt_tc_netns(skb));
		e->sport = sport;
		e->dport = dport;
		e->seq = seq;
		e->ack_seq = ack;
		e->tcpflags = fl;
		return 1;
	}
	int ret;
	if (!(fl & NPT_TCPF_ACK)) {
		if (egress)
			return 0;
		ret = npt_tc_syn(e, skb, k, end, npt_tc_netns(skb), sport, dport, seq);
	} else {
		if (!egress)
			return 0;
		ret = npt_tc_synack(e, skb, k, end, npt_tc_netns(skb), sport, dport);
	}
	if (ret) {
		e->sport = sport;
		e->dport = dport;
		e->seq = seq;
		e->ack_seq = ack;
		e->tcpflags = fl;
	}
	return ret;
}

/* ICMP type 3 / ICMPv6 type 1 (destination unreachable) quoting a TCP packet: the tuple is
 * the quoted packet (the flow it is about), outer_* the ICMP packet's own addresses (IPv6
 * ones for ICMPv6), reason = type << 8 | code, as npt_read_skb does. Inside VXLAN the underlay
 * addresses are not reported (outer_* are taken), only vni. */
static __always_inline int npt_tc_icmp(struct npt_event *e, struct __sk_buff *skb,
				       struct npt_tc_pkt *k, void *end, u8 egress)
{
	void *ic = k->l4;
	if (ic + 8 > end)
		return 0;
	u8 type = *(u8 *)ic, code = *(u8 *)(ic + 1);
	void *q = ic + 8;
	u8 qfam;
	void *qth;
	if (k->l4proto == NPT_IPPROTO_ICMP) {
		if (type != 3)
			return 0;
		if (q + 20 > end)
			return 0;
		u8 vihl = *(u8 *)q;
		if ((vihl >> 4) != 4 || *(u8 *)(q + 9) != NPT_IPPROTO_TCP)
			return 0;
		qfam = NPT_AF_INET;
		qth = q + (vihl & 0xf) * 4;
	} else {
		if (type != 1)
			return 0;
		if (q + 40 > end)
			return 0;
		if (*(u8 *)(q + 6) != NPT_IPPROTO_TCP)
			return 0;
		qfam = NPT_AF_INET6;
		qth = q + 40;
	}
	if (qth + 8 > end)    /* RFC 792: at least 8 bytes of the quoted L4 header */
		return 0;

	npt_tc_event(e, NPT_T_WIRE_ICMP, skb, k, end, egress, npt_tc_netns(skb));
	e->flags &= ~NPT_F_ENCAP;
	__builtin_memcpy(e->outer_saddr, e->saddr, 16);
	__builtin_memcpy(e->outer_daddr, e->daddr, 16);
	__builtin_memset(e->saddr, 0, 16);
	__builtin_memset(e->daddr, 0, 16);
	npt_tc_addrs(q, end, qfam, e->saddr, e->daddr);
	e->family = qfam;
	e->sport = bpf_ntohs(*(u16 *)qth);
	e->dport = bpf_ntohs(*(u16 *)(qth + 2));
	e->seq = bpf_ntohl(*(u32 *)(qth + 4));
	e->reason = (u32)type << 8 | code;
	e->flags |= NPT_F_ICMP_QUOTE;
	return 1;
}

static __always_inline int npt_tc(struct __sk_buff *skb, u8 egress)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct npt_tc_pkt k = {};
	u16 proto = 0;

	int off = npt_tc_l2(data, end, &proto);
	if (off < 0 || npt_tc_l3(data + off, end, proto, &k) < 0)
		return NPT_TC_PASS;

#if NPT_TC_VXLAN
	if (k.l4proto == NPT_IPPROTO_UDP && k.family == NPT_AF_INET) {
		void *udp = k.l4;
		void *ip = k.ip;
		if (udp + 8 + NPT_VXLAN_HLEN > end || ip + 20 > end)
			return NPT_TC_PASS;
		void *vx = udp + 8;
		if (!(*(u8 *)vx & NPT_VXLAN_F_VNI))
			return NPT_TC_PASS;
		void *inner = vx + NPT_VXLAN_HLEN;
		off = npt_tc_l2(inner, end, &proto);
		if (off < 0 || npt_tc_l3(inner + off, end, proto, &k) < 0)
			return NPT_TC_PASS;
		/* Bulk overlay traffic is TCP data: decide on its flags before the vxlan_ports
		 * lookup (a hash of the port, the dearest step here). Any UDP packet that looks
		 * like an inner TCP segment without SYN/RST passes; VXLAN or not, nothing here
		 * would report it. */
		if (k.l4proto == NPT_IPPROTO_TCP) {
			if (k.l4 + 20 > end)
				return NPT_TC_PASS;
			if (!(*(u8 *)(k.l4 + 13) & (NPT_TCPF_SYN | NPT_TCPF_RST)))
				return NPT_TC_PASS;
		} else if (k.l4proto != NPT_IPPROTO_ICMP && k.l4proto != NPT_IPPROTO_ICMPV6) {
			return NPT_TC_PASS;
		}
		u16 port = bpf_ntohs(*(u16 *)(udp + 2));
		if (!vxlan_ports.lookup(&port))
			return NPT_TC_PASS;
		k.osaddr = *(u32 *)(ip + 12);
		k.odaddr = *(u32 *)(ip + 16);
		k.vni = bpf_ntohl(*(u32 *)(vx + 4)) >> 8;
		k.encap = 1;
	}
#endif

	struct npt_event e;
	int want = 0;
	if (k.l4proto == NPT_IPPROTO_TCP)
		want = npt_tc_tcp(&e, skb, &k, end, egress);
	else if (k.l4proto == NPT_IPPROTO_ICMP || k.l4proto == NPT_IPPROTO_ICMPV6)
		want = npt_tc_icmp(&e, skb, &k, end, egress);
	if (want)
		npt_emit_tc_packet(&e, skb, egress);   /* npt_packet.h: + its bytes with --pcap */
	return NPT_TC_PASS;
}

int npt_tc_ingress(struct __sk_buff *skb)
{
	return npt_tc(skb, 0);
}

int npt_tc_egress(struct __sk_buff *skb)
{
	return npt_tc(skb, 1);
}

#endif /* NPT_WITH_TC */
