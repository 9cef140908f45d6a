"""New connections per second through a NodePort, with and without nptrace.

Three identical paths k = 0, 1, 2: client (10.251.4k.1) -- node (10.251.4k.2 | 10.251.4k+1.1)
-- server (10.251.4k+1.2:8080), e.g. 10.251.40.0/24 and 10.251.41.0/24 for path 0. Each node
forwards and DNATs its 10.251.4k.2:30080 to its server with iptables, as kube-proxy does. The
node's conntrack TIME_WAIT timeout is 1 s (a per-netns sysctl) so the table holds seconds of
connections, not two minutes of them. The two clients are pinned one to each CPU and the
server to the last one (taskset): left to the scheduler, the three sometimes shared a CPU for
a run and its rate moved by a tenth.

The workload makes no resets, as NodePort traffic that works makes none. Two client processes
per path keep 128 non-blocking connects each in flight (traffic.py connect); each sends its FIN
as soon as its handshake is done, the server accepts a connection once that FIN is in
(TCP_DEFER_ACCEPT) and closes it (traffic.py accept), and a connection counts when the
server's FIN reaches the client. So the client keeps the TIME_WAITs and the server none;
connect() takes a port whose TIME_WAIT is over a second old (net.ipv4.tcp_tw_reuse=1 in the
client namespace: the SYN's timestamp tells the server it is new). The server's default route
has `quickack 1`. Why, measured on one path without nptrace (nstat in its three namespaces):
- A workload closing the other way round (server first, client second, no TIME_WAIT at the
  client) reset 0.0001-0.04 of its connections, more the longer it ran: once the
  client's 64k ports wrapped, SYNs met the server's minute-long TIME_WAITs with an older
  timestamp (TcpExtPAWSTimewait), answered with an ACK that the client reset. In a bench run
  that was 0.03-0.1 resets per connection, and nptrace's process spent 2.5-8 us per
  connection labeling them: resets of the load generator. Its tracepoints are global, so it
  labeled the plain and floor paths' resets too, and that CPU slowed all three paths alike:
  those ratios leaned toward 1 (three runs of each the same hour, alternated: 96.6-101.4%
  with the floor at 100.8-103.8%, above plain; this workload 94.4-96.9%, floor 96.1-97.6%).
- With the client closing first, 0.1-0.9% still reset: the server's delayed ACK of the
  client's FIN, sent by the delayed-ACK timer on the CPU that took that FIN, and the server's
  FIN, sent from its process's CPU, cross the node through two CPUs' backlogs and sometimes
  swap; the client's TIME_WAIT answers the stale ACK with a duplicate, which finds the server's
  socket gone and is reset (seen in a capture at the server). `quickack 1` sends that ACK at
  once, long before the FIN; without it 0.6% still reset.
- A server that peeked for the FIN and waited for it in epoll, instead of TCP_DEFER_ACCEPT,
  made no drops at all but ran 11% slower (median of 30 alternated 1-s pairs on two paths).
  TCP_DEFER_ACCEPT drops each handshake's bare ACK (TcpExtTCPDeferAcceptDrop: one kfree_skb
  per connection, as many as the reverse-close workload freed).
- All of it: 0 resets in each bench run (1.5-2.9 million connections). Untraced rate beside
  the reverse-close workload, alternated on two paths, 30-40 rounds of 1 s: 94-105% of it while
  the VM ran slow (15k/s), 84% while it ran fast (27k/s) (probably the client's shutdown() and
  its extra epoll events, which weigh more when the kernel's share shrinks). The rounds count
  TcpOutRsts in every namespace of the paths: the resets-per-connection info row shows a
  workload that resets.

The three paths play three roles at once: TRACED (`nptrace run --iface node/n0 --iface
node/n1`: its tc programs and the netfilter-hook view in that node, every tracepoint), FLOOR
(two empty programs, r0 = -1; exit, on each of n0 and n1, attached the way nptrace attaches
its own: tcx links, or clsact filters without tcx: what any tc observer there costs before it
does anything) and PLAIN (nothing). A round runs the three loads one after another, `secs`
each, in an order that rotates, and pairs traced/plain and floor/plain within the round: the
runs of a pair follow each other within a second, so the VM's neighbour noise (which moves on
the scale of seconds, and swung ratios of pairs that started nptrace in between from 75% to
119%) hits both alike. The clients of each path are started once and run on command
(ConnLoad(serve=True), traffic.py connect --serve): every run starts with none in flight, and
the connections open at its end are let end, uncounted, before the next run starts, so the
runs of a round are adjacent, with no process start between them. In A/A tests (two plain
paths, 60 rounds of 0.5 s, twice each) that halved the ratios' interquartile range: 3.6 and
3.2 points wide, against 6.4 and 8.4 with a client process started per run. The roles move
to the next path in each of three phases (nptrace restarted there), so a difference between
the paths cancels. Verdict: the median of the per-round ratios, with its distribution-free 95%
interval (median_ci) and whether that interval's lower bound clears 97% (only then is the
target met beyond the noise), and the ratios' interquartile range. Runs are 0.5 s: 36 rounds
a phase (108 in all) fit the section in about 4 minutes; 36 one-second rounds gave intervals
7-9 points wide, 108 half-second ones 3.4-4.3 (10 while other jobs shared the VM), and 1.2-1.7
with the served clients (ten runs; 0.7 with 324). Caveat: nptrace's tracepoints are global, so
the plain and floor paths' connections run its kfree_skb program too (1.0 run and ~10 ns net
per connection: the bare ACK TCP_DEFER_ACCEPT drops), a bias of the ratio toward 1 of under
0.1%.

After the rounds, one more run on the traced path holds BPF_ENABLE_STATS and divides each of
nptrace's programs' run_time_ns by the connections made: where the kernel-side cost per
connection goes (info rows). Stats are on only in that run, so the ratio runs are not charged
for them. Stats cost each run two clock reads, 67-78 ns here, more than most of our runs do:
four empty programs on the same devices in that run measure it, and the rows give each
program's time net of it (2.5-2.6 us with stats were 0.86-0.95 us net). nptrace's own
process competes for the same 2 CPUs: its CPU time during the rounds, per traced connection,
is an info row too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os

from nptrace.bench import bpfprog
from nptrace.bench.context import Bench
from nptrace.bench.report import Row, Section, si, spread
from nptrace.bench.topology import Topology, in_ns, sh, snmp
from nptrace.bench.workloads import ConnLoad

TARGET = 0.97
NODEPORT, TARGET_PORT = 30080, 8080
PATHS = 3
ROLES = ("traced", "floor", "plain")


def setup(t: Topology, k: int = 0) -> tuple[str, str, str, str]:
    """Path k's namespaces (client, node, server) and the NodePort address."""
    c, n, s = t.ns(f"c{k}"), t.ns(f"n{k}"), t.ns(f"s{k}")
    a, b = f"10.251.{40 + 2 * k}", f"10.251.{41 + 2 * k}"
    t.veth(c, "c0", f"{a}.1/24", n, "n0", f"{a}.2/24")
    t.veth(n, "n1", f"{b}.1/24", s, "s0", f"{b}.2/24")
    t.ip(c, "route", "add", "default", "via", f"{a}.2")
    t.ip(s, "route", "add", "default", "via", f"{b}.1", "quickack", "1")
    t.sysctl(n, "net.ipv4.ip_forward", 1)
    t.sysctl(c, "net.ipv4.ip_local_port_range", "1024 65535")
    # the client keeps the TIME_WAITs (it closes first): connect() may take a port whose
    # TIME_WAIT is over a second old (its timestamps tell the server's stack it is new)
    t.sysctl(c, "net.ipv4.tcp_tw_reuse", 1)
    t.run(n, ["iptables", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "-d", f"{a}.2",
              "--dport", str(NODEPORT), "-j", "DNAT", "--to-destination",
              f"{b}.2:{TARGET_PORT}"])
    # conntrack exists in the node namespace once the nat rule does
    t.sysctl(n, "net.netfilter.nf_conntrack_tcp_timeout_time_wait", 1)
    return c, n, s, f"{a}.2"


