"""Automatic interfaces on a node with 200 pods: what `nptrace run` without --iface costs
(node/ifchoice.py chooses, node/ifwatch.py AutoIfaces follows), beside no tc at all
(`--iface none`) and the node's devices named with --iface (the lab's form).

The node is a namespace of the bench's and nptrace runs in it (`ip netns exec NODE nptrace
run`), as the shipped form runs in a node's namespace; there it is one node of several on
this kernel (node/scope.py), with 200 pods of its own:

  up 10.251.44.1 --veth-- node: eth0 10.251.44.2/24, default route via up
                                flannel.1 VXLAN (VNI 1, port 8472) over eth0, 10.251.47.0/32
                                cni0 bridge 10.251.46.1/24, ports vethp0..vethp199 (no address)
                                  each the node's end of a pod: a namespace of its own,
                                  eth0 10.251.46.N/24, default route via cni0
  up --veth-- far (a neighbour, so that `up` leads elsewhere too and is not one of the pods)

The three forms run one after another in the same topology, each with --no-nft-trace and
--host 10.251.0.0/16: nptrace adds nft trace tables, on an incident, to the namespace it
happened in (on this shared machine that may be another lab's), and another lab's records on
the same kernel are not this node's cost. Each form is launched once, again if that launch
compiled its BPF object (a warm start is compared; the compile stays in the data), and:
- which devices got tc: the start line ("interfaces chosen automatically: ..."), and after
  the churn, what the kernel holds on each of the node's devices (tcx links, clsact);
- launch -> ready file;
- at rest for REST_S (quick: 4 s): CPU (the tracer's threads' run time,
  /proc/<pid>/task/*/schedstat) and RSS, its anonymous part compared. The automatic form's
  30 s recheck falls outside the window: it costs one re-read, the last row's figure, every
  30 s;
- pod churn: CHURN pods' veths deleted and re-created CHURN_GAP_S apart. Each is a burst of
  link, address and route announcements in the node's namespace, and a bridge port announces
  itself once more forward_delay later, when it starts forwarding (15 s by default, STP or
  not; cni0 gets FORWARD_DELAY_S so that the window need not last 15 s more). An
  announcement makes the automatic form re-read the links at its next one-second poll, and a
  change of the node's veths makes every form's node scope find the pods again. CPU from the
  first change until SETTLE_S after the last port's second announcement, less the form's
  rest rate over the same time;
- per packet: a bulk TCP transfer from pod 0 out of the node (workloads.Bulk), bpf_stats on:
  the run time of every tc (sched_cls) program the tracer holds, divided by the packets
  eth0 carried both ways. A packet is an sk_buff (GSO super-packets, as in tc_cost) and
  crosses two traced devices, cni0 and eth0; tc_cost has a program's cost beside an empty one;
- one re-read of each kind, timed in the node's namespace by the project's own functions in a
  process of their own: AutoIfaces' (links, addresses and routes, then choose), the node
  scope's look at this namespace's veths on a link announcement, and its sort (which
  namespaces are pods'), made only when those veths changed.
Ratios are against `--iface none`. These launches stay out of the startup section's figures:
they start beside 200 pods, not the one veth the others watch.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

from nptrace.bench.context import Bench
from nptrace.bench.report import Row, Section
from nptrace.bench.topology import BenchError, Topology, sh
from nptrace.bench.tracer_proc import Nptrace

PODS = 200
CHURN = 20
CHURN_GAP_S = 0.2
REST_S = 10
FORWARD_DELAY_S = 2       # cni0's (the kernel's default: 15 s): a port's second announcement
SETTLE_S = 2.0            # two of the tracer's one-second polls, and the work they start
POD_NET = "10.251.46"     # .1 cni0, .2 .. .201 the pods
NODE_DEVS = ("eth0", "cni0", "flannel.1")
COMMON = ["--no-nft-trace", "--host", "10.251.0.0/16"]
FORMS = (("none", ["--iface", "none"]),
         ("auto", []),
         ("list", [a for d in NODE_DEVS for a in ("--iface", d)]))
BPF_PROG_TYPE_SCHED_CLS = 3


# --- pure: what nptrace printed, the kernel's numbers, the rows ------------------------------
def split_top(text: str, sep: str = ", ") -> list[str]:
    """text split at `sep` outside parentheses."""
    out, depth, cur, i = [], 0, "", 0
    while i < len(text):
        c = text[i]
        if depth == 0 and text.startswith(sep, i):
            out.append(cur)
            cur, i = "", i + len(sep)
            continue
        depth += (c == "(") - (c == ")")
        cur += c
        i += 1
    if cur:
        out.append(cur)
    return out


_CHOSEN = re.compile(r"interfaces chosen automatically: (.*)$", re.M)


def parse_chosen(stderr: str) -> tuple[list[str], str] | None:
    """(names, what was left out) from the automatic form's start line; None without one."""
    m = _CHOSEN.search(stderr)
    if not m:
        return None
    parts = split_top(m.group(1), "; ")
    names = [] if parts[0] == "none yet" else [p.split(" (", 1)[0] for p in split_top(parts[0])]
    left = next((p[len("left out: "):] for p in parts[1:] if p.startswith("left out: ")), "")
    return names, left


