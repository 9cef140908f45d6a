/* Maps and helpers shared by every nptrace BPF program (one bcc BPF() object holds them all,
 * so every hook family writes to one ring buffer and one set of counters).
 *
 * Kernel structs are NEVER read through header layouts: bcc compiles against borrowed Debian
 * headers whose layouts differ from the running kernel. Every offset comes from BTF at load
 * time as a -DNPT_OFF_<struct>__<member> macro (nptrace/kernel/offsets.py), and every read is a
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
/* A tracer that is one node of several on one kernel (a lab's namespaces, kind's containers)
 * reports its node's namespace and its pods' alone: filter_netns holds the other nodes'
 * namespaces and their pods' (nptrace/node/scope.py fills it), whose records are neither
 * counted nor sent. A namespace it does not hold passes: a pod created a moment ago is this
 * node's as likely as another's, and a missed reset costs more than a stray line. */
#if NPT_FILTER_NETNS
BPF_HASH(filter_netns, u32, u8, 4096);
#endif

#ifndef NPT_MAX_RATE
#define NPT_MAX_RATE 0          /* records per second per CPU and kind sent to user space; 0: all */
#endif
#ifndef NPT_MAX_BURST
#define NPT_MAX_BURST 200       /* ...after a burst of this many */
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
	else            /* the map is full (NPT_MAX_COUNTS kinds): never counted nowhere */
		npt_stat_inc(NPT_S_COUNT_FULL);
}

#ifndef NPT_NF_NAT_ONLY
#define NPT_NF_NAT_ONLY 1
#endif
/* The netfilter-hook program (nf_hook.bpf.c, -DNPT_WITH_NF_HOOK) adds NAT tuples to
 * conn_slots; so do the NAT and IPVS kprobes (kprobes.bpf.c): IPVS connections, which carry
 * no nf_nat status the hook looks for, and every NAT where the kernel has no netfilter-hook
 * programs (before 6.4). The node that DNATs a connection to another node then still ties
 * the client's packets to the endpoint's (classify/rules.py). */
#define NPT_NAT_VIEW ((NPT_WITH_NF_HOOK || NPT_WITH_KPROBES) && NPT_NF_NAT_ONLY)
#ifndef NPT_FLOW_TABLE_SIZE
#define NPT_FLOW_TABLE_SIZE 65536      /* slots for tc's flows (--iface) */
#endif
#if NPT_WITH_TC || NPT_NAT_VIEW
#if NPT_NAT_VIEW
#ifndef NPT_NAT_PEERS
#define NPT_NAT_PEERS 131072    /* slots; one per connection (two with SNAT) */
#endif
#define NPT_CONN_SLOTS (NPT_FLOW_TABLE_SIZE > NPT_NAT_PEERS ? NPT_FLOW_TABLE_SIZE : NPT_NAT_PEERS)
#else
#define NPT_CONN_SLOTS NPT_FLOW_TABLE_SIZE
#endif
/* One slot per connection (struct npt_conn_slot, nptrace_events.h): what tc saw of its SYN
 * (tc.bpf.c: SYN retransmissions, asymmetric SYN-ACKs) and the two tuples of its NAT
 * (nf_hook.bpf.c), looked up by user space only when an incident needs them
 * (classify.Context.nat_peer): linking a client's tuple to its pod's costs nothing per
 * healthy connection in user space. A slot sits in the set of the connection's CLIENT end: the
 * original tuple's source, which is the reply tuple's destination unless SNAT changed it (then
 * the netfilter hook also writes the pair into the set of the SNAT end). A NAT lookup by
 * either tuple probes the sets of both its ends and compares it with both tuples of each slot
 * (npt_nat_find).
 *
 * A 2-way set-associative array, not an LRU hash: an LRU insert (free-list pop, bucket lock,
 * cold element, an eviction once full) cost 0.6-0.9 us under bpf_stats on the 6.18 VM
 * (BPF_F_NO_COMMON_LRU measured slower). What a slot write costs is its cold cache lines and a
 * TLB miss in a 16 MiB array, ~0.3 us there: tc's SYN slot and the NAT slot were two such
 * writes, in two maps, per NodePort connection; one slot per connection makes the second
 * write land on the line tc's just brought in (and its neighbour). A new connection takes its
 * own slot of its set, else the empty or the older one (npt_conn_set_of; nptrace/kernel/natpeers.py
 * computes the same set and compares the tuples). A slot survives t seconds at R new
 * connections/s with probability e^-x (1 + x), x = 2 R t / NPT_CONN_SLOTS (twice that with
 * SNAT: 99.7% (99%) for 5 s at 1k/s with 131072 slots, 82% (56%) at 10k/s); a SYN watched in
 * two namespaces (the node's and the pod's devices) takes one slot in each, in one set. Slots
 * are written without a lock; two CPUs writing one slot at the same instant can mix it, and the
 * tuple compares catch most of that (a wrong link needs both to hash to one set within
 * nanoseconds). */
