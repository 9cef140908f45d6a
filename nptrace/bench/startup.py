"""Start-up time and memory.

Start-up: launch of `nptrace run` to its ready file (every probe attached), over every launch
of this benchmark run (the other sections start nptrace many times), with nptrace's own
`attached ... in X s` beside it. Stop: SIGINT to exit (nptrace drains its ring first). And
three kinds of start side by side, each the median of KIND_RUNS launches watching one veth:
warm (the compiled object in the cache, kernel/objcache.py), cold (the page cache dropped
before each launch, the object cached) and compiling (an empty object cache: a first start,
the page cache warm).

Memory: one nptrace watching a veth (tracepoints + tc), then a churn of distinct flows for
10 minutes (quick: 20 s): SYNs at a steady rate to a closed port, each from a new (source
address, port), so every one is a new flow in the kernel's flow table and the classifier,
with a reset and drops as events, all sent to user space (--max-rate 0). RSS (VmRSS) is sampled throughout. Targets: RSS < 160 MiB,
and flat: the last sample within 10% of the one halfway through (by then every bounded table
has had time to fill; growth after that is a leak).
"""
from __future__ import annotations

import json
import subprocess
import time

from nptrace.bench.context import Bench
from nptrace.bench.report import Row, Section, spread
from nptrace.bench.topology import Topology
from nptrace.bench.workloads import TRAFFIC

STARTUP_TARGET_S = 2.0
KIND_RUNS = 3
# (kind, what the row says, target in s or None)
KINDS = (("warm", "warm: object cached", 1.5), ("cold", "cold: page cache dropped, object cached", 3.0),
         ("compile", "first start: no cached object (bcc compiles)", None))
RSS_TARGET = 160 * 2**20
FLAT = 0.10
SRC_NET = "10.251.128.0/17"


def run(b: Bench) -> Section:
    sec = Section("startup")
    secs = b.scale(600, 20)
    rate = b.scale(3000, 3000)
    step = b.scale(5.0, 1.0)
    samples = []
    with Topology("su") as t:
        c, s = t.ns("c"), t.ns("s")
        t.veth(c, "c0", "10.251.8.1/24", s, "s0", "10.251.8.2/24")
        t.ip(c, "route", "add", "local", SRC_NET, "dev", "lo")
        t.ip(s, "route", "add", SRC_NET, "via", "10.251.8.1")
        dmac = t.mac(s, "s0")
        kinds = _start_kinds(b, t, ["--iface", f"{s}/s0", "--max-rate", "0"])
        # --max-rate 0: every flow reaches the classifier (by default the kernel would send a
        # sample of this churn), the worst case for its memory
        n = b.nptrace(t, "startup", "startup", ["--iface", f"{s}/s0", "--max-rate", "0"])
        try:
            t0 = time.monotonic()
            samples.append({"t": 0.0, "rss": n.rss_ready, "cpu": n.cpu()})
            churn = t.spawn(c, TRAFFIC + ["syn", "--dev", "c0", "--dmac", dmac, "--src-net",
                                          SRC_NET, "--dst", "10.251.8.2", "--dport", "9999",
                                          "--rate", str(rate), "--secs", str(secs)],
                            stdout=subprocess.PIPE)
            while churn.poll() is None:
                time.sleep(step)
                rss = n.rss()
                if rss is None:
                    break
                samples.append({"t": round(time.monotonic() - t0, 2), "rss": rss,
                                "cpu": n.cpu()})
            out = churn.stdout.read() if churn.stdout else ""
            t.stop(churn)
            sent = json.loads(out.strip().splitlines()[-1])["sent"] if out.strip() else None
        finally:
            n.stop()
    launches = b.launch_records()
    sec.data = _data(samples, launches, secs, rate, sent)
    sec.data["kinds"] = kinds
    sec.rows = rows(sec.data)
    return sec


def _drop_page_cache() -> None:
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _start_kinds(b: Bench, t: Topology, args: list[str]) -> dict[str, dict]:
    """kind -> spread() of launch -> ready over KIND_RUNS launches (KINDS); each launch in
    an object cache of its own: a fresh empty folder for "compile", one a first start filled
    for the others."""
    import tempfile
    out: dict[str, list[float]] = {k: [] for k, _, _ in KINDS}
    with tempfile.TemporaryDirectory(prefix="npt-bench-cache-") as tmp:
        filled = {"NPTRACE_BPF_CACHE": f"{tmp}/filled"}
        b.nptrace(t, "startup", "su-fill", args, env=filled).stop()
        for i in range(KIND_RUNS):
            for kind, _, _ in KINDS:
                env = filled if kind != "compile" else {"NPTRACE_BPF_CACHE": f"{tmp}/empty{i}"}
                if kind == "cold":
                    _drop_page_cache()
                n = b.nptrace(t, "startup", f"su-{kind}{i}", args, env=env)
                n.stop()
                out[kind].append(n.startup_wall_s)
    return {k: spread(v) for k, v in out.items()}


