"""tc fast path: run time per packet of nptrace's tc programs beside an empty tc program.

Two namespaces joined by a veth (10.251.1.0/24) and a VXLAN (VNI 42, UDP 4789) over it
(10.251.2.0/24). `nptrace run --iface <server>/s0` watches the server's veth; two empty
programs (r0 = TC_ACT_UNSPEC; exit) sit on the same hooks, so all four see the same packets.
A bulk TCP transfer runs over the veth, then over the VXLAN (on s0 the packets are then
VXLAN-in-UDP: nptrace's tc programs decapsulate them). The kernel's per-program run_cnt and
run_time_ns (BPF_ENABLE_STATS) are read from nptrace's own fds through /proc/<pid>/fdinfo.

A "packet" is one sk_buff at tc: veth carries GSO super-packets of up to 64 KiB, so there
are far fewer runs than wire-size segments. The empty program is the measuring floor (the
stats clock reads alone cost tens of ns); the target is nptrace minus the floor.
"""
from __future__ import annotations

from nptrace.bench import bpfprog
from nptrace.bench.context import Bench
from nptrace.bench.report import Row, Section
from nptrace.bench.topology import BenchError, Topology
from nptrace.bench.workloads import Bulk

TARGET_NS = 30.0
PROG_TYPES = {3: "tc", 32: "netfilter hook"}


def _setup(t: Topology) -> tuple[str, str]:
    c, s = t.ns("c"), t.ns("s")
    t.veth(c, "c0", "10.251.1.1/24", s, "s0", "10.251.1.2/24")
    for ns, dev, local, remote, addr in ((c, "c0", "10.251.1.1", "10.251.1.2", "10.251.2.1/24"),
                                         (s, "s0", "10.251.1.2", "10.251.1.1", "10.251.2.2/24")):
        t.ip(ns, "link", "add", "vx0", "type", "vxlan", "id", "42", "dstport", "4789",
             "local", local, "remote", remote, "dev", dev)
        t.ip(ns, "addr", "add", addr, "dev", "vx0")
        t.ip(ns, "link", "set", "vx0", "up")
    return c, s


def run(b: Bench) -> Section:
    from nptrace.kernel.tc import enable_bpf_stats

    sec = Section("tc_cost")
    secs = b.scale(4, 2)
    with Topology("tc") as t:
        c, s = _setup(t)
        empty = {"ingress": bpfprog.load_empty_sched_cls("npt_bn_empty_i"),
                 "egress": bpfprog.load_empty_sched_cls("npt_bn_empty_e")}
        links: list[int] = []
        try:
            for hook, fd in empty.items():     # attached the way nptrace's are (tcx or clsact)
                _how, link = bpfprog.attach_empty(s, "s0", fd, hook == "ingress")
                if link is not None:
                    links.append(link)
            bulk = Bulk(t, s, c, "10.251.1.2")
            bulk.run(1)       # warm-up: ARP, slow start, page cache of iperf3
            n = b.nptrace(t, "tc_cost", "tc_cost", ["--iface", f"{s}/s0"])
            try:
                ids = bpfprog.tc_prog_ids(s, "s0")
                # a clsact filter named npt_<pid>_ing|egr, or a tcx link of npt_tc_<hook>
                ours = {hook: next((i for name, i in ids[hook].items()
                                    if name.startswith(f"npt_{n.pid}_")
                                    or name == f"npt_tc_{hook}"), None)
                        for hook in ("ingress", "egress")}
                if None in ours.values():
                    raise BenchError(f"nptrace's tc filters not found on s0: {ids}")
                snap0 = bpfprog.process_prog_stats(n.pid)
                names = bpfprog.prog_names(snap0)
                data = {"secs": secs, "tool": bulk.tool, "paths": {}}
                with enable_bpf_stats():
                    for path, dst in (("veth", "10.251.1.2"), ("vxlan", "10.251.2.2")):
                        bulk.host = dst
                        a = bpfprog.process_prog_stats(n.pid)
                        e0 = {h: bpfprog.own_stats(fd) for h, fd in empty.items()}
                        bps = bulk.run(secs)
                        e1 = {h: bpfprog.own_stats(fd) for h, fd in empty.items()}
                        d = bpfprog.delta(a, bpfprog.process_prog_stats(n.pid))
                        data["paths"][path] = _path_result(path, bps, d, ours, names, e0, e1)
            finally:
                n.stop()
        finally:
            import os
            for fd in links + list(empty.values()):
                os.close(fd)
    sec.data = data
    for path, r in data["paths"].items():
        for hook in ("ingress", "egress"):
            h = r[hook]
            over = (h["nptrace_ns"] - h["empty_ns"]) if h["nptrace_ns"] is not None \
                and h["empty_ns"] is not None else None
            sec.rows.append(Row(
                "tc_cost", f"tc {hook} ns/packet, bulk TCP over {path} ({h['runs']} runs)",
                _ns(h["nptrace_ns"]), f"{_ns(h['empty_ns'])} empty prog",
                f"{'+' if over is not None and over >= 0 else ''}{_ns(over)} / "
                f"<= +{TARGET_NS:.0f} ns",
                None if over is None else over <= TARGET_NS,
                h["nptrace_ns"], h["empty_ns"], over, f"<= +{TARGET_NS:.0f} ns over empty"))
        for name, o in r["other"].items():
            sec.rows.append(Row("tc_cost", f"{name} ns/run, bulk TCP over {path} "
                                f"({o['runs']} runs)", _ns(o["ns_per_run"]), "", "info",
                                None, o["ns_per_run"]))
    return sec


def _ns(x) -> str:
    return "n/a" if x is None else f"{x:.0f} ns"


def _path_result(path, bps, d, ours, names, e0, e1) -> dict:
    out = {"gbit_s": bps / 1e9, "other": {}}
    for hook in ("ingress", "egress"):
        mine = d.get(ours[hook], {"runs": 0, "ns_per_run": None})
        ecnt, ens = e1[hook][0] - e0[hook][0], e1[hook][1] - e0[hook][1]
        out[hook] = {"runs": mine["runs"], "nptrace_ns": mine["ns_per_run"],
                     "empty_runs": ecnt, "empty_ns": ens / ecnt if ecnt else None}
    for pid_, v in d.items():
        if pid_ in ours.values() or not v["runs"] or v["type"] not in PROG_TYPES:
            continue
        label = f"{PROG_TYPES[v['type']]} {names.get(pid_, pid_)}"
        out["other"][label] = {"runs": v["runs"], "ns_per_run": v["ns_per_run"]}
    return out