#define NPT_CONN_WAYS 2
#define NPT_CONN_SETS (NPT_CONN_SLOTS / NPT_CONN_WAYS)
/* BPF_F_MMAPABLE: user space reads the slots from memory (natpeers.find); with a bpf() lookup
 * per way and direction, a storm's unlinked records cost four syscalls each. It also aligns
 * them: an mmapable array's values start on a page (kernel/bpf/arraymap.c), a plain one's at
 * offsetof(struct bpf_array, value), 312 on 6.18, so each slot would straddle a line more. */
BPF_F_TABLE("array", u32, struct npt_conn_set, conn_slots, NPT_CONN_SETS, BPF_F_MMAPABLE);

/* The set of the end addr:port (16-byte address). Mirrored by nptrace/kernel/natpeers.py
 * nat_set() (which numbers slots: set * 2); keep the two identical. */
static __always_inline u32 npt_conn_set_of(const u8 *addr, u16 port)
{
	const u32 *w = (const u32 *)addr;
	u32 h = port;
#pragma unroll
	for (int i = 0; i < 4; i++)
		h = (h ^ w[i]) * 0x9E3779B1u;
	h ^= h >> 16;
	return h % NPT_CONN_SETS;
}
#endif /* NPT_WITH_TC || NPT_NAT_VIEW */

#if NPT_NAT_VIEW
/* [0] != 0 once any NATed connection was stored: until then user space skips the lookups
 * (a node without NAT, or before kube-proxy's first connection). Written only while 0, so the
 * line stays shared among CPUs instead of bouncing once per connection. */
BPF_F_TABLE("array", u32, u64, nat_used, 1, BPF_F_MMAPABLE);

static __always_inline int npt_nat_key_eq(const struct npt_nat_key *a, const struct npt_nat_key *b)
{
	const u32 *x = (const u32 *)a, *y = (const u32 *)b;
	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3] && x[4] == y[4] &&
	       x[5] == y[5] && x[6] == y[6] && x[7] == y[7] && x[8] == y[8];
}

/* k's other tuple from one way of a set (a pointer into the map: no 36-byte copy on the
 * stack, which tcp_send_reset's program with --host has no room for), or 0. */
static __always_inline const struct npt_nat_key *npt_nat_match(const struct npt_conn_slot *s,
							       const struct npt_nat_key *reply,
							       const struct npt_nat_key *k)
{
	if (!s->nat)
		return 0;
	if (npt_nat_key_eq(&s->key, k))
		return reply;
	if (npt_nat_key_eq(reply, k))
		return &s->key;
	return 0;
}

static __always_inline const struct npt_nat_key *npt_nat_match_set(u32 i,
								   const struct npt_nat_key *k)
{
	struct npt_conn_set *c = conn_slots.lookup(&i);
	if (!c)
		return 0;
	const struct npt_nat_key *p = npt_nat_match(&c->way[0], &c->nat[0].peer, k);
	return p ? p : npt_nat_match(&c->way[1], &c->nat[1].peer, k);
}

/* The tuple k's connection has on the other side of its NAT, from the slots the netfilter
 * hook wrote, or 0. The client end is k's source or destination: both sets. */
static __always_inline const struct npt_nat_key *npt_nat_find(const struct npt_nat_key *k)
{
	const struct npt_nat_key *p = npt_nat_match_set(npt_conn_set_of(k->src, k->sport), k);
	return p ? p : npt_nat_match_set(npt_conn_set_of(k->dst, k->dport), k);
}

/* Store the pair (orig, reply) in the set of the end addr:port: into the slot of orig (tc's
 * for its SYN, or ours from an earlier packet), else over the empty or older one. */
static __always_inline void npt_nat_store(const u8 *addr, u16 port, const struct npt_nat_key *orig,
					  const struct npt_nat_key *reply, u64 now)
{
	u32 i = npt_conn_set_of(addr, port);
	struct npt_conn_set *c = conn_slots.lookup(&i);
	if (!c)
		return;
	int w;
	if (npt_nat_key_eq(&c->way[0].key, orig)) {
		w = 0;
	} else if (npt_nat_key_eq(&c->way[1].key, orig)) {
		w = 1;
	} else {
		w = c->way[0].syn_ns <= c->way[1].syn_ns ? 0 : 1;
		struct npt_conn_slot *s = &c->way[w];
		s->key = *orig;
		s->netns = 0;       /* no SYN tc saw: tc's lookups pass it by */
		s->syn_ns = now;
		s->family = 0;
		s->syns = 0;
		s->reported = 0;
	}
	c->nat[w].peer = *reply;
	c->way[w].nat = 1;
}

