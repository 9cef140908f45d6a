"""Reset storm: SYNs to a closed port as fast as one Python AF_PACKET sender makes them, and
what each observer costs and misses on the same storm.

client (10.251.6.1, plus 10.251.128.0/17 routed locally as source addresses) -- server
(10.251.6.2, nothing listening on 9999). Every SYN is a distinct flow (source address x
port); the server answers each with a RST (tcp_send_reset, reason NO_SOCKET), the exact
number of which is the server namespace's TcpOutRsts (what `nstat` shows) before and after.
The same storm size runs once per observer, one at a time:

  none      no observer: the storm rate the machine makes by itself
  nptrace   `nptrace run --json --iface server/s0 --host 10.251.0.0/16 --metrics-addr ...`
            (tracepoints + tc), stdout to a file; missed = RSTs sent - incident lines with
            port 9999; its own `events decoded, lost` and `over --max-rate` counts from
            stderr; every miss must be covered by a lost or rate-limited record, and its
            exact in-kernel RST_SENT counter (scraped from its metrics on loopback before the
            stop) must equal TcpOutRsts. Run twice: as shipped (--max-rate default, records
            beyond it counted in the kernel, not sent) and with --max-rate 0 (no limit)
  tcpdump   `tcpdump -i s0 -w FILE 'tcp[tcpflags] & tcp-rst != 0'` in the server namespace;
            missed = RSTs sent - packets in FILE (it reports `dropped by kernel` itself)
  trace     bcc's trace-bpfcc on tcp:tcp_send_reset, filtered to port 9999 (what an SRE would
            type: bcc ships no reset tool); kernels >= 6.10 give that tracepoint an `enum
            sk_rst_reason` field bcc 0.26 cannot compile, so a one-line header declares it
  tcpdrop   bcc's tcpdrop-bpfcc, as shipped (reported as not running where it fails)

Then the storm of three causes at once (nptrace/bench/three_causes.py, the same as
tests/privileged/test_exact_causes.py): `nptrace run --json --metrics-addr` with default
options, hping3 floods for a few seconds; per cause, the exported counter against the truth
counted without nptrace (TcpOutRsts, TcpExtIPReversePathFilter, the DROP rule's counter), and
the JSON lines' `repeat` sums plus incident records against the counter.

CPU is the run time of the observer's threads (/proc/<pid>/task/*/schedstat, nanoseconds; the
clock ticks of /proc/<pid>/stat are 10 ms, coarser than what a sampled storm costs), from just
before the storm until the observer went idle after it (its backlog drained).
"""
from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

from nptrace.bench import bpfprog, three_causes
from nptrace.bench.context import Bench
from nptrace.bench.report import (Row, Section, count_bcc_events, count_port_lines,
                                  parse_bcc_lost, parse_tcpdump, pcap_count, per_100k,
                                  prom_samples, prom_sum, si)
from nptrace.bench.topology import (BenchError, Topology, cpu_seconds, cpu_seconds_exact,
                                    node_busy_seconds, snmp,
                                    wait_for)
from nptrace.bench.workloads import TRAFFIC

SRC_NET = "10.251.128.0/17"
SERVER = "10.251.6.2"
PORT = 9999
BPF_PROG_TYPE_TRACEPOINT = 5
TRACE = "/usr/sbin/trace-bpfcc"
TCPDROP = "/usr/sbin/tcpdrop-bpfcc"
TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))


class Storm:
    def __init__(self, t: Topology, client: str, server: str):
        self.t, self.client, self.server = t, client, server
        self.dmac = t.mac(server, "s0")
        self.first = 0

    def fire(self, count: int) -> dict:
        """Send `count` SYNs of new flows; the node's busy CPU is counted from here until
        settled() (after the observer drained)."""
        import json
        self.node0 = node_busy_seconds()
        r0 = snmp(self.server, "Tcp", "OutRsts")
        out = self.t.run(self.client, TRAFFIC + [
            "syn", "--dev", "c0", "--dmac", self.dmac, "--src-net", SRC_NET, "--dst", SERVER,
            "--dport", str(PORT), "--count", str(count), "--first", str(self.first)],
            timeout=300)
        self.first += count
        r = json.loads(out.strip().splitlines()[-1])
        resets = snmp(self.server, "Tcp", "OutRsts") - r0
        self.last = {"sent": r["sent"], "secs": r["secs"], "resets": resets,
                     "rate": resets / r["secs"] if r["secs"] else None}
        return self.last

    def settled(self) -> None:
        self.last["node_cpu_s"] = node_busy_seconds() - self.node0


