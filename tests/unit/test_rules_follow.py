"""Node knowledge follows rule changes (node/knowledge.py check_changes): a rollout's new
endpoints are seen within the watch period, not at the next 10 s refresh."""
from nptrace.node import knowledge, rules_source


class Names:
    host = 1

    def netns_name(self, inode):
        return "host" if inode == 1 else f"ns{inode}"


class Map:
    """A ServiceMap stand-in: one endpoint address -> Service."""

    def __init__(self, eps):
        self.eps = eps

    def __bool__(self):
        return bool(self.eps)

    def lookup(self, addr, port):
        name = self.eps.get(addr)
        return type("S", (), {"name": name, "kind": "endpoint"}) if name else None

    def with_local_addrs(self, addrs):
        return self


def _node(monkeypatch, rules):
    """rules: {netns name: (fingerprint, {endpoint addr: service})}, mutable by the test."""
    monkeypatch.setattr(rules_source, "load_service_map", lambda ns: Map(dict(rules[ns or "host"][1])))
    monkeypatch.setattr(rules_source, "fingerprint", lambda ns: rules[ns or "host"][0])
    monkeypatch.setattr(rules_source, "nft_generation", lambda ns: rules[ns or "host"][0][0])
    monkeypatch.setattr(rules_source, "legacy_digest", lambda ns: rules[ns or "host"][0][1])
    monkeypatch.setattr(rules_source, "legacy_info", lambda ns: ("sizes", rules[ns or "host"][0][1]))
    monkeypatch.setattr(rules_source, "local_addresses", lambda ns: ())
    now = [0.0]
    kn = knowledge.NodeKnowledge(Names(), clock=lambda: now[0])
    return kn, now


def test_a_removed_endpoint_is_forgotten_at_the_next_check(monkeypatch):
    rules = {"host": ((7, None), {"10.244.0.10": "default/web"})}
    kn, now = _node(monkeypatch, rules)
    kn.preload({1})
    assert kn.endpoint_of("10.244.0.10", 8080) == "default/web"
    gen = kn.generation
    rules["host"] = ((8, None), {"10.244.0.11": "default/web"})    # kube-proxy's next sync
    now[0] = 1.0
    assert kn.check_changes() == 1
    assert kn.endpoint_of("10.244.0.10", 8080) is None
    assert kn.endpoint_of("10.244.0.11", 8080) == "default/web"
    assert kn.generation > gen


def test_unchanged_rules_are_not_reread_and_stay_current(monkeypatch):
    rules = {"host": ((7, None), {"10.244.0.10": "default/web"})}
    kn, now = _node(monkeypatch, rules)
    kn.preload({1})
    reads = []
    monkeypatch.setattr(rules_source, "load_service_map", lambda ns: reads.append(ns) or Map({}))
    gen = kn.generation
    for t in range(1, 30):
        now[0] = float(t)
        assert kn.check_changes() == 0
        kn.rules(1)     # checked current by the watch: no timed re-read either
    assert not reads and kn.generation == gen


def test_empty_namespaces_are_not_watched(monkeypatch):
    rules = {"host": ((1, None), {"10.244.0.10": "default/web"}), "ns5": ((1, None), {})}
    kn, now = _node(monkeypatch, rules)
    kn.preload({1, 5})
    asked = []
    monkeypatch.setattr(rules_source, "nft_generation", lambda ns: asked.append(ns) or 1)
    kn.check_changes()
    assert asked == [None]      # the host only: a pod's empty namespace costs nothing


def test_a_namespace_whose_rules_all_went_is_still_watched(monkeypatch):
    """kube-proxy deletes its table and writes it anew: the empty moment between must not
    leave the namespace unwatched (listener and checks) until the 10 s refresh."""
    rules = {"host": ((1, None), {}), "ns5": ((1, None), {"10.244.0.10": "default/web"})}
    kn, now = _node(monkeypatch, rules)
    kn.preload({1, 5})
    assert set(kn.watched_paths()) == {5}
    rules["ns5"] = ((2, None), {})                     # the table deleted
    now[0] = 1.0
    assert kn.check_changes() == 1 and kn.endpoint_of("10.244.0.10", 8080) is None
    assert set(kn.watched_paths()) == {5}
    rules["ns5"] = ((3, None), {"10.244.0.11": "default/web"})   # and written anew
    now[0] = 2.0
    assert kn.check_changes() == 1 and kn.endpoint_of("10.244.0.11", 8080) == "default/web"
    kn.prune({1})
    assert kn.watched_paths() == {}


