"""Bulk TCP throughput with nptrace attached (tc on both ends of the veth, every tracepoint)
as a ratio to the same transfer without it.

Runs alternate within one topology: pair i is (without, with) for even i and (with, without)
for odd i, so a drift of the VM (another tenant, thermal, page cache) hits both sides alike.
nptrace is started before each "with" run and stopped after it: the run measures nptrace
attached and idle-waiting, its compile is over by then. The verdict is on the median of
the per-pair ratios; the spread is printed beside it because single runs vary by +-15% here.
"""
from __future__ import annotations

from nptrace.bench.context import Bench
from nptrace.bench.report import Row, Section, paired_ratios, spread
from nptrace.bench.topology import Topology
from nptrace.bench.workloads import Bulk

TARGET = 0.98


def alternate(pairs: int, measure_without, measure_with) -> tuple[list, list]:
    """Run `pairs` with/without pairs in ABBA order; returns (with, without) lists by pair."""
    w, wo = [], []
    for i in range(pairs):
        if i % 2 == 0:
            wo.append(measure_without())
            w.append(measure_with(i))
        else:
            w.append(measure_with(i))
            wo.append(measure_without())
    return w, wo


def ratio_row(section: str, metric: str, unit_fmt, w: list[float], wo: list[float],
              target: float) -> tuple[Row, dict]:
    ratios = paired_ratios(w, wo)
    sp, sw, swo = spread(ratios), spread(w), spread(wo)
    med = sp.get("median")
    row = Row(section, metric, unit_fmt(sw.get("median")), unit_fmt(swo.get("median")),
              (f"{med:.1%} [{sp['min']:.1%}-{sp['max']:.1%}] / >= {target:.0%}"
               if med is not None else "n/a"),
              None if med is None else med >= target, sw.get("median"), swo.get("median"),
              med, f">= {target:.0%} of without")
    return row, {"with": w, "without": wo, "ratios": ratios, "ratio_spread": sp,
                 "with_spread": sw, "without_spread": swo, "target": target}


def run(b: Bench) -> Section:
    sec = Section("throughput")
    pairs, secs = b.scale(10, 2), b.scale(2, 1)
    with Topology("tp") as t:
        c, s = t.ns("c"), t.ns("s")
        t.veth(c, "c0", "10.251.3.1/24", s, "s0", "10.251.3.2/24")
        bulk = Bulk(t, s, c, "10.251.3.2")
        bulk.run(1)    # warm-up

        def without():
            return bulk.run(secs)

        def with_nptrace(i):
            n = b.nptrace(t, "throughput", f"throughput{i}",
                          ["--iface", f"{c}/c0", "--iface", f"{s}/s0"])
            try:
                return bulk.run(secs)
            finally:
                n.stop()

        w, wo = alternate(pairs, without, with_nptrace)
    gbit = lambda x: "n/a" if x is None else f"{x / 1e9:.2f} Gbit/s"   # noqa: E731
    row, data = ratio_row("throughput", f"bulk TCP over veth, {bulk.tool} ({pairs} pairs x "
                          f"{secs}s, median)", gbit, w, wo, TARGET)
    sec.rows.append(row)
    sec.data = dict(data, pairs=pairs, secs=secs, tool=bulk.tool)
    return sec
