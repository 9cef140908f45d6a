/* nptrace event record: the one layout every BPF program writes to the ring buffer.
 *
 * Mirrored by nptrace/events.py; tests/unit/test_layout.py compiles static asserts of every
 * offset and size with clang -target bpf, so a change here that is not made there fails CI.
 * Rules: fixed-width types, largest first within each group, explicit padding, addresses as
 * __u8[16] (IPv4 in the first 4 bytes), no __int128, no packed.
 *
 * Tuples describe the PACKET the event is about, in its direction on the wire: for a reset
 * that is sender -> receiver of the RST, for a drop the dropped packet's source -> destination.
 * Ports are host order.
 */
#ifndef NPTRACE_EVENTS_H
#define NPTRACE_EVENTS_H

#define NPT_ABI_VERSION 1

enum npt_type {
	NPT_T_DROP        = 1,  /* a TCP (or ICMP-about-TCP) packet was freed with a drop reason */
	NPT_T_RST_SENT    = 2,  /* the local TCP stack sent a reset */
	NPT_T_RST_RECV    = 3,  /* a local socket received a reset */
	NPT_T_ICMP_UNREACH = 4, /* the node sent an ICMP error about a TCP packet (REJECT, no route) */
	NPT_T_SYNACK_RETX = 5,  /* a SYN-ACK was retransmitted: the client's ACK never arrived */
	NPT_T_WIRE_RST    = 6,  /* tc saw a RST on an interface */
	NPT_T_ASYM_IFACE  = 7,  /* tc: a reply left by another interface than its request came in */
	NPT_T_ASYM_SRC    = 8,  /* tc: a reply's source is not the address the client connected to */
	NPT_T_SYN_RETX    = 9,  /* tc: a SYN was seen again for the same flow (silent drop upstream) */
	NPT_T_NF_VIEW     = 10, /* netfilter-hook program: the packet as seen at a hook/priority */
	NPT_T_WIRE_ICMP   = 11, /* tc saw an ICMP unreachable about a TCP flow */
	NPT_T_PACKET      = 12, /* not an event: struct npt_packet, the bytes of the event before it */
	NPT_T_MAX
};

enum npt_hook {
	NPT_H_KFREE_SKB     = 1,  /* tracepoint skb:kfree_skb */
	NPT_H_TCP_SEND_RST  = 2,  /* tracepoint tcp:tcp_send_reset */
	NPT_H_TCP_RECV_RST  = 3,  /* tracepoint tcp:tcp_receive_reset */
	NPT_H_ICMP_SEND     = 4,  /* tracepoint icmp:icmp_send */
	NPT_H_SYNACK_RETX   = 5,  /* tracepoint tcp:tcp_retransmit_synack */
	NPT_H_TC_INGRESS    = 6,  /* tc clsact ingress */
	NPT_H_TC_EGRESS     = 7,  /* tc clsact egress */
	NPT_H_NF_HOOK       = 8,  /* BPF_PROG_TYPE_NETFILTER; aux = pf<<24 | hooknum<<16 | prio */
	NPT_H_KPROBE        = 9,  /* kprobe enrichment; aux = which function (enum npt_kfunc) */
	NPT_H_MAX
};

enum npt_dir {
	NPT_D_UNKNOWN   = 0,
	NPT_D_INGRESS   = 1,  /* arrived on ifindex */
	NPT_D_EGRESS    = 2,  /* leaving by ifindex */
	NPT_D_LOCAL     = 3,  /* generated or consumed by a local socket */
};

/* Kernel functions the kprobe enrichment hooks (bpf/kprobes.bpf.c), in aux */
enum npt_kfunc {
	NPT_KF_NAT_MANIP      = 1,
	NPT_KF_NAT_PACKET     = 2,
	NPT_KF_FIB_VALIDATE   = 3,
	NPT_KF_NF_SEND_RESET  = 4,
	NPT_KF_IPVS_IN        = 5,
	NPT_KF_IPVS_OUT       = 6,
};
#define NPT_HAVE_KFUNC_ENUM 1

