"""The mapped ring reader against the real probes: every emitted record arrives and decodes.

Resets come from connects to a closed port on the loopback of a namespace made for the test
(npt-rb<pid>): each one fires tcp:tcp_send_reset (NO_SOCKET), tcp:tcp_receive_reset and, when
the reason table makes NO_SOCKET drops worth an event, skb:kfree_skb in that namespace.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from nptrace import events as ev
from nptrace.kernel import ringbuf as rb

pytestmark = pytest.mark.privileged

from loopback import CLOSED_PORT, GENERATOR, TRACEPOINTS, loopback_netns  # noqa: E402


@pytest.fixture(scope="module")
def netns():
    with loopback_netns("npt-rb") as ns:
        yield ns


def load_probes(**cfg_kw):
    from nptrace import reasons
    from nptrace.kernel import btf, offsets
    from nptrace.config import Config
    from nptrace.kernel.loader import Probes
    b = btf.default()
    drops, _ = reasons.load_tables(b)
    cfg_kw.setdefault("ringbuf_pages", 4096)   # these tests size their storms for 16 MiB
    return Probes(Config(**cfg_kw), offsets.cflags(b), drops, TRACEPOINTS)


def start_resets(ns: str, n: int) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", GENERATOR,
                             str(n), str(CLOSED_PORT)], stdout=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, n: int) -> None:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and int(out) == n, f"generator: {out!r}"


def drain_until_settled(probes, reader, got: list, base: int = 0) -> dict:
    """Read until the ring is empty AND the kernel's emitted count (minus `base`, what was
    emitted before `got` started) equals what was read (host traffic may still add records:
    retry briefly)."""
    deadline = time.monotonic() + 5
    while True:
        while (batch := reader.read_batch()):
            got += batch
        stats = probes.stats()
        while (batch := reader.read_batch()):
            got += batch
        if stats["emitted"] - base == len(got) or time.monotonic() > deadline:
            return stats


def baseline(probes, reader) -> dict:
    """Empty the ring and return stats that count exactly the records consumed so far: the
    host's other traffic keeps emitting, so retry until the ring is still empty after the
    stats read (a record counted in them was committed before it, hence already read)."""
    deadline = time.monotonic() + 5
    while True:
        reader.read_batch()
        stats = probes.stats()
        if reader.pending_bytes() == 0 or time.monotonic() > deadline:
            return stats


@pytest.fixture(scope="module")
def probes(netns):
    p = load_probes()
    try:
        yield p
    finally:
        p.close()


def test_reader_gets_every_emitted_record(probes, netns):
    ns, inode = netns
    n = 20000
    info = rb.map_info(probes.ring_map_fd())
    assert info["type"] == rb.BPF_MAP_TYPE_RINGBUF
    got: list = []
    with rb.RingReader(probes.ring_map_fd()) as reader:
        assert reader.data_size == info["max_entries"] == 4096 * 4096
        before = baseline(probes, reader)
        gen = start_resets(ns, n)
        t0 = time.monotonic()
        while gen.poll() is None:
            got += reader.poll(50)
        dt = time.monotonic() - t0
        finish(gen, n)
        stats = drain_until_settled(probes, reader, got, before["emitted"])
    assert stats["lost"] == before["lost"], stats
    assert len(got) == stats["emitted"] - before["emitted"], (len(got), before, stats)
    decoded = [ev.from_tuple(t) for t in got]
    ours = [e for e in decoded if e.netns == inode]
    sent = [e for e in ours if e.type is ev.EvType.RST_SENT and e.sport == CLOSED_PORT]
    assert len(sent) == n
    assert sum(e.type is ev.EvType.RST_RECV for e in ours) == n
    print(f"\nlive concurrent: {len(got)} records in {dt:.2f} s while generating "
          f"({len(got) / dt / 1e3:.0f}k/s, generator-bound), {reader.stats.as_dict()}")


def storm_drain(probes, ns: str, n: int) -> tuple[int, float]:
    """Let the records of n resets pile up unread, then time the walk + unpack of all of them."""
    got: list = []
    with rb.RingReader(probes.ring_map_fd()) as reader:
        before = baseline(probes, reader)
        finish(start_resets(ns, n), n)
        pending = reader.pending_bytes()
        t0 = time.perf_counter()
        while (batch := reader.read_batch()):
            got += batch
        dt = time.perf_counter() - t0
        records = len(got)
        after = drain_until_settled(probes, reader, got, before["emitted"])
    assert after["lost"] == before["lost"], "16 MiB ring overflowed: fewer resets needed"
    assert len(got) == after["emitted"] - before["emitted"]
    assert pending >= 2 * n * rb.stride_of(ev.SIZE)
    for t in got[:: max(1, len(got) // 1000)]:
        ev.from_tuple(t)
    return records, dt


def records_per_connect(probes, ns: str) -> float:
    """How many records one refused connect makes with the probes as loaded (2 or 3,
    depending on whether NO_SOCKET drops are worth an event)."""
    with rb.RingReader(probes.ring_map_fd()) as reader:
        got: list = []
        before = baseline(probes, reader)
        finish(start_resets(ns, 200), 200)
        drain_until_settled(probes, reader, got, before["emitted"])
    return len(got) / 200


def test_real_storm_drain_rate(probes, netns, record_property):
    ns, _ = netns
    # fill about 60% of the 16 MiB ring: enough records to time, no overflow
    n = int(0.6 * (16 << 20) / rb.stride_of(ev.SIZE) / max(1.0, records_per_connect(probes, ns)))
    # A second try only if the first was slow: this VM is shared and a stall of a few ms
    # (another test's namespace teardown) skews one 40 ms measurement.
    for _ in range(2):
        records, dt = storm_drain(probes, ns, n)
        rate = records / dt
        if rate > 250_000:
            break
    record_property("records_per_s", int(rate))
    print(f"\nreal storm drain: {records} records ({records * 224 / 2**20:.1f} MiB) in "
          f"{dt * 1e3:.1f} ms = {rate / 1e6:.2f} M records/s")
    assert rate > 250_000  # target is 1M/s; the floor only catches a broken fast path