def test_the_watch_thread_starts_and_stops(monkeypatch):
    rules = {"host": ((1, None), {"10.244.0.10": "default/web"})}
    kn, _ = _node(monkeypatch, rules)
    kn.preload({1})
    kn.start_watch(every_s=0.01)
    rules["host"] = ((2, None), {})
    import time
    for _ in range(200):
        if kn.endpoint_of("10.244.0.10", 8080) is None:
            break
        time.sleep(0.01)
    kn.stop_watch()
    assert kn.endpoint_of("10.244.0.10", 8080) is None and kn._watch is None


def test_exact_counts_relabel_when_rules_move():
    from nptrace.sinks.exact import ExactCounts
    cleared = []

    class Labeler:
        def clear(self):
            cleared.append(1)

        def register(self, keys):
            pass

        def label(self, key):
            raise AssertionError("no keys")

    gen = [0]
    ex = ExactCounts(Labeler(), generation=lambda: gen[0])
    ex.update({}, 1)
    ex.update({}, 2)
    assert len(cleared) == 1
    gen[0] = 1
    ex.update({}, 3)
    assert len(cleared) == 2


def test_a_chain_left_behind_by_a_restore_names_no_endpoint():
    """iptables-restore --noflush rewrites the chains it declares: a Service re-rendered without
    web-0 no longer jumps to web-0's KUBE-SEP chain, which may stay in the table."""
    from nptrace.services import parse_iptables_save
    dump = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-WEB - [0:0]
:KUBE-SEP-OLD - [0:0]
:KUBE-SEP-NEW - [0:0]
-A KUBE-SERVICES -d 10.96.0.80/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-WEB
-A KUBE-SEP-OLD -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.0.10:8080
-A KUBE-SEP-NEW -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.1.10:8080
-A KUBE-SVC-WEB -m comment --comment "default/web:http -> 10.244.1.10:8080" -j KUBE-SEP-NEW
COMMIT
"""
    m = parse_iptables_save(dump)
    assert m.lookup("10.244.0.10", 8080) is None
    assert m.lookup("10.244.1.10", 8080).name == "default/web:http"
    # one chain listed alone (no jumps in the dump): its endpoint still counts
    alone = "\n".join(ln for ln in dump.splitlines() if "KUBE-SVC-WEB" not in ln or ln.startswith(":"))
    assert parse_iptables_save(alone).lookup("10.244.0.10", 8080) is not None


def test_a_heavy_legacy_dump_is_spaced_out(monkeypatch):
    """iptables-legacy has no generation id: its dump is hashed, at most 2% of a core."""
    rules = {"host": ((None, "d1"), {"10.244.0.10": "default/web"})}
    kn, now = _node(monkeypatch, rules)
    kn.preload({1})
    dumps = []

    def slow_digest(ns):
        dumps.append(now[0])
        now[0] += 0.1          # a 100 ms dump (a few thousand Services)
        return rules["host"][0][1]
    monkeypatch.setattr(rules_source, "legacy_digest", slow_digest)
    monkeypatch.setattr(knowledge.time, "perf_counter", lambda: now[0])
    for t in range(1, 30):
        now[0] = float(t)
        kn.check_changes()
    assert 3 <= len(dumps) <= 6, dumps      # every ~5 s, not every second


def test_the_frequent_legacy_look_reads_only_legacy_tables_and_follows_them(monkeypatch):
    """The watch's look every LEGACY_EVERY_S: namespaces with legacy tables only, their
    digest only (no nf_tables or IPVS query), and a moved digest re-reads the map."""
    rules = {"host": ((7, "d1"), {"10.244.0.10": "default/web"}), "ns2": ((3, None), {"10.244.1.10": "x"})}
    kn, now = _node(monkeypatch, rules)
    kn.preload({1, 2})
    asked = []
    monkeypatch.setattr(rules_source, "nft_generation", lambda ns: asked.append(("gen", ns)) or rules[ns or "host"][0][0])
    monkeypatch.setattr(rules_source, "ipvs_digest", lambda ns: asked.append(("ipvs", ns)))
    kn.check_changes()
    assert kn._legacy_ns == {1}               # ns2 has no legacy tables
    asked.clear()
    rules["host"] = ((7, "d2"), {"10.244.0.11": "default/web"})
    now[0] += 1.0
    assert kn.check_changes(legacy_only=True) == 1
    assert asked == []                        # the legacy tables alone were asked
    assert kn.service_of("10.244.0.11", 8080) == "default/web"
    # a rule rewritten in place (sizes unmoved): found by the whole blob when it is due
    monkeypatch.setattr(rules_source, "legacy_info", lambda ns: "same sizes")
    kn.check_changes(legacy_only=True)
    rules["host"] = ((7, "d3"), {"10.244.0.12": "default/web"})
    kn._legacy_next[1] = now[0] + 2.0
    assert kn.check_changes(legacy_only=True) == 0      # not due: the sizes alone, unmoved
    now[0] += 2.0
    assert kn.check_changes(legacy_only=True) == 1
    assert kn.service_of("10.244.0.12", 8080) == "default/web"


def test_the_barrier_waits_for_a_legacy_look_begun_after_it(monkeypatch):
    import threading
    monkeypatch.setattr(knowledge, "BARRIER_S", 2.0)
    kn, _ = _node(monkeypatch, {"host": ((None, "d1"), {})})
    kn._legacy_ns = {1}
    assert kn.barrier() == 0.0                # no watch running: nothing will look
    kn._watch = object()
    looked = threading.Timer(0.05, lambda: setattr(kn, "_legacy_look_ns", knowledge.time.monotonic_ns()))
    looked.start()
    waited = kn.barrier()
    assert 0.03 <= waited < 1.5 and kn.barrier_late == 0     # the timer began just before it
    kn._legacy_ns = set()
    assert kn.barrier() == 0.0                # no legacy tables: no look to wait for


class Pending:
    """NftChanges' pending() as a switch."""

    def __init__(self, on=False):
        self.on = on

    def pending(self):
        return self.on