def _pins() -> tuple[list[int], int]:
    """(CPU of each client, CPU of the server): the clients one per CPU, the server on the last."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[i % len(cpus)] for i in range(2)], cpus[-1]


@contextlib.contextmanager
def empty_programs(node: str, how: set):
    """The floor: an empty program on each hook of n0 and n1 in `node` while inside."""
    progs, links = [], []
    try:
        for dev in ("n0", "n1"):
            for ingress in (True, False):
                progs.append(bpfprog.load_empty_sched_cls("npt_bn_floor"))
                kind, link = bpfprog.attach_empty(node, dev, progs[-1], ingress)
                how.add(kind)
                if link is not None:
                    links.append(link)
        yield progs
    finally:
        for fd in links + progs:
            os.close(fd)
        if "clsact" in how:
            for dev in ("n0", "n1"):
                sh(*in_ns(node, ["tc", "qdisc", "del", "dev", dev, "clsact"]), check=False)


def run(b: Bench) -> Section:
    sec = Section("connrate")
    # rounds per phase; three phases (each role on each path once). Rounds rotate the order
    # of the three runs: a multiple of 3 puts each role in each position equally.
    rounds, secs = b.scale(36, 3), 0.5
    failures, npt_cpu, done = [], [], 0
    res = {r: [] for r in ROLES}
    floor_how: set[str] = set()
    clients_cpu, server_cpu = _pins()
    with Topology("cr") as t:
        paths, namespaces = [], []
        for k in range(PATHS):
            c, n, s, addr = setup(t, k)
            load = ConnLoad(t, s, TARGET_PORT, c, addr, NODEPORT, cpus=clients_cpu,
                            server_cpu=server_cpu, serve=True)
            load.run(1)    # warm-up: ARP, conntrack, the server's accept queue
            paths.append((n, load))
            namespaces += [c, n, s]
        rsts0 = resets_sent(namespaces)
        for phase in range(PATHS):
            role_path = {r: paths[(phase + i) % PATHS] for i, r in enumerate(ROLES)}
            tn = role_path["traced"][0]
            npt = b.nptrace(t, "connrate", f"connrate{phase}",
                            ["--iface", f"{tn}/n0", "--iface", f"{tn}/n1"])
            try:
                with empty_programs(role_path["floor"][0], floor_how):
                    for _n, load in paths:   # settle: the first runs after a start swing
                        done += load.run(secs)["done"]
                    for i in range(rounds):
                        for j in range(len(ROLES)):
                            role = ROLES[(i + j) % len(ROLES)]
                            c0 = npt.cpu_exact() if role == "traced" else 0
                            r = role_path[role][1].run(secs)
                            if role == "traced":
                                npt_cpu.append((npt.cpu_exact() - c0, r["done"]))
                            failures.append(r["failed"])
                            res[role].append(r["rate"])
                            done += r["done"]
            finally:
                npt.stop()
        # every reset the paths' namespaces sent during the rounds and their settle runs
        rsts = resets_sent(namespaces) - rsts0
        n0, load0 = paths[0]
        costs = per_connection_costs(b, t, n0, load0, max(secs, 1.0) * 2)
    n_rounds = rounds * PATHS
    row, data = ratio_row("connrate", f"NodePort (DNAT) new connections/s ({n_rounds} rounds "
                          f"x {secs:g}s, 3 paths, median [95% CI; IQR])", lambda x: si(x, "/s"),
                          res["traced"], res["plain"], TARGET)
    sec.rows.append(row)
    frow, fdata = ratio_row("connrate", f"NodePort: floor, 4 empty programs on n0/n1 "
                            f"({'/'.join(sorted(floor_how))}), same rounds",
                            lambda x: si(x, "/s"), res["floor"], res["plain"], TARGET)
    sec.rows.append(dataclasses.replace(frow, ratio_target=frow.ratio_target.split(" / ")[0],
                                        met=None, target=""))
    data["floor"] = dict(fdata, how=sorted(floor_how))
    per_conn = rsts / max(1, done)
    sec.rows.append(Row("connrate", f"NodePort: resets sent per connection (TcpOutRsts of the "
                        f"paths' namespaces, {done} connections; the workload makes none)",
                        f"{per_conn:.5f}", "", "info", None, per_conn))
    user_ns = 1e9 * sum(c for c, _ in npt_cpu) / max(1, sum(n for _, n in npt_cpu))
    sec.data = dict(data, rounds=n_rounds, secs=secs, failed_connects=sum(failures),
                    connections=done, resets_sent=rsts,
                    clients=load0.clients, in_flight=load0.conc * load0.clients,
                    client_cpus=clients_cpu, server_cpu=server_cpu,
                    kernel_per_conn=costs, nptrace_cpu_ns_per_conn=user_ns)
    sec.rows.append(Row("connrate", f"NodePort: nptrace process CPU per connection (during the "
                        f"{n_rounds} runs with it; scheduler run time)", f"{user_ns:.0f} ns", "", "info",
                        None, user_ns))
    total = sum(c["ns_per_conn"] for c in costs["programs"].values())
    net = sum(c["net_ns_per_conn"] for c in costs["programs"].values())
    sec.rows.append(Row("connrate", f"NodePort: nptrace kernel ns per connection, all programs "
                        f"({costs['connections']} connections, stats on; net: less an empty "
                        f"program's {costs['stats_ns_per_run']:.0f} ns a run measured beside)",
                        f"{net:.0f} ns net ({total:.0f} ns with stats)", "", "info", None, net))
    for name, c in sorted(costs["programs"].items(), key=lambda kv: -kv[1]["net_ns_per_conn"]):
        sec.rows.append(Row("connrate", f"NodePort: {name} ns per connection "
                            f"({c['runs_per_conn']:.1f} runs x {c['ns_per_run']:.0f} ns)",
                            f"{c['net_ns_per_conn']:.0f} ns net ({c['ns_per_conn']:.0f})", "",
                            "info", None, c["net_ns_per_conn"]))
    return sec


def resets_sent(namespaces: list[str]) -> int:
    """TcpOutRsts summed over the namespaces: every reset their stacks sent."""
    return sum(snmp(ns, "Tcp", "OutRsts") for ns in namespaces)


def ratio_row(section: str, metric: str, unit_fmt, w: list[float], wo: list[float],
              target: float) -> tuple[Row, dict]:
    """Like throughput.ratio_row, with the 95% interval of the median of the paired ratios and
    whether its lower bound clears the target (the median alone may sit above the target by
    noise), and their interquartile range."""
    ratios = [a / b for a, b in zip(w, wo) if b]
    sp, sw, swo = spread(ratios), spread(w), spread(wo)
    med = sp.get("median")
    lo, hi = median_ci(ratios)
    clears = None if lo is None else lo >= target
    row = Row(section, metric, unit_fmt(sw.get("median")), unit_fmt(swo.get("median")),
              (f"{med:.1%} [95% CI {lo:.1%}-{hi:.1%}: lower bound "
               f"{'clears' if clears else 'below'} {target:.0%}; IQR {sp['p25']:.1%}-"
               f"{sp['p75']:.1%}] / >= {target:.0%}" if med is not None else "n/a"),
              None if med is None else med >= target, sw.get("median"), swo.get("median"),
              med, f">= {target:.0%} of without")
    return row, {"with": w, "without": wo, "ratios": ratios, "ratio_spread": sp,
                 "median_ci95": [lo, hi], "ci_clears_target": clears, "with_spread": sw,
                 "without_spread": swo, "target": target}


def median_ci(xs: list[float]) -> tuple[float | None, float | None]:
    """About 95% confidence bounds of the median of xs, distribution-free: the order
    statistics n/2 -+ 0.98 sqrt(n) (the binomial's normal approximation). How far the median
    of this many rounds may be from the ratio the rounds' noise hides."""
    xs = sorted(xs)
    n = len(xs)
    if not n:
        return None, None
    d = 0.98 * math.sqrt(n)
    return xs[max(0, math.floor(n / 2 - d))], xs[min(n - 1, math.ceil(n / 2 + d) - 1)]


def per_connection_costs(b: Bench, t: Topology, node: str, load: ConnLoad, secs: float) -> dict:
    """{connections, stats_ns_per_run, programs: {name: {runs_per_conn, ns_per_run,
    ns_per_conn, net_ns_per_conn}}} of one run of nptrace with BPF_ENABLE_STATS held;
    programs that did not run are left out. Stats cost each run of a program two clock reads
    (67-78 ns on the 6.18 VM, more than most runs of ours do): four empty programs on the same
    devices measure that in the same run, and net_* is each program's time less it."""
    from nptrace.kernel.tc import enable_bpf_stats
    npt = b.nptrace(t, "connrate", "connrate_stats",
                    ["--iface", f"{node}/n0", "--iface", f"{node}/n1"])
    try:
        with empty_programs(node, set()) as empty, enable_bpf_stats():
            before = bpfprog.process_prog_stats(npt.pid)
            e0 = [bpfprog.own_stats(fd) for fd in empty]
            r = load.run(secs)
            d = bpfprog.delta(before, bpfprog.process_prog_stats(npt.pid))
            e1 = [bpfprog.own_stats(fd) for fd in empty]
        names = bpfprog.prog_names(d)
    finally:
        npt.stop()
    done = r["done"] or 1
    runs = sum(b1[0] - a[0] for a, b1 in zip(e0, e1))
    base = sum(b1[1] - a[1] for a, b1 in zip(e0, e1)) / runs if runs else 0.0
    progs = {}
    for pid_, v in d.items():
        if not v["runs"]:
            continue
        progs[names.get(pid_, str(pid_))] = {
            "runs_per_conn": v["runs"] / done, "ns_per_run": v["ns_per_run"],
            "ns_per_conn": v["ns"] / done,
            "net_ns_per_conn": max(0.0, v["ns"] - base * v["runs"]) / done}
    return {"connections": r["done"], "stats_ns_per_run": base, "programs": progs}