def wait_idle(pid: int, max_s: float, quiet_cpu: float = 0.03, step: float = 0.25,
              min_s: float = 2.0) -> tuple[bool, float]:
    """Wait until process pid uses < quiet_cpu CPU-seconds per `step` twice in a row (its
    backlog is drained), and at least min_s: tcpdump's TPACKET_V3 blocks are handed to it
    only when full or when their timer retires them, so an idle-looking tcpdump may still
    have packets coming. Returns (went idle, monotonic time it was last busy)."""
    t_min = time.monotonic() + min_s
    end = time.monotonic() + max_s
    last = cpu_seconds(pid)
    busy_at = time.monotonic()
    quiet = 0
    while time.monotonic() < end:
        time.sleep(step)
        now = cpu_seconds(pid)
        if now - last < quiet_cpu:
            quiet += 1
            if quiet >= 2 and time.monotonic() >= t_min:
                return True, busy_at
        else:
            quiet = 0
            busy_at = time.monotonic()
        last = now
    return False, busy_at


def _has_tp_prog(pid: int) -> bool:
    try:
        return any(v["type"] == BPF_PROG_TYPE_TRACEPOINT
                   for v in bpfprog.process_prog_stats(pid).values())
    except OSError:
        return False


def _tracepoint_format(name: str) -> str:
    for root in TRACEFS:
        p = root / "events" / name / "format"
        if p.exists():
            return p.read_text()
    return ""


def _result(name: str, st: dict, cpu: float | None, seen: int | None, **kw) -> dict:
    resets = st["resets"]
    missed = None if seen is None else max(0, resets - seen)
    return dict({"tool": name, "resets": resets, "storm_secs": st["secs"],
                 "storm_rate": st["rate"], "cpu_s": cpu, "node_cpu_s": st.get("node_cpu_s"),
                 "node_cpu_per_100k": per_100k(st["node_cpu_s"], resets)
                 if st.get("node_cpu_s") is not None else None,
                 "cpu_per_100k": per_100k(cpu, resets) if cpu is not None else None,
                 "seen": seen, "missed": missed}, **kw)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> list:
    """nptrace's Prometheus metrics (loopback): its exact in-kernel counters."""
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return prom_samples(r.read().decode())
    except OSError:
        return []


def measure_storm(storm: Storm, pid: int, count: int, drain_s: float):
    """Fire the storm while observer pid watches: (storm result, drained, busy until, the
    observer's CPU seconds from the first reset until its backlog was drained)."""
    cpu0 = cpu_seconds_exact(pid)
    st = storm.fire(count)
    idle, busy_until = wait_idle(pid, drain_s)
    storm.settled()
    return st, idle, busy_until, cpu_seconds_exact(pid) - cpu0


