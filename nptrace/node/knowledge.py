"""What the live classifier may ask about the node: kube-proxy services and netfilter rules per
network namespace, and which interface a route leaves by. Each answer is cached, so the
per-event cost is a dict lookup. Rules are re-read when they change: a watch thread hears each
ruleful namespace's nf_tables commits as the kernel announces them (node/nftwatch.py), asks
the kernel for the legacy tables' sizes every LEGACY_EVERY_S (node/xtables.py) and compares
every namespace's fingerprint (nf_tables generation id, legacy tables' digest, IPVS table)
every second, re-reading in the background; besides, every answer is re-read after
`refresh_s`. Routes follow `refresh_s` alone.

The classifier only sees plain callables built from this (classify.Context), so the same
classifier runs over recorded sessions with the rules the recording kept.
"""
from __future__ import annotations

import subprocess
import threading
import time

from nptrace.kernel import nsenter
from nptrace.node.netns import Names
from nptrace.services import nf_cause
from nptrace.services.ipvs import without_local


ROUTE_LOOKUPS_PER_S = 20
MAX_NAMESPACES = 1024    # namespaces whose ServiceMap is kept (each a few hundred kB at most)


# How long a batch of records may wait for the rules view to apply an nf_tables commit made
# before it (barrier()): a small ruleset is re-read in tens of ms, 2,000 Services in 0.45-0.5 s
# (`nft -a list table` 0.36 s of it), which a rollout's resets must wait out to be labeled with
# the rules their packets met. The ring is drained meanwhile: a wait delays lines, loses none.
BARRIER_S = 0.6
# Generations of a namespace's rules kept with the time each came into force (at()): a record
# read late from the ring is labeled with the rules its packet met, not newer ones.
HISTORY = 4
HISTORY_NS = 30 * 10**9
# Endpoints a namespace's rules stopped listing, kept this long: a rollout's held connections
# are steered by another node's conntrack to a removed endpoint for as long as they live, and
# the node that had the endpoint sees their packets fail with no DNAT of its own to explain
# them (removed_endpoint). Bounded: the oldest go first.
REMOVED_KEEP_NS = 15 * 60 * 10**9
REMOVED_MAX = 4096
# iptables-legacy announces nothing: its tables' sizes are asked of the kernel this often
# (node/xtables.py, microseconds), and the barrier waits for a look begun after its batch.
LEGACY_EVERY_S = 0.05


