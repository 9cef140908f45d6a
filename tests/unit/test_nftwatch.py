"""node/nftwatch.py NftChanges: listeners follow the namespaces asked for, wait() names the
ones that committed (ready), drain() empties them, and a listener that cannot be opened is
remembered."""
import os
import socket

import pytest

from nptrace.node.nftwatch import NftChanges


class Opener:
    def __init__(self, refuse=()):
        self.peers: dict = {}
        self.opened: list = []
        self.refuse = set(refuse)

    def __call__(self, path):
        if path in self.refuse:
            raise PermissionError(1, "Operation not permitted")
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        self.peers[path] = theirs
        self.opened.append(path)
        return ours


def test_a_commit_is_heard_once_and_drained():
    op = Opener()
    w = NftChanges(op)
    w.sync({10: "/run/netns/a", 11: "/run/netns/b"})
    assert w.ready(0) == [] and not w.pending()
    op.peers["/run/netns/b"].send(b"x" * 300)
    op.peers["/run/netns/b"].send(b"y" * 300)
    assert w.ready(1.0) == [11] and w.pending()
    assert w.drain([11]) == [11]
    assert w.ready(0) == [] and not w.pending()     # both messages were drained
    w.close()


def test_listeners_follow_the_namespaces_and_failures_are_not_retried_while_wanted():
    op = Opener(refuse={"/run/netns/c"})
    w = NftChanges(op)
    w.sync({10: "/run/netns/a", 12: "/run/netns/c"})
    assert w.watched() == {10} and 12 in w.failed
    w.sync({10: "/run/netns/a", 12: "/run/netns/c"})
    assert op.opened == ["/run/netns/a"]          # neither reopened nor retried
    w.sync({12: "/run/netns/c"})
    assert w.watched() == set()
    w.sync({})
    assert not w.failed                           # gone: tried again if it comes back
    w.close()


def test_a_listener_whose_peer_went_away_is_dropped():
    op = Opener()
    w = NftChanges(op)
    w.sync({10: None})
    op.peers[None].close()
    assert w.drain(w.ready(1.0)) == [10] and w.watched() == set()
    w.close()


def test_wake_ends_a_wait_at_once():
    """A stop wakes the watch thread's wait (a second's timeout) instead of waiting it out,
    with listeners or without."""
    import threading
    import time
    for wanted in ({10: "/run/netns/a"}, {}):
        w = NftChanges(Opener())
        w.sync(wanted)
        got = []
        t = threading.Thread(target=lambda: got.append(w.ready(30.0)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.05)
        w.wake()
        t.join(timeout=5)
        assert got == [[]] and time.monotonic() - t0 < 5
        w.close()


def test_a_wake_after_close_writes_nowhere():
    w = NftChanges(Opener())
    w.close()
    r, wr = os.pipe()         # may take the closed fd's number
    try:
        w.wake()
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)      # nothing was written to whatever has that number now
    finally:
        os.close(r)
        os.close(wr)