def test_the_barrier_waits_for_a_heard_commit_to_be_applied(monkeypatch):
    import threading
    monkeypatch.setattr(knowledge, "BARRIER_S", 2.0)
    kn, _ = _node(monkeypatch, {"host": ((1, None), {})})
    assert kn.barrier() == 0.0                # no watch: nothing to wait for
    kn.nft = Pending()
    assert kn.barrier() == 0.0 and kn.barrier_waits == 0
    kn.nft.on = True                          # a commit not yet drained, then being applied
    def apply():
        kn._rereading = True
        kn.nft.on = False
        threading.Event().wait(0.05)
        kn._rereading = False
    threading.Timer(0.02, apply).start()
    waited = kn.barrier()
    assert 0.05 <= waited < 1.5 and kn.barrier_waits == 1 and kn.barrier_late == 0


def test_past_the_bound_records_are_labeled_and_one_wait_per_watch_turn(monkeypatch):
    monkeypatch.setattr(knowledge, "BARRIER_S", 0.05)
    kn, _ = _node(monkeypatch, {"host": ((1, None), {})})
    kn.nft = Pending(on=True)                 # the watch is stuck (a long legacy dump)
    assert kn.barrier() >= 0.05 and kn.barrier_late == 1
    assert kn.barrier() == 0.0                # the same turn: no second wait
    kn._turns += 1
    assert kn.barrier() >= 0.05 and kn.barrier_late == 2


def test_a_record_is_labeled_with_the_generation_in_force_at_its_time(monkeypatch):
    """A recorded sequence of rule generations: web-0 (10.244.0.10) is an endpoint until T1,
    then only another Service's pod is (T1), then a new pod has the old address (T2). Lookups answer
    for the record's time, before and after each change, whenever they are asked."""
    T1, T2 = 5 * 10**9, 9 * 10**9
    rules = {"host": ((1, None), {"10.244.0.10": "default/web"})}
    kn, now = _node(monkeypatch, rules)
    kn.preload({1})                                        # in force since the start
    rules["host"] = ((2, None), {"10.244.0.99": "default/other"})
    assert kn.check_changes(since_ns=T1) == 1
    rules["host"] = ((3, None), {"10.244.0.10": "default/web-new"})
    assert kn.check_changes(since_ns=T2) == 1
    for ts, want in ((1, "default/web"), (T1 - 1, "default/web"), (T1, None),
                     (T2 - 1, None), (T2, "default/web-new"), (T2 + 10**9, "default/web-new")):
        kn.at(ts)
        assert kn.endpoint_of("10.244.0.10", 8080) == want, ts
    kn.at(0)
    assert kn.service_of("10.244.0.10", 8080) == "default/web"
    kn.at(None)                                            # the rules now
    assert kn.endpoint_of("10.244.0.10", 8080) == "default/web-new"


def test_the_classifier_asks_for_each_records_time(monkeypatch):
    from nptrace import events as ev
    from nptrace.classify import Classifier, Context
    asked = []
    c = Classifier(Context(at=asked.append, drop_name=lambda v: "NEIGH_FAILED"))
    e = ev.decode(ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=9,
                            ts_ns=123_456, saddr="10.0.0.1", sport=1, daddr="10.0.0.2", dport=2))
    c.feed(e)
    c.flush()
    assert asked and set(asked) == {123_456}
