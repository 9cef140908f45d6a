"""connrate's verdict (the median's interval against the target) and its workload's close
order, on loopback: no root, no namespaces."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from nptrace.bench import connrate

TRAFFIC = [sys.executable, "-m", "nptrace.bench.traffic"]


def test_median_interval_holds_the_middle_order_statistics():
    lo, hi = connrate.median_ci([i / 100 for i in range(100)])
    assert (lo, hi) == (0.4, 0.59)      # ranks 50 -+ 9.8
    assert connrate.median_ci([]) == (None, None)
    assert connrate.median_ci([1.0]) == (1.0, 1.0)


def test_ratio_row_says_whether_the_lower_bound_clears_the_target():
    plain = [100.0] * 30
    row, data = connrate.ratio_row("connrate", "m", str, [99.0] * 30, plain, 0.97)
    assert row.met and data["ci_clears_target"]
    assert "lower bound clears 97%" in row.ratio_target
    # median above the target, its interval not: met by the median, not beyond the noise
    noisy = [90.0, 104.0] * 15
    noisy[0] = 98.0
    row, data = connrate.ratio_row("connrate", "m", str, noisy, plain, 0.97)
    assert data["median_ci95"][0] < 0.97
    assert data["ci_clears_target"] is False and "lower bound below 97%" in row.ratio_target


@pytest.fixture
def accept_port():
    """The port of a running `traffic accept` server on loopback."""
    with socket.socket() as probe:     # a free port for the server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(TRAFFIC + ["accept", "--port", str(port)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert "ready" in server.stdout.readline()
        yield port
    finally:
        server.kill()
        server.wait()


def test_client_closes_first_and_every_connection_completes(accept_port):
    out = subprocess.run(TRAFFIC + ["connect", "--host", "127.0.0.1", "--port", str(accept_port),
                                    "--secs", "0.3", "--conc", "8"],
                         capture_output=True, text=True, timeout=30)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["done"] > 0 and r["failed"] == 0


def test_a_served_client_runs_once_a_line_and_starts_each_run_from_none_in_flight(accept_port):
    client = subprocess.Popen(TRAFFIC + ["connect", "--host", "127.0.0.1", "--port",
                                         str(accept_port), "--conc", "8", "--serve"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(client.stdout.readline()) == {"ready": True}
        for secs in ("0.2", "0.1"):
            client.stdin.write(secs + "\n")
            client.stdin.flush()
            r = json.loads(client.stdout.readline())
            # the connections in flight at the run's end were let end, uncounted
            assert r["done"] > 0 and r["failed"] == 0 and r["stuck"] == 0
            assert float(secs) <= r["secs"] < float(secs) + 1
        client.stdin.close()
        assert client.wait(10) == 0
    finally:
        client.kill()
        client.wait()