_ATTACHED = re.compile(r"attached (.*) in [0-9.]+ ?s \(BPF object (\w+)")


def parse_attached_line(stderr: str) -> tuple[list[str], str | None]:
    """(interfaces with tc, BPF object origin: "cache" or "compiled") from the start line
    `attached <probes>, tc:<iface>, ... (tc via tcx) in X s (BPF object <origin>; ...)`."""
    m = _ATTACHED.search(stderr)
    if not m:
        return [], None
    what = re.sub(r" \(tc via \w+\)| on node \S+", "", m.group(1))
    return [p[3:] for p in split_top(what) if p.startswith("tc:")], m.group(2)


def link_packets(ip_json: str) -> int:
    """rx + tx packets of the one link in `ip -j -s link show dev X`."""
    st = json.loads(ip_json)[0]["stats64"]
    return int(st["rx"]["packets"]) + int(st["tx"]["packets"])


def sched_cls(delta: dict[int, dict]) -> tuple[int, int]:
    """(runs, ns) summed over the tc programs of a bpfprog.delta()."""
    runs = sum(v["runs"] for v in delta.values() if v["type"] == BPF_PROG_TYPE_SCHED_CLS)
    ns = sum(v["ns"] for v in delta.values() if v["type"] == BPF_PROG_TYPE_SCHED_CLS)
    return runs, ns


def status_bytes(status: str, key: str) -> int | None:
    """A `<key>: N kB` field of /proc/<pid>/status, in bytes (RssAnon, RssFile, VmRSS)."""
    m = re.search(rf"^{key}:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) * 1024 if m else None


def pod_veths(names) -> list[str]:
    return [n for n in names if n.startswith("vethp")]


def _ratio(v, base) -> float | None:
    return v / base if v is not None and base else None


def _rt(r) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _ms(x) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f} ms"


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.0f} MiB"


