"""The live pipeline: probes -> decoder -> classifier -> sinks, with start-up checks and a clean
stop. Status and start-up lines go to stderr; stdout belongs to the sinks. The Tracer
orchestrates: what to attach is kernel/attach.py's plan (from features.probe() and the hook
table), compiling and attaching is kernel/attach.py's, the extra outputs are sinks/outputs.py's."""
from __future__ import annotations

import dataclasses
import gc
import os
import signal
import threading
import time

from nptrace import events as ev
from nptrace.classify import Classifier, Context
from nptrace.config import Config
from nptrace.errors import (OUTPUT_ERRNOS, LoadError, OutputError, on_exit_now, output_error,
                            quiet_stdout)
from nptrace.daemon.lifecycle import Interrupted, Signals, run_steps
from nptrace.daemon.losses import MESSAGES as LOSS_MESSAGES, RECORD_STAGES, Ledger, stop_lines
from nptrace.daemon.preflight import (InstanceLock, check_ifaces, check_privileges,
                                      inode_of_netns, log, release_startup_memory,
                                      write_ready_file)
from nptrace.sinks.outputs import Outputs, open_outputs  # noqa: F401 (Outputs: cli.py's)
from nptrace.sinks.snap import headers_only

# Records handled between checks of the stop flag and --duration (a stop must stop in a storm).
DRAIN_BATCH = 4096
WAKE_EVERY = 256       # records a CPU emits per wake-up of run() (bpf/npt_common.h)