/* The pair in the set of the client end, and in the set of the SNAT address too when SNAT
 * moved the client end of the reply tuple; then the flag that lets lookups start. */
static __always_inline void npt_nat_store_pair(const struct npt_nat_key *orig,
					       const struct npt_nat_key *reply)
{
	u64 now = bpf_ktime_get_ns();
	npt_nat_store(orig->src, orig->sport, orig, reply, now);
	const u64 *c = (const u64 *)orig->src, *r = (const u64 *)reply->dst;
	if (orig->sport != reply->dport || c[0] != r[0] || c[1] != r[1])
		npt_nat_store(reply->dst, reply->dport, orig, reply, now);
	u32 zero = 0;
	u64 *used = nat_used.lookup(&zero);
	if (used && !*used)
		*used = 1;
}
#endif /* NPT_NAT_VIEW */

/* Flow keys: npt_rate_ok's per-flow sampling and npt_count_cause's flow facts */
static __always_inline u32 npt_end_hash(const u8 *addr, u16 port)
{
	const u32 *w = (const u32 *)addr;
	u32 h = port * 0x9E3779B1u;
	h = (h ^ w[0]) * 0x85EBCA77u;
	h = (h ^ w[1]) * 0xC2B2AE3Du;
	h = (h ^ w[2]) * 0x9E3779B1u;
	h = (h ^ w[3]) * 0x85EBCA77u;
	return h ^ (h >> 15);
}

static __always_inline u64 npt_tuple_hash(const u8 *s, u16 sp, const u8 *d, u16 dp)
{
	u32 a = npt_end_hash(s, sp), b = npt_end_hash(d, dp);
	return a < b ? (u64)a << 32 | b : (u64)b << 32 | a;
}

/* A connection's key, the same from either direction, in every namespace and on both sides
 * of a NAT: the smaller hash of its two conntrack tuples (original and reply). A record with
 * the conntrack entry has both; one without (the client's, a pod's own stack) has its own
 * tuple and, when the netfilter hook stored the connection's NAT, the other one from
 * conn_slots. 0: no ports, no flow (sampled per record). */
static __always_inline u64 npt_flow_hash(struct npt_event *e)
{
	u64 h, p;
	if (e->flags & NPT_F_HAS_CT) {
		h = npt_tuple_hash(e->ct_osrc, e->ct_osport, e->ct_odst, e->ct_odport);
		p = npt_tuple_hash(e->ct_rsrc, e->ct_rsport, e->ct_rdst, e->ct_rdport);
	} else {
		if (!e->sport && !e->dport)
			return 0;
		h = p = npt_tuple_hash(e->saddr, e->sport, e->daddr, e->dport);
#if NPT_NAT_VIEW
		u32 zero = 0;
		u64 *used = nat_used.lookup(&zero);
		if (used && *used) {
			struct npt_nat_key k = {};
			__builtin_memcpy(k.src, e->saddr, 16);
			__builtin_memcpy(k.dst, e->daddr, 16);
			k.sport = e->sport;
			k.dport = e->dport;
			const struct npt_nat_key *peer = npt_nat_find(&k);
			if (!peer) {             /* a packet of the other direction */
				__builtin_memcpy(k.src, e->daddr, 16);
				__builtin_memcpy(k.dst, e->saddr, 16);
				k.sport = e->dport;
				k.dport = e->sport;
				peer = npt_nat_find(&k);
			}
			if (peer)
				p = npt_tuple_hash(peer->src, peer->sport, peer->dst, peer->dport);
		}
#endif
	}
	u64 k = h < p ? h : p;
	return k ? k : 1;
}

