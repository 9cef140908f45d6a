/* Packet bytes for --pcap: after an event that is about a packet (a dropped SYN at
 * skb:kfree_skb, the packet an ICMP error is sent about at icmp:icmp_send, a RST, SYN or
 * SYN-ACK at tc), the first NPT_SNAPLEN bytes of that packet as the kernel had it at the hook,
 * in a struct npt_packet record (nptrace_events.h) with the event's ts_ns and skb.
 *
 * Gate: -DNPT_SNAPLEN=N (nptrace/kernel/cflags.py; `run -w` and `run --record` set it from
 * --snaplen: N, or 160 for the default `headers`, which user space then cuts where each packet's
 * headers end, nptrace/sinks/snap.py); 0 compiles nothing here. Hooks and kernels: those of the events (tracepoints.bpf.c,
 * tc.bpf.c); bpf_skb_load_bytes in tc programs since 4.5, bpf_probe_read_kernel since 5.5.
 * Cost: one per-CPU array lookup, a copy of at most NPT_SNAPLEN bytes and a second ring-buffer
 * record per event sent, nothing per packet that makes no event.
 *
 * Only a record whose event reached the ring is written: npt_emit (npt_common.h) says nothing
 * of what it did, so the emitted counter of this CPU is compared before and after it. A BPF
 * program that interrupts this one on the same CPU between the two reads (a tc program in a
 * softirq on the irq exit of a kfree_skb in process context) can make a packet record follow
 * an event that was filtered or sampled out: user space then finds no event of that ts_ns and
 * skb and drops it.
 *
 * Caveats: at kfree_skb only the linear part of the skb is copied (bpf_probe_read_kernel
 * from skb->head; SYNs and RSTs are linear), and the link-layer header only when the skb has
 * one (a received packet: mac_header set and 14 bytes before the network header); else the
 * copy starts at the IP header (NPT_PL_IP). At tc, bpf_skb_load_bytes reads fragments too,
 * from the Ethernet header on (tc.bpf.c parses Ethernet devices only).
 */
#ifndef NPT_PACKET_H
#define NPT_PACKET_H

#include "npt_common.h"

#ifndef NPT_SNAPLEN
#define NPT_SNAPLEN 0
#endif

#if NPT_SNAPLEN
struct npt_pkt_rec {
	struct npt_packet h;
	u8 data[NPT_SNAPLEN];
};
/* scratch: 40 + NPT_SNAPLEN bytes do not fit beside an npt_event on the 512-byte stack */
BPF_PERCPU_ARRAY(pkt_scratch, struct npt_pkt_rec, 1);

static __always_inline u64 npt_emitted(void)
{
	u32 idx = NPT_S_EMITTED;
	u64 *n = stats.lookup(&idx);
	return n ? *n : 0;
}

/* The scratch record for e, its header filled; 0 when e did not go out (sent: npt_emitted()
 * before npt_emit). */
static __always_inline struct npt_pkt_rec *npt_pkt_start(struct npt_event *e, u64 sent)
{
	if (npt_emitted() == sent)
		return 0;
	u32 zero = 0;
	struct npt_pkt_rec *r = pkt_scratch.lookup(&zero);
	if (!r)
		return 0;
	r->h.ts_ns = e->ts_ns;
	r->h.skb = e->skb;
	r->h.ifindex = e->ifindex;
	r->h.type = NPT_T_PACKET;
	r->h.abi = NPT_ABI_VERSION;
	r->h.ev_type = e->type;
	r->h.hook = e->hook;
	return r;
}

static __always_inline void npt_pkt_out(struct npt_pkt_rec *r, u32 cap)
{
	r->h.cap_len = cap;
	/* the ring's wake-up policy is the event's (npt_emit): this record never wakes */
	events.ringbuf_output(r, sizeof(r->h) + (cap & 0xffff), NPT_RB_NO_WAKEUP);
}

/* npt_emit(e), then the bytes of the kernel sk_buff skb at a tracepoint. */
static __always_inline void npt_emit_skb_packet(struct npt_event *e, void *skb)
{
	u64 sent = npt_emitted();
	npt_emit(e);
	if (!skb)
		return;
	struct npt_pkt_rec *r = npt_pkt_start(e, sent);
	if (!r)
		return;
	unsigned char *head = 0, *data = 0;
	u16 mac = 0, nh = 0;
	u32 len = 0, data_len = 0, iif = 0;
	NPT_READ(head, skb, NPT_OFF_sk_buff__head);
	NPT_READ(data, skb, NPT_OFF_sk_buff__data);
	NPT_READ(mac, skb, NPT_OFF_sk_buff__mac_header);
	NPT_READ(nh, skb, NPT_OFF_sk_buff__network_header);
	NPT_READ(len, skb, NPT_OFF_sk_buff__len);
	NPT_READ(data_len, skb, NPT_OFF_sk_buff__data_len);
	NPT_READ(iif, skb, NPT_OFF_sk_buff__skb_iif);
	if (!head || !data || nh == 0xffff)
		return;
	unsigned char *start;
	if (mac != 0xffff && mac < nh && nh - mac == 14) {
		start = head + mac;
		r->h.link = NPT_PL_ETHERNET;
	} else {
		start = head + nh;
		r->h.link = NPT_PL_IP;
	}
	/* received on the device it is freed on: inbound; anything else is not told here */
	r->h.dir = r->h.link == NPT_PL_ETHERNET && iif && iif == e->ifindex ?
		NPT_PD_INBOUND : NPT_PD_UNKNOWN;
	s64 before = data - start;            /* bytes of the packet in front of skb->data */
	s64 orig = (s64)len + before;
	s64 linear = (s64)(len - data_len) + before;
	if (before < 0 || before > 1024 || orig <= 0 || linear <= 0)
		return;                           /* not a layout this reads */
	r->h.orig_len = orig;
	u32 cap = linear < NPT_SNAPLEN ? (u32)linear : NPT_SNAPLEN;
	if (cap > NPT_SNAPLEN)
		return;
	if (bpf_probe_read_kernel(r->data, cap, start))
		return;
	npt_pkt_out(r, cap);
}

/* npt_emit(e), then the bytes of the packet a tc program sees (from its Ethernet header). */
static __always_inline void npt_emit_tc_packet(struct npt_event *e, struct __sk_buff *skb,
					       u8 egress)
{
	u64 sent = npt_emitted();
	npt_emit(e);
	struct npt_pkt_rec *r = npt_pkt_start(e, sent);
	if (!r)
		return;
	u32 len = skb->len;
	u32 cap = len < NPT_SNAPLEN ? len : NPT_SNAPLEN;
	if (cap == 0 || cap > NPT_SNAPLEN)
		return;
	r->h.link = NPT_PL_ETHERNET;
	r->h.dir = egress ? NPT_PD_OUTBOUND : NPT_PD_INBOUND;
	r->h.orig_len = len;
	if (bpf_skb_load_bytes(skb, 0, r->data, cap))
		return;
	npt_pkt_out(r, cap);
}

#else  /* !NPT_SNAPLEN: the events alone */
#define npt_emit_skb_packet(e, skb) npt_emit(e)
#define npt_emit_tc_packet(e, skb, egress) npt_emit(e)
#endif /* NPT_SNAPLEN */

#endif /* NPT_PACKET_H */