class Tracer:
    def __init__(self, cfg: Config, sinks: list, ready_file: str | None = None,
                 context: Context | None = None, outputs: Outputs | None = None):
        # run() reads the ring every 100 ms whether woken or not: the kernel may batch wake-ups
        self.cfg = dataclasses.replace(cfg, wake_every=WAKE_EVERY) if cfg.wake_every == 1 else cfg
        self.sinks = sinks
        self.ready_file = ready_file
        self.ctx = context
        self.probes = None
        self.tc = None
        self.recorder = None
        self.stop_requested = False
        self.decoded = 0
        self.bad_records = 0
        self.epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self.lock = InstanceLock()
        self.reopen_requested = False
        self.recorders: list = []      # get every raw record (session files)
        self.status_every = 10.0       # seconds between status lines on stderr (0: none)
        self.reader = None
        self.outputs = outputs or Outputs()
        self.metrics = self.metrics_server = self.probe_server = self.health = None
        self.plan = None               # kernel/attach.py Plan: what start() attaches
        self.nf_links = None           # netfilter-hook links (kernel/nfhook.py)
        self.knowledge = None          # node knowledge (node/knowledge.py), without a context
        self.nft = None                # nf_tables tracing of dropped flows (node/nftrace_live.py)
        self.pods = None               # pod names (node/pods.py PodNames), without a context
        self.output_failed = False     # run() ended on an output error: stop() adds none
        self.classifier = None
        self.signals = Signals()       # from the first line of start() to the last of stop()
        self.interrupted = False       # a stop signal ended start-up early
        self.losses = Ledger()         # every user-space loss, for status, metrics, --json
        self.ifwatch = None            # --iface devices re-created, or chosen (node/ifwatch.py)
        self.scope = None              # one node of several: its namespaces (node/scope.py)
        self.unread_at_stop = 0        # records left in the ring when the stop's drain ended
        self.names = None
        self.prune_every_s = 10.0      # release state of namespaces that went away
        from nptrace.daemon.sdnotify import Notifier
        self.notify = Notifier.from_env()   # Type=notify: READY=1 after attach, WATCHDOG=1 per loop
        self.exact = None              # per-cause counts of every record (sinks/exact.py)
        self.exact_every_ns = 1_000_000_000
        self._next_idle_ns = 0
        # run --service in the kernel: () -> the Service's ends now (classify/filters.py
        # Filter.kernel_ends), filled at start and every prune_every_s (the rules may change)
        self.service_gate = None
        self._gate_n = None

    # -- start ---------------------------------------------------------------------------
    def start(self) -> float:
        """Check, compile, attach. A SIGINT/SIGTERM from here on is seen at the next step
        boundary: start-up stops there and stop() detaches what was attached (lifecycle.py).
        Where LLVM ends the process inside the compile, stop() runs before its line
        (errors.on_exit_now): the caller's finally is never reached then."""
        self.signals.install()
        try:
            with on_exit_now(self.stop):
                return self._start()
        except Interrupted as e:
            self.interrupted = True
            log(f"stopping: {e}; removing what was attached so far")
            return 0.0

    def _start(self) -> float:
        t0 = time.monotonic()
        check = self.signals.checkpoint
        check_privileges()
        check_ifaces(self.cfg)
        self.lock.acquire()
        check("instance lock")
        from nptrace.node.scope import is_nested
        if is_nested():          # one node of several on this kernel: its namespaces alone
            self.cfg = dataclasses.replace(self.cfg, node_scope=True)
        # killed runs' nft trace tables swept during the compile; its lines after (fd 2 is held)
        swept: list[str] = []
        sweep = threading.Thread(target=self._sweep_leftovers, args=(swept.append,), daemon=True)
        sweep.start()
        from nptrace.kernel import headers     # bcc's compile needs some; which ones, said once
        hsrc = headers.find()
        if hsrc.kind == "none":
            raise LoadError(f"no kernel headers for bcc's compile: {hsrc.detail}")
        headers.select(hsrc)
        from nptrace import reasons
        from nptrace.kernel import attach, btf, features
        from nptrace.node.netns import Names
        kbtf = btf.default()
        drops, rsts = reasons.load_tables(kbtf)
        # tracefs is often not mounted on minimal hosts; mounting it is harmless and needed.
        feats = features.probe(mount_tracefs=True)
        self.plan = plan = attach.plan(feats, self.cfg)
        self._open_outputs(drops, rsts)   # before the slow compile: bad paths fail fast
        plan.require()
        log(hsrc.line())     # with the plan: start-up errors before here stay one line
        from nptrace.doctor import hot_path, hot_path_line
        slow = hot_path_line(hot_path())    # the pure-Python decode/JSON paths, said once
        if slow:
            log(slow)
        for line in plan.lines():
            log(f"plan: {line}")
        self.cfg = plan.cfg
        check("plan")
        kflags = attach.kernel_flags(plan, kbtf, drops, rsts, log)
        self.probes = attach.load(plan, kflags, drops, log)
        if self.cfg.node_scope:
            from nptrace.node.scope import NodeScope
            self.scope = NodeScope(self.probes.set_netns_scope, log)
            log(self.scope.start())
            for spec in self.cfg.ifaces:
                if spec.netns and not self.scope.owns(inode_of_netns(spec.netns)):
                    log(f"warning: --iface {spec} is in another node's namespace, whose "
                        "records this node does not report: nothing seen there will show "
                        "(run nptrace in that namespace)")
        check("compile")
        if plan.tc:
            self.probes, self.tc = attach.attach_tc(plan, self.probes, kflags, drops, log)
            if self.cfg.iface_auto:
                from nptrace.node.ifwatch import AutoIfaces
                self.ifwatch = AutoIfaces(self.tc, log, on_gap=self._on_gap)
                self.ifwatch.start()
                if self.ifwatch.choice is not None:
                    log(self.ifwatch.choice.line())
            check("tc attach")
        self.nf_links = attach.attach_netfilter(plan, self.probes, log)
        check("netfilter hook")
        attach.attach_kprobes(plan, self.probes, log)
        check("kprobes")
        sweep.join()
        for line in swept:
            log(line)
        check("leftovers of killed runs")
        self._fill_service_gate()
        self.names = names = Names()
        if self.ctx is None:
            from nptrace.node.knowledge import NodeKnowledge
            self.knowledge = kn = NodeKnowledge(names)
            watched = {names.host} | {inode_of_netns(s.netns) for s in self.cfg.ifaces if s.netns}
            kn.preload(watched)
            kn.start_watch()    # nf_tables commits at once, legacy within 50 ms, IPVS a second
            from nptrace.node.nftrace_live import TracedRules
            self.nft = TracedRules(kn, enabled=self.cfg.nft_trace, log=log,
                                   owns=self.scope.owns if self.scope is not None else None)
            from nptrace.node import kubeapi
            from nptrace.node.pods import PodNames   # API watch or crictl; never blocks
            self.pods = PodNames(self.outputs.node, api=kubeapi.from_env(), log=log).start()
            if self.pods.source != "none":
                log(f"pods named from {self.pods.source}")
            lookups = dict(iface_name=names.iface, iface_peer=names.veth_peer,
                           peer_tx_csum=names.veth_peer_tx_csum,
                           service_of=kn.service_of,
                           endpoint_of=kn.endpoint_of, etp_local=kn.etp_local,
                           removed_endpoint=kn.removed_endpoint,
                           nf_rule=self.nft.nf_rule,
                           route_iface=kn.route_iface, nat_peer=self._nat_peer,
                           pod_of=self.pods.pod_of, pod_of_netns=self.pods.pod_of_netns)
            if self.recorder is not None:
                # every answer the classifier gets is recorded, so replay labels alike
                lookups["iface_name"] = self.recorder.iface_name(lookups["iface_name"])
                lookups["service_of"] = self.recorder.service_of(lookups["service_of"])
                from nptrace.sessions.schema import LOOKUPS
                for name in LOOKUPS:
                    lookups[name] = self.recorder.lookup(name, lookups[name])
            self.ctx = Context(drop_name=drops.name, rst_name=rsts.name, at=kn.at, **lookups)
        self._start_exact(names, drops, rsts)
        if self.metrics is not None:
            from nptrace.kernel.hooks import TRACEPOINTS
            from nptrace.sinks import health
            probes = self.probes
            scope = self.scope

            def counts():
                got = probes.counts()
                # one node of several: a namespace sorted since the kernel's filter was filled
                # (another lab's new one) or none at all is not this node's to count
                return got if scope is None else {k: v for k, v in got.items() if scope.owns(k[4])}
            self.metrics.watch_kernel(lambda: (counts(), probes.stats()),
                                      iface_name=names.iface, drop_name=drops.name,
                                      rst_name=rsts.name, flows=lambda: len(self.classifier.flows),
                                      probes=lambda: health.probe_states(
                                          TRACEPOINTS, probes.attached, self._ifaces(), self.tc,
                                          plan.nf_hook))
        self.classifier = Classifier(self.ctx)
        self._watch_losses()
        if self.tc is not None and self.ifwatch is None:
            from nptrace.node.ifwatch import IfaceWatch
            self.ifwatch = IfaceWatch(self.cfg.ifaces, self.tc, log, on_gap=self._on_gap)
        check("node knowledge")
        release_startup_memory()
        from nptrace.kernel.ringbuf import open_reader
        # On x86-64 the ring is memory-mapped and walked in batches: bcc's per-record callback
        # tops out near 350-600k records/s in Python, the mmap walk above 1M/s
        # (docs/PLATFORM.md). Elsewhere the walk's ordering assumptions do not hold: bcc's poll.
        self.reader = open_reader(self.probes, log)
        elapsed = time.monotonic() - t0
        what = ", ".join(self.probes.attached + [f"tc:{s}" for s in self._ifaces()])
        if self.tc is not None:
            what += f" (tc via {self.tc.mode})"
        node = f" on node {self.outputs.node}" if self.outputs.node else ""
        log(f"attached {what}{node} in {elapsed:.2f}s (BPF object {self.probes.origin}; "
            f"kprobes: {'yes' if plan.kprobes else 'absent'})")
        check("attached")
        if self.ready_file:
            write_ready_file(self.ready_file)
        self.notify.ready(f"attached {what}")
        if self.health is not None:
            self.health.ready(what)
        return elapsed

    def _sweep_leftovers(self, say=log) -> None:
        """nft trace tables a killed run left (tc filters are kernel/tc.py's recover(), at
        attach), under the node's instance lock; a private lock file (NPTRACE_LOCK_FILE) proves
        nothing about other instances: then only tables whose comment names a dead run go."""
        from nptrace.kernel.netlink import named_netns
        from nptrace.node.nftrace_live import sweep_tables
        try:
            # one node of several: the other nodes' namespaces are their tracers' to sweep
            spaces = [None] if self.cfg.node_scope else [None] + named_netns()
            sweep_tables(spaces, say, node_lock="NPTRACE_LOCK_FILE" not in os.environ)
        except Exception as e:       # a sweep that cannot run must not stop the start
            say(f"warning: could not look for nft trace tables of killed runs: {e}")

    def _watch_losses(self) -> None:
        w = self.losses.watch
        probes = self.probes
        w("ring_lost", lambda: probes.stats().get("lost", 0))
        w("undecodable", lambda: self.bad_records)
        w("stop_unread", lambda: self.unread_at_stop)
        if self.recorder is not None:
            writer = self.recorder.writer
            w("recorder_dropped", lambda: writer.dropped)
        if self.knowledge is not None:
            kn = self.knowledge
            w("rules_late", lambda: kn.barrier_late)
            from nptrace.node import rules_source
            refused = rules_source.REFUSED
            refused.log = log         # each refused table name said once, on the status stream
            w("rules_bad_names", lambda: refused.count)
        if self.nft is not None:
            nft = self.nft
            w("nft_trace_malformed", nft.malformed)
            w("nft_trace_reader", lambda: nft.reader_errors)
            w("nft_trace_overruns", nft.overruns)

    def _report_losses(self) -> None:
        """Each loss since the last look: a loss line in --json, a metrics counter (the
        sinks that have `loss`). The status line and stop() say the totals."""
        for stage, n in self.losses.poll().items():
            self._loss(stage, n if stage in RECORD_STAGES else None,
                       f"{n} {LOSS_MESSAGES.get(stage, stage)}")

    def _loss(self, stage: str, n: int | None, message: str) -> None:
        for sink in self.sinks:
            fn = getattr(sink, "loss", None)
            if fn is not None:
                try:
                    fn(stage, n, message)
                except Exception:
                    pass

    def _ifaces(self) -> list:
        """The interfaces traced now: --iface's, or those the automatic choice holds."""
        return list(self.tc.specs) if self.tc is not None else list(self.cfg.ifaces)

    def _on_gap(self, gap) -> None:
        self._loss("iface_gap", None, f"interface {gap.iface} was not traced for "
                   + (f"{gap.seconds:.1f} s" if gap.seen_gone else "under 1 s")
                   + " (device re-created); tc programs re-attached")

    def _prune(self) -> None:
        """Release what is kept per network namespace for namespaces that went away."""
        from nptrace.node.netns import live_namespaces
        alive = live_namespaces()
        for holder in (self.names, self.knowledge, self.nft):
            if holder is not None:
                try:
                    holder.prune(alive)
                except Exception as e:
                    log(f"warning: releasing state of deleted namespaces: {e}")

    def _fill_service_gate(self) -> None:
        if self.service_gate is None or not self.cfg.service_gate or self.probes is None:
            return
        ends = self.service_gate()
        if ends:      # the Service left the rules: the last ends stay (as the user-space filter)
            n = self.probes.set_service_ends(ends)
            if n != self._gate_n:
                self._gate_n = n
                log(f"--service in the kernel: {n} addresses and ports of the Service")

    def _start_exact(self, names, drops, rsts) -> None:
        """Every record counted under its cause (bpf/npt_common.h npt_count_cause), labeled
        per key with the classifier's rules (classify/keylabel.py). The labeler's lookups are
        the plain ones, not the session recorder's (a key's labeling is not a record's) nor
        nft tracing's (a synthetic event must not start a trace); routes only fill hints."""
        from nptrace.classify.keylabel import KeyLabeler
        from nptrace.classify.verdict import WEAK_DROPS
        from nptrace.sinks.exact import ExactCounts
        self.probes.mark_weak_drops(WEAK_DROPS)
        kn = self.knowledge
        if kn is not None:
            ctx = Context(drop_name=drops.name, rst_name=rsts.name, iface_name=names.iface,
                          service_of=kn.service_of, endpoint_of=kn.endpoint_of,
                          etp_local=kn.etp_local, nf_rule=kn.nf_rule)
        else:
            ctx = self.ctx
        self.exact = ExactCounts(KeyLabeler(ctx, load_netns=kn.rules if kn is not None else None),
                                 generation=(lambda: kn.generation) if kn is not None else None)
        if self.metrics is not None:
            self.metrics.count_exactly(self.exact)

    def _count_exact(self, now_ns: int) -> None:
        """Once a second: read the cause keys, update the exact counters, write the summary
        lines of what was counted and not sent."""
        if self.exact is None or self.probes is None:
            return
        if self.knowledge is not None:
            self.knowledge.at(None)     # a key's label: the rules now, not a last record's
        counts = self.probes.cause_counts()
        if self.scope is not None:
            owns = self.scope.owns
            counts = {k: v for k, v in counts.items() if k is None or owns(k.netns)}
        rows = self.exact.update(counts, now_ns)
        if now_ns >= self._next_idle_ns:
            # keep the bounded map for the keys in use: delete those idle for a minute
            self._next_idle_ns = now_ns + 10_000_000_000
            idle = self.exact.idle(now_ns)
            if idle:
                self.probes.delete_cause_keys(idle)
                self.exact.forget(idle)
        if rows:
            for s in self.sinks + self.recorders:
                w = getattr(s, "write_summary", None)
                if w is not None:
                    w(rows)

    def _nat_peer(self, saddr, sport, daddr, dport):
        # filled by the netfilter-hook program, or by the NAT and IPVS kprobes (the loader
        # answers None where the object holds no such map)
        if self.probes is None:
            return None
        peer = self.probes.nat_peer(saddr, sport, daddr, dport)
        return list(peer) if peer else None    # lists: what msgpack gives back in replay

    # -- outputs: session files, metrics endpoint, pcapng (sinks/outputs.py) ----------------
    def _open_outputs(self, drops, rsts) -> None:
        plan = self.plan
        opened = open_outputs(
            self.outputs, epoch_offset_ns=self.epoch_offset_ns, drops=drops, rsts=rsts,
            features={"tracepoints": sorted(plan.tracepoints),
                      "ifaces": [str(i) for i in self.cfg.ifaces], "kprobes": plan.kprobes},
            counters=lambda: (self.probes.counts(), self.probes.stats()), log=log)
        self.metrics, self.metrics_server = opened.metrics, opened.metrics_server
        self.probe_server = opened.probe_server
        self.health = opened.health
        self.recorder = opened.recorder
        if self.recorder is not None:
            self.recorders.append(self.recorder)
        self.sinks.extend(opened.sinks)

    # -- run -----------------------------------------------------------------------------
    def _on_record(self, raw: bytes) -> None:
        for r in self.recorders:
            r.on_raw(raw)
        try:
            e = ev.decode(raw)
        except ev.DecodeError:
            self.bad_records += 1
            return
        self.decoded += 1
        self._emit(self.classifier.feed(e))

    def _emit(self, verdicts) -> None:
        if self.scope is not None and verdicts:
            verdicts = self.scope.keep(verdicts)
        for v in verdicts:
            for s in self.sinks:
                s.write(v)

    def _drain(self, timeout_ms: int) -> int:
        batch = self.reader.poll(timeout_ms, max_records=DRAIN_BATCH, raw=True)  # a stop waits <= 1 batch
        if batch and self.knowledge is not None:   # the rules their packets met; the ring drains on
            self.knowledge.barrier(lambda: batch.extend(self.reader.poll(1, DRAIN_BATCH, raw=True)))
        n = len(batch)
        if self.cfg.snaplen and batch:
            batch = self._take_packets(batch)   # --pcap's packet bytes go to its sink
        if self.recorders:
            # a session keeps each record next to the lookups made for it (replay order)
            for raw in batch:
                self._on_record(raw)
        elif batch:
            # the batch path: one decode, one classifier call and one write per sink for the
            # whole batch (classify.feed_many returns what feed() per event would)
            events, bad = ev.decode_many(batch)
            self.bad_records += bad
            self.decoded += len(events)
            vs = self.classifier.feed_many(events)
            if vs and self.scope is not None:
                vs = self.scope.keep(vs)
            if vs:
                for s in self.sinks:
                    many = getattr(s, "write_many", None)
                    if many is not None:
                        many(vs)
                    else:
                        for v in vs:
                            s.write(v)
        self._flush_sinks()
        return n

    def _drain_at_stop(self, bound_s: float = 2.0, clock=time.monotonic) -> None:
        """Drain what arrived before the stop, for a bounded time: under a reset storm the ring
        never empties, and a stop must still stop. What the bound leaves in the ring is a loss
        (stop_unread), said in the stop line and as a loss line, not silently dropped."""
        deadline = clock() + bound_s
        while self._drain(0) and clock() < deadline:
            pass
        pending = getattr(self.reader, "pending_bytes", None)
        if pending is not None and clock() >= deadline:
            from nptrace.kernel.ringbuf import stride_of
            self.unread_at_stop = pending() // stride_of(ev.SIZE)

    def _take_packets(self, batch: list) -> list:
        """The event records of batch; its packet-bytes records (bpf/npt_packet.h) go to the
        sinks that take them (the pcapng one), before the events they belong to, and to the
        session files (replay -w writes them); with --snaplen headers cut where the packet's
        headers end (sinks/snap.py), so neither file holds payload."""
        if self.cfg.snap_headers:
            batch = [headers_only(b) if ev.is_packet(b) else b for b in batch]
        if self.recorders:
            for b in batch:
                if ev.is_packet(b):
                    for r in self.recorders:
                        r.on_packet_raw(b)
        batch, packets = ev.split_packets(batch)
        if packets:
            for s in self.sinks:
                take = getattr(s, "on_packet", None)
                if take is not None:
                    for p in packets:
                        take(p)
        return batch

    def _tick_sinks(self, now_ns: int) -> None:
        """Sinks that hold lines back (a storm's collapsed summary) write what is due."""
        for s in self.sinks:
            tick = getattr(s, "tick", None)
            if tick is not None:
                tick(now_ns)

    def _flush_sinks(self) -> None:
        for s in self.sinks:
            flush = getattr(s, "flush", None)
            if flush is not None:
                flush()

    def run(self, duration: float | None = None) -> None:
        if self.interrupted:
            return          # a signal ended start-up: stop() cleans up
        self.signals.install()     # start() installed them; a test may call run() alone
        end = time.monotonic() + duration if duration else None
        # Start-up objects (bcc, BTF leftovers, click) never die: keep them out of every
        # collection. The classifier holds up to max_flows flows of small objects; full
        # collections over them cost a storm ~10% of its CPU (measured, bench/pipeline.py).
        gc.freeze()
        # The classifier's flows and verdicts hold no reference cycles: young collections at
        # the default 700 allocations only re-walk live flows (1-2 us a record in a storm).
        gc.set_threshold(10_000, 10, 10)
        next_status = time.monotonic() + self.status_every
        next_second = time.monotonic() + 1.0
        next_prune = time.monotonic() + self.prune_every_s
        next_exact = time.monotonic_ns() + self.exact_every_ns
        last_decoded = 0
        try:
            sig = self.signals
            while not self.stop_requested and not sig.requested:
                self.notify.tick()
                if self.health is not None:
                    self.health.beat()
                if sig.hup:      # log rotation: reopen files at the next loop turn
                    sig.hup = False
                    self.reopen_requested = True
                if self.scope is not None:   # a new pod's namespace: its first reset counts
                    self.scope.poll()
                if time.monotonic() >= next_second:
                    next_second = time.monotonic() + 1.0
                    self._report_losses()
                    if self.ifwatch is not None:
                        self.ifwatch.poll()

                if self.prune_every_s and time.monotonic() >= next_prune:
                    next_prune = time.monotonic() + self.prune_every_s
                    self._prune()
                    self._fill_service_gate()
                if self.status_every and time.monotonic() >= next_status:
                    # the 3 a.m. view: is it attached, how busy, is anything being lost
                    st = self.probes.stats()
                    rate = (self.decoded - last_decoded) / self.status_every
                    last_decoded = self.decoded
                    next_status += self.status_every
                    more = self.losses.summary()
                    log(f"status: {len(self.probes.attached)} probes, {len(self._ifaces())} "
                        f"interfaces, {rate:.0f} events/s, {st.get('lost', 0)} lost, "
                        f"{st.get('sampled', 0)} sampled, {len(self.classifier.flows)} flows tracked"
                        + (f", {st['count_full']} past the full counts map"
                           if st.get("count_full") else "")
                        + (f"; losses so far: {more}" if more else ""))
                timeout = 100   # woken sooner only every WAKE_EVERY records a CPU emits
                if end is not None:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    timeout = max(1, min(timeout, int(left * 1000)))
                now = time.monotonic_ns()   # before the drain: no event read is newer
                if self._drain(timeout) < DRAIN_BATCH:
                    # Caught up: incidents whose flow went quiet are reported on time, not at
                    # the next event. Behind (a full batch), event time alone decides, as in
                    # replay: wall time would split incidents whose events are still unread.
                    self._emit(self.classifier.tick(now))
                    self._tick_sinks(now)
                    self._flush_sinks()
                if now >= next_exact:
                    next_exact = now + self.exact_every_ns
                    self._count_exact(now)
                    self._flush_sinks()
                for r in self.recorders:
                    r.tick()
                if self.reopen_requested:
                    self.reopen_requested = False
                    for sink in self.sinks + self.recorders:
                        if hasattr(sink, "reopen"):
                            sink.reopen()
                    log("SIGHUP: reopened output files")
            self._drain_at_stop()
            self._emit(self.classifier.flush())
            self._count_exact(time.monotonic_ns())
            self._flush_sinks()
            self._report_losses()
        except OSError as e:
            # A sink's write to a full disk (--pcap says its own path, sinks/pcapng.py): what
            # is left is stdout (console or JSON lines).
            if e.errno not in OUTPUT_ERRNOS:
                raise
            self.output_failed = True
            quiet_stdout()          # the interpreter's last flush of it must stay silent
            raise output_error("stdout", e) from None
        except OutputError:
            self.output_failed = True
            raise

    # -- stop ----------------------------------------------------------------------------
    def stop(self) -> dict:
        """Detach and close everything, each step in its own guard (lifecycle.run_steps): a
        step that fails, or a second SIGTERM while one runs, skips nothing after it. The
        signal handlers stay ours until the last step, then the old ones come back."""
        self.signals.install()
        self.signals.on_again = lambda signum: log(
            f"{signal.Signals(signum).name} again: finishing the clean-up first "
            "(SIGKILL skips it; the next start removes what is left)")
        started = self.probes is not None or self.tc is not None
        stats: dict = {}

        def read_stats():
            if self.probes is not None:
                stats.update(self.probes.stats())

        def closer(attr):
            def close():
                obj = getattr(self, attr)
                setattr(self, attr, None)
                if obj is not None:
                    obj.close()
            return close

        def final_scrape():
            # every incident is in the counters (run()'s flush) and the kernel maps are still
            # open: one more scrape gives Prometheus the run's final numbers
            wait, srv = self.outputs.metrics_final_scrape_s, self.metrics_server
            if not wait or srv is None or not hasattr(srv, "wait_scrape") or not started:
                return
            log(f"final counts on {srv.url}: waiting up to {wait:g}s for one more scrape")
            if not srv.wait_scrape(wait):
                log(f"no scrape within {wait:g}s: the last counts were not scraped")

        def rules_watch_stop():
            if self.knowledge is not None:
                self.knowledge.stop_watch()

        def health_stop():
            if self.health is not None:
                self.health.stop()     # /healthz answers 503 from here on

        steps = [("notify", self.notify.stopping), ("health", health_stop),
                 ("read counters", read_stats),
                 ("loss report", self._report_losses), ("final scrape", final_scrape),
                 ("tracepoints", lambda: self.probes is not None and self.probes.begin_detach()),
                 ("tc programs", closer("tc")), ("netfilter links", closer("nf_links")),
                 ("rules watch", rules_watch_stop), ("nft trace tables", closer("nft")), ("pod names", closer("pods")),
                 ("ring reader", closer("reader"))]
        # session files: their last counter snapshot reads the live maps, so before probes
        steps += [(f"session {i}", r.close) for i, r in enumerate(self.recorders)]
        steps += [("probes", closer("probes"))]
        steps += [(f"sink {type(sk).__name__}", sk.close) for sk in self.sinks
                  if sk not in self.recorders]
        steps += [("metrics server", closer("metrics_server")),
                  ("probe server", closer("probe_server")),
                  ("instance lock", self.lock.release)]
        # an output failing again as it closes (a full disk) is said once, as the run's error
        out_errors: list[OSError] = []

        def quiet_outputs(fn):
            def step():
                try:
                    fn()
                except OSError as e:
                    if e.errno not in OUTPUT_ERRNOS:
                        raise
                    out_errors.append(e)
            return step
        steps = [(name, quiet_outputs(fn)) for name, fn in steps]
        try:
            run_steps(steps, log)
        finally:
            self.signals.on_again = None
            self.signals.restore()
        if not started:
            return {}    # never attached: nothing to report
        lost = stats.get("lost", 0)
        more = self.losses.summary()
        log(f"stopped: {self.decoded} events decoded, {lost} lost"
            + (f", {self.bad_records} undecodable" if self.bad_records else "")
            + (f" (user-space losses: {more})" if more else ""))
        for line in stop_lines(stats, self.knowledge):
            log(line)
        if out_errors and not self.output_failed:
            quiet_stdout()
            raise output_error("stdout", out_errors[0]) from None
        return stats
