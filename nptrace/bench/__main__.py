"""`python -m nptrace.bench [--quick] [--only SECTION ...] [--out DIR]`: run the benchmark
sections one after another, print one table, and save it under DIR/<timestamp>/ as
report.json, table.txt, table.md and report.png (the chart needs matplotlib).

Full mode takes about 26 minutes (10 of them the memory churn, 10 the soak), --quick under 5. Targets are
measured, never asserted: the exit status is 0 when every section produced its numbers, 1
when one failed (its row says why), 2 on bad usage.
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from nptrace.bench.context import Bench
from nptrace.bench.report import (SECTIONS, Row, Section, document, dumps, render_markdown,
                                  render_table, summary)
from nptrace.bench.topology import BenchError, remove_stale


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _versions() -> dict:
    out = {"kernel": platform.release(), "python": platform.python_version(),
           "cpus": os.cpu_count()}
    for name, cmd in (("iperf3", ["iperf3", "--version"]), ("tcpdump", ["tcpdump", "--version"])):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
            out[name] = (r.stdout or r.stderr).splitlines()[0].strip()
        except (OSError, IndexError, subprocess.TimeoutExpired):
            out[name] = None
    try:
        import bcc
        out["bcc"] = getattr(bcc, "__version__", "?")
    except Exception:
        out["bcc"] = None
    return out


MAIN_PID = os.getpid()


def _interrupt(signum, _frame):
    # SIGTERM/SIGHUP unwind like Ctrl-C, so every Topology's finally removes its namespaces.
    # Only here: pyroute2 forks helpers that inherit this handler and are ended with SIGTERM;
    # one that unwound our stack would run our cleanup from its copy of it.
    if os.getpid() != MAIN_PID:
        os._exit(128 + signum)
    raise KeyboardInterrupt(f"signal {signum}")


def run_section(name: str, bench: Bench) -> Section:
    t0 = time.monotonic()
    log(f"{name} ...")
    try:
        mod = importlib.import_module(f"nptrace.bench.{name}")
        sec = mod.run(bench)
    except Exception as e:   # any failure: its row says why, the traceback goes to logs
        (bench.logdir / f"{name}.traceback").write_text(traceback.format_exc())
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        sec = Section(name, [Row(name, name, "", error=msg[:200])], error=msg)
    sec.seconds = time.monotonic() - t0
    log(f"{name}: {len(sec.rows)} rows in {sec.seconds:.1f}s"
        + (f" (error: {sec.error})" if sec.error else ""))
    return sec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nptrace.bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short runs (under 2 minutes)")
    p.add_argument("--only", action="append", choices=SECTIONS, metavar="SECTION",
                   help=f"run only this section (repeatable): {', '.join(SECTIONS)}")
    p.add_argument("--out", default="results", help="results folder (default: results)")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench: error: needs root (network namespaces, BPF); run with sudo",
              file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    stale = remove_stale()
    if stale:
        log(f"removed namespaces of dead bench runs: {', '.join(stale)}")
    outdir = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    logdir = outdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(quick=a.quick, logdir=logdir)
    names = [n for n in SECTIONS if not a.only or n in a.only]
    # start-up figures gather every nptrace launch of the run: that section goes last
    t0 = time.monotonic()
    sections: list[Section] = []
    try:
        for name in names:
            sections.append(run_section(name, bench))
    except KeyboardInterrupt:
        log("interrupted: namespaces and processes removed; partial results saved")
    meta = {"mode": "quick" if a.quick else "full", "started": outdir.name,
            "seconds": round(time.monotonic() - t0, 1), "sections": names, **_versions()}
    doc = document(sections, meta)
    rows = [r for s in sections for r in s.rows]
    table = render_table(rows)
    (outdir / "report.json").write_text(dumps(doc))
    (outdir / "table.txt").write_text(table + "\n")
    (outdir / "table.md").write_text(render_markdown(rows) + "\n")
    chart_note = "skipped (--no-chart)"
    if not a.no_chart:
        from nptrace.bench.chart import render
        why = render(doc, outdir / "report.png")
        chart_note = f"skipped: {why}" if why else str(outdir / "report.png")
    s = summary(rows)
    print(table)
    print(f"\n{s['met']} met, {s['missed']} missed, {s['error']} errors "
          f"({meta['mode']} mode, {meta['seconds']:.0f}s)")
    print(f"saved: {outdir / 'report.json'}, {outdir / 'table.txt'}; chart: {chart_note}")
    if len(sections) < len(names):
        return 130
    return 1 if any(sec.error for sec in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