def run_nptrace(b: Bench, t: Topology, storm: Storm, server: str, count: int,
                drain_s: float, name: str = "nptrace", extra: tuple[str, ...] = ()) -> dict:
    out = b.logdir / f"storm-{name}.jsonl"
    port = _free_port()
    n = b.nptrace(t, "reset_storm", f"storm-{name}",
                  ["--iface", f"{server}/s0", "--host", "10.251.0.0/16",
                   "--metrics-addr", f"127.0.0.1:{port}", *extra], stdout_path=out)
    from nptrace.kernel.tc import enable_bpf_stats
    try:
        with enable_bpf_stats():
            p0 = bpfprog.process_prog_stats(n.pid)
            cpu0, t0 = n.cpu_exact(), time.monotonic()
            st = storm.fire(count)
            p1 = bpfprog.process_prog_stats(n.pid)
        names = bpfprog.prog_names(p1)      # while nptrace still holds its programs
        idle, busy_until = wait_idle(n.pid, drain_s)
        storm.settled()
        cpu = n.cpu_exact() - cpu0
        rss = n.rss()
        metrics = _scrape(port)
    finally:
        n.stop()
    exact = {"rst_sent": prom_sum(metrics, "nptrace_kernel_events_total", type="RST_SENT",
                                  iface=server),
             # the per-cause counter: every reset under its cause, not a sample
             "no_listener": prom_sum(metrics, "nptrace_resets_total", cause="no_listener",
                                     direction="sent"),
             "emitted": prom_sum(metrics, "nptrace_events_emitted_total"),
             "lost": prom_sum(metrics, "nptrace_events_lost_total")}
    progs = bpfprog.delta(p0, p1)
    prog_costs = {f"{names.get(i, i)}": {"runs": v["runs"], "ns_per_run": v["ns_per_run"],
                                         "ns_per_reset": v["ns"] / st["resets"]
                                         if st["resets"] else None}
                  for i, v in progs.items() if v["runs"]}
    with open(out, "rb") as f:
        seen = count_port_lines(f, PORT)
    _trim(out)
    missed = max(0, st["resets"] - seen)
    # a reset with no line of its own must be covered by a record the ring lost or one the
    # in-kernel rate limit kept back, and the exact in-kernel count must equal TcpOutRsts
    uncounted = n.lost is None or (n.lost + (n.sampled or 0)) < missed
    counted = (missed == 0 or not uncounted) and exact["rst_sent"] in (None, st["resets"])
    secs = max(busy_until - t0, st["secs"])
    return _result(name, st, cpu, seen, decoded=n.decoded, lost=n.lost, sampled=n.sampled,
                   decoded_per_s=(n.decoded / secs) if n.decoded else None,
                   drained=idle, killed=n.killed, stop_s=n.stop_s, rss_after=rss,
                   every_loss_counted=counted, bpf_programs=prog_costs, exact=exact)


def run_tcpdump(b: Bench, t: Topology, storm: Storm, server: str, count: int,
                drain_s: float) -> dict:
    tcpdump = shutil.which("tcpdump")
    if not tcpdump:
        return {"tool": "tcpdump", "note": "tcpdump not installed"}
    pcap, errp = (b.logdir / "storm.pcap").resolve(), b.logdir / "storm-tcpdump.stderr"
    p = t.spawn(server, [tcpdump, "-i", "s0", "-n", "-w", str(pcap),
                         "tcp[tcpflags] & tcp-rst != 0"], stderr=t.open_log(errp))
    try:
        wait_for(lambda: "listening on" in errp.read_text(), 15, 0.02, "tcpdump listening", p)
        st, idle, _, cpu = measure_storm(storm, p.pid, count, drain_s)
    finally:
        t.stop(p, signal.SIGINT, 10)
    stats = parse_tcpdump(errp.read_text())
    seen = pcap_count(pcap.read_bytes()) if pcap.exists() else 0
    pcap.unlink(missing_ok=True)
    return _result("tcpdump", st, cpu, seen, kernel_dropped=stats.get("dropped"),
                   captured=stats.get("captured"), drained=idle)


def _bcc_tool(b: Bench, t: Topology, storm: Storm, name: str, argv: list[str], count: int,
              drain_s: float, count_events) -> dict:
    outp, errp = b.logdir / f"storm-{name}.stdout", b.logdir / f"storm-{name}.stderr"
    p = t.spawn(None, argv, stdout=t.open_log(outp), stderr=t.open_log(errp))
    try:
        try:
            wait_for(lambda: _has_tp_prog(p.pid), 60, 0.05, f"{name} attached", p)
        except BenchError:
            t.stop(p, signal.SIGINT, 5)
            err = errp.read_text()
            why = next((ln.strip() for ln in err.splitlines() if "error:" in ln),
                       err.strip().splitlines()[-1] if err.strip() else "exited")
            return {"tool": name, "note": f"does not run here: {why[:160]}"}
        time.sleep(0.3)       # attach happens right after load; let its poll loop start
        st, idle, _, cpu = measure_storm(storm, p.pid, count, drain_s)
    finally:
        t.stop(p, signal.SIGINT, 10)
    text_out, text_err = outp.read_text(errors="replace"), errp.read_text(errors="replace")
    lost = parse_bcc_lost(text_out + text_err)
    seen = count_events(text_out)
    _trim(outp)
    return _result(name, st, cpu, seen, lost_reported=lost, drained=idle)


