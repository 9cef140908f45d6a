"""The production sinks on the real kernel: probes loaded, connection refusals made in a
namespace we create, then (1) a scrape of the served endpoint shows the exact kernel counts and
the labeled resets, (2) the recorded session replays to the same verdicts, (3) the pcapng file
tcpdump reads back. Wired the way tracer.py wires them (recorder.on_raw before feed)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request

import pytest

from nptrace import events as ev

pytestmark = pytest.mark.privileged

from loopback import CLOSED_PORT, GENERATOR, TRACEPOINTS, loopback_netns  # noqa: E402

N = 50


@pytest.fixture
def netns():
    with loopback_netns("npt-met") as ns:
        yield ns


def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body) for s in f.samples}


def kernel_resets(samples: dict) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == "nptrace_kernel_events_total"
               and ("type", "RST_SENT") in labels and ("reason", "NO_SOCKET") in labels
               and ("iface", "lo") in labels)     # only our namespace's lo has a name


def test_metrics_recording_and_pcap_on_the_real_kernel(netns, tmp_path):
    import time

    from prometheus_client import CollectorRegistry

    from nptrace import reasons
    from nptrace.kernel import btf, offsets
    from nptrace.sessions.replay import Replay
    from nptrace.sessions.report import report
    from nptrace.classify import Classifier, Context
    from nptrace.config import Config
    from nptrace.kernel.loader import Probes
    from nptrace.sessions.header import make_header
    from nptrace.sessions.writer import SessionWriter
    from nptrace.sinks.jsonl import verdict_dict
    from nptrace.sinks.pcapng import PcapngSink
    from nptrace.sinks.health import serve
    from nptrace.sinks.prometheus import MetricsSink
    from nptrace.sinks.recorder import Recorder

    ns, inode = netns
    b = btf.default()
    drops, rsts = reasons.load_tables(b)
    offset = time.time_ns() - time.monotonic_ns()
    probes = Probes(Config(), offsets.cflags(b), drops, TRACEPOINTS)
    writer = SessionWriter(tmp_path / "rec", header=make_header(epoch_offset_ns=offset,
                                                                drops=drops, resets=rsts))
    counters = lambda: (probes.counts(), probes.stats())  # noqa: E731
    rec = Recorder(writer, counters=counters)
    ifnames = {1: "lo"}
    lookup = lambda n, i: ifnames.get(i) if n == inode else None  # noqa: E731
    ctx = Context(drop_name=drops.name, rst_name=rsts.name, iface_name=rec.iface_name(lookup))
    classifier = Classifier(ctx)
    reg = CollectorRegistry()
    metrics = MetricsSink(reg)
    # The collector runs on the HTTP thread: give it the plain lookup, never the recorder's
    # wrapper (which writes session records and belongs to the main thread).
    metrics.watch_kernel(counters, iface_name=lookup, drop_name=drops.name,
                         rst_name=rsts.name, flows=lambda: len(classifier.flows),
                         probes=lambda: {tp.replace("/", ":"): True for tp in probes.attached})
    pcap = PcapngSink(tmp_path / "out.pcapng", offset)
    live = []

    def handle(verdicts) -> None:
        for v in verdicts:
            if v.event.netns != inode:   # host traffic during the test is not ours to assert on
                continue
            metrics.write(v)
            pcap.write(v)
            live.append(verdict_dict(v, offset))

    def on_record(raw: bytes) -> None:
        rec.on_raw(raw)
        handle(classifier.feed(ev.decode(raw)))

    srv = serve("127.0.0.1:0", reg)
    try:
        probes.open_ring(on_record)

        def refuse(n: int) -> None:
            r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", GENERATOR,
                                str(n), str(CLOSED_PORT)], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and int(r.stdout) == n, r.stderr
            want = sum(1 for d in live if d["direction"] == "sent") + n
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                probes.poll(100)
                handle(classifier.tick(time.monotonic_ns()))   # incidents whose flow went quiet
                rec.tick()
                if sum(1 for d in live if d["direction"] == "sent") >= want:
                    break
        # One first, so every count key exists before the scrape the delta starts from.
        refuse(1)
        before = kernel_resets(scrape(srv.url))
        refuse(N)
        after = scrape(srv.url)
        assert kernel_resets(after) - before == N      # exact in-kernel count
        sent = [d for d in live if d["direction"] == "sent"]
        assert len(sent) == N + 1
        by_cause = {}
        for d in sent:
            by_cause[d["cause"]] = by_cause.get(d["cause"], 0) + 1
        for cause, n in by_cause.items():
            assert after[("nptrace_resets_total",
                          (("cause", cause), ("direction", "sent"), ("iface", "lo")))] >= n
        assert after[("nptrace_kernel_counters_up", ())] == 1
        handle(classifier.flush())       # as the tracer does at stop, and replay at the end
        rec.snapshot_counters()
    finally:
        srv.close()
        rec.close()
        pcap.close()
        probes.close()

    # Replay: the same verdicts for this namespace's events, from the files alone.
    replayed = [verdict_dict(it.verdict, it.header["epoch_offset_ns"])
                for it in Replay(tmp_path / "rec").items()
                if it.verdict.event.netns == inode]
    assert replayed == live
    assert "kernel counts (exact" in report(tmp_path / "rec")

    if shutil.which("tcpdump"):
        out = subprocess.run(["tcpdump", "-r", str(tmp_path / "out.pcapng"), "-nn"],
                             capture_output=True, text=True, timeout=30).stdout
        assert out.count(f"127.0.0.1.{CLOSED_PORT} > 127.0.0.1.") >= N + 1
