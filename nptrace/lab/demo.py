"""`make demo`: bring a lab scenario up, trace it with the real `nptrace run`, trigger the
failure, print the labeled events, and always clean up.

    python -m nptrace.lab.demo [SCENARIO] [--count N]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


def _nptrace_cmd() -> list[str]:
    return [sys.executable, "-m", "nptrace.cli"]


def wait_ready(path: Path, proc: subprocess.Popen, timeout: float = 60, stderr: Path | None = None) -> None:
    end = time.monotonic() + timeout
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
                   rounds: int = 1, pause: float = 1.5):
    """Up, trace, trigger (``rounds`` times, ``pause`` s apart), stop, down.
    Returns (lab info, attempts, JSON events, stderr)."""
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
                proc = subprocess.Popen(_nptrace_cmd() + ["run", "--json", "--ready-file", str(ready),
                                                          *ifaces, *extra_args],
                                        stdout=fo, stderr=fe)
                try:
                    wait_ready(ready, proc, stderr=err)
                    attempts = lab.trigger(name, count=count, prefix=prefix)
                    for _ in range(rounds - 1):
                        time.sleep(pause)
                        attempts += lab.trigger(name, count=count, prefix=prefix)
                    time.sleep(settle)   # let the last records reach user space
                finally:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            events = [json.loads(l) for l in out.read_text().splitlines() if l.strip()]
            return info, attempts, events, err.read_text()
    finally:
        lab.down(name, prefix=prefix)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="nptrace-demo", description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?", default="no-listener")
    ap.add_argument("--count", type=int, default=5)
    ap.add_argument("--backend", default="iptables")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("nptrace demo: error: needs root (network namespaces and BPF): run with sudo",
              file=sys.stderr)
        return 2
    from nptrace import lab
    known = {s.name: s for s in lab.scenarios()}
    if a.scenario not in known:
        print(f"nptrace demo: error: unknown scenario {a.scenario!r}; one of: "
              f"{', '.join(sorted(known))}", file=sys.stderr)
        return 2
    sc = known[a.scenario]
    print(f"== scenario {sc.name}: {sc.story}")
    print(f"== expected cause: {sc.cause}")
    inodes: dict = {}
    info, attempts, events, err = trace_scenario(a.scenario, a.count, a.backend, settle=sc.observe,
                                                 inode_sink=inodes)
    from nptrace.lab.scorecard import scenario_events
    outcomes = Counter(getattr(x, "outcome", "?") for x in attempts)
    print(f"== client saw: {dict(outcomes)}")
    mine = scenario_events(attempts, events, set(inodes.values()))   # only this lab's
    print(f"== nptrace reported {len(mine)} incidents for these connections "
          f"({sum(e.get('events', 1) for e in mine)} kernel events):")
    for e in mine[:12]:
        flow = (f"{e['client']} -> {e['frontend']} -> {e['endpoint']}" if e.get("client")
                else f"{e['saddr']}:{e['sport']} -> {e['daddr']}:{e['dport']}")
        print(f"  {e['kind']:<7} {e.get('direction') or '':<9} {e['cause']:<18} {flow}"
              f"  {e.get('iface') or '-'}"
              f"  [{e['hook']} {e['reason']}] svc={e.get('service') or '-'} events={e.get('events', 1)}")
    if len(mine) > 12:
        print(f"  ... and {len(mine) - 12} more")
    if mine:
        first = mine[0]
        print(f"== hint: {first['hint']}")
        print("== evidence of the first incident:")
        for x in first.get("evidence", [])[:10]:
            print(f"     {x['hook']:<26} {x['what']:<16} {x.get('iface') or '-':<22} {x['detail']}")
    causes = Counter(e["cause"] for e in mine)
    print(f"== causes: {dict(causes)} (expected: {sc.cause or 'none'})")
    for line in err.splitlines():
        if "attached" in line or "lost" in line:
            print(f"== {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