def run_trace(b, t, storm, count, drain_s) -> dict:
    if not Path(TRACE).exists():
        return {"tool": "trace", "note": f"{TRACE} not installed (bpfcc-tools)"}
    fmt = _tracepoint_format("tcp/tcp_send_reset")
    argv = [TRACE]
    if "enum sk_rst_reason" in fmt:
        hdr = (b.logdir / "sk_rst_reason.h").resolve()
        hdr.write_text("enum sk_rst_reason { SK_RST_REASON_NOT_SPECIFIED };\n")
        argv += ["-I", str(hdr)]
    if "sport;" in fmt:            # Linux < 6.10: ports are fields of their own
        filt = f"args->sport == {PORT} || args->dport == {PORT}"
    else:                          # 6.10+: saddr is the RST sender's sockaddr_in
        filt = f"args->saddr[2] == {PORT >> 8} && args->saddr[3] == {PORT & 0xFF}"
    argv.append(f"t:tcp:tcp_send_reset ({filt})")
    return _bcc_tool(b, t, storm, "trace", argv, count, drain_s, count_bcc_events)


def run_tcpdrop(b, t, storm, count, drain_s) -> dict:
    if not Path(TCPDROP).exists():
        return {"tool": "tcpdrop", "note": f"{TCPDROP} not installed (bpfcc-tools)"}
    import re
    line = re.compile(rf"^\d\d:\d\d:\d\d .*:{PORT}\b", re.M)
    return _bcc_tool(b, t, storm, "tcpdrop", [TCPDROP], count, drain_s,
                     lambda text: len(line.findall(text)))


def _trim(path: Path, keep: int = 200) -> None:
    """Keep the head of a large output file as a sample; the counts are already taken."""
    if not path.exists() or path.stat().st_size < 1 << 20:
        return
    with open(path, "rb") as f:
        head = [f.readline() for _ in range(keep)]
    path.write_bytes(b"".join(head) + b"... (cut by the benchmark after counting)\n")


def run(b: Bench) -> Section:
    sec = Section("reset_storm")
    count = b.scale(300_000, 50_000)
    drain_s = b.scale(20, 5)
    tools: dict[str, dict] = {}
    with Topology("rs") as t:
        c, s = t.ns("c"), t.ns("s")
        t.veth(c, "c0", "10.251.6.1/24", s, "s0", f"{SERVER}/24")
        t.ip(c, "route", "add", "local", SRC_NET, "dev", "lo")
        t.ip(s, "route", "add", SRC_NET, "via", "10.251.6.1")
        storm = Storm(t, c, s)
        storm.fire(5000)      # warm-up: neighbour entries, page cache of the sender
        storm.fire(count)
        time.sleep(2)         # the same settling time the observers get (wait_idle min_s)
        storm.settled()
        tools["none"] = _result("none", storm.last, None, None)
        tools["nptrace"] = run_nptrace(b, t, storm, s, count, drain_s)
        # the same without the in-kernel rate limit: what the ring and the consumer take
        tools["nptrace_unlimited"] = run_nptrace(b, t, storm, s, count, drain_s,
                                                 "nptrace_unlimited", ("--max-rate", "0"))
        tools["tcpdump"] = run_tcpdump(b, t, storm, s, count, drain_s)
        tools["trace"] = run_trace(b, t, storm, count, drain_s)
        tools["tcpdrop"] = run_tcpdrop(b, t, storm, count, drain_s)
        three = run_three_causes(b, t, b.scale(3, 2))
    sec.data = {"resets": count, "tools": tools, "port": PORT, "three_causes": three}
    sec.rows = rows(tools, count) + three_cause_rows(three)
    return sec


