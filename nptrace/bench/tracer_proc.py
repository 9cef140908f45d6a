"""`nptrace run` as a black box: launched as a subprocess with a ready file, timed from launch
to that file, stopped with SIGINT (its normal stop: drain, detach, `stopped: N events decoded,
M lost` on stderr). Each run gets its own instance lock file, so the benchmark does not queue
behind (or block) another nptrace on the node. It runs in the root namespace, or with `netns`
in a namespace of the bench's through `ip netns exec` (which execs: the pid is nptrace's own),
as the shipped form runs in a node's namespace."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from nptrace.bench.report import parse_attached, parse_sampled, parse_stopped
from nptrace.bench.topology import (PY, BenchError, Topology, cpu_seconds, cpu_seconds_exact,
                                    rss_bytes, wait_for)

START_TIMEOUT_S = 90


class Nptrace:
    """One `nptrace run --json` in the root namespace (or `netns`); args add --iface/--host
    etc."""

    def __init__(self, topo: Topology, logdir: Path, tag: str, args: list[str],
                 stdout_path: Path | None = None, stop_wait: float = 15.0,
                 env: dict[str, str] | None = None, netns: str | None = None):
        self.topo = topo
        self.netns = netns
        self.env = env or {}
        self.tag = tag
        self.args = args
        self.ready = logdir / f"{tag}.ready"
        self.err_path = logdir / f"{tag}.stderr"
        self.out_path = stdout_path
        self.lock = logdir / f"{tag}.lock"
        self.proc: subprocess.Popen | None = None
        self.startup_wall_s: float | None = None
        self.startup_self_s: float | None = None
        self.rss_ready: int | None = None
        self.decoded: int | None = None
        self.lost: int | None = None
        self.sampled: int | None = None    # over --max-rate: counted in the kernel, not sent
        self.stderr = ""
        self.stop_wait = stop_wait
        self.stop_s: float | None = None
        self.killed = False

    def start(self) -> "Nptrace":
        self.ready.unlink(missing_ok=True)
        env = dict(os.environ, NPTRACE_LOCK_FILE=str(self.lock), **self.env)
        out = self.topo.open_log(self.out_path) if self.out_path else subprocess.DEVNULL
        err = self.topo.open_log(self.err_path)
        argv = [PY, "-m", "nptrace.cli", "run", "--json", "--ready-file", str(self.ready),
                *self.args]
        t0 = time.monotonic()
        self.proc = self.topo.spawn(self.netns, argv, stdout=out, stderr=err, env=env)
        try:
            wait_for(self.ready.exists, START_TIMEOUT_S, 0.005, f"nptrace ({self.tag}) ready file",
                     self.proc)
        except BenchError as e:
            self.stop(5)
            raise BenchError(f"{e}: {self.stderr.strip().splitlines()[-1:] or ''}") from None
        self.startup_wall_s = time.monotonic() - t0
        self.rss_ready = rss_bytes(self.proc.pid)
        self.startup_self_s = parse_attached(self.err_path.read_text())
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def cpu_exact(self) -> float:
        return cpu_seconds_exact(self.proc.pid)

    def rss(self) -> int | None:
        return rss_bytes(self.proc.pid)

    def stop(self, wait: float | None = None) -> None:
        """SIGINT (nptrace drains its ring, detaches, prints its counts); SIGKILL after
        `wait` seconds (default stop_wait), in which case `killed` is set and the counts
        stay None."""
        if self.proc is None or self.stop_s is not None:
            return
        wait = self.stop_wait if wait is None else wait
        t0 = time.monotonic()
        self.topo.stop(self.proc, signal.SIGINT, wait)
        self.stop_s = time.monotonic() - t0
        self.stderr = self.err_path.read_text() if self.err_path.exists() else ""
        got = parse_stopped(self.stderr)
        if got:
            self.decoded, self.lost = got
            self.sampled = parse_sampled(self.stderr)
        else:
            self.killed = True
        self.ready.unlink(missing_ok=True)
        self.lock.unlink(missing_ok=True)

    def record(self, section: str) -> dict:
        return {"section": section, "tag": self.tag, "wall_s": self.startup_wall_s,
                "self_s": self.startup_self_s, "rss_ready": self.rss_ready,
                "stop_s": self.stop_s, "killed": self.killed, "decoded": self.decoded,
                "lost": self.lost, "sampled": self.sampled}

    def __enter__(self) -> "Nptrace":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
