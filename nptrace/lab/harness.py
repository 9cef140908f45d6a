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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
                   rounds: int = 1, pause: float = 1.5, wrap: tuple = (), after=None):
    """Up, trace, trigger (``rounds`` times, ``pause`` s apart), stop, down. ``wrap``: a
    command prefix for nptrace (a mount namespace, ...); ``after(case)``: as trace_labs'.
    Returns (lab info, attempts, JSON events, stderr)."""
    [(info, attempts, inodes)], events, err = trace_labs(
        [Case(name, backend, variant, prefix)], count, extra_args=extra_args, settle=settle,
        watch=watch, rounds=rounds, pause=pause, wrap=wrap, after=after)
    if inode_sink is not None:
        inode_sink.update(inodes)
    return info, attempts, events, err


@dataclass(frozen=True)
class Case:
    """One lab to bring up: a scenario, its rules backend and variant, under a prefix, its
    addresses in a slot (slots.py: labs up at once in different slots stay apart)."""
    name: str
    backend: str = "iptables"
    variant: str | None = None
    prefix: str | None = None
    slot: int = 0
    observe: float | None = None     # its own settle (trace_labs), else the run's
    real: bool = False               # the real tier: a real control plane and kube-proxy
    release: str | None = None       # with real: the Kubernetes release (k8s/releases)


def _own_ports(info, i: int) -> None:
    """Labs up together get disjoint ephemeral ports (4000 each from 10000): with one address
    plan (the kernel matrix's labs), a connection of one (a SYN-ACK still retransmitted) never
    has the 4-tuple of another's and the tracer keeps them apart, as scenario_events does,
    which tells a case's incidents by client port in any slot."""
    lo = 10000 + 4000 * (i % 12)
    for ns in info.namespaces.values():
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                        f"net.ipv4.ip_local_port_range={lo} {lo + 3999}"], check=False,
                       capture_output=True)


def node_namespaces(info) -> list[tuple[str, str]]:
    """(host, namespace) of a lab's nodes: the hosts whose devices its watch list names."""
    spaces = {w.split("/", 1)[0] for w in info.watch}
    return [(h, ns) for h, ns in info.namespaces.items() if ns in spaces]


def trace_labs(cases, count: int, extra_args=(), settle: float = 1.0, watch: bool = True,
               rounds: int = 1, pause: float = 1.5, wrap: tuple = (), after=None,
               overlap: bool = False, nodes: bool = False):
    """Several labs up at once (each under its own prefix), one `nptrace run` watching all
    of them, each triggered in turn (``rounds`` times, ``pause`` s apart), then stop and down;
    ``overlap``: the next lab is triggered as soon as the last one's trigger returned, while
    that one is still watched (its settle; labs in different slots, slots.py). Triggers never
    run at the same time: measured, four bursts at once changed what the clients saw (41 of
    100 IPv6 clients of no-endpoints timed out instead of being refused). A traced run's start
    is paid once for all the cases: a minute or two in a guest under TCG (the kernel matrix).
    ``after(case)``: called while the tracer is still attached, after the case's last trigger
    and its settle (``Case.observe``, else ``settle``). Returns ([(lab info, attempts, netns
    inodes)] in the cases' order, JSON events of all of them, stderr); scenario_events() tells
    each case's incidents by its inodes and client ports. ``nodes``: the shipped form, as a
    node runs it: one plain `nptrace run` (no --iface) inside each lab node's namespace, each
    reporting its node and its pods (node/scope.py), their lines together."""
    from nptrace import lab
    ups: list = []

    def run_case(c, info, inodes):
        attempts = lab.trigger(c.name, count=count, prefix=c.prefix)
        for _ in range(rounds - 1):
            time.sleep(pause)
            attempts += lab.trigger(c.name, count=count, prefix=c.prefix)
        return c, info, inodes, attempts

    def finish(c, info, inodes, attempts):
        time.sleep(settle if c.observe is None else c.observe)  # the last records reach user space
        if after is not None:
            after(c)
        # pods a scenario's steps (re)created
        for ns in (lab.status(prefix=c.prefix) or {}).get("namespaces", []):
            try:
                inodes[f"{ns}@after"] = os.stat(f"/run/netns/{ns}").st_ino
            except OSError:
                pass
        return info, attempts, inodes

    def bring_up(i, c):
        info = lab.up(c.name, backend=c.backend, prefix=c.prefix, variant=c.variant, slot=c.slot,
                      real=c.real, release=c.release)
        # netns inodes exist only while the lab is up
        got = (c, info, {ns: os.stat(f"/run/netns/{ns}").st_ino for ns in info.namespaces.values()})
        if len(cases) > 1:
            _own_ports(info, i)
        return got

    try:
        # With overlap, all but the first side by side: each lab its own namespaces, servers
        # and state file. The first alone, so that `ip netns` sets up /run/netns once.
        for i, c in enumerate(cases if not overlap else cases[:1]):
            ups.append(bring_up(i, c))
        if overlap and len(cases) > 1:
            with ThreadPoolExecutor(len(cases) - 1) as pool:
                futs = [pool.submit(bring_up, i, c) for i, c in enumerate(cases) if i]
                failed = []
                for f in futs:      # every lab that came up is taken down below
                    try:
                        ups.append(f.result())
                    except Exception as e:
                        failed.append(e)
                if failed:
                    raise failed[0]
        with tempfile.TemporaryDirectory(prefix="npt-demo-") as tmp:
            ifaces = [a for _, info, _ in ups for w in (info.watch if watch and not nodes else ())
                      for a in ("--iface", w)]
            # the real tier's API, as the DaemonSet's ServiceAccount reads it (lab/real/lab.py)
            env = {**os.environ, **{k: v for _, info, _ in ups for k, v in info.env.items()}}
            runs = ([(["ip", "netns", "exec", ns], ["--node-name", host])
                     for _, info, _ in ups for host, ns in node_namespaces(info)]
                    if nodes else [((), ())])
            procs = []
            try:
                for i, (enter, args) in enumerate(runs):
                    ready, out, err = (Path(tmp) / f"{n}{i}" for n in ("ready", "events", "stderr"))
                    with open(out, "w") as fo, open(err, "w") as fe:
                        procs.append((subprocess.Popen(
                            [*enter, *wrap] + _nptrace_cmd() + ["run", "--json", "--ready-file",
                                                                str(ready), *args, *ifaces,
                                                                *extra_args],
                            stdout=fo, stderr=fe, env=env), ready, out, err))
                for proc, ready, _, err in procs:
                    wait_ready(ready, proc, stderr=err)
                if overlap and len(ups) > 1:
                    with ThreadPoolExecutor(len(ups)) as pool:
                        waits = [pool.submit(finish, *run_case(*u)) for u in ups]
                        done = [w.result() for w in waits]
                else:
                    done = [finish(*run_case(*u)) for u in ups]
            finally:
                with ThreadPoolExecutor(max(1, len(procs))) as pool:
                    list(pool.map(interrupt, [p for p, _, _, _ in procs]))
            events = [json.loads(l) for _, _, out, _ in procs
                      for l in out.read_text().splitlines() if l.strip()]
            return done, events, "".join(err.read_text() for _, _, _, err in procs)
    finally:
        # each its own namespaces and state; an up that failed took its half-made lab down
        with ThreadPoolExecutor(max(1, len(ups))) as pool:
            for f in [pool.submit(lab.down, c.name, prefix=c.prefix) for c, _, _ in ups]:
                f.result()


def ports_of(detail: str) -> set[int]:
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
        return any(ports_of(x.get("detail", "")) & ports for x in e.get("evidence", ()))
    return [e for e in events if mine(e)]
