"""State the main loop shares with other threads, and threads the main loop starts.

node/netns.py Names is used by the main loop (the classifier's lookups) and by the metrics
server's scrape worker (the collectors' iface labels) at once: hammered here from two threads
through forced evictions and prunes, it must never raise (an unlocked eviction raised KeyError
in the main loop, which then exited; without the lock this test fails in each of 3 runs of 3,
with "dictionary changed size during iteration" in the eviction).

A thread the main loop starts that cannot be started (thread exhaustion: RuntimeError "can't
start new thread") is handled where it is started. The metrics server's are in test_httpd.py."""
import sys
import threading
import time

import pytest


def test_names_hammered_from_two_threads(monkeypatch):
    from nptrace.node import netns
    monkeypatch.setattr(netns, "named_namespaces", lambda: {})
    monkeypatch.setattr(netns, "MAX_CACHED_NAMESPACES", 8)     # every few lookups evict
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)          # switch threads as often as the interpreter can
    try:
        n = netns.Names(refresh_s=0.0)

        def links(inode):       # no sleep: both threads stay in the eviction loop's window
            return {1: f"eth{inode % 3}", 2: "lo"}
        monkeypatch.setattr(n, "_load_links", links)
        errors, stop = [], threading.Event()

        def main_loop():
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    n.iface(1000 + i % 40, 1 + i % 2)
                    n.netns_name(1000 + i % 40)
                    if i % 50 == 0:
                        n.prune({1000 + j for j in range(0, 40, 3)})
                except Exception as e:
                    errors.append(("main", repr(e)))
                    return

        def scrape_worker():
            i = 0
            while not stop.is_set():
                i += 7
                try:
                    n.iface(1000 + i % 40, 1)
                except Exception as e:
                    errors.append(("scrape", repr(e)))
                    return
        threads = [threading.Thread(target=main_loop), threading.Thread(target=scrape_worker)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(5)
        assert not errors, errors
        assert len(n._links) <= 8 and len(n._last_scan) <= 16
    finally:
        sys.setswitchinterval(interval)


def test_run_in_cannot_start_a_thread_is_an_oserror(monkeypatch):
    """nsenter.run_in starts a thread per namespace switch, on the main loop's lookups: at the
    thread limit that is the OSError its callers handle (namespace not readable), not a
    RuntimeError that ends the loop."""
    from nptrace.kernel import nsenter

    def refuse(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(OSError, match="cannot start a thread"):
        nsenter.run_in("/proc/self/ns/net", lambda: 1)


def test_nft_trace_reader_that_cannot_start_is_said_not_raised(monkeypatch):
    from nptrace.node import nftrace_live
    said = []
    tr = nftrace_live.TracedRules(knowledge=None, log=said.append)

    def refuse(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    tr._start_reader()
    tr._start_reader()
    assert tr._thread is None and len(said) == 1 and "not started" in said[0]
    assert tr.reader_not_started == 2