#if NPT_MAX_RATE
/* Storm protection, a token bucket per kind (the counter key: type, hook, reason, interface,
 * netns) and CPU: a burst of NPT_MAX_BURST records goes out at once (a hundred clients failing
 * together are all labeled), then NPT_MAX_RATE a second; the rest is only counted (exactly).
 * A person needs a sample of a 100k-resets/s storm, not all of it, and each record costs user
 * space tens of us; the counts map keeps the totals, and a storm of one kind never starves the
 * records of another. User space passes the node-wide --max-rate / --max-burst divided by the
 * CPUs (config.per_cpu): per-CPU buckets need no atomics, and a 64-CPU node must not send 64
 * times what a 2-CPU one does. Credit is kept in nanoseconds: a record costs 1e9 / NPT_MAX_RATE.
 *
 * The sample is of FLOWS, not of records: buckets per kind alone kept one kind of a flow's
 * records and dropped another, and user space then saw a connection's consequence without
 * its cause (a client's reset received, the conntrack-INVALID drop behind it sampled out:
 * labeled peer_reset, about 5% of a 100-client burst). The first record of a flow decides for
 * it, in sample_flows, for NPT_SAMPLE_HOLD_NS: a flow sent keeps sending (its records may take
 * its kind's bucket up to one burst below zero, so the rate stays bounded), a flow not sent
 * stays unsent even when its other kinds have credit. */
#define NPT_RATE_COST (1000000000ULL / NPT_MAX_RATE)
#define NPT_RATE_CAP (NPT_RATE_COST * NPT_MAX_BURST)
struct npt_rate {
	u64 last_ns;
	s64 credit_ns;      /* below zero: records of flows already sent, taken on credit */
};
BPF_TABLE("lru_percpu_hash", struct npt_count_key, struct npt_rate, rate, 4096);

#ifndef NPT_SAMPLE_FLOWS
#define NPT_SAMPLE_FLOWS 16384   /* slots, a power of two */
#endif
/* How long a flow's decision holds: the classifier's max_hold (5 s), the longest it waits for
 * the records of one incident. */
#define NPT_SAMPLE_HOLD_NS 5000000000ULL
/* One slot per flow hash, direct-mapped and shared by the CPUs (a flow's records come from
 * several: the client's, the node's, the pod's softirqs). Written without a lock: a race of
 * two flows on one slot costs one of them its coherence, never a count. */
struct npt_sample_slot {
	u64 key;            /* npt_flow_hash, 0: empty */
	u64 ns;             /* when its first record was decided; low bit 1: that one was sent */
};
BPF_ARRAY(sample_flows, struct npt_sample_slot, NPT_SAMPLE_FLOWS);

/* 1: send the record; 0: only counted (NPT_S_SAMPLED). */
static __always_inline int npt_rate_ok(struct npt_event *e, u64 fk)
{
	u64 now = e->ts_ns;
	struct npt_sample_slot *s = 0;
	int follow = -1;                 /* the flow's decision: 1 sent, 0 not, -1 none yet */
	if (fk) {
		u32 i = (u32)(fk ^ (fk >> 29)) & (NPT_SAMPLE_FLOWS - 1);
		s = sample_flows.lookup(&i);
		if (s && s->key == fk) {
			/* signed: CPUs' records arrive a few us out of time order, and a flow's
			 * record stamped just before the one that decided still follows it */
			s64 age = (s64)(now - (s->ns & ~1ULL));
			if (age < (s64)NPT_SAMPLE_HOLD_NS && age > -(s64)NPT_SAMPLE_HOLD_NS)
				follow = s->ns & 1;
		}
	}
	if (follow == 0)
		return 0;

	struct npt_count_key rk = {};
	struct npt_rate fresh = { .last_ns = now, .credit_ns = NPT_RATE_CAP };
	npt_count_key_of(&rk, e);
	struct npt_rate *r = rate.lookup_or_try_init(&rk, &fresh);
	int send = 1;
	if (r) {
		s64 credit = r->credit_ns;
		if (now > r->last_ns)
			credit += now - r->last_ns;
		if (credit > (s64)NPT_RATE_CAP)
			credit = NPT_RATE_CAP;
		r->last_ns = now;
		if (credit >= (s64)NPT_RATE_COST) {
			credit -= NPT_RATE_COST;
		} else if (follow == 1 && credit - (s64)NPT_RATE_COST >= -(s64)NPT_RATE_CAP) {
			credit -= NPT_RATE_COST;
			npt_stat_inc(NPT_S_FLOW_KEPT);
		} else {
			send = 0;
		}
		r->credit_ns = credit;
	}
	if (s && follow < 0) {
		s->key = fk;
		s->ns = (now & ~1ULL) | send;
	}
	return send;
}
#endif


/* drop_reasons values (filled by nptrace/kernel/loader.py from the reason names): bit 0 the
 * reason is worth a record, bit 1 the rules read the dropped packet's source (the netfilter
 * verdicts: keep the client address in the cause key), bit 2 the reason is weak (evidence
 * only: never the flow's causal fact). */
#define NPT_DR_EVENT 1
#define NPT_DR_SRC   2
#define NPT_DR_WEAK  4

