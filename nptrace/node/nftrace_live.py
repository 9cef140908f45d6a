"""nf_tables tracing for the flows of interest, and the rule it names behind a netfilter drop.

Evaluating a dumped ruleset (nptrace/services) can name the rule that probably dropped a packet;
an nf_tables trace names the rule that did. Tracing every packet would cost one netlink
message per rule each packet meets, so nptrace traces only flows of interest: on a
namespace's first netfilter drop it adds its own table there,

    table inet nptrace_trace   (prerouting and output, priority raw - 10)
        ip daddr . tcp dport @want4  limit rate 50/second  meta nftrace set 1

and puts the dropped flow's destination (before and after DNAT) in the set for a minute.
The client's retransmitted SYN or next attempt is then traced, and the rule that drops it
is read from the trace (table, chain, handle, with the rule's text from `nft -a list chain`).
The first drop of a destination is named from the ruleset and says it was not traced.
iptables-legacy rules are invisible to nf_tables tracing: the answer says so.

The classifier sees this only as Context.nf_rule answers (plain dicts), recorded for replay.
"""
from __future__ import annotations

import collections
import errno
import ipaddress
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from nptrace.text import hostport
from nptrace.node import nftrace
from nptrace.node.nlmsg import (NFGENMSG_LEN, NLM_F_DUMP, NLM_F_REQUEST, NLMSG, NLMSG_DONE,
                                NLMSG_ERROR, attrs, error_of, messages, request)
from nptrace.node.rules_source import RulesSourceError, in_netns, is_xt, nft_name, run_in_netns

TABLE = "nptrace_trace"
ARM_FOR_S = 60          # a destination stays traced this long after its last drop
TRACE_RATE = "50/second"  # packets traced per second and namespace, whatever the set holds
SET_SIZE = 1024
ARMS_PER_S = 10         # `nft add element` forks; a flood of drops must not fork per event
SOCK_RCVBUF = 1 << 20
MAX_NAMESPACES = 1024   # namespaces with a session or a reason kept (one fd per session)


# Table and chain names in trace messages come from the kernel, any bytes but NUL: one that
# is not an nft identifier (rules_source.nft_name) is never an nft argument, and the answer
# says the rule text was not read.
NFT_FAMILIES = frozenset(nftrace.NFPROTO_NAMES.values())


def table_script() -> str:
    """One nft transaction: (re)create the table, leaving no older copy of it behind."""
    sets, rules = [], []
    for fam, addr, typ in (("4", "ip", "ipv4_addr"), ("6", "ip6", "ipv6_addr")):
        sets.append(f"set want{fam} {{ type {typ} . inet_service; flags timeout; size {SET_SIZE}; }}")
        rules.append(f"{addr} daddr . tcp dport @want{fam} limit rate {TRACE_RATE} meta nftrace set 1")
    chains = [f"chain {name} {{ type filter hook {hook} priority raw - 10; policy accept; "
              + "; ".join(rules) + "; }"
              for name, hook in (("pre", "prerouting"), ("out", "output"))]
    body = "; ".join(sets + chains)
    return (f"table inet {TABLE} {{}}; delete table inet {TABLE}; "
            f"table inet {TABLE} {{ comment \"{owner_comment()}\"; {body}; }}")


# --- leftovers of a killed run -----------------------------------------------------------------
_NFT_MSG_NEWTABLE, _NFT_MSG_GETTABLE = 0, 1      # linux/netfilter/nf_tables.h
_NFNL_SUBSYS_NFTABLES = 10
_NFTA_TABLE_NAME = 1
_NFPROTO_INET = 1


_NFTA_TABLE_USERDATA = 6
_NFTNL_UDATA_TABLE_COMMENT = 0


def _comment(udata: bytes) -> str:
    """The comment in a table's userdata (libnftnl udata: type, length, value TLVs)."""
    off = 0
    while off + 2 <= len(udata):
        typ, ln = udata[off], udata[off + 1]
        val = udata[off + 2:off + 2 + ln]
        if typ == _NFTNL_UDATA_TABLE_COMMENT:
            return val.split(b"\0", 1)[0].decode(errors="replace")
        off += 2 + ln
    return ""


