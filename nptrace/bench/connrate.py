"""New connections per second through a NodePort, with and without nptrace.

client (10.251.4.1) -- node (10.251.4.2 | 10.251.5.1) -- server (10.251.5.2:8080). The node
forwards and DNATs 10.251.4.2:30080 to the server with iptables, as kube-proxy does. Two
client processes keep 128 non-blocking connects each in flight; a connection counts when the
server's FIN arrives (accept + close there), then the client closes: the client keeps no
TIME_WAIT and its ports recycle. The node's conntrack TIME_WAIT timeout is 1 s (a per-netns
sysctl) so the table holds seconds of connections, not two minutes of them.
With nptrace: `--iface node/n0 --iface node/n1` (the node's two "NICs"), every tracepoint,
and the netfilter-hook view it attaches in the node.

Rounds rotate three runs: without anything, with nptrace, and with the FLOOR: two empty
programs (r0 = -1; exit) on each of n0 and n1, attached the way nptrace attaches its own (tcx
links, or clsact filters without tcx). The floor is what any tc observer on those devices
costs before doing anything (an info row); the with/without ratios are paired within a round.

After the pairs, one more run with nptrace holds BPF_ENABLE_STATS and divides each of its
programs' run_time_ns by the connections made: where the kernel-side cost per connection
goes (info rows). Stats are on only in that run, so the ratio runs are not charged for them.
nptrace's own process competes for the same 2 CPUs: its CPU time during the "with" runs,
per connection, is an info row too.
"""
from __future__ import annotations

import dataclasses
import os

from nptrace.bench import bpfprog
from nptrace.bench.context import Bench
from nptrace.bench.report import Row, Section, si
from nptrace.bench.throughput import ratio_row
from nptrace.bench.topology import Topology, in_ns, sh
from nptrace.bench.workloads import ConnLoad

TARGET = 0.97
NODEPORT, TARGET_PORT = 30080, 8080


def setup(t: Topology) -> tuple[str, str, str]:
    c, n, s = t.ns("c"), t.ns("n"), t.ns("s")
    t.veth(c, "c0", "10.251.4.1/24", n, "n0", "10.251.4.2/24")
    t.veth(n, "n1", "10.251.5.1/24", s, "s0", "10.251.5.2/24")
    t.ip(c, "route", "add", "default", "via", "10.251.4.2")
    t.ip(s, "route", "add", "default", "via", "10.251.5.1")
    t.sysctl(n, "net.ipv4.ip_forward", 1)
    t.sysctl(c, "net.ipv4.ip_local_port_range", "1024 65535")
    t.run(n, ["iptables", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "-d", "10.251.4.2",
              "--dport", str(NODEPORT), "-j", "DNAT", "--to-destination",
              f"10.251.5.2:{TARGET_PORT}"])
    # conntrack exists in the node namespace once the nat rule does
    t.sysctl(n, "net.netfilter.nf_conntrack_tcp_timeout_time_wait", 1)
    return c, n, s