#ifndef NPT_MAX_CAUSE_KEYS
#define NPT_MAX_CAUSE_KEYS 16384
#endif
#ifndef NPT_FACT_FLOWS
#define NPT_FACT_FLOWS 16384    /* slots, a power of two */
#endif
/* How long a flow's causal fact is kept: the classifier's window_ns (30 s) */
#define NPT_FACT_HOLD_NS 30000000000ULL
/* A record this long after its flow's fact is in a later incident (the classifier's hold_ns:
 * an incident is cut once its flow is quiet for a second; an approximation, the kernel does
 * not see the quiet) */
#define NPT_INCIDENT_HOLD_NS 1000000000ULL

/* Every record counted under its cause key (nptrace_events.h struct npt_cause_key): user space
 * labels each key with the classifier's rules once, so the cause counters are exact at any
 * record rate, and the sample sent to the ring only adds evidence. Bounded: a key that finds
 * the map full is counted in cause_other[type] (exported as cause="other"). */
BPF_PERCPU_HASH(cause_counts, struct npt_cause_key, struct npt_cause_val, NPT_MAX_CAUSE_KEYS);
BPF_PERCPU_ARRAY(cause_other, struct npt_cause_val, NPT_T_MAX);

/* Per connection, its first causal record (type, hook, reason, SYN/ACK bits): a later record of the flow
 * (the client's reset received, a retransmitted SYN, the RST on the wire) is counted with it,
 * and user space gives it the better-ranked of its own label and that one's, as the classifier
 * names an incident by its best label. Direct-mapped by flow hash and shared by the CPUs, like
 * sample_flows and for the same reason (an LRU insert per record costs ~0.6 us, PLATFORM.md);
 * written without a lock: a race of two flows on one slot costs one of them its fact, never
 * a count. */
struct npt_fact_slot {
	u64 key;            /* npt_flow_hash, 0: empty */
	u64 ns;
	u32 reason;
	u16 type;
	u8  hook;
	u8  tcpflags;       /* its SYN/ACK bits (npt_cause_key.tcpflags) */
	u32 srv_end;        /* npt_end_hash of its server end: orients the flow's later records */
	u32 srv_end2;       /* ...and of the endpoint behind a DNAT (else srv_end) */
	u32 key_hash;       /* npt_cause_key_hash of its own cause key */
	u32 _pad;
};
BPF_ARRAY(flow_facts, struct npt_fact_slot, NPT_FACT_FLOWS);

static __always_inline int npt_causal_type(u16 t)
{
	return t == NPT_T_DROP || t == NPT_T_RST_SENT || t == NPT_T_ICMP_UNREACH ||
	       t == NPT_T_ASYM_IFACE || t == NPT_T_ASYM_SRC;
}

/* The cause key of a record: the packet's tuple with its client end reduced (its port always,
 * its address unless keep_src), the server end kept for the Service lookup. Which end is the
 * client (cli_src): the flow fact's, else npt_client_is_src(), which follows
 * nptrace/sinks/collapse.py server_end(): conntrack's original source when DNATed; else the
 * sender of a SYN (a sent reset answering it goes to it), the receiver of a SYN-ACK; else the
 * end with the higher port. */
/* Hash of a cause key, 22 words. Mirrored by nptrace/kernel/causekeys.py key_hash(); keep
 * the two identical. Never 0. */
static __always_inline u32 npt_cause_key_hash(const struct npt_cause_key *k)
{
	const u32 *w = (const u32 *)k;
	u32 h = 0x811C9DC5u;
#pragma unroll
	for (int i = 0; i < (int)(sizeof(*k) / 4); i++)
		h = (h ^ w[i]) * 0x9E3779B1u;
	h ^= h >> 16;
	return h ? h : 1;
}

/* 1 when the rules read the client address of a record of this type and reason. */
static __always_inline int npt_keeps_src(u16 type, u32 reason)
{
	if (type == NPT_T_DROP) {
		u32 r = reason < NPT_MAX_REASONS ? reason : NPT_MAX_REASONS - 1;
		u8 *dr = drop_reasons.lookup(&r);
		return dr && (*dr & NPT_DR_SRC);
	}
	if (type == NPT_T_ICMP_UNREACH || type == NPT_T_WIRE_ICMP) {
		u32 code = reason & 0xff;
		return reason >> 8 == 3 && (code == 3 || code == 9 || code == 10 || code == 13);
	}
	return 0;
}

/* keep_src: the record's own rules read the client address, or its flow's prior's do (the
 * prior is labeled with this key's tuple). */