def run_three_causes(b: Bench, t: Topology, secs: float) -> dict:
    """The three-cause storm under `nptrace run` with default options: per cause, truth,
    exported counter, and the JSON lines' repeat sum plus incident records."""
    if not shutil.which("hping3"):
        return {"note": "hping3 not installed (scripts/setup.sh installs it)"}
    cli, srv = t.ns("xc"), t.ns("xs")
    three_causes.build(cli, srv)
    out = b.logdir / "storm-three-causes.jsonl"
    port = _free_port()
    base = three_causes.snapshot(srv)
    n = b.nptrace(t, "reset_storm", "storm-three-causes",
                  ["--metrics-addr", f"127.0.0.1:{port}"], stdout_path=out)
    try:
        three_causes.flood(cli, secs)
        time.sleep(2.5)            # the once-a-second count picks up the last records
        after = three_causes.snapshot(srv)
        m = three_causes.settled(port)
    finally:
        n.stop()
    summary, incidents = three_causes.line_sums(out.read_text())
    _trim(out)
    return {"secs": secs, "truth": three_causes.truth(base, after),
            "exported": three_causes.exported(m), "summary_repeat": summary,
            "incident_records": incidents,
            "records": three_causes.total(m, "nptrace_kernel_events_total"),
            "sampled": three_causes.total(m, "nptrace_events_sampled_total")}


def three_cause_rows(r: dict) -> list[Row]:
    if "note" in r:
        return [Row("reset_storm", "storm, three causes at once", "", r["note"], "info")]
    out = []
    for c in three_causes.CAUSES:
        n, k = r["truth"][c], r["exported"][c]
        err = abs(k - n) / n if n else None
        out.append(Row("reset_storm", f"storm, 3 causes at once: counting error, {c} "
                       f"(vs {three_causes.TRUTH_NAMES[c]})",
                       f"{err:.3%} ({k:.0f})" if err is not None else "n/a",
                       f"{n} truth", "< 0.5%", None if err is None else err < 0.005, k, n, err,
                       "< 0.5%"))
    lines = {c: r["summary_repeat"][c] + r["incident_records"][c] for c in three_causes.CAUSES}
    worst = max((abs(lines[c] - r["exported"][c]) / r["exported"][c]
                 for c in three_causes.CAUSES if r["exported"][c]), default=None)
    out.append(Row("reset_storm", f"storm, 3 causes at once: JSON repeat + incident records "
                   f"vs counters ({r['records']:.0f} records, {r['sampled']:.0f} not sent)",
                   " / ".join(f"{lines[c]:.0f}" for c in three_causes.CAUSES),
                   " / ".join(f"{r['exported'][c]:.0f}" for c in three_causes.CAUSES),
                   f"{worst:.2%} / <= 0.1%" if worst is not None else "n/a",
                   None if worst is None else worst <= 0.001, worst, None, None, "<= 0.1%"))
    return out