def rows(d: dict) -> list[Row]:
    f = d["forms"]
    none = f.get("none", {})
    out = []
    auto = f.get("auto", {})
    if auto:
        got = auto.get("traced") or auto.get("chosen") or []
        pods = pod_veths(got) + pod_veths(auto.get("chosen") or [])
        ok = not pods and set(NODE_DEVS) <= set(got)
        out.append(Row("auto_ifaces", f"interfaces with tc, no --iface, {d['pods']} pod veths "
                       f"(after {d['churn']} re-created)", ", ".join(got) or "none",
                       f"list: {', '.join(f.get('list', {}).get('traced') or NODE_DEVS)}",
                       "no pod veth; eth0, cni0, flannel.1", ok, len(got), None, None,
                       "the node's devices, no pod veth"))
    for form, label in (("auto", "no --iface"), ("list", "--iface " + ",".join(NODE_DEVS))):
        x = f.get(form)
        if not x:
            continue
        s, b = x.get("start_s"), none.get("start_s")
        out.append(Row("auto_ifaces", f"start, launch -> ready file: {label}", _s(s),
                       f"{_s(b)} --iface none", _rt(_ratio(s, b)), None, s, b, _ratio(s, b)))
        r, rb = x.get("rest_cpu_rate"), none.get("rest_cpu_rate")
        out.append(Row("auto_ifaces", f"CPU at rest ({d['rest_s']:g} s): {label}",
                       _rate(r), f"{_rate(rb)} --iface none",
                       f"{_rt(_ratio(r, rb))} ({_plus(r, rb, _rate)})", None, r, rb,
                       _ratio(r, rb)))
        # VmRSS counts the libraries' pages mapped, which moved by 40 MiB from one launch to
        # the next whatever the form: the ratio is of the private (anonymous) part
        m, mb = x.get("rss_anon"), none.get("rss_anon")
        out.append(Row("auto_ifaces", f"RSS at rest, anonymous (VmRSS): {label}",
                       f"{_mib(m)} ({_mib(x.get('rss'))})",
                       f"{_mib(mb)} ({_mib(none.get('rss'))}) --iface none",
                       _rt(_ratio(m, mb)), None, m, mb, _ratio(m, mb)))
        c, cb = x.get("churn_cpu_s"), none.get("churn_cpu_s")
        per = None if c is None else c / d["churn"]
        out.append(Row("auto_ifaces", f"CPU for {d['churn']} pod veths re-created "
                       f"({d['churn_gap_s']:g} s apart), net of rest: {label}",
                       f"{_ms(c)} ({_ms(per)}/pod)", f"{_ms(cb)} --iface none",
                       f"{_rt(_ratio(c, cb))} ({_plus(c, cb, _ms)})", None, c, cb,
                       _ratio(c, cb)))
        k = x.get("bulk") or {}
        ns = k.get("ns_per_packet")
        if k.get("error"):
            out.append(Row("auto_ifaces", f"tc ns per packet forwarded, bulk TCP pod -> "
                           f"outside: {label}", "n/a", error=k["error"]))
        elif ns is not None:
            out.append(Row("auto_ifaces", f"tc ns per packet forwarded, bulk TCP pod -> "
                           f"outside: {label}", f"{ns:.0f} ns ({k['runs_per_packet']:.1f} "
                           f"runs, {k['ns_per_run']:.0f} ns/run)" if k.get("runs") else
                           f"{ns:.0f} ns", "0 ns --iface none (no tc)", f"+{ns:.0f} ns", None,
                           ns, 0.0, None))
    u = d.get("unit") or {}
    if u.get("choice_s") is not None:
        out.append(Row("auto_ifaces", f"one re-read of the node's links, addresses and routes "
                       f"(no --iface, on each announcement), {d['pods']} pod veths",
                       _ms(u["choice_s"]), f"{_ms(u.get('scope_s'))} the node scope's "
                       "re-read of the pods (every form)", "info", None, u["choice_s"],
                       u.get("scope_s")))
    if u.get("veths_s") is not None:
        out.append(Row("auto_ifaces", "the node scope on a link announcement: this namespace's "
                       f"veths read, {d['pods']} pod veths (every form)", _ms(u["veths_s"]),
                       f"{_ms(u.get('scope_s'))} the sort, made only when they changed",
                       "info", None, u["veths_s"], u.get("scope_s")))
    return out


def _plus(v, base, fmt) -> str:
    """v - base in fmt's unit, signed."""
    if v is None or base is None:
        return "n/a"
    text = fmt(abs(v - base))
    return ("-" if v < base else "+") + text


def _s(x) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def _rate(x) -> str:
    """CPU seconds per second as ms/s."""
    return "n/a" if x is None else f"{x * 1e3:.2f} ms/s"


# --- the topology ----------------------------------------------------------------------------
def _batch(ns: str, lines: list[str]) -> None:
    sh("ip", "-n", ns, "-batch", "-", input="".join(f"{ln}\n" for ln in lines), timeout=60)


def _pod_side(pod: str, i: int) -> None:
    _batch(pod, [f"addr add {POD_NET}.{i + 2}/24 dev eth0", "link set eth0 up",
                 f"route add default via {POD_NET}.1"])


def _pod_veth(node: str, pod: str, i: int) -> list[str]:
    return [f"link add vethp{i} type veth peer name eth0 netns {pod}",
            f"link set vethp{i} master cni0 up"]