static __always_inline void npt_cause_key_of(struct npt_cause_key *k, struct npt_event *e,
					     int cli_src, int keep_src)
{
	if (cli_src) {
		if (keep_src)
			__builtin_memcpy(k->saddr, e->saddr, 16);
		__builtin_memcpy(k->daddr, e->daddr, 16);
		k->dport = e->dport;
	} else {
		__builtin_memcpy(k->saddr, e->saddr, 16);
		if (keep_src)
			__builtin_memcpy(k->daddr, e->daddr, 16);
		k->sport = e->sport;
	}
	if ((e->flags & NPT_F_HAS_CT) && (e->ct_status & NPT_IPS_DST_NAT)) {
		__builtin_memcpy(k->odst, e->ct_odst, 16);
		k->oport = e->ct_odport;
	}
	k->netns = e->netns;
	k->ifindex = e->ifindex;
	k->reason = e->reason;
	k->type = e->type;
	k->family = e->family;
	k->hook = e->hook;
	k->dir = e->dir;
	k->flags = e->flags & (NPT_F_HAS_CT | NPT_F_ENCAP | NPT_F_HAS_SOCK | NPT_F_ICMP_QUOTE);
	k->tcpflags = (e->type == NPT_T_RST_SENT ? (u8)e->aux : e->tcpflags) & 0x12;
	k->ct_bits = (e->ct_status & NPT_IPS_SRC_NAT ? NPT_CK_SNAT : 0) |
		     (e->ct_status & NPT_IPS_DST_NAT ? NPT_CK_DNAT : 0);
}

/* 1 when the record's source is the client end of its connection, by the record alone. */
static __always_inline int npt_client_is_src(struct npt_event *e)
{
	u8 fl = (e->type == NPT_T_RST_SENT ? (u8)e->aux : e->tcpflags) & 0x12;  /* SYN|ACK */
	if ((e->flags & NPT_F_HAS_CT) && (e->ct_status & NPT_IPS_DST_NAT))
		return e->sport == e->ct_osport && *(u32 *)e->saddr == *(u32 *)e->ct_osrc;
	if (fl == 0x02)
		return e->type != NPT_T_RST_SENT;
	if (fl == 0x12)
		return e->type == NPT_T_RST_SENT;
	return e->sport > e->dport;
}

/* Count the record under its cause key; the value, to count it sent, or 0 (cause_other).
 * A record of a flow with a live fact takes its client end from the fact: the server end the
 * causal record named (the client's drop of a reset to a closed port has ports and flags that
 * alone would name the client as the server, one key per connection). */
static __always_inline struct npt_cause_val *npt_count_cause(struct npt_event *e, u64 fk)
{
	u16 t = e->type;
	if (t == NPT_T_SYNACK_RETX || t == NPT_T_NF_VIEW || e->hook == NPT_H_KPROBE)
		return 0;                /* evidence only: never a cause of their own */
	struct npt_cause_key k = {};
	struct npt_fact_slot *f = 0;
	int live = 0, cli_src;
	u8 fl = (t == NPT_T_RST_SENT ? (u8)e->aux : e->tcpflags) & 0x12;
	u32 src_end = npt_end_hash(e->saddr, e->sport);
	if (fk) {
		u32 i = (u32)(fk ^ (fk >> 31)) & (NPT_FACT_FLOWS - 1);
		f = flow_facts.lookup(&i);
		if (f) {
			s64 age = (s64)(e->ts_ns - f->ns);
			live = f->key == fk && age < (s64)NPT_FACT_HOLD_NS &&
			       age > -(s64)NPT_FACT_HOLD_NS;
		}
	}
	cli_src = live ? src_end != f->srv_end && src_end != f->srv_end2 : npt_client_is_src(e);
	int prior = live && (f->type != t || f->reason != e->reason || f->hook != e->hook ||
			     f->tcpflags != fl);
	npt_cause_key_of(&k, e, cli_src, npt_keeps_src(t, e->reason) ||
			 (prior && npt_keeps_src(f->type, f->reason)));
	if (prior) {
		k.prior_type = f->type;
		k.prior_reason = f->reason;
		k.prior_hook = f->hook;
		k.prior_tcpflags = f->tcpflags;
		k.prior_late = (s64)(e->ts_ns - f->ns) > (s64)NPT_INCIDENT_HOLD_NS;
		k.prior_key = f->key_hash;
	}
	if (!live && f && npt_causal_type(t)) {
		int weak = 0;
		if (t == NPT_T_DROP) {
			u32 r = e->reason < NPT_MAX_REASONS ? e->reason : NPT_MAX_REASONS - 1;
			u8 *dr = drop_reasons.lookup(&r);
			weak = dr && (*dr & NPT_DR_WEAK);
		}
		if (!weak) {
			f->key = fk;
			f->ns = e->ts_ns;
			f->reason = e->reason;
			f->type = t;
			f->hook = e->hook;
			f->tcpflags = fl;
			f->key_hash = npt_cause_key_hash(&k);
			if ((e->flags & NPT_F_HAS_CT) && (e->ct_status & NPT_IPS_DST_NAT)) {
				f->srv_end = npt_end_hash(e->ct_odst, e->ct_odport);
				f->srv_end2 = npt_end_hash(e->ct_rsrc, e->ct_rsport);
			} else {
				f->srv_end = cli_src ? npt_end_hash(e->daddr, e->dport) : src_end;
				f->srv_end2 = f->srv_end;
			}
		}
	}
	struct npt_cause_val zero = {}, *v = cause_counts.lookup_or_try_init(&k, &zero);
	if (!v) {
		u32 idx = t < NPT_T_MAX ? t : 0;
		v = cause_other.lookup(&idx);
	}
	if (v)
		v->counted++;
	return v;
}

