"""The two steady workloads the with/without comparisons run: bulk TCP (iperf3, or the Python
fallback in traffic.py when iperf3 is absent) and new connections through a DNAT'd NodePort
(traffic.py's accept server and non-blocking connect clients)."""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time

from nptrace.bench.topology import PY, BenchError, Topology, in_ns, sh, wait_for

TRAFFIC = [PY, "-m", "nptrace.bench.traffic"]


def _json_tail(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise BenchError(f"no JSON result in {text[-200:]!r}")


class Bulk:
    """Bulk TCP from client_ns to host:port in server_ns; run(secs) -> receiver bits/s."""

    def __init__(self, topo: Topology, server_ns: str, client_ns: str, host: str,
                 port: int = 5201):
        self.topo, self.client_ns, self.host, self.port = topo, client_ns, host, port
        self.iperf3 = shutil.which("iperf3")
        if self.iperf3:
            self.tool = "iperf3"
            self.server = topo.spawn(server_ns, [self.iperf3, "-s", "-p", str(port)])
            # iperf3 -s has no ready line on stdout worth parsing: wait for its socket
            wait_for(lambda: f":{port}" in sh(*in_ns(server_ns, ["ss", "-Htln"])), 10,
                     0.05, "iperf3 server listening", self.server)
        else:
            self.tool = "python"
            self.server = topo.spawn(server_ns, TRAFFIC + ["sink", "--port", str(port)],
                                     stdout=subprocess.PIPE)
            if "ready" not in self.server.stdout.readline():
                raise BenchError("bulk sink did not start")

    def run(self, secs: float) -> float:
        if self.tool == "iperf3":
            # whole seconds: iperf3 3.12 never ends a run given a fractional -t
            secs = max(1, round(secs))
            # Sender on CPU 0, receiver on CPU 1 (-A: iperf3 pins both ends). Left to the
            # scheduler, the two sometimes share a CPU and the run halves (10 vs 20 Gbit/s
            # here), which swung single ratios from 53% to 162%.
            pin = ["-A", "0,1"] if (os.cpu_count() or 1) >= 2 else []
            out = sh(*in_ns(self.client_ns, [self.iperf3, "-c", self.host, "-p", str(self.port),
                                             "-t", str(secs), "-J", *pin]), timeout=secs + 30)
            from nptrace.bench.report import iperf3_bps
            return iperf3_bps(json.loads(out))
        out = sh(*in_ns(self.client_ns, TRAFFIC + ["source", "--host", self.host, "--port",
                                                   str(self.port), "--secs", f"{secs:g}"]),
                 timeout=secs + 30)
        return float(_json_tail(out)["bps"])


def _pinned(cpu: int | None, argv: list[str]) -> list[str]:
    return argv if cpu is None else ["taskset", "-c", str(cpu), *argv]


class ConnLoad:
    """Connections/s from `clients` processes in client_ns to host:port (a NodePort); client
    i runs on CPU cpus[i % len(cpus)] and the server on server_cpu when given (taskset).
    The client closes first (traffic.py): reset-free with the sysctls connrate.setup sets.

    serve: the clients are started once and run on command (traffic.py connect --serve), each
    run from none in flight, and let the connections end after it; without it every run
    starts its clients afresh (tens of ms of Python start between two runs)."""

    def __init__(self, topo: Topology, server_ns: str, server_port: int, client_ns: str,
                 host: str, port: int, clients: int = 2, conc: int = 128,
                 cpus: list[int] | None = None, server_cpu: int | None = None,
                 serve: bool = False):
        self.topo, self.client_ns, self.host, self.port = topo, client_ns, host, port
        self.clients, self.conc, self.cpus = clients, conc, cpus
        self.server = topo.spawn(server_ns, _pinned(server_cpu, TRAFFIC + [
            "accept", "--port", str(server_port)]), stdout=subprocess.PIPE)
        if "ready" not in self.server.stdout.readline():
            raise BenchError("accept server did not start")
        self.served = [self._client(["--serve"], subprocess.PIPE, i)
                       for i in range(clients)] if serve else []
        for p in self.served:
            _reply(p, 30, "connect client did not start")

    def _client(self, extra: list[str], stdin, i: int) -> subprocess.Popen:
        argv = TRAFFIC + ["connect", "--host", self.host, "--port", str(self.port),
                          "--conc", str(self.conc), *extra]
        cpu = self.cpus[i % len(self.cpus)] if self.cpus else None
        return self.topo.spawn(self.client_ns, _pinned(cpu, argv), stdout=subprocess.PIPE,
                               stdin=stdin)

    def run(self, secs: float) -> dict:
        if self.served:
            for p in self.served:
                p.stdin.write(f"{secs:g}\n")
                p.stdin.flush()
            results = [_reply(p, secs + 30, "connect client did not finish")
                       for p in self.served]
        else:
            results = []
            for p in [self._client(["--secs", f"{secs:g}"], subprocess.DEVNULL, i)
                      for i in range(self.clients)]:
                try:
                    out, _ = p.communicate(timeout=secs + 30)
                except subprocess.TimeoutExpired:
                    self.topo.stop(p)
                    raise BenchError("connect client did not finish") from None
                if p in self.topo.procs:
                    self.topo.procs.remove(p)
                results.append(_json_tail(out))
        done = sum(r["done"] for r in results)
        failed = sum(r["failed"] for r in results)
        secs_max = max(r["secs"] for r in results)
        return {"done": done, "failed": failed, "secs": secs_max,
                "rate": done / secs_max if secs_max else 0.0}


def _reply(p: subprocess.Popen, timeout: float, what: str) -> dict:
    """The next JSON line a served client prints, within timeout seconds."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0 or not select.select([p.stdout], [], [], left)[0]:
            raise BenchError(what)
        line = p.stdout.readline()
        if not line:
            raise BenchError(f"{what}: it exited ({p.poll()})")
        if line.startswith("{"):
            return json.loads(line)