def build(t: Topology, pods: int) -> tuple[str, str, list[str]]:
    """The node, its upstream and its pods' namespaces (see the module)."""
    node, up, far = t.ns("node"), t.ns("up"), t.ns("far")
    t.veth(node, "eth0", "10.251.44.2/24", up, "u0", "10.251.44.1/24")
    t.veth(up, "u1", "10.251.45.1/24", far, "f0", "10.251.45.2/24")
    t.ip(node, "route", "add", "default", "via", "10.251.44.1")
    t.ip(up, "route", "add", f"{POD_NET}.0/24", "via", "10.251.44.2")
    t.sysctl(node, "net.ipv4.ip_forward", 1)
    t.ip(node, "link", "add", "flannel.1", "type", "vxlan", "id", "1", "dstport", "8472",
         "local", "10.251.44.2", "dev", "eth0", "nolearning")
    t.ip(node, "addr", "add", "10.251.47.0/32", "dev", "flannel.1")
    t.ip(node, "link", "set", "flannel.1", "up")
    # a bridge without an address of its own takes its ports' lowest, so a pod's veth
    # re-created would move it and strand the pods' neighbour entries for their gateway
    t.ip(node, "link", "add", "cni0", "address", "02:00:0a:fb:2e:01", "type", "bridge",
         "forward_delay", str(FORWARD_DELAY_S * 100))
    t.ip(node, "addr", "add", f"{POD_NET}.1/24", "dev", "cni0")
    t.ip(node, "link", "set", "cni0", "up")
    # 200 namespaces in one `ip -batch` (0.1 s; one `ip netns add` each would be 200 forks);
    # listed first, so close() deletes whichever were made if the batch fails half-way
    names = [f"{t.prefix}-p{i}" for i in range(pods)]
    t.namespaces.extend(names)
    sh("ip", "-batch", "-", input="".join(f"netns add {n}\n" for n in names), timeout=60)
    _batch(node, [ln for i, p in enumerate(names) for ln in _pod_veth(node, p, i)])
    for i, p in enumerate(names):
        _pod_side(p, i)
    return node, up, names


def recreate(node: str, pod: str, i: int) -> None:
    """A pod's veth deleted and made again: the node's end enslaved to cni0, the pod's end
    given its address and route back."""
    _batch(node, [f"link del vethp{i}"] + _pod_veth(node, pod, i))
    _pod_side(pod, i)


def traced_devices(node: str) -> list[str]:
    """The node's devices that hold a tcx program or a clsact qdisc, by ifindex."""
    from nptrace.kernel import tcx
    from nptrace.kernel.nsenter import path_of
    from nptrace.node.netns import link_names
    path = path_of(node)
    links = link_names(path)
    clsact = {q.get("dev") for q in json.loads(sh("tc", "-n", node, "-j", "qdisc", "show")
                                               or "[]") if q.get("kind") == "clsact"}
    out = []
    for idx, name in sorted(links.items()):
        has = name in clsact
        if not has:
            try:
                has = any(tcx.prog_ids(idx, ing, path) for ing in (True, False))
            except OSError:
                pass          # no tcx in this kernel: clsact alone says
        if has:
            out.append(name)
    return out


# --- one form ------------------------------------------------------------------------------
def _launch(b: Bench, t: Topology, node: str, form: str, args: list[str]) -> tuple[Nptrace, dict]:
    """Started and ready; launched again when the first start compiled (a warm start is
    what is compared; the compile is kept in the data)."""
    rec: dict = {"args": args}
    for attempt in range(2):
        tag = f"auto_ifaces-{form}{attempt}"
        n = Nptrace(t, b.logdir, tag, COMMON + args, b.logdir / f"{tag}.jsonl",
                    stop_wait=b.stop_wait, netns=node).start()
        err = n.err_path.read_text()
        traced, origin = parse_attached_line(err)
        rec.update(start_s=n.startup_wall_s, origin=origin, at_start=traced,
                   rss_ready=n.rss_ready)
        if origin != "compiled" or attempt:
            break
        rec["compiled_start_s"] = n.startup_wall_s
        n.stop()
    chosen = parse_chosen(err)
    if chosen is not None:
        rec["chosen"], rec["left_out"] = chosen
    else:
        rec["chosen"] = traced
    return n, rec


def _rest(n: Nptrace, secs: float) -> dict:
    c0, t0 = n.cpu_exact(), time.monotonic()
    time.sleep(secs)
    cpu, dt = n.cpu_exact() - c0, time.monotonic() - t0
    status = Path(f"/proc/{n.pid}/status").read_text()
    return {"rest_cpu_s": cpu, "rest_window_s": dt, "rest_cpu_rate": cpu / dt,
            "rss": status_bytes(status, "VmRSS"), "rss_anon": status_bytes(status, "RssAnon"),
            "rss_file": status_bytes(status, "RssFile")}


def _churn(n: Nptrace, node: str, pods: list[str], which: list[int], rest_rate: float) -> dict:
    """The pods' veths re-created CHURN_GAP_S apart; the window runs until each port's
    second announcement (forwarding, FORWARD_DELAY_S later) has been polled and handled."""
    c0, t0 = n.cpu_exact(), time.monotonic()
    for k, i in enumerate(which):
        if k:
            time.sleep(CHURN_GAP_S)
        recreate(node, pods[i], i)
    time.sleep(FORWARD_DELAY_S + SETTLE_S)
    gross, dt = n.cpu_exact() - c0, time.monotonic() - t0
    return {"churn_gross_s": gross, "churn_window_s": dt,
            "churn_cpu_s": max(0.0, gross - rest_rate * dt)}