/* Namespace, port and host filters (a port or host on either end of the tuple). 1 = keep. */
static __always_inline int npt_wanted(struct npt_event *e)
{
#if NPT_FILTER_NETNS
	if (e->netns) {
		u32 ns = e->netns;
		if (filter_netns.lookup(&ns))
			return 0;
	}
#endif
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

/* `run --service` in the kernel (-DNPT_FILTER_SVC=1; nptrace/kernel/loader.py
 * set_service_ends fills it from the user-space resolver, classify/filters.py ServiceSel, and
 * refills it as the node's rules change): the Service's ends as {addr, port}: an endpoint or
 * frontend addr:port, a frontend address with port 0 (ClusterIP, external and LB IPs: any
 * port), the zero address with a port (a NodePort, on any node address). A record with an end
 * there (either end of its tuple, or of its conntrack entry's original destination or reply
 * source: before and after DNAT) is sent; the others are counted exactly (npt_count,
 * npt_count_cause) and not sent: NPT_S_SVC_GATED. User space's filter stays the exact check.
 * Cost when on: up to 12 hash lookups a record that would be sent; off: none. */
#if NPT_FILTER_SVC
struct npt_svc_key { u8 addr[16]; u16 port; u16 _pad; };
BPF_HASH(filter_svc, struct npt_svc_key, u8, 4096);

static __always_inline int npt_svc_end(const u8 *addr, u16 port)
{
	struct npt_svc_key k = {};
	__builtin_memcpy(k.addr, addr, 16);
	k.port = port;
	if (filter_svc.lookup(&k))
		return 1;
	k.port = 0;
	if (filter_svc.lookup(&k))
		return 1;
	__builtin_memset(k.addr, 0, 16);
	k.port = port;
	return filter_svc.lookup(&k) != 0;
}

static __always_inline int npt_svc_wanted(struct npt_event *e)
{
	if (npt_svc_end(e->saddr, e->sport) || npt_svc_end(e->daddr, e->dport))
		return 1;
	return (e->flags & NPT_F_HAS_CT) &&
	       (npt_svc_end(e->ct_odst, e->ct_odport) || npt_svc_end(e->ct_rsrc, e->ct_rsport));
}
#else
#define npt_svc_wanted(e) 1
#endif

/* Count the event exactly, then copy it to the ring buffer if there is room. */
static __always_inline void npt_emit(struct npt_event *e)
{
	if (!npt_wanted(e)) {
		npt_stat_inc(NPT_S_FILTERED);
		return;
	}
	npt_count(e);
	u64 fk = npt_flow_hash(e);
	struct npt_cause_val *cv = npt_count_cause(e, fk);
	if (!npt_svc_wanted(e)) {
		npt_stat_inc(NPT_S_SVC_GATED);
		return;
	}
#if NPT_MAX_RATE
	if (!npt_rate_ok(e, fk)) {
		npt_stat_inc(NPT_S_SAMPLED);
		return;
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
		if (cv)
			cv->sent++;
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
/* The skb's conntrack entry (skb->_nfct without its ctinfo bits), or 0. */
static __always_inline void *npt_ct_of(void *skb)
{
#if NPT_HAVE_sk_buff___nfct
	unsigned long nfct = 0;
	NPT_READ(nfct, skb, NPT_OFF_sk_buff___nfct);
	return (void *)(nfct & ~7UL);
#else
	return 0;
#endif
}

/* Both tuples and the status of conntrack entry ct (0: nothing). */
static __always_inline void npt_read_ct_of(struct npt_event *e, void *ct)
{
#if NPT_HAVE_sk_buff___nfct
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

static __always_inline void npt_read_ct(struct npt_event *e, void *skb)
{
	npt_read_ct_of(e, npt_ct_of(skb));
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
	} else if (l4 == NPT_IPPROTO_ICMPV6 && e->family == NPT_AF_INET6) {
		/* ICMPv6 destination unreachable (1) / time exceeded (3) quote the IPv6 header
		 * (RFC 4443 2.4): as above, the quoted TCP packet's tuple, outer_* the ICMPv6 one's */
		u8 type = 0, code = 0, inner_l4 = 0;
		NPT_READ(type, l4h, 0);
		NPT_READ(code, l4h, 1);
		e->reason = (u32)type << 8 | code;
		if (type != 1 && type != 3)
			return -1;
		void *qip = l4h + 8;
		NPT_READ(inner_l4, qip, 6);
		if (inner_l4 != NPT_IPPROTO_TCP)
			return -1;
		__builtin_memcpy(e->outer_saddr, e->saddr, 16);
		__builtin_memcpy(e->outer_daddr, e->daddr, 16);
		bpf_probe_read_kernel(e->saddr, 16, qip + 8);
		bpf_probe_read_kernel(e->daddr, 16, qip + 24);
		u16 p = 0;
		NPT_READ(p, qip + 40, 0); e->sport = bpf_ntohs(p);
		NPT_READ(p, qip + 40, 2); e->dport = bpf_ntohs(p);
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
		void *iip = inner + 14, *ith;
		u8 i6 = bpf_ntohs(etype) == NPT_ETH_P_IPV6;   /* IPv6 pods over an IPv4 underlay */
		if (bpf_ntohs(etype) != NPT_ETH_P_IP && !i6)
			return l4;
		NPT_READ(vihl, iip, 0);
		NPT_READ(il4, iip, i6 ? 6 : 9);   /* IPv6: no extension headers walked */
		if (il4 != NPT_IPPROTO_TCP)
			return l4;
		__builtin_memcpy(e->outer_saddr, e->saddr, 16);
		__builtin_memcpy(e->outer_daddr, e->daddr, 16);
		if (i6) {   /* the tuple's family is the inner one; outer_* stay IPv4 (NPT_F_ENCAP) */
			bpf_probe_read_kernel(e->saddr, 16, iip + 8);
			bpf_probe_read_kernel(e->daddr, 16, iip + 24);
			e->family = NPT_AF_INET6;
			ith = iip + 40;
		} else {
			bpf_probe_read_kernel(e->saddr, 4, iip + 12);
			bpf_probe_read_kernel(e->daddr, 4, iip + 16);
			ith = iip + (vihl & 0xf) * 4;
		}
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

/* An event's tuple turned around: the reply's, or a reset's about the packet it answers. */
static __always_inline void npt_reverse(struct npt_event *e)
{
	u8 a[16];
	__builtin_memcpy(a, e->saddr, 16);
	__builtin_memcpy(e->saddr, e->daddr, 16);
	__builtin_memcpy(e->daddr, a, 16);
	u16 p = e->sport;
	e->sport = e->dport;
	e->dport = p;
}

/* A reset the TCP stack sends about a packet, not from a connection: no socket (nothing
 * listens; since 6.10 tcp:tcp_send_reset fires for these, before only the kprobe on
 * tcp_v4_send_reset / tcp_v6_send_reset sees them, bpf/kprobes.bpf.c), or a LISTEN socket
 * answering a segment of a connection it never had. The RST's tuple is the offending
 * packet's, reversed; aux = the flags of what was answered (a SYN: no listener). */
static __always_inline int npt_emit_skb_reset(void *skb, void *sk, u8 state, u32 reason)
{
	struct npt_event e;
	npt_init(&e, NPT_T_RST_SENT, NPT_H_TCP_SEND_RST);
	if (npt_read_skb(&e, skb) != NPT_IPPROTO_TCP)
		return 0;
	e.aux = e.tcpflags;
	if (!e.netns)
		e.netns = npt_netns_of_sk(sk);
	if (sk)
		e.flags |= NPT_F_HAS_SOCK;
	npt_reverse(&e);
	e.l4proto = NPT_IPPROTO_TCP;
	e.tcpflags = 0x04;
	e.state = state;
	e.reason = reason;
	e.dir = NPT_D_LOCAL;
	npt_emit(&e);
	return 0;
}

#endif /* NPT_COMMON_H */