/* flags */
#define NPT_F_HAS_CT     0x01  /* ct_* fields hold the skb's conntrack entry */
#define NPT_F_ENCAP      0x02  /* tuple is the inner (VXLAN) packet; outer_* hold the outer header */
#define NPT_F_HAS_SOCK   0x04  /* a socket was attached (reset sent by a socket, not a bare packet) */
#define NPT_F_TRUNC      0x08  /* headers could not all be read; tuple may be partial */
#define NPT_F_ICMP_QUOTE 0x10  /* tuple is the TCP packet an ICMP error quotes; outer_* hold the
				  ICMP packet's own addresses; reason = type << 8 | code */

/* nf_conn.status bits we report (include/uapi/linux/netfilter/nf_conntrack_common.h) */
#define NPT_IPS_EXPECTED     (1 << 0)
#define NPT_IPS_SEEN_REPLY   (1 << 1)
#define NPT_IPS_ASSURED      (1 << 2)
#define NPT_IPS_CONFIRMED    (1 << 3)
#define NPT_IPS_SRC_NAT      (1 << 4)
#define NPT_IPS_DST_NAT      (1 << 5)
#define NPT_IPS_SRC_NAT_DONE (1 << 7)
#define NPT_IPS_DST_NAT_DONE (1 << 8)

struct npt_event {
	/* common header: every record starts with it */
	__u64 ts_ns;        /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	__u64 skb;          /* correlation key, never dereferenced by user space */
	__u32 ifindex;      /* device the packet was on (0 if none) */
	__u16 type;         /* enum npt_type */
	__u16 abi;          /* NPT_ABI_VERSION */
	/* 24 */
	__u64 location;     /* kfree_skb: the freeing call site (kernel text address) */
	__u32 netns;        /* inode of the network namespace (device's, else socket's) */
	__u32 reason;       /* drop: enum skb_drop_reason; rst sent: enum sk_rst_reason;
			       icmp: type << 8 | code */
	__u32 ct_status;    /* nf_conn.status (NPT_IPS_*) when NPT_F_HAS_CT */
	__u32 mark;         /* skb->mark */
	/* 48 */
	__u8  saddr[16];
	__u8  daddr[16];
	/* 80 */
	__u16 sport;
	__u16 dport;
	__u16 family;       /* AF_INET (2) or AF_INET6 (10) */
	__u8  l4proto;      /* IPPROTO_TCP, or IPPROTO_ICMP for an error about TCP */
	__u8  tcpflags;     /* FIN 0x01 SYN 0x02 RST 0x04 PSH 0x08 ACK 0x10 */
	/* 88 */
	__u8  hook;         /* enum npt_hook */
	__u8  dir;          /* enum npt_dir */
	__u8  state;        /* TCP state of the socket, if any */
	__u8  flags;        /* NPT_F_* */
	__u32 aux;          /* per type: ASYM_IFACE/ASYM_SRC the SYN's ingress ifindex; SYN_RETX
			       count; NF_HOOK pf<<24|hook<<16|prio; KPROBE enum npt_kfunc;
			       RST_SENT: TCP flags of the packet the reset answers */
	/* 96: conntrack tuples (original and reply direction), valid with NPT_F_HAS_CT */
	__u8  ct_osrc[16];
	__u8  ct_odst[16];
	__u8  ct_rsrc[16];
	__u8  ct_rdst[16];
	/* 160 */
	__u16 ct_osport;
	__u16 ct_odport;
	__u16 ct_rsport;
	__u16 ct_rdport;
	/* 168: outer header of an encapsulated packet (NPT_F_ENCAP), the ICMP packet's own
	 * addresses (NPT_F_ICMP_QUOTE), or the address the SYN was sent to (ASYM_SRC) */
	__u8  outer_saddr[16];
	__u8  outer_daddr[16];
	/* 200 */
	__u32 vni;          /* VXLAN network identifier */
	__u32 seq;          /* TCP sequence number of the packet (host order) */
	__u32 ack_seq;      /* TCP acknowledgment number (host order) */
	__u32 aux2;         /* per type: ASYM_IFACE second stacked ingress ifindex; ASYM_SRC the
			       port the SYN was sent to; SYN_RETX the SYN's ingress ifindex */
	/* 216 */
};