def _bulk(n: Nptrace, bulk, node: str, secs: float) -> dict:
    from nptrace.bench import bpfprog
    from nptrace.kernel.tc import enable_bpf_stats

    def packets() -> int:
        return link_packets(sh("ip", "-n", node, "-j", "-s", "link", "show", "dev", "eth0"))

    with enable_bpf_stats():
        a, p0 = bpfprog.process_prog_stats(n.pid), packets()
        bps = bulk.run(secs)
        d, p1 = bpfprog.delta(a, bpfprog.process_prog_stats(n.pid)), packets()
    runs, ns = sched_cls(d)
    pk = p1 - p0
    return {"gbit_s": bps / 1e9, "packets": pk, "runs": runs, "ns": ns,
            "ns_per_packet": ns / pk if pk else None,
            "runs_per_packet": runs / pk if pk else None,
            "ns_per_run": ns / runs if runs else None}


# One re-read of each kind, timed in the node's namespace by the project's own functions
# (a process of its own: the tracer is a black box): AutoIfaces' (the links, addresses and
# routes by raw rtnetlink dumps, then choose), the node scope's look at this namespace's veths
# on a link announcement, and its sort (which namespaces are pods').
_UNIT = """
import json, statistics, time
from nptrace.node.ifwatch import current_choice
from nptrace.node.scope import own_veths, pods_of_here
def med(fn, n):
    fn()
    xs = []
    for _ in range(n):
        t0 = time.process_time(); fn(); xs.append(time.process_time() - t0)
    return statistics.median(xs)
print(json.dumps({"choice_s": med(current_choice, 9), "veths_s": med(own_veths, 9),
                  "scope_s": med(pods_of_here, 3)}))
"""


def unit_costs(t: Topology, node: str) -> dict:
    from nptrace.bench.topology import PY
    try:
        return json.loads(t.run(node, [PY, "-c", _UNIT], timeout=60).strip().splitlines()[-1])
    except (BenchError, ValueError, IndexError) as e:
        return {"error": str(e)[:200]}


def run(b: Bench) -> Section:
    from nptrace.bench.workloads import Bulk

    sec = Section("auto_ifaces")
    rest_s = b.scale(REST_S, 4)
    bulk_s = b.scale(2, 1)
    data = {"pods": PODS, "pod_form": "a namespace each", "churn": CHURN,
            "churn_gap_s": CHURN_GAP_S, "forward_delay_s": FORWARD_DELAY_S,
            "settle_s": SETTLE_S, "rest_s": rest_s, "bulk_s": bulk_s,
            "common_args": COMMON, "forms": {}}
    sec.data = data
    with Topology("ai") as t:
        t0 = time.monotonic()
        node, up, pods = build(t, PODS)
        changed = time.monotonic()
        data["build_s"] = round(changed - t0, 2)
        bulk = Bulk(t, up, pods[0], "10.251.44.1")
        bulk.run(1)        # warm-up: ARP, slow start, iperf3's pages
        data["unit"] = unit_costs(t, node)
        churned = list(range(PODS - CHURN, PODS))
        for form, args in FORMS:
            n, rec = _launch(b, t, node, form, args)
            try:
                # at rest: past the start's own first polls, and past the ports' second
                # announcement of the last change to the topology
                time.sleep(max(1.0, changed + FORWARD_DELAY_S + SETTLE_S - time.monotonic()))
                rec.update(_rest(n, rest_s))
                rec.update(_churn(n, node, pods, churned, rec["rest_cpu_rate"]))
                changed = time.monotonic()
                rec["traced"] = traced_devices(node)
                try:
                    rec["bulk"] = _bulk(n, bulk, node, bulk_s)
                except BenchError as e:       # the other figures stand without it
                    rec["bulk"] = {"error": str(e)[:200]}
                    sec.error = sec.error or f"{form}: {e}"[:200]
            finally:
                n.stop()
            rec.update(stop_s=n.stop_s, killed=n.killed)
            data["forms"][form] = rec
            if n.killed:
                raise BenchError(f"nptrace ({form}) did not stop within {b.stop_wait:g} s")
    sec.rows = rows(data)
    return sec
