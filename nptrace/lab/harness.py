"""Trace a lab scenario with the real `nptrace run --json` and pick out the incidents about
the scenario's own connections: what `make demo`, the scorecard and the end-to-end tests share.

A flow belongs to a scenario's trigger when one of its ports is a client port of an attempt
(masquerade keeps the client's port; ephemeral ports are unique within one run).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path



def interrupt(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Stop a traced run as an SRE's Ctrl-C does (its clean-up runs), killed only when it
    does not exit within timeout."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

def _nptrace_cmd() -> list[str]:
    return [sys.executable, "-m", "nptrace.cli"]


# How long a traced run may take to compile and attach: about a second here, a minute or more
# in a guest under TCG (the kernel matrix, nptrace/lab/kernels.py, sets it higher).
ATTACH_TIMEOUT = float(os.environ.get("NPT_LAB_ATTACH_TIMEOUT", "60"))


def wait_ready(path: Path, proc: subprocess.Popen, timeout: float | None = None,
               stderr: Path | None = None) -> None:
    end = time.monotonic() + (ATTACH_TIMEOUT if timeout is None else timeout)
    while time.monotonic() < end:
        if path.exists():
            return
        if proc.poll() is not None:
            why = stderr.read_text().strip().splitlines()[-1:] if stderr else []
            raise RuntimeError(f"nptrace run exited early with code {proc.returncode}"
                               + (f": {why[0]}" if why else ""))
        time.sleep(0.05)
    raise RuntimeError("nptrace run did not attach in time")


def trace_scenario(name: str, count: int, backend: str = "iptables", extra_args=(),
                   prefix: str | None = None, settle: float = 1.0, watch: bool = True,
                   inode_sink: dict | None = None, variant: str | None = None,
                   rounds: int = 1, pause: float = 1.5, wrap: tuple = (), before_stop=None):
    """Up, trace, trigger (``rounds`` times, ``pause`` s apart), stop, down. ``wrap``: a
    command prefix for nptrace (a mount namespace, ...); ``before_stop``: called while the
    tracer is still attached, after the last trigger (the kernel matrix reads the programs'
    run counts there). Returns (lab info, attempts, JSON events, stderr)."""
    from nptrace import lab
    info = lab.up(name, backend=backend, prefix=prefix, variant=variant)
    if inode_sink is not None:   # netns inodes exist only while the lab is up
        for ns in info.namespaces.values():
            inode_sink[ns] = os.stat(f"/run/netns/{ns}").st_ino
    try:
        with tempfile.TemporaryDirectory(prefix="npt-demo-") as tmp:
            ready = Path(tmp) / "ready"
            out = Path(tmp) / "events.json"
            err = Path(tmp) / "stderr"
            ifaces = []
            for w in (info.watch if watch else ()):
                ifaces += ["--iface", w]
            with open(out, "w") as fo, open(err, "w") as fe:
                proc = subprocess.Popen([*wrap] + _nptrace_cmd() + ["run", "--json", "--ready-file", str(ready),
                                                          *ifaces, *extra_args],
                                        stdout=fo, stderr=fe)
                try:
                    wait_ready(ready, proc, stderr=err)
                    attempts = lab.trigger(name, count=count, prefix=prefix)
                    for _ in range(rounds - 1):
                        time.sleep(pause)
                        attempts += lab.trigger(name, count=count, prefix=prefix)
                    time.sleep(settle)   # let the last records reach user space
                    if before_stop is not None:
                        before_stop()
                    if inode_sink is not None:   # pods a scenario's steps (re)created
                        for ns in (lab.status(prefix=prefix) or {}).get("namespaces", []):
                            try:
                                inode_sink[f"{ns}@after"] = os.stat(f"/run/netns/{ns}").st_ino
                            except OSError:
                                pass
                finally:
                    interrupt(proc)
            events = [json.loads(l) for l in out.read_text().splitlines() if l.strip()]
            return info, attempts, events, err.read_text()
    finally:
        lab.down(name, prefix=prefix)


def _ports_of(detail: str) -> set[int]:
    out = set()
    for part in detail.replace("(", " ").replace(")", " ").split():
        host, sep, port = part.rpartition(":")
        if sep and port.isdigit():
            out.add(int(port))
    return out


def scenario_events(attempts, events, netns: set | None = None) -> list[dict]:
    """Incidents about the trigger's connections: a client port appears in the incident's own
    tuple, its conntrack entry or any of its evidence (masquerade may pick another port on the
    pod side, the client side keeps it); with `netns` (the lab's namespace inodes), only
    incidents whose primary event happened there (other traffic on the machine may reuse a
    port)."""
    ports = {a.sport for a in attempts}

    def mine(e):
        if netns is not None and e.get("netns") not in netns:
            return False
        if e["sport"] in ports or e["dport"] in ports:
            return True
        if e.get("conntrack") and e["conntrack"]["orig"][1] in ports:
            return True
        return any(_ports_of(x.get("detail", "")) & ports for x in e.get("evidence", ()))
    return [e for e in events if mine(e)]