def _data(samples, launches, secs, rate, sent) -> dict:
    rss = [s["rss"] for s in samples if s["rss"]]
    mid = samples[len(samples) // 2]["rss"] if samples else None
    last = samples[-1]["rss"] if samples else None
    cpu = (samples[-1]["cpu"] - samples[0]["cpu"]) / samples[-1]["t"] \
        if len(samples) > 1 and samples[-1]["t"] else None
    return {
        "samples": samples, "churn_secs": secs, "rate": rate, "flows_sent": sent,
        "rss_after_start": samples[0]["rss"] if samples else None, "rss_mid": mid,
        "rss_end": last, "rss_max": max(rss) if rss else None,
        "second_half_growth": (last - mid) / mid if mid and last else None,
        "cpu_share_during_churn": cpu,
        "launches": launches,
        "startup_wall": spread([x["wall_s"] for x in launches]),
        "startup_self": spread([x["self_s"] for x in launches]),
        "stop": spread([x["stop_s"] for x in launches]),
        "killed": sum(1 for x in launches if x["killed"]),
    }


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.0f} MiB"


def rows(d: dict) -> list[Row]:
    w, s, st = d["startup_wall"], d["startup_self"], d["stop"]
    out = []
    if w.get("n"):
        # the median is judged: on a shared 2-vCPU VM the slowest launch measures the
        # neighbours as much as nptrace; the max stays in the metric text
        out.append(Row("startup", f"start-up, launch -> ready file (median of {w['n']}, "
                       f"max {w['max']:.2f}s)", f"{w['median']:.2f} s",
                       f"{s['median']:.2f} s self-reported" if s.get("n") else "",
                       f"< {STARTUP_TARGET_S:g} s", w["median"] < STARTUP_TARGET_S,
                       w["median"], s.get("median"), None, f"< {STARTUP_TARGET_S:g} s"))
    for kind, what, target in KINDS:
        k = d.get("kinds", {}).get(kind, {})
        if k.get("n"):
            out.append(Row("startup", f"start-up, {what} (median of {k['n']}, max "
                           f"{k['max']:.2f}s)", f"{k['median']:.2f} s", "",
                           f"< {target:g} s" if target else "info",
                           None if target is None else k["median"] < target, k["median"],
                           None, None, f"< {target:g} s" if target else ""))
    if st.get("n"):
        out.append(Row("startup", f"stop, SIGINT -> exit after load (max of {st['n']}, "
                       f"median {st['median']:.1f}s)", f"{st['max']:.1f} s",
                       f"{d['killed']} killed (did not exit in time)", "info", None,
                       st["max"]))
    out.append(Row("startup", "RSS after start", _mib(d["rss_after_start"]), "",
                   f"< {_mib(RSS_TARGET)}", None if d["rss_after_start"] is None
                   else d["rss_after_start"] < RSS_TARGET, d["rss_after_start"], None, None,
                   f"< {RSS_TARGET}"))
    g = d["second_half_growth"]
    out.append(Row("startup", f"RSS under {d['churn_secs']:g}s of flow churn at {d['rate']}/s, --max-rate 0 "
                   f"(max; end vs halfway)", _mib(d["rss_max"]),
                   f"{_mib(d['rss_mid'])} halfway, {_mib(d['rss_end'])} end",
                   f"{'n/a' if g is None else f'{g:+.1%}'} / < {_mib(RSS_TARGET)}, "
                   f"flat +-{FLAT:.0%}",
                   None if d["rss_max"] is None or g is None
                   else (d["rss_max"] < RSS_TARGET and abs(g) <= FLAT),
                   d["rss_max"], d["rss_mid"], g, f"< {RSS_TARGET}, flat within {FLAT:.0%}"))
    if d["cpu_share_during_churn"] is not None:
        out.append(Row("startup", f"nptrace CPU during the churn ({d['rate']} flows/s)",
                       f"{d['cpu_share_during_churn']:.0%} of a core", "", "info", None,
                       d["cpu_share_during_churn"]))
    return out