class NodeKnowledge:
    def __init__(self, names: Names, refresh_s: float = 10.0, clock=time.monotonic):
        self.names = names
        self.refresh_s = refresh_s
        self.clock = clock
        self._maps: dict[int, tuple[float, object | None]] = {}
        self._routes: dict[tuple[int, str], tuple[float, str | None]] = {}
        self.errors: dict[int, str] = {}
        self._route_window = 0.0
        self._route_budget = ROUTE_LOOKUPS_PER_S
        self._ct: dict[int, tuple[float, dict | None]] = {}
        self._ct_drop: dict[int, int] = {}
        self._smaps: tuple = ()                  # the non-None maps, for _lookup
        self._hist: dict[int, list] = {}         # inode -> [(in force since ns, map)], oldest first
        # namespaces that have had rules: still watched when their rules are all gone (a
        # kube-proxy that deletes its table to write it anew), unlike the pods' rule-less ones
        self._ruleful: set[int] = set()
        self._newest_ns = 0                      # the latest of those times
        self._removed: dict[tuple[str, int], tuple[str, int]] = {}   # removed_endpoint's
        self._asof: int | None = None            # the record time lookups answer for (at())
        self._etp_memo: dict[tuple[str, int], tuple] = {}   # etp_local's answers
        self._checked: dict[int, float] = {}     # when check_changes last saw a map current
        self._prints: dict[int, tuple] = {}      # rules_source.fingerprint at the last read
        self._legacy_next: dict[int, float] = {}  # when a namespace's legacy digest is due again
        self._legacy_ns: set[int] = set()        # namespaces with legacy tables the kernel tells of
        self._legacy_info: dict[int, tuple] = {}  # their tables' sizes at the last look
        self._legacy_look_ns = 0                 # when the last look at all of them began
        self.generation = 0                      # moves when any map was re-read changed
        self.heard = 0                           # namespaces the watch heard commit, summed
        self.nft = None                          # the watch's NftChanges while it runs
        self._rereading = False                  # the watch is applying a heard commit
        self._turns = 0                          # the watch loop's turns (barrier's skip)
        self._late_turn = -1                     # the turn in which the barrier gave up
        self.barrier_waits = 0                   # labelings the barrier held back
        self.barrier_wait_s = 0.0                # and for how long in all
        self.barrier_max_s = 0.0
        self.barrier_late = 0                    # held back past BARRIER_S: labeled anyway
        self._lock = threading.Lock()
        self._watch: threading.Thread | None = None
        self._stop = threading.Event()

    # -- netfilter rules ---------------------------------------------------------------
    def _netns_arg(self, inode: int) -> str | None | bool:
        """The `ip netns` name, None for the host namespace, False when unknown."""
        name = self.names.netns_name(inode)
        if name is None:
            return False
        return None if name == "host" else name

    def rules(self, inode: int):
        now = self.clock()
        hit = self._maps.get(inode)
        if hit is not None and now - max(hit[0], self._checked.get(inode, hit[0])) < self.refresh_s:
            return hit[1]
        smap = self._load(inode)
        with self._lock:
            while len(self._maps) >= MAX_NAMESPACES:         # pod churn: oldest first
                old = next(iter(self._maps))
                del self._maps[old]
                self._hist.pop(old, None)
                self._ruleful.discard(old)
                self.errors.pop(old, None)
                self._checked.pop(old, None)
                self._prints.pop(old, None)
            if hit is not None and hit[1] is not smap:
                self.generation += 1
            self._maps.pop(inode, None)                      # re-inserted last: oldest stays first
            self._maps[inode] = (now, smap)
            # a first read holds for every record before it; a timed re-read from now on
            self._keep(inode, time.monotonic_ns() if hit is not None else 0, smap)
            self._snapshot()
        return smap

    def _load(self, inode: int, fp: tuple | None = None):
        """The namespace's ServiceMap read now (None when it has no readable rules). ``fp``:
        its fingerprint, when the caller has just read it (2,000 Services' legacy blob costs
        ~40 ms: not twice per change)."""
        ns = self._netns_arg(inode)
        smap = None
        if ns is not False:
            try:
                from nptrace.node.rules_source import fingerprint, load_service_map, local_addresses
                try:
                    self._prints[inode] = fp if fp is not None else fingerprint(ns)
                    self._legacy_watch(inode, ns, self._prints[inode][1])
                except Exception:
                    self._prints.pop(inode, None)
                smap = load_service_map(ns)
                # the namespace's own addresses: which filter hook a packet crossed (INPUT or
                # FORWARD) and whether `--src/--dst-type LOCAL` matches
                addrs = local_addresses(ns)
                if addrs:
                    smap = smap.with_local_addrs(addrs)
                self.errors.pop(inode, None)
            except Exception as e:   # no rules readable: the classifier says so in its hint
                self.errors[inode] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return smap

    def _snapshot(self) -> None:
        """The maps _lookup walks, rebuilt on every change (under _lock): the watch thread
        replaces entries while the classifier looks up, and a dict must not change size
        under an iteration."""
        self._smaps = tuple(m for _, m in self._maps.values() if m is not None)

    def _keep(self, inode: int, since_ns: int, smap) -> None:
        """A namespace's map in force from since_ns (under _lock): the last HISTORY kept, and
        none that stopped being in force more than HISTORY_NS before the newest began."""
        h = self._hist.setdefault(inode, [])
        if h:
            self._note_removed(h[-1][1], smap, since_ns)
        h.append((since_ns, smap))
        if smap:
            self._ruleful.add(inode)
        while len(h) > HISTORY or (len(h) > 1 and h[1][0] < since_ns - HISTORY_NS):
            del h[0]
        if since_ns > self._newest_ns:
            self._newest_ns = since_ns

    def _note_removed(self, old, new, since_ns: int) -> None:
        """Endpoints `old` listed and `new` does not, removed at since_ns (under _lock); one
        listed again is no longer removed."""
        before, after = _endpoint_ends(old), _endpoint_ends(new)
        for end, service in before.items():
            if end not in after:
                self._removed.pop(end, None)             # re-inserted last: oldest stays first
                self._removed[end] = (service, since_ns or time.monotonic_ns())
        for end in after:
            self._removed.pop(end, None)
        while len(self._removed) > REMOVED_MAX:
            del self._removed[next(iter(self._removed))]

    def removed_endpoint(self, addr: str, port: int) -> str | None:
        """The Service whose endpoint addr:port was until a namespace's rules stopped listing
        it, before the record's time (at()) and within REMOVED_KEEP_NS; None when it is listed
        now (endpoint_of answers) or never was."""
        hit = self._removed.get((addr, port))
        if hit is None:
            return None
        service, since = hit
        now = self._asof if self._asof is not None else time.monotonic_ns()
        if since > now or now - since > REMOVED_KEEP_NS or self.endpoint_of(addr, port):
            return None
        return service

    def at(self, ts_ns: int | None) -> None:
        """The lookups that follow answer for a record of time ts_ns (its packet's
        CLOCK_MONOTONIC time, the clock of time.monotonic_ns): with the maps then in force.
        None: with the current ones (what a cause key's label, not a record's, is made of)."""
        self._asof = ts_ns

    def _view(self) -> tuple:
        """The maps _lookup walks: the current ones, or those in force at the record's time
        when a namespace's rules changed after it (a record read late from the ring)."""
        asof = self._asof
        if asof is None or asof >= self._newest_ns:
            return self._smaps
        out = []
        for inode, (_, smap) in list(self._maps.items()):
            h = self._hist.get(inode)
            if h:
                smap = h[0][1]          # older than every generation kept: the oldest
                for since, m in h:
                    if since > asof:
                        break
                    smap = m
            if smap is not None:
                out.append(smap)
        return tuple(out)

    # -- following rule changes ------------------------------------------------------------
    def check_changes(self, only=None, since_ns: int | None = None, legacy_only: bool = False) -> int:
        """Re-read the rules of every namespace that has some (the host, nodes' and
        kube-proxy's namespaces, not the pods' empty ones) whose fingerprint moved: the
        nf_tables generation id (a netlink query, about a millisecond), the legacy tables'
        digest and IPVS's table. A rollout re-renders a Service's endpoints; until the map
        follows, a new pod on a removed endpoint's address would be taken for that endpoint.
        Returns how many maps were re-read. ``only``: the namespaces to check (those whose
        nf_tables commits the watch heard), else all; ``since_ns``: when the change was heard
        (monotonic ns, the time it is in force from), else when it is found; ``legacy_only``:
        the namespaces with legacy tables, and only those tables (the watch's frequent look)."""
        from nptrace.node.rules_source import ipvs_digest, legacy_digest, legacy_info, nft_generation
        n = 0
        look_ns = time.monotonic_ns()
        for inode, (_, smap) in list(self._maps.items()):
            if not (smap or inode in self._ruleful) or (only is not None and inode not in only) \
                    or (legacy_only and inode not in self._legacy_ns):
                continue
            ns = self._netns_arg(inode)
            if ns is False:
                continue
            old = self._prints.get(inode)
            try:
                if legacy_only:
                    # the frequent look: the tables' sizes and entry counts, microseconds; the
                    # whole blob (a rule rewritten in place) when they moved or it is due
                    info = legacy_info(ns)
                    moved = info != self._legacy_info.get(inode)
                    self._legacy_info[inode] = info
                    if not moved and self.clock() < self._legacy_next.get(inode, 0.0):
                        continue
                gen = old[0] if legacy_only and old else nft_generation(ns)
                if legacy_only or self.clock() >= self._legacy_next.get(inode, 0.0) or old is None:
                    # the whole blob costs what the ruleset weighs (2,000 Services: ~40 ms asked
                    # of the kernel; a dump where it cannot be asked: far more): spaced to take
                    # at most 2% of a core
                    t = time.perf_counter()
                    dig = legacy_digest(ns)
                    self._legacy_next[inode] = self.clock() + 50 * (time.perf_counter() - t)
                    self._legacy_watch(inode, ns, dig)
                else:
                    dig = old[1]
                # a /proc read: kube-proxy's IPVS syncs move no generation
                ipvs = (old[2] if len(old) > 2 else None) if legacy_only and old else ipvs_digest(ns)
            except Exception:
                continue
            fp = (gen, dig) if ipvs is None else (gen, dig, ipvs)
            self._checked[inode] = self.clock()
            if fp == self._prints.get(inode):
                continue
            found_ns = time.monotonic_ns()
            new = self._load(inode, fp)
            with self._lock:
                if inode in self._maps:
                    self._maps[inode] = (self.clock(), new)
                    self._keep(inode, since_ns if since_ns is not None else found_ns, new)
                    self.generation += 1
                    self._snapshot()
            n += 1
        if only is None:
            self._legacy_look_ns = look_ns
        return n

    def _legacy_watch(self, inode: int, ns, dig) -> None:
        """Join the frequent look the namespaces with legacy tables whose sizes the kernel
        tells (not those only a dump can read)."""
        from nptrace.node.rules_source import legacy_info
        try:
            if dig is None:
                raise OSError
            if inode not in self._legacy_info:
                self._legacy_info[inode] = legacy_info(ns)
            self._legacy_ns.add(inode)
        except OSError:
            self._legacy_ns.discard(inode)
            self._legacy_info.pop(inode, None)

    def watched_paths(self) -> dict[int, str | None]:
        """inode -> nsfs path of the namespaces that have rules (what the watch listens in)."""
        from nptrace.kernel.nsenter import path_of
        out = {}
        for inode, (_, smap) in list(self._maps.items()):
            ns = self._netns_arg(inode) if smap or inode in self._ruleful else False
            if ns is not False:
                out[inode] = path_of(ns)
        return out

    def start_watch(self, every_s: float = 1.0, listen: bool = True) -> None:
        """In a thread of its own (a re-read of a large ruleset takes seconds, iptables-nft-save
        of 10,000 Services 2 s, and must not stall the ring): a namespace whose nf_tables
        commit the kernel announces (node/nftwatch.py) is checked at once, and every namespace
        every `every_s` (iptables-legacy and IPVS announce nothing). ``listen`` False: the
        timed checks alone."""
        if self._watch is not None:
            return
        self._stop.clear()
        from nptrace.node.nftwatch import NftChanges
        self.nft = NftChanges() if listen else None

        def loop() -> None:
            due = time.monotonic() + every_s
            legacy_due = time.monotonic() + LEGACY_EVERY_S
            try:
                while not self._stop.is_set():
                    try:
                        wait = max(0.0, due - time.monotonic())
                        if self._legacy_ns:
                            wait = min(wait, max(0.0, legacy_due - time.monotonic()))
                        if self.nft is None:
                            self._stop.wait(wait)
                        else:
                            self.nft.sync(self.watched_paths())
                            ready = self.nft.ready(min(wait, 0.5))
                            heard_ns = time.monotonic_ns()
                            if ready:
                                # before the drain: barrier() sees a commit pending or this
                                self._rereading = True
                                try:
                                    heard = self.nft.drain(ready)
                                    self.heard += len(heard)
                                    self.check_changes(only=set(heard), since_ns=heard_ns)
                                finally:
                                    self._rereading = False
                        self._turns += 1
                        if time.monotonic() >= due and not self._stop.is_set():
                            due = time.monotonic() + every_s
                            legacy_due = time.monotonic() + LEGACY_EVERY_S
                            self.check_changes()
                        elif self._legacy_ns and time.monotonic() >= legacy_due:
                            legacy_due = time.monotonic() + LEGACY_EVERY_S
                            self.check_changes(legacy_only=True)
                    except Exception:   # a namespace that went away mid-read: next turn
                        self._stop.wait(0.1)    # (and never a busy loop on a lasting error)
            finally:
                if self.nft is not None:
                    self.nft.close()

        self._watch = threading.Thread(target=loop, name="npt-rules-watch", daemon=True)
        self._watch.start()

    def barrier(self, idle=None) -> float:
        """Hold the labeling of records until the rules view has applied every nf_tables
        commit made before now (so before any record at hand), and, where there are legacy
        tables, until a look at them begun after now has ended; BARRIER_S at most; returns
        the seconds waited. A commit made before a packet is announced before that packet's
        record can reach user space (the kernel sends it within the commit), so once no
        listener holds one and none is being applied, the view is the packet's own.
        Past the bound the records are labeled with the view as it is (counted in
        barrier_late); until the watch's next turn (a long legacy dump may hold it) no batch
        waits again, so a stuck watch costs one wait, not one per batch. ``idle()``: what to do
        between two looks (the tracer keeps taking records off the ring: a storm fills it in
        a wait of a few hundred ms); a 2 ms sleep without it."""
        nft = self.nft
        legacy = bool(self._legacy_ns) and self._watch is not None
        if (nft is None and not legacy) or self._late_turn == self._turns:
            return 0.0
        t0, entered = None, time.monotonic_ns()

        def behind() -> bool:
            return (nft is not None and nft.pending()) or self._rereading or \
                (legacy and self._legacy_look_ns < entered)
        while behind():
            now = time.monotonic()
            if t0 is None:
                t0 = now
            elif now - t0 >= BARRIER_S:
                self.barrier_late += 1
                self._late_turn = self._turns
                break
            if idle is None:
                time.sleep(0.002)
            else:
                idle()
        if t0 is None:
            return 0.0
        waited = time.monotonic() - t0
        self.barrier_waits += 1
        self.barrier_wait_s += waited
        self.barrier_max_s = max(self.barrier_max_s, waited)
        return waited

    def stop_watch(self) -> None:
        self._stop.set()
        if self.nft is not None:
            self.nft.wake()
        if self._watch is not None:
            self._watch.join(timeout=5)
            self._watch = None

    def prune(self, alive) -> int:
        """Forget the rules and routes of namespaces not in `alive` (netns.live_namespaces()):
        a deleted pod's namespace must not keep its ServiceMap. Returns how many went."""
        with self._lock:
            gone = [i for i in self._maps if i not in alive]
            for i in gone:
                del self._maps[i]
                self._hist.pop(i, None)
                self._ruleful.discard(i)
                self._checked.pop(i, None)
                self._prints.pop(i, None)
                self._legacy_next.pop(i, None)
                self._legacy_ns.discard(i)
                self._legacy_info.pop(i, None)
            self._snapshot()
        for i in [i for i in self.errors if i not in alive]:
            del self.errors[i]
        for k in [k for k in self._routes if k[0] not in alive]:
            del self._routes[k]
        return len(gone)

    def nf_rule(self, inode: int, saddr: str, daddr: str, dport: int, odst: str, oport: int,
                syn: bool, has_ct: bool) -> dict | None:
        """Context.nf_rule: services.nf_cause on this namespace's rules (plain data,
        recordable for replay), None when no ruleset is readable. A connection's first packet
        dropped without a conntrack entry also gets the namespace's conntrack table at that
        moment (``ct_count``, ``ct_max``, ``ct_drop``: conntrack's own drop counter,
        ``ct_drop_new``: its increase since the previous reading): conntrack drops a new
        connection when the table is full, before any rule."""
        smap = self.rules(inode)
        ct = self.conntrack_table(inode) if syn and not has_ct else None
        if smap is None:
            if ct is None:
                return None
            got = {"tag": None, "no_ruleset": True}  # the classifier still sees the table
        else:
            got = nf_cause(smap, saddr, daddr, dport, odst, oport, syn, has_ct)
        if ct is not None:
            got = {**got, **ct}
        return got

    def conntrack_table(self, inode: int) -> dict | None:
        """{ct_count, ct_max, ct_drop, ct_drop_new} of a namespace, read at most every 0.1 s."""
        now = self.clock()
        hit = self._ct.get(inode)
        if hit is not None and now - hit[0] < 0.1:
            return hit[1]
        ns = self._netns_arg(inode)
        got = None
        if ns is not False:
            try:
                vals = nsenter.run_in(nsenter.path_of(ns), read_conntrack, "npt-ct")
            except OSError:
                vals = None
            if vals is not None:
                count, cmax, drop = vals
                last = self._ct_drop.get(inode)
                self._ct_drop[inode] = drop
                got = {"ct_count": count, "ct_max": cmax, "ct_drop": drop,
                       "ct_drop_new": max(0, drop - last) if last is not None else 0}
        self._ct[inode] = (now, got)
        return got

    def preload(self, inodes) -> None:
        for i in inodes:
            self.rules(i)

    def _lookup(self, addr: str, port: int, kind: str | None = None) -> str | None:
        for smap in self._view():
            try:
                s = smap.lookup(addr, port)
            except Exception:
                continue
            if s is not None and (kind is None or s.kind == kind):
                return s.name
        return None

    def service_of(self, addr: str, port: int) -> str | None:
        return self._lookup(addr, port)

    def endpoint_of(self, addr: str, port: int) -> str | None:
        return self._lookup(addr, port, "endpoint")

    def etp_local(self, addr: str, port: int) -> dict | None:
        """When addr:port is an endpoint of an externalTrafficPolicy: Local Service:
        {"service", "no_local": the IPVS virtual servers of it, in any namespace read, that hold
        it as a real server and have no real server of their own node}, else None. kube-proxy's
        IPVS mode fills such a node's eTP=Local NodePort with the cluster's endpoints and does
        not masquerade it, which is how a Local Service's pod meets an unmasqueraded client.
        Kept per endpoint while the maps stay the same (_snapshot rebuilds _smaps on every
        change): a reset storm asks it per record, and the answer walks every IPVS virtual server."""
        view = self._view()
        hit = self._etp_memo.get((addr, port))
        if hit is not None and hit[0] is view:
            return hit[1]
        if len(self._etp_memo) >= 4096:
            self._etp_memo.clear()
        got = self._etp_local(addr, port, view)
        self._etp_memo[(addr, port)] = (view, got)
        return got

    def _etp_local(self, addr: str, port: int, view: tuple) -> dict | None:
        for smap in view:
            try:
                s = smap.lookup(addr, port)
            except Exception:
                continue
            # Any namespace's view that knows it as a Local Service's endpoint answers: another
            # view may hold the address as an endpoint of some other Service (a pod address
            # reused, a namespace not yet pruned), and the walk's order is the order reads
            # happened in.
            if s is None or s.kind != "endpoint" or not s.etp_local:
                continue
            return {"service": s.name,
                    "no_local": sorted({v for m in view for st in m.ipvs
                                        for v in without_local(st, addr, port)})}
        return None

    # -- routes ------------------------------------------------------------------------
    def route_iface(self, inode: int, addr: str) -> str | None:
        now = self.clock()
        key = (inode, addr)
        hit = self._routes.get(key)
        if hit is not None and now - hit[0] < self.refresh_s:
            return hit[1]
        ns = self._netns_arg(inode)
        dev = None
        # A flood of distinct (spoofed) sources must not fork `ip` per event: a few a second.
        if now - self._route_window >= 1.0:
            self._route_window, self._route_budget = now, ROUTE_LOOKUPS_PER_S
        if self._route_budget <= 0:
            return None
        self._route_budget -= 1
        if ns is not False:
            cmd = (["ip", "-n", ns] if ns else ["ip"]) + ["-o", "route", "get", addr]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=3).stdout.split()
                if "dev" in out:
                    dev = out[out.index("dev") + 1]
            except (OSError, subprocess.TimeoutExpired):
                pass
        if len(self._routes) > 4096:
            self._routes.clear()
        self._routes[key] = (now, dev)
        return dev