def parse_tables(data: bytes) -> tuple[list[tuple[int, str, str]], bool]:
    """([(family, name, comment)] of the NFT_MSG_NEWTABLE messages in one recv, dump
    finished). Never raises on a short or odd datagram (an NLMSG_ERROR becomes its OSError)."""
    out = []
    for mtype, start, end in messages(data):
        if mtype == NLMSG_DONE:
            return out, True
        if mtype == NLMSG_ERROR:
            raise error_of(data, start)
        if mtype != (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWTABLE:
            continue
        if end - start < NLMSG.size + NFGENMSG_LEN:
            continue
        family = data[start + NLMSG.size]
        name = comment = None
        for atype, payload in attrs(data, start + NLMSG.size + NFGENMSG_LEN, end):
            if atype == _NFTA_TABLE_NAME:
                name = payload.split(b"\0", 1)[0].decode(errors="replace")
            elif atype == _NFTA_TABLE_USERDATA:
                comment = _comment(payload)
        if name is not None:
            out.append((family, name, comment or ""))
    return out, False


def _trace_table_owner_here() -> str | None:
    """The comment of `table inet nptrace_trace` in this thread's namespace ("" without one),
    None when there is no such table. An nfnetlink table dump: no fork of nft per namespace."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       nftrace.NETLINK_NETFILTER) as s:
        s.settimeout(2.0)
        s.bind((0, 0))
        s.send(request((_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETTABLE,
                       NLM_F_REQUEST | NLM_F_DUMP, 1, struct.pack("=BBH", 0, 0, 0)))
        found, done = None, False
        while not done:
            got, done = parse_tables(s.recv(1 << 16))
            for fam, name, comment in got:
                if fam == _NFPROTO_INET and name == TABLE:
                    found = comment
        return found


def owner_comment(pid: int | None = None) -> str:
    """`nptrace <pid> <start time>`: the comment our trace tables carry, so a later start can
    tell a dead run's table from a live one's (a pid alone may have been reused)."""
    from nptrace.kernel.tc import start_time
    pid = os.getpid() if pid is None else pid
    return f"nptrace {pid} {start_time(pid) or 0}"


def owner_alive(comment: str, node_lock: bool = True) -> bool:
    """Does the run named by a table comment still run? A table with no owner (an older
    nptrace, or not a comment of ours) counts as dead only under the node-wide lock, which
    proves no other nptrace runs here; a run with a private lock file (NPTRACE_LOCK_FILE:
    tests, benchmarks) leaves such tables alone."""
    from nptrace.kernel.tc import process_alive
    parts = comment.split()
    if len(parts) != 3 or parts[0] != "nptrace" or not parts[1].isdigit() \
            or not parts[2].isdigit():
        return not node_lock
    pid, start = int(parts[1]), int(parts[2])
    return pid != os.getpid() and process_alive(pid, start or None)


def sweep_tables(namespaces, log=lambda msg: None, *, node_lock: bool = True) -> list[str]:
    """Remove `table inet nptrace_trace` that a killed run left in each namespace of
    `namespaces` (names; None is the host): left in place it would go on marking packets for
    tracing. A table whose comment names a run that still runs is left alone. Returns where
    one was removed; a namespace that cannot be read is skipped."""
    removed = []
    for ns in namespaces:
        try:
            owner = in_netns(ns, _trace_table_owner_here)
            if owner is None or owner_alive(owner, node_lock):
                continue
            run_in_netns(ns, ["nft", f"delete table inet {TABLE}"], check=False)
        except (OSError, RulesSourceError):
            continue
        removed.append("the host namespace" if ns is None else f"netns {ns}")
    if removed:
        log(f"removed table inet {TABLE} left by a killed nptrace run in {', '.join(removed)}")
    return removed


def _trace_socket() -> socket.socket:
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK
                      | socket.SOCK_CLOEXEC, nftrace.NETLINK_NETFILTER)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_RCVBUF)
        s.bind((0, 1 << (nftrace.NFNLGRP_NFTRACE - 1)))
    except OSError:
        s.close()
        raise
    return s


@dataclass
class NsTrace:
    """Tracing in one network namespace (None: the host's): its table, set and socket."""

    netns: str | None
    sock: socket.socket
    book: nftrace.TraceBook = field(default_factory=lambda: nftrace.TraceBook(TABLE))
    armed: dict = field(default_factory=dict)      # (addr, port) -> time armed
    _chains: dict = field(default_factory=dict)    # (family, table, chain) -> (time, lines)

    @classmethod
    def open(cls, netns: str | None) -> "NsTrace":
        run_in_netns(netns, ["nft", table_script()])
        return cls(netns, in_netns(netns, _trace_socket))

    def arm(self, addr: str, port: int, now: float) -> bool:
        """Trace addr:port's packets from now on; False when it was armed already (or the
        address is not one: it goes into an nft command)."""
        last = self.armed.get((addr, port))
        if last is not None and now - last < ARM_FOR_S / 2:
            return False
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            return False
        port = int(port)
        if not 0 <= port <= 0xFFFF:
            return False
        fam = str(ip.version)
        run_in_netns(self.netns, ["nft", f"add element inet {TABLE} want{fam} "
                                 f"{{ {ip} . {port} timeout {ARM_FOR_S}s }}"])
        self.armed[(addr, port)] = now
        if len(self.armed) > SET_SIZE:
            self.armed.pop(next(iter(self.armed)))
        return True

    malformed: int = 0      # datagrams that could not be decoded: counted and skipped
    overruns: int = 0       # ENOBUFS: the kernel dropped trace messages for this socket

    def drain(self, now: float) -> int:
        n = 0
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return n
            except OSError as e:
                if e.errno == errno.ENOBUFS:    # the kernel dropped messages; the next ones count
                    self.overruns += 1
                    continue
                return n
            try:
                self.book.feed(nftrace.decode(data), now)
            except Exception:
                # decode() is fuzzed never to raise; should a datagram still break it, the
                # reader thread must go on: count it, skip it
                self.malformed += 1
                continue
            n += 1

    def rule_line(self, d: nftrace.TracedDrop, now: float) -> tuple[str | None, int]:
        """(nft's text of the traced rule, its 1-based position in the chain), read with
        `nft -a list chain` and kept a few seconds (rules change, handles do not repeat)."""
        key = (d.family, d.table, d.chain)
        if d.family not in NFT_FAMILIES or nft_name(d.table) is None or nft_name(d.chain) is None:
            return None, 0     # not an nft identifier: never an nft argument (see nft_name)
        hit = self._chains.get(key)
        if hit is None or now - hit[0] > 5.0:
            lines = []
            try:
                out = run_in_netns(self.netns, ["nft", "-a", "list", "chain", *key]).stdout
                lines = [ln.strip() for ln in out.splitlines()
                         if "# handle " in ln and not ln.strip().startswith(("chain ", "table "))]
            except RulesSourceError:
                pass
            hit = self._chains[key] = (now, lines)
            if len(self._chains) > 256:
                self._chains.pop(next(iter(self._chains)))
        for pos, ln in enumerate(hit[1], 1):
            text, _, h = ln.rpartition("# handle ")
            if h.strip() == str(d.handle):
                return text.strip(), pos
        return None, 0

    def close(self) -> None:
        self.sock.close()
        try:
            run_in_netns(self.netns, ["nft", f"delete table inet {TABLE}"], check=False)
        except RulesSourceError:
            pass


class TracedRules:
    """Context.nf_rule that asks nf_tables tracing first, then the ruleset (NodeKnowledge)."""

    def __init__(self, knowledge, *, enabled: bool = True, clock=time.monotonic, log=None,
                 owns=None):
        self.kn = knowledge
        self.enabled = enabled
        # one node of several (node/scope.py NodeScope.owns): no trace table in a namespace
        # that is not this node's nor its pods' (another node's tracer owns those)
        self.owns = owns
        self.clock = clock
        self.log = log or (lambda msg: None)
        self._ns: dict[int, NsTrace | str] = {}   # netns inode -> session, or why there is none
        self._lock = threading.Lock()
        self._arm_window = 0.0
        self._arm_budget = ARMS_PER_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # destinations waiting for `nft add element`: the fork runs on the reader thread,
        # never on the classifier's (a fork per destination stalled the whole pipeline where
        # forks are slow: a busy node, an emulated guest)
        self._pending: collections.deque = collections.deque(maxlen=SET_SIZE)
        self._queued: set = set()

    # -- sessions ------------------------------------------------------------------------
    def _session(self, inode: int, smap) -> NsTrace | str:
        got = self._ns.get(inode)
        if got is not None:
            return got
        why = self._no_trace_reason(inode, smap)
        if why is None:
            ns = self.kn._netns_arg(inode)
            try:
                got = NsTrace.open(ns)
                self.log(f"nft trace: table inet {TABLE} added in "
                         f"{'the host namespace' if ns is None else 'netns ' + ns}; flows of "
                         f"interest are traced (at most {TRACE_RATE})")
            except (RulesSourceError, OSError) as e:
                why = f"nft trace unavailable here ({str(e).splitlines()[0] if str(e) else e})"
        if len(self._ns) >= MAX_NAMESPACES:
            # namespaces come and go faster than prune() runs (pod churn): forget the oldest
            # reason first, a session only when nothing else is left to forget
            old = next((i for i, v in self._ns.items() if isinstance(v, str)), None)
            if old is None:
                old = next(iter(self._ns))
                self._gone_malformed += self._ns[old].malformed
                self._ns[old].close()
            del self._ns[old]
        self._ns[inode] = got if why is None else why
        if why is None:
            self._start_reader()
        return self._ns[inode]

    def _no_trace_reason(self, inode: int, smap) -> str | None:
        if not self.enabled:
            return "nft trace off (--no-nft-trace)"
        if self.owns is not None and not self.owns(inode):
            return "nft trace: not this node's namespace"
        if self.kn._netns_arg(inode) is False:
            return "nft trace needs a named network namespace (ip netns) and this one has none"
        backends = tuple(getattr(smap, "backends", ()) or ())
        if backends and all(b == "iptables-legacy" for b in backends):
            return "iptables-legacy rules are invisible to nft trace"
        return None

    # -- the lookup ----------------------------------------------------------------------
    def nf_rule(self, inode: int, saddr: str, daddr: str, dport: int, odst: str, oport: int,
                syn: bool, has_ct: bool) -> dict | None:
        got = self.kn.nf_rule(inode, saddr, daddr, dport, odst, oport, syn, has_ct)
        smap = self.kn.rules(inode)
        now = self.clock()
        with self._lock:
            sess = self._session(inode, smap)
            if isinstance(sess, str):
                return _annotate(got, "ruleset", sess)
            self._start_reader()         # started with the first session; again if it could not be
            sess.drain(now)
            dests = [(daddr, int(dport))] + ([(odst, int(oport))] if (odst, oport) != (daddr, dport) else [])
            d = sess.book.lookup(saddr, dests, now, ARM_FOR_S)
            if d is not None:
                return self._traced(sess, d, got, smap, daddr, dport, odst, oport, now)
            note = self._arm(sess, dests, now)
        return _annotate(got, "ruleset", note)

    def _arm(self, sess: NsTrace, dests, now: float) -> str:
        if now - self._arm_window >= 1.0:
            self._arm_window, self._arm_budget = now, ARMS_PER_S
        try:
            for a, p in dests:
                if (a, p) in sess.armed and now - sess.armed[(a, p)] < ARM_FOR_S / 2:
                    continue
                if self._arm_budget <= 0:
                    return f"not traced (nptrace arms at most {ARMS_PER_S} destinations a second)"
                if (id(sess), a, p) in self._queued:
                    continue
                self._arm_budget -= 1
                self._queued.add((id(sess), a, p))
                self._pending.append((sess, a, p, now))
        except RulesSourceError as e:
            return f"not traced ({str(e).splitlines()[0]})"
        return "nft trace is armed for the next packets to this destination"

    arm_errors = 0

    def arm_pending(self) -> int:
        """Add the queued destinations to their namespaces' sets (the reader thread's work);
        how many were added."""
        n = 0
        while self._pending:
            sess, a, p, now = self._pending.popleft()
            self._queued.discard((id(sess), a, p))
            try:
                n += sess.arm(a, p, now)
            except RulesSourceError as e:
                self.arm_errors += 1
                if self.arm_errors == 1:
                    self.log(f"warning: nft trace: {str(e).splitlines()[0]} (counted; the ruleset "
                             "still names the rule)")
        return n

    def _traced(self, sess, d, got, smap, daddr, dport, odst, oport, now) -> dict:
        text, pos = sess.rule_line(d, now)
        rule = _rule_for(smap, d, pos)
        where = d.where() + (f" (rule {pos})" if pos else "")
        tag = None
        if isinstance(got, dict) and got.get("tag") not in (None, "other") \
                and _same_table(got.get("where", ""), d):
            # the ruleset named a kube-proxy rule of the table the trace ended in: kube-proxy's
            # nft maps send packets to a shared reject chain, so the traced rule is that chain's
            # and the tag (which Service, why) is the ruleset's
            tag = got["tag"]
            service = got.get("service")
        elif rule is not None:
            tag, service = rule.reason, rule.service
        else:
            tag, service = "other", None
        if rule is not None and rule.text:
            text = rule.text
        to_pod = bool(got.get("to_pod")) if isinstance(got, dict) else False
        if not to_pod and smap is not None:
            ep = smap.lookup(daddr, dport)
            to_pod = (ep is not None and ep.kind == "endpoint") or (daddr, dport) != (odst, oport)
        return {"tag": tag, "where": where, "text": text or "(rule text not readable)",
                "service": service, "to_pod": to_pod, "source": "nft trace",
                "note": f"seen by nft trace: {hostport(d.saddr, d.sport)} -> {hostport(d.daddr, d.dport)} dropped "
                        f"at {d.where()}"}

    # -- background drain -----------------------------------------------------------------
    def _start_reader(self) -> None:
        """Trace messages queue in each socket between drops; a thread keeps them read, so
        the socket buffer holds only fresh ones and the lookup above finds them in time."""
        if self._thread is not None:
            return
        t = threading.Thread(target=self._reader, name="npt-nftrace", daemon=True)
        try:
            t.start()
        except RuntimeError as e:     # "can't start new thread": tried again at the next drop
            self.reader_not_started += 1
            if self.reader_not_started == 1:
                self.log(f"warning: nft trace reader not started ({e}): no flow is traced "
                         "until it is (tried again at each netfilter drop)")
            return
        self._thread = t

    reader_not_started = 0

    def _reader(self) -> None:
        while not self._stop.is_set():
            try:
                self._read_once()
            except Exception as e:      # never dies: a dead reader lets the sockets fill
                self.reader_errors += 1
                if self.reader_errors == 1:
                    self.log(f"warning: nft trace reader: {type(e).__name__}: {e} "
                             "(counted and skipped; tracing goes on)")
                self._stop.wait(0.5)

    reader_errors = 0

    def _read_once(self) -> None:
        self.arm_pending()
        socks = [s.sock for s in list(self._ns.values()) if not isinstance(s, str)]
        try:
            ready, _, _ = select.select(socks, [], [], 0.5)
        except (OSError, ValueError):
            ready = []
            self._stop.wait(0.05)     # a closed socket in the list: do not spin
        if ready:
            with self._lock:
                now = self.clock()
                for s in list(self._ns.values()):
                    if not isinstance(s, str) and s.sock in ready:
                        s.drain(now)

    def malformed(self) -> int:
        """Trace datagrams skipped as undecodable, in every namespace (released ones too)."""
        return self._gone_malformed + sum(s.malformed for s in list(self._ns.values())
                                          if not isinstance(s, str))

    def overruns(self) -> int:
        """ENOBUFS on the trace sockets: the kernel dropped trace messages for us."""
        return sum(s.overruns for s in list(self._ns.values()) if not isinstance(s, str))

    _gone_malformed = 0
    released = 0            # namespaces whose session was closed because they went away

    def prune(self, alive) -> int:
        """Close the sessions of namespaces not in `alive` (inodes): a deleted pod's socket
        would otherwise keep its namespace (and an fd) forever. Its table went with it, so
        nothing is deleted there. Returns how many were released."""
        with self._lock:
            gone = [i for i in self._ns if i not in alive]
            for i in gone:
                s = self._ns.pop(i)
                if not isinstance(s, str):
                    self._gone_malformed += s.malformed
                    s.sock.close()
            self.released += len(gone)
        return len(gone)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        with self._lock:
            for s in self._ns.values():
                if not isinstance(s, str):
                    s.close()
            self._ns.clear()


def _annotate(got: dict | None, source: str, note: str) -> dict | None:
    if got is None:
        return None
    return {**got, "source": source, "note": note}


def _same_table(where: str, d: nftrace.TracedDrop) -> bool:
    """Does a ServiceMap rule location (``filter/CHAIN rule 3``, ``ip kube-proxy/chain``) name
    the traced packet's table? iptables-nft tables are named without their family."""
    table = where.split("/", 1)[0]
    return table in (f"{d.family} {d.table}",) or (" " not in table and table == d.table
                                                  and is_xt(d.family, d.table))


def _rule_for(smap, d: nftrace.TracedDrop, pos: int):
    """The ServiceMap rule the trace names: by handle in nft tables, by position in
    iptables-nft ones (iptables-nft-save prints no handles)."""
    if smap is None:
        return None
    xt = is_xt(d.family, d.table)
    table = d.table if xt else f"{d.family} {d.table}"
    for r in smap.rules:
        if r.table != table or r.chain != d.chain:
            continue
        if d.handle is None and r.comment == "chain policy":
            return r            # a chain policy
        if d.handle is not None and ((not xt and r.handle == d.handle) or (xt and pos and r.position == pos)):
            return r
    return None
