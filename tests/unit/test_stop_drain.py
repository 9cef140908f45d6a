"""daemon/tracer.py _drain_at_stop: the stop drains the ring for a bounded time, and what the
bound leaves there is counted as a loss (stop_unread), not dropped in silence."""
from nptrace import events as ev
from nptrace.daemon.tracer import Tracer
from nptrace.kernel.ringbuf import stride_of


class Ring:
    def __init__(self, records):
        self.left = records

    def pending_bytes(self):
        return self.left * stride_of(ev.SIZE)


def tracer_over(ring):
    t = Tracer.__new__(Tracer)
    t.reader, t.unread_at_stop = ring, 0

    def drain(_timeout):
        n = min(ring.left, 100)
        ring.left -= n
        return n
    t._drain = drain
    return t


def test_a_ring_drained_within_the_bound_loses_nothing():
    t = tracer_over(Ring(250))
    now = [0.0]
    t._drain_at_stop(2.0, clock=lambda: now[0])
    assert t.unread_at_stop == 0


def test_what_the_bound_leaves_in_the_ring_is_counted():
    ring = Ring(10_000)
    t = tracer_over(ring)
    now = [0.0]

    def clock():
        now[0] += 0.5          # each look at the clock: half a second of a storm's draining
        return now[0]
    t._drain_at_stop(2.0, clock=clock)
    assert t.unread_at_stop == ring.left > 0
