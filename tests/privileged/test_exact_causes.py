"""The exactness check: a storm of three causes at once, with default options, and every record
counted under its cause. The storm and its truth counters are nptrace/bench/three_causes.py
(the reset_storm bench section runs the same storm for its per-cause counting error rows):
no_listener resets (truth: TcpOutRsts), rp_filter drops (TcpExtIPReversePathFilter) and
policy_drop drops (the DROP rule's packet counter), all at once.
`nptrace run --json --metrics-addr` (default --max-rate: only a sample reaches user space)
must export each cause's counter within 0.5% of its truth, and the `repeat` of its JSON
summary lines plus its incident lines must add up to the counter; `replay` of the session it
recorded gives the same sums, and `report` the same summary counts."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from loopback import need_root_and_bcc
from nptrace.bench import three_causes as storm
from nptrace.lab.harness import interrupt

pytestmark = pytest.mark.privileged
TAG = f"{os.getpid() % 10000}"
CLI, SRV = f"npt-xc{TAG}", f"npt-xs{TAG}"
FLOOD_S = 3


@pytest.fixture
def topo():
    need_root_and_bcc()
    if not subprocess.run(["which", "hping3"], capture_output=True).returncode == 0:
        pytest.skip("hping3 not installed (scripts/setup.sh installs it)")
    for ns in (CLI, SRV):
        storm.sh("ip", "netns", "add", ns)
    try:
        storm.build(CLI, SRV)
        yield
    finally:
        for ns in (CLI, SRV):
            storm.sh("ip", "netns", "del", ns, check=False)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_three_cause_storm_is_counted_exactly(topo, tmp_path):
    port = free_port()
    ready, out, err = tmp_path / "ready", tmp_path / "out.jsonl", tmp_path / "err"
    env = dict(os.environ, NPTRACE_LOCK_FILE=str(tmp_path / "lock"))
    base = storm.snapshot(SRV)
    rec = tmp_path / "session"
    proc = subprocess.Popen([sys.executable, "-m", "nptrace.cli", "run", "--json",
                             "--ready-file", str(ready), "--metrics-addr", f"127.0.0.1:{port}",
                             "--record", str(rec)],
                            stdout=out.open("w"), stderr=err.open("w"), env=env)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        storm.flood(CLI, FLOOD_S)
        time.sleep(2.5)            # the once-a-second count picks up the last records
        after = storm.snapshot(SRV)
        m = storm.settled(port)    # two reads a second apart agree
    finally:
        interrupt(proc)
    truth = storm.truth(base, after)
    got = storm.exported(m)
    records = storm.total(m, "nptrace_kernel_events_total")
    print(f"\ntruth {truth}\nexported {got}\nkernel records {records:.0f}, sampled "
          f"{storm.total(m, 'nptrace_events_sampled_total'):.0f}")
    assert records >= 200_000, records
    for cause, n in truth.items():
        assert n > 10_000, (cause, n)
        assert abs(got[cause] - n) <= 0.005 * n, (cause, got[cause], n)

    # the JSON lines: summary rows' repeat plus the records the incident lines carry
    summary, incidents = storm.line_sums(out.read_text())
    print(f"summary repeat {summary}, records in incident lines {incidents}")
    for c in summary:
        assert summary[c] > 0
        # within 0.1%: records sent in the last instants may be read after the stop began,
        # and a client port hping3 reuses joins two connections in one incident
        assert summary[c] + incidents[c] == pytest.approx(got[c], rel=0.001), \
            (c, summary[c], incidents[c], got[c])

    # the session replays to the same lines, and its report counts the same summaries
    r = subprocess.run([sys.executable, "-m", "nptrace.cli", "replay", str(rec), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rsummary, rincidents = storm.line_sums(r.stdout)
    print(f"replay: summary repeat {rsummary}, records in incident lines {rincidents}")
    assert rsummary == summary
    for c in summary:
        assert rincidents[c] == pytest.approx(incidents[c], rel=0.01), (c, rincidents, incidents)
    rep = subprocess.run([sys.executable, "-m", "nptrace.cli", "report", str(rec)],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert "counted, not sent" in rep.stdout
    assert f"{summary['rp_filter']}" in rep.stdout, rep.stdout