/* Exact per-CPU counters, kept whether or not the ring buffer has room.
 * Key of the `counts` map; the value is a __u64 count. */
struct npt_count_key {
	__u32 ifindex;
	__u32 reason;
	__u32 netns;
	__u16 type;
	__u8  hook;
	__u8  _pad;
};


/* Cause-level accounting (npt_common.h npt_count_cause): every record but evidence-only ones
 * (SYNACK_RETX, NF_VIEW, kprobes) is counted under this key in the per-CPU `cause_counts`
 * hash, value struct npt_cause_val. The key is the record projected onto what the classifier's
 * rules and the Service lookup read (nptrace/classify/keylabel.py builds an event from it and
 * runs classify/rules.py), so user space labels each key once, not each record. High-cardinality
 * fields are zeroed: the client end's port always, the client end's address unless the rules
 * read it (netfilter verdicts: a NetworkPolicy or loadBalancerSourceRanges matches on it).
 * prior_* name the flow's earlier causal record (flow_facts), 0 when none; prior_key lets user
 * space label it by its own key (its tuple, conntrack and direction), the rest is the fallback
 * when that key is gone.
 * Mirrored by nptrace/kernel/causekeys.py; tests/unit/test_layout.py checks it. */
struct npt_cause_key {
	__u8  saddr[16];    /* the packet's source (zero: the client end, not read by the rules) */
	__u8  daddr[16];
	__u8  odst[16];     /* conntrack original destination when DNATed (NPT_CK_DNAT) */
	__u32 netns;
	__u32 ifindex;
	__u32 reason;
	__u32 prior_reason;
	__u32 prior_key;    /* npt_cause_key_hash of the prior record's own key (0: none) */
	__u16 sport;
	__u16 dport;
	__u16 oport;
	__u16 type;
	__u16 family;
	__u16 prior_type;
	__u8  hook;
	__u8  dir;
	__u8  flags;        /* NPT_F_HAS_CT | NPT_F_ENCAP | NPT_F_HAS_SOCK | NPT_F_ICMP_QUOTE */
	__u8  tcpflags;     /* SYN/ACK bits of the packet the record is about (answered_flags) */
	__u8  ct_bits;      /* NPT_CK_* */
	__u8  prior_hook;
	__u8  prior_tcpflags; /* the prior record's SYN/ACK bits, as tcpflags */
	__u8  prior_late;   /* 1: the prior is older than the classifier's hold (1 s): it named an
			       earlier incident, whose cause the classifier keeps for the flow */
};
#define NPT_CK_SNAT 0x01    /* nf_conn.status IPS_SRC_NAT */
#define NPT_CK_DNAT 0x02    /* nf_conn.status IPS_DST_NAT */
struct npt_cause_val {
	__u64 counted;      /* records under the key */
	__u64 sent;         /* ...of them written to the ring buffer */
};

/* Index into the `stats` per-CPU array. Mirrored by nptrace/kernel/loader.py Stat (the names
 * Probes.stats() returns); tests/unit/test_layout.py checks the mirror. */
enum npt_stat {
	NPT_S_EMITTED   = 0,  /* records written to the ring buffer */
	NPT_S_LOST      = 1,  /* records lost: ring buffer full */
	NPT_S_FILTERED  = 2,  /* events the in-kernel filters rejected */
	NPT_S_SAMPLED   = 3,  /* counted exactly, not sent: over the per-CPU rate (--max-rate) */
	NPT_S_FLOW_KEPT = 4,  /* sent over an empty bucket: an earlier record of its flow was sent */
	NPT_S_COUNT_FULL = 5, /* records the exact counts map had no room for: counted here only */
	NPT_S_SVC_GATED = 6,  /* counted exactly, not sent: no end at run --service's ends */
	NPT_S_MAX       = 8,
};

