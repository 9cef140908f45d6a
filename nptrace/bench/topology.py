"""Network namespaces and processes a benchmark starts, and their removal even on failure.

A `Topology` owns namespaces named `npt-bn<pid>-<name>` and every process it spawned (in a
namespace through `ip netns exec`, which execs, so the pid is the program's own, or in the
root namespace). `close()` stops the processes first (a namespace stays alive while a process
is in it), then deletes the namespaces. `remove_stale()` deletes namespaces of bench runs whose
pid no longer runs (a run killed with -9). Nothing here touches the root namespace's links,
routes or firewall.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "npt-bn"
_STALE = re.compile(rf"^{PREFIX}(\d+)-")
PY = sys.executable   # the venv's python: imports nptrace (editable) and, via system site, bcc


class BenchError(RuntimeError):
    """A benchmark step failed; the message says which and why."""


def sh(*cmd: str, check: bool = True, timeout: float = 30, input: str | None = None) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{' '.join(cmd)}: no answer in {timeout:.0f}s") from None
    except FileNotFoundError:
        raise BenchError(f"{cmd[0]}: not installed") from None
    if check and r.returncode != 0:
        raise BenchError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()[:300]}")
    return r.stdout


def in_ns(ns: str | None, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv] if ns else list(argv)


def netns_names() -> list[str]:
    try:
        return sorted(p.name for p in Path("/run/netns").iterdir())
    except OSError:
        return []


def remove_stale() -> list[str]:
    """Delete `npt-bn<pid>-*` namespaces whose bench pid is gone; returns their names."""
    gone = []
    for name in netns_names():
        m = _STALE.match(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone.append(name)
    return gone


class Topology:
    def __init__(self, tag: str):
        self.owner = os.getpid()
        self.prefix = f"{PREFIX}{self.owner}-{tag}"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._files: list = []

    # --- namespaces and links ----------------------------------------------------------
    def ns(self, name: str) -> str:
        full = f"{self.prefix}-{name}"
        if full not in self.namespaces:
            sh("ip", "netns", "add", full)
            self.namespaces.append(full)
            sh("ip", "-n", full, "link", "set", "lo", "up")
        return full

    def veth(self, a: str, dev_a: str, addr_a: str | None, b: str, dev_b: str,
             addr_b: str | None, mtu: int | None = None) -> None:
        sh("ip", "link", "add", dev_a, "netns", a, "type", "veth", "peer", dev_b, "netns", b)
        for ns, dev, addr in ((a, dev_a, addr_a), (b, dev_b, addr_b)):
            if addr:
                sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            if mtu:
                sh("ip", "-n", ns, "link", "set", dev, "mtu", str(mtu))
            sh("ip", "-n", ns, "link", "set", dev, "up")

    def ip(self, ns: str, *args: str) -> str:
        return sh("ip", "-n", ns, *args)

    def sysctl(self, ns: str, key: str, value) -> None:
        sh(*in_ns(ns, ["sysctl", "-qw", f"{key}={value}"]))

    def run(self, ns: str | None, argv: list[str], timeout: float = 120) -> str:
        return sh(*in_ns(ns, argv), timeout=timeout)

    def mac(self, ns: str, dev: str) -> str:
        return json.loads(self.ip(ns, "-j", "link", "show", "dev", dev))[0]["address"]

    # --- processes -----------------------------------------------------------------------
    def spawn(self, ns: str | None, argv: list[str], stdout=subprocess.DEVNULL,
              stderr=subprocess.DEVNULL, env: dict | None = None, text: bool = True,
              stdin=subprocess.DEVNULL) -> subprocess.Popen:
        for f in (stdout, stderr):
            if hasattr(f, "close") and f not in self._files:
                self._files.append(f)
        p = subprocess.Popen(in_ns(ns, argv), stdout=stdout, stderr=stderr, env=env,
                             text=text, stdin=stdin)
        self.procs.append(p)
        return p

    def open_log(self, path: Path, mode: str = "w"):
        f = open(path, mode)
        self._files.append(f)
        return f

    def stop(self, p: subprocess.Popen, sig: int = signal.SIGTERM, wait: float = 5) -> int:
        """Signal p, wait up to `wait` seconds, then SIGKILL. Returns its exit status."""
        if p.poll() is None:
            try:
                p.send_signal(sig)
                p.wait(wait)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            except ProcessLookupError:
                pass
        if p in self.procs:
            self.procs.remove(p)
        return p.returncode

    def close(self) -> None:
        if os.getpid() != self.owner:
            return    # a forked helper (pyroute2's netns child) unwinding its copy of us
        for p in reversed(list(self.procs)):
            try:
                self.stop(p, signal.SIGTERM, 3)
            except Exception:
                pass
        for f in self._files:
            try:
                f.close()
            except Exception:
                pass
        self._files = []
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces = []

    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for(pred, timeout: float, interval: float = 0.01, what: str = "condition",
             proc: subprocess.Popen | None = None):
    """Poll pred() until truthy; BenchError on timeout or if `proc` exits first."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"{what}: process exited with {proc.returncode} first")
        if time.monotonic() > end:
            raise BenchError(f"{what}: not seen within {timeout:.0f}s")
        time.sleep(interval)


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and its reaped children, from /proc/<pid>/stat."""
    from nptrace.bench.report import proc_cpu_ticks
    return proc_cpu_ticks(Path(f"/proc/{pid}/stat").read_text()) / os.sysconf("SC_CLK_TCK")


def cpu_seconds_exact(pid: int) -> float:
    """CPU time of a process's live threads in nanoseconds' precision: the sum of their
    /proc/<pid>/task/<tid>/schedstat run times (the scheduler's sum_exec_runtime). /proc/<pid>/stat
    counts in clock ticks (10 ms here), as coarse as what a storm costs a quiet observer; this
    misses only threads that already exited (nptrace's namespace helpers: microseconds)."""
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def rss_bytes(pid: int) -> int | None:
    from nptrace.bench.report import proc_rss_bytes
    try:
        return proc_rss_bytes(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None


def snmp(ns: str, proto: str, name: str) -> int:
    """A /proc/net/snmp counter of a namespace (what `nstat` shows as e.g. TcpOutRsts)."""
    from nptrace.bench.report import snmp_counter
    return snmp_counter(sh(*in_ns(ns, ["cat", "/proc/net/snmp"])), proto, name)


def node_busy_seconds() -> float:
    """CPU time all CPUs spent busy (user, nice, system, irq, softirq; not idle, iowait or
    steal) from /proc/stat: what a tool costs the node, its kernel-side work included."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return sum(int(f[i]) for i in (1, 2, 3, 6, 7)) / os.sysconf("SC_CLK_TCK")