def _endpoint_ends(smap) -> dict:
    """A map's endpoints (ServiceMap.endpoint_ends), {} for none or a map that lists none."""
    ends = getattr(smap, "endpoint_ends", None)
    return ends() if ends is not None else {}


def read_conntrack() -> tuple[int, int, int] | None:
    """(count, max, drop) of the calling thread's network namespace. /proc/sys/net follows the
    thread's namespace, /proc/net the process's: hence /proc/thread-self/net."""
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_count") as f:
            count = int(f.read())
        with open("/proc/sys/net/netfilter/nf_conntrack_max") as f:
            cmax = int(f.read())
    except (OSError, ValueError):
        return None
    return count, cmax, conntrack_drops("/proc/thread-self/net/stat/nf_conntrack") or 0


def conntrack_drops(path) -> int | None:
    """The sum over CPUs of the ``drop`` column of /proc/net/stat/nf_conntrack (hex): new
    connections conntrack dropped because the table was full and nothing could be evicted."""
    return (conntrack_stat(path) or {}).get("drop")


def conntrack_stat(path) -> dict[str, int] | None:
    """Each column of /proc/net/stat/nf_conntrack (hex, one row a CPU: what `conntrack -S`
    prints) summed over CPUs: drop, insert_failed, early_drop, ... None: no such file."""
    try:
        with open(path) as f:
            head, *rows = f.read().split("\n")
    except OSError:
        return None
    cols = head.split()
    cells = [r.split() for r in rows]
    return {c: sum(int(r[i], 16) for r in cells if len(r) > i) for i, c in enumerate(cols)}