def rows(tools: dict, count: int) -> list[Row]:
    out = []
    none, npt, td = tools["none"], tools["nptrace"], tools.get("tcpdump", {})
    out.append(Row("reset_storm", f"storm: RSTs sent (TcpOutRsts), no observer",
                   f"{none['resets']} at {si(none['storm_rate'], '/s')}", "", "info", None,
                   none["storm_rate"]))
    c_n, c_t = npt.get("cpu_per_100k"), td.get("cpu_per_100k")
    ratio = c_n / c_t if c_n is not None and c_t else None
    out.append(Row("reset_storm", "storm: observer CPU s per 100k resets (vs tcpdump -w)",
                   _f(c_n, "s"), f"{_f(c_t, 's')} tcpdump",
                   f"{ratio:.1f}x / < tcpdump" if ratio is not None else "n/a / < tcpdump",
                   None if ratio is None else ratio < 1, c_n, c_t, ratio, "< tcpdump"))
    base = none.get("node_cpu_per_100k")
    over = {k: (r["node_cpu_per_100k"] - base) if r.get("node_cpu_per_100k") is not None
            and base is not None else None for k, r in tools.items()}
    out.append(Row("reset_storm", "storm: node CPU s per 100k resets over no observer "
                   "(kernel side included)", _f(over.get("nptrace"), "s"),
                   f"{_f(over.get('tcpdump'), 's')} tcpdump, {_f(over.get('trace'), 's')} "
                   "bcc trace", "info", None, over.get("nptrace"), over.get("tcpdump")))
    out.append(Row("reset_storm", f"storm: resets with no line of their own, of "
                   f"{npt['resets']} (vs tcpdump)", _missed(npt),
                   f"{td.get('missed', 'n/a')} (kernel dropped {td.get('kernel_dropped', '?')})",
                   "every loss counted", bool(npt.get("every_loss_counted")),
                   npt.get("missed"), td.get("missed"), None, "every loss counted"))
    ex = npt.get("exact") or {}
    if ex.get("rst_sent") is not None:
        k = int(ex["rst_sent"])
        out.append(Row("reset_storm", "storm: nptrace exact in-kernel RST_SENT count vs "
                       "TcpOutRsts", str(k), f"{npt['resets']} TcpOutRsts",
                       "equal", k == npt["resets"], k, npt["resets"]))
    if ex.get("no_listener") is not None and npt["resets"]:
        k = int(ex["no_listener"])
        err = abs(k - npt["resets"]) / npt["resets"]
        out.append(Row("reset_storm", "storm: per-cause counting error, nptrace_resets_total"
                       "{no_listener,sent} vs TcpOutRsts", f"{err:.3%} ({k})",
                       f"{npt['resets']} TcpOutRsts", "< 0.5%", err < 0.005, k,
                       npt["resets"], err, "< 0.5%"))
    out.append(Row("reset_storm", "storm: nptrace events decoded/s (until drained)",
                   si(npt.get("decoded_per_s"), "/s"),
                   f"{si(npt.get('storm_rate'), '/s')} resets made", "info", None,
                   npt.get("decoded_per_s")))
    out.append(Row("reset_storm", "storm: resets/s the sender made with the observer on",
                   si(npt.get("storm_rate"), "/s"), f"{si(none['storm_rate'], '/s')} none, "
                   f"{si(td.get('storm_rate'), '/s')} tcpdump", "info", None,
                   npt.get("storm_rate"), none["storm_rate"]))
    unl = tools.get("nptrace_unlimited")
    if unl and "note" not in unl:
        out.append(Row("reset_storm", "storm, nptrace --max-rate 0: CPU s per 100k resets; "
                       "resets with no line", f"{_f(unl.get('cpu_per_100k'), 's')}; "
                       f"{_missed(unl)}", f"{si(unl.get('decoded_per_s'), '/s')} decoded",
                       "info", None, unl.get("cpu_per_100k"), None))
    for key, label in (("trace", "bcc trace-bpfcc tcp:tcp_send_reset"),
                       ("tcpdrop", "bcc tcpdrop-bpfcc")):
        r = tools.get(key, {})
        if "note" in r:
            note = r["note"] if len(r["note"]) <= 70 else r["note"][:67] + "..."
            out.append(Row("reset_storm", f"storm: {label}", "", note, "info"))
            continue
        c_b = r.get("cpu_per_100k")
        out.append(Row("reset_storm", f"storm: CPU s per 100k resets (vs {label})", _f(c_n, "s"),
                       _f(c_b, "s"), f"{c_n / c_b:.1f}x" if c_n is not None and c_b else "n/a",
                       None, c_n, c_b))
        out.append(Row("reset_storm", f"storm: resets with no line of their own (vs {label})",
                       str(npt.get("missed")), f"{r.get('missed')} ({r.get('lost_reported')} "
                       "reported lost)", "info", None, npt.get("missed"), r.get("missed")))
    return out


def _missed(r: dict) -> str:
    if r.get("killed"):
        return f"{r.get('missed')} (killed before its counts)"
    parts = [f"{r.get('lost')} lost"]
    if r.get("sampled"):
        parts.append(f"{r['sampled']} over --max-rate")
    return f"{r.get('missed')} ({', '.join(parts)}; " \
        f"{'all counted' if r.get('every_loss_counted') else 'NOT all counted'})"


def _f(x, unit="") -> str:
    return "n/a" if x is None else f"{x:.3g} {unit}".strip()