def run(b: Bench) -> Section:
    sec = Section("connrate")
    # rounds rotate the three runs: a multiple of 3 puts each run in each position equally
    pairs, secs = b.scale(9, 3), b.scale(2, 1)
    failures, npt_cpu = [], []
    with Topology("cr") as t:
        c, n, s = setup(t)
        load = ConnLoad(t, s, TARGET_PORT, c, "10.251.4.2", NODEPORT)
        load.run(1)    # warm-up: ARP, conntrack, the server's accept queue

        def measure(r):
            failures.append(r["failed"])
            return r["rate"]

        def without(_i):
            return measure(load.run(secs))

        def with_nptrace(i):
            npt = b.nptrace(t, "connrate", f"connrate{i}",
                            ["--iface", f"{n}/n0", "--iface", f"{n}/n1"])
            try:
                c0 = npt.cpu()
                r = load.run(secs)
                npt_cpu.append((npt.cpu() - c0, r["done"]))
                return measure(r)
            finally:
                npt.stop()

        def with_floor(i):
            progs, links = [], []
            try:
                for dev in ("n0", "n1"):
                    for ingress in (True, False):
                        progs.append(bpfprog.load_empty_sched_cls("npt_bn_floor"))
                        how, link = bpfprog.attach_empty(n, dev, progs[-1], ingress)
                        floor_how.add(how)
                        if link is not None:
                            links.append(link)
                return measure(load.run(secs))
            finally:
                for fd in links + progs:
                    os.close(fd)
                if "clsact" in floor_how:
                    for dev in ("n0", "n1"):
                        sh(*in_ns(n, ["tc", "qdisc", "del", "dev", dev, "clsact"]), check=False)

        floor_how: set[str] = set()
        wo, w, fl = rotate(pairs, (without, with_nptrace, with_floor))
        costs = per_connection_costs(b, t, n, load, secs)
    row, data = ratio_row("connrate", f"NodePort (DNAT) new connections/s ({pairs} rounds x "
                          f"{secs}s, median)", lambda x: si(x, "/s"), w, wo, TARGET)
    sec.rows.append(row)
    frow, fdata = ratio_row("connrate", f"NodePort: floor, 4 empty programs on n0/n1 "
                            f"({'/'.join(sorted(floor_how))}), same rounds", lambda x: si(x, "/s"),
                            fl, wo, TARGET)
    sec.rows.append(dataclasses.replace(frow, ratio_target=frow.ratio_target.split(" / ")[0],
                                        met=None, target=""))
    data["floor"] = dict(fdata, how=sorted(floor_how))
    user_ns = 1e9 * sum(c for c, _ in npt_cpu) / max(1, sum(n for _, n in npt_cpu))
    sec.data = dict(data, pairs=pairs, secs=secs, failed_connects=sum(failures),
                    clients=load.clients, in_flight=load.conc * load.clients,
                    kernel_per_conn=costs, nptrace_cpu_ns_per_conn=user_ns)
    sec.rows.append(Row("connrate", f"NodePort: nptrace process CPU per connection (during the "
                        f"{pairs} runs with it; clock ticks)", f"{user_ns:.0f} ns", "", "info",
                        None, user_ns))
    total = sum(c["ns_per_conn"] for c in costs["programs"].values())
    sec.rows.append(Row("connrate", f"NodePort: nptrace kernel ns per connection, all programs "
                        f"({costs['connections']} connections, stats on)", f"{total:.0f} ns",
                        "", "info", None, total))
    for name, c in sorted(costs["programs"].items(), key=lambda kv: -kv[1]["ns_per_conn"]):
        sec.rows.append(Row("connrate", f"NodePort: {name} ns per connection "
                            f"({c['runs_per_conn']:.1f} runs x {c['ns_per_run']:.0f} ns)",
                            f"{c['ns_per_conn']:.0f} ns", "", "info", None, c["ns_per_conn"]))
    return sec


def rotate(rounds: int, runs) -> list[list]:
    """Round i runs `runs` (functions of the round number) starting at i % len(runs), so each
    takes each position equally often and a drift of the VM hits all alike; one list of
    results per function, by round."""
    out: list[list] = [[None] * rounds for _ in runs]
    for i in range(rounds):
        for k in range(len(runs)):
            j = (i + k) % len(runs)
            out[j][i] = runs[j](i)
    return out


def per_connection_costs(b: Bench, t: Topology, node: str, load: ConnLoad, secs: float) -> dict:
    """{connections, programs: {name: {runs_per_conn, ns_per_run, ns_per_conn}}} of one run
    of nptrace with BPF_ENABLE_STATS held; programs that did not run are left out."""
    from nptrace.kernel.tc import enable_bpf_stats
    npt = b.nptrace(t, "connrate", "connrate_stats",
                    ["--iface", f"{node}/n0", "--iface", f"{node}/n1"])
    try:
        with enable_bpf_stats():
            before = bpfprog.process_prog_stats(npt.pid)
            r = load.run(secs)
            d = bpfprog.delta(before, bpfprog.process_prog_stats(npt.pid))
        names = bpfprog.prog_names(d)
    finally:
        npt.stop()
    done = r["done"] or 1
    progs = {}
    for pid_, v in d.items():
        if not v["runs"]:
            continue
        progs[names.get(pid_, str(pid_))] = {"runs_per_conn": v["runs"] / done,
                                             "ns_per_run": v["ns_per_run"],
                                             "ns_per_conn": v["ns"] / done}
    return {"connections": r["done"], "programs": progs}