/* Connection map (npt_common.h `conn_slots`, read by user space from memory): one slot per
 * connection, in the set of its CLIENT end (npt_common.h npt_conn_set_of), written once by each
 * hook that knows something of it. tc ingress takes the slot at the SYN (its way[]: the SYN's
 * tuple, namespace, ISN, ingress devices); the netfilter hook, at the same connection's first
 * packet just after SNAT, finds that slot by the tuple (the line it compares is still in the
 * CPU's cache: tc ran microseconds before on this CPU) and adds the reply tuple (nat[], nat =
 * 1), or takes a slot of its own where no tc program saw the SYN. Two cold slot writes per
 * NodePort connection became one (nf_hook.bpf.c, tc.bpf.c). A set is 256 bytes: the two ways'
 * tc lines side by side (what every lookup reads: one 128-byte pair of lines, which the
 * adjacent-line prefetcher fetches together), then the two reply tuples (what only the
 * netfilter hook writes and only NAT lookups read), in one page.
 * Mirrored by nptrace/kernel/natpeers.py (NatKey, ConnSlot, ConnNat, ConnSet);
 * tests/unit/test_layout.py checks it. Addresses as in npt_event (IPv4 in the first 4
 * bytes), ports host order. npt_nat_key_eq() compares the key as 9 __u32 words: keep it 36
 * bytes with no padding. */
struct npt_nat_key {
	__u8  src[16];
	__u8  dst[16];
	__u16 sport;
	__u16 dport;
};
struct npt_conn_slot {          /* one cache line: what tc writes at the SYN */
	struct npt_nat_key key;     /* the first packet's tuple, client -> where it connected
				       (conntrack's original tuple); all zero when empty */
	__u32 netns;                /* inode of the namespace tc saw the SYN in; 0: none did */
	__u64 syn_ns;               /* when the slot was taken or the SYN last came again: the
				       older slot of a set is replaced */
	__u32 isn;                  /* the SYN's sequence number */
	__u32 in_ifindex;           /* ingress device of the SYN */
	__u32 in_ifindex2;          /* a device stacked on or under it the same SYN also crossed */
	__u8  family;               /* AF_INET / AF_INET6 of the SYN tc saw; 0: none */
	__u8  nat;                  /* 1: the set's nat[] of this way holds the reply tuple */
	__u8  syns;                 /* copies of the SYN tc saw, at most 255; 0: none */
	__u8  reported;             /* tc's NPT_REPORTED_*: one anomaly event per flow and kind */
};
struct npt_conn_nat {           /* one cache line: what the netfilter hook adds */
	struct npt_nat_key peer;    /* conntrack's reply tuple, in its packet direction */
	__u8  _pad[28];
};
struct npt_conn_set {
	struct npt_conn_slot way[2];
	struct npt_conn_nat nat[2];
};

/* Packet bytes (--pcap): struct npt_packet, then cap_len bytes of the packet as the kernel had
 * it at the hook. Written right after the event it belongs to (same ts_ns and skb: user space
 * pairs them by those, since another CPU's record may come between) and only when that event
 * went to the ring. Only with -DNPT_SNAPLEN > 0. Mirrored by nptrace/events.py RawPacket. */
enum npt_pkt_link {
	NPT_PL_ETHERNET = 1,  /* data[] starts at the Ethernet header */
	NPT_PL_IP       = 2,  /* data[] starts at the IP header: no link-layer header at this hook */
};
enum npt_pkt_dir {        /* the pcapng EPB flags' direction bits */
	NPT_PD_UNKNOWN  = 0,
	NPT_PD_INBOUND  = 1,
	NPT_PD_OUTBOUND = 2,
};
struct npt_packet {
	__u64 ts_ns;        /* the event's */
	__u64 skb;          /* the event's */
	__u32 ifindex;      /* the event's */
	__u16 type;         /* NPT_T_PACKET */
	__u16 abi;          /* NPT_ABI_VERSION */
	/* 24 */
	__u32 orig_len;     /* length of the packet from data[0] on, as the kernel had it */
	__u16 cap_len;      /* bytes that follow this header (<= NPT_SNAPLEN, the linear part) */
	__u16 ev_type;      /* the event's type (enum npt_type) */
	__u8  link;         /* enum npt_pkt_link */
	__u8  dir;          /* enum npt_pkt_dir */
	__u8  hook;         /* the event's hook (enum npt_hook) */
	__u8  _pad[5];
	/* 40: cap_len bytes of packet */
};

#endif /* NPTRACE_EVENTS_H */
