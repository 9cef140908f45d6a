"""User-space throughput without a kernel: how fast nptrace can take records off a full ring.

decoder   RingReader over a synthetic ring (the kernel's layout: consumer page, producer page,
          data mapped twice) filled to the brim with records, read with read_batch() into
          RECORD tuples (ringbuf.walk's fast path): events/s. Target >= 1,000,000/s.
pipeline  what `nptrace run --json` does per record after the ring walk (the decoder row times
          that): events.decode_many of raw records, as read_batch(raw=True) hands them over ->
          Classifier.feed_many (+ tick per batch, flush at the end) -> JsonLines.write_many to
          /dev/null, batches of 256 records (the batch APIs the live loop uses).
          One tcp_send_reset NO_SOCKET record per reset, every reset a flow of its own (a
          storm). A second run feeds the storm's real mix (4 records per reset: kfree_skb of
          the SYN, tcp_send_reset, the RST on tc egress, kfree_skb of the RST at the client).
          Both report labeled records/s against the target, >= 200,000/s, and
          resets/s beside it, in CPU time (process_time: the loop is one thread, and the VM's
          neighbours move wall time by a third from one minute to the next). Both run the live
          loop's code: the label memo (classify/labelmemo.py: a record's own label kept by the
          values its rules read), the one-event line template (sinks/jsonl.py), and the hot
          path's modules compiled by Cython from their own sources where setup.py compiled
          them (nptrace/compiled.py); the section says which ran ("paths").
compiled  the same loops in child processes, alternating with NPTRACE_PURE=1 (the same
          sources run as Python), CPU time: what compiling gains, as a ratio of pairs.
          The measured history of these rows is docs/benchmarks.md.
Both run for a bounded time (the classifier may be slow on many flows), then report the rate
reached. A cProfile pass of the pipeline lists its hot spots in the JSON; a py-spy pass
(sampling, without cProfile's per-call cost) splits a reset's time by stage in one info row:
decode, attribution (classify.py), json sink (sinks/jsonl.py, sinks/collapse.py), other (the
ring stage of pyspy.py stays 0 here: no ring is walked).

`python -m nptrace.bench.pipeline [--resets N] [--mix]` runs the pipeline alone (for py-spy).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import struct
import sys
import time
from pathlib import Path

from nptrace import events as ev
from nptrace.kernel import ringbuf as rb
from nptrace.bench import pyspy
from nptrace.bench.report import Row, Section, si

DECODER_TARGET = 1_000_000
PIPELINE_TARGET = 200_000
PAGE = 4096
NO_SOCKET = 2          # SKB_DROP_REASON_NO_SOCKET (kfree_skb); sk_rst_reason NO_SOCKET is 1
SERVER, PORT = "10.251.6.2", 9999
_OFF = {name: getattr(ev.RawEvent, name).offset for name, _ in ev.RawEvent._fields_}


def _templates() -> dict[str, bytes]:
    """One record per kind of event a closed-port reset produces (server 10.251.6.2:9999)."""
    common = dict(family=2, l4proto=6, netns=4026531840)
    return {
        "syn_drop": ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=NO_SOCKET,
                              daddr=SERVER, dport=PORT, tcpflags=ev.TCP_SYN, ifindex=2,
                              **common),
        # aux: the flags of the packet the reset answers (bpf/tracepoints.bpf.c), a SYN here
        "rst_sent": ev.encode(type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1,
                              saddr=SERVER, sport=PORT, tcpflags=ev.TCP_RST | ev.TCP_ACK,
                              aux=ev.TCP_SYN, **common),
        "wire_rst": ev.encode(type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_EGRESS,
                              dir=ev.Dir.EGRESS, saddr=SERVER, sport=PORT, ifindex=2,
                              tcpflags=ev.TCP_RST | ev.TCP_ACK, **common),
        "rst_drop": ev.encode(type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=NO_SOCKET,
                              saddr=SERVER, sport=PORT, tcpflags=ev.TCP_RST | ev.TCP_ACK,
                              ifindex=2, **common),
    }


def records(n_resets: int, mix: bool, t0_ns: int = 10**12, gap_ns: int = 2000) -> list[bytes]:
    """Raw records for n_resets resets of distinct client flows (10.251.128.0/17 x port)."""
    tpl = _templates()
    kinds = ("syn_drop", "rst_sent", "wire_rst", "rst_drop") if mix else ("rst_sent",)
    out = []
    for i in range(n_resets):
        client = struct.pack("!I", (10 << 24 | 251 << 16 | 128 << 8) + 1 + i // 64000)
        cport = 1024 + i % 64000
        for k, kind in enumerate(kinds):
            b = bytearray(tpl[kind])
            struct.pack_into("<Q", b, _OFF["ts_ns"], t0_ns + i * gap_ns + k * 100)
            struct.pack_into("<Q", b, _OFF["skb"], 0xFFFF000000000000 + i * 8 + k)
            if kind == "syn_drop":      # the SYN: client -> server
                b[_OFF["saddr"]:_OFF["saddr"] + 4] = client
                struct.pack_into("<H", b, _OFF["sport"], cport)
            else:                       # the RST: server -> client
                b[_OFF["daddr"]:_OFF["daddr"] + 4] = client
                struct.pack_into("<H", b, _OFF["dport"], cport)
            out.append(bytes(b))
    return out


def full_ring(recs: list[bytes], data_size: int) -> tuple[bytearray, bytearray, int]:
    """(consumer page, producer area, records written): the kernel's mapping, filled."""
    stride = rb.stride_of(ev.SIZE)
    n = data_size // stride          # records repeat: the walk does not care
    cons = bytearray(PAGE)
    area = bytearray(PAGE + 2 * data_size)
    hdr = struct.pack("<II", ev.SIZE, 0)
    pad = bytes(stride - rb.HDR - ev.SIZE)
    blob = b"".join(hdr + recs[i % len(recs)] + pad for i in range(n))
    area[PAGE:PAGE + len(blob)] = blob
    area[PAGE + data_size:PAGE + data_size + len(blob)] = blob
    struct.pack_into("<Q", area, 0, len(blob))
    return cons, area, n


def bench_decoder(data_size: int = 64 << 20, rounds: int = 3) -> dict:
    recs = records(4096, mix=True)
    cons, area, n = full_ring(recs, data_size)
    rates = []
    for _ in range(rounds):
        struct.pack_into("<Q", cons, 0, 0)
        reader = rb.RingReader.over_memory(cons, area, data_size, page=PAGE)
        got = 0
        t0 = time.perf_counter()
        while True:
            batch = reader.read_batch(65536)
            if not batch:
                break
            got += len(batch)
        dt = time.perf_counter() - t0
        reader.close()
        if got != n:
            raise RuntimeError(f"decoder read {got} records of {n}")
        rates.append(n / dt)
    # the live path's variant: payload bytes, then events.decode_many per batch
    struct.pack_into("<Q", cons, 0, 0)
    reader = rb.RingReader.over_memory(cons, area, data_size, page=PAGE)
    t0 = time.perf_counter()
    dec = 0
    while True:
        batch = reader.read_batch(65536, raw=True)
        if not batch:
            break
        ev.decode_many(batch)
        dec += len(batch)
        if time.perf_counter() - t0 > 10:
            break
    decode_rate = dec / (time.perf_counter() - t0)
    reader.close()
    return {"records": n, "ring_bytes": data_size, "rates": rates, "eps": max(rates),
            "raw_decode_eps": decode_rate}


def run_pipeline(n_resets: int, mix: bool, budget_s: float, batch: int = 256,
                 collapse: bool = False, clock=time.perf_counter) -> dict:
    """Feed records through decode -> classify -> JSON (to /dev/null) for at most budget_s.
    With collapse, the JSON sink collapses storms (sinks/collapse.py): every reset is still
    labeled and counted (the sum of `repeat` over the lines), fewer lines are written."""
    from nptrace.classify import Classifier, Context
    from nptrace.sinks.collapse import StormCollapse
    from nptrace.sinks.jsonl import JsonLines

    recs = records(n_resets, mix)
    per = 4 if mix else 1
    ctx = Context(drop_name=lambda v: "NO_SOCKET" if v == NO_SOCKET else f"REASON_{v}",
                  rst_name=lambda v: "NO_SOCKET" if v == 1 else f"REASON_{v}")
    clf = Classifier(ctx)
    devnull = open(os.devnull, "w")
    # the live offset (tracer.py): a line's `ts` is epoch seconds, as nptrace run writes it
    sink = JsonLines(time.time_ns() - time.monotonic_ns(), devnull,
                     StormCollapse() if collapse else None)
    verdicts = fed = 0
    gc.collect()
    gc.freeze()           # as Tracer.run does
    gc.set_threshold(10_000, 10, 10)
    t0 = clock()
    deadline = t0 + budget_s
    complete = True
    # the batch APIs the live loop drains a ring batch with (decode_many, feed_many,
    # write_many); the classifier ticks once per batch, as Tracer.run does when behind
    for start in range(0, len(recs), batch):
        chunk = recs[start:start + batch]
        events, _bad = ev.decode_many(chunk)
        vs = clf.feed_many(events)
        vs += clf.tick(events[-1].ts_ns)
        sink.write_many(vs)
        sink.tick(events[-1].ts_ns)
        verdicts += len(vs)
        fed += len(chunk)
        if clock() > deadline:
            complete = fed >= len(recs)
            break
    vs = clf.flush()
    sink.write_many(vs)
    verdicts += len(vs)
    dt = clock() - t0
    gc.unfreeze()
    sink.close()
    devnull.close()
    resets = fed // per
    return {"resets": resets, "records": fed, "records_per_reset": per, "verdicts": verdicts,
            "secs": dt, "resets_per_s": resets / dt, "records_per_s": fed / dt,
            "complete": complete, "budget_s": budget_s, "collapse": collapse,
            "lines": sink.collapse.lines if collapse else verdicts}


def median_run(runs: list[dict]) -> dict:
    """The run of median records/s (the lower middle of an even count), with every run's
    records/s beside it ("runs_records_per_s", in the order they ran)."""
    order = sorted(runs, key=lambda r: r["records_per_s"])
    return {**order[(len(order) - 1) // 2],
            "runs_records_per_s": [r["records_per_s"] for r in runs]}


def compiled_vs_python(n_resets: int, mix: bool, budget_s: float, rounds: int = 3) -> dict:
    """The hot path compiled (nptrace/compiled.py) against the same sources run as Python,
    side by side: `rounds` alternating pairs of children, one with NPTRACE_PURE=1,
    each timing its loop in CPU time (process_time: the VM's neighbours move wall time by a
    third from one minute to the next, and the other helpers' benches share its two CPUs).
    The ratio is the median of the pairs' ratios."""
    import json
    import statistics
    import subprocess
    rates: dict[str, list[float]] = {"compiled": [], "python": []}
    argv = [sys.executable, "-m", "nptrace.bench.pipeline", "--resets", str(n_resets),
            "--budget", str(budget_s), "--cpu", "--json"] + (["--mix"] if mix else [])
    paths = {}
    for _ in range(rounds):
        for mode in ("compiled", "python"):
            env = {**os.environ, "NPTRACE_PURE": "1" if mode == "python" else "0"}
            out = subprocess.run(argv, env=env, capture_output=True, text=True,
                                 timeout=budget_s + 120)
            if out.returncode != 0:
                return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
            r = json.loads(out.stdout)
            rates[mode].append(r["records_per_s"])
            paths[mode] = r["paths"]
    ratios = [a / b for a, b in zip(rates["compiled"], rates["python"])]
    return {"rates": rates, "paths": paths, "ratios": ratios,
            "ratio": statistics.median(ratios),
            "compiled": statistics.median(rates["compiled"]),
            "python": statistics.median(rates["python"])}


def paths_in_use() -> dict:
    """Which of the hot path's modules run compiled ("compiled") or as Python ("python: why")."""
    from nptrace import compiled
    compiled.hot_path()     # imports every one
    return dict(compiled.STATE)


def profile_pipeline(n_resets: int, budget_s: float, top: int = 15) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    run_pipeline(n_resets, False, budget_s)
    prof.disable()
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"function": f"{os.path.relpath(fn) if fn.startswith('/') else fn}:"
                                 f"{line}({name})", "calls": nc, "tottime": tt, "cumtime": ct})
    rows.sort(key=lambda r: r["tottime"], reverse=True)
    return rows[:top]


# The py-spy pass samples the whole `python -m nptrace.bench.pipeline` process: start-up,
# imports, records() building the input, the timed loop and the teardown of its objects. The
# split counts only the samples under run_pipeline, minus those under records() or full_ring()
# (the input, built before the clock starts) and under _find_and_load (run_pipeline's
# first-time imports): what is left is the loop the rate is measured over, plus the final
# flush. Without that, "other" would be mostly the build, which is not per-reset time.
PYSPY_WITHIN, PYSPY_SKIP = "run_pipeline", ("records", "full_ring", "_find_and_load")


def pyspy_pipeline(n_resets: int, budget_s: float, out_path: Path, rate: int) -> dict:
    """py-spy over the single-record pipeline in a child: its summary, or {"error": why}."""
    argv = [sys.executable, "-m", "nptrace.bench.pipeline", "--resets", str(n_resets),
            "--budget", str(budget_s)]
    # the budget bounds the loop; start-up, the build and the teardown get a minute more
    rec = pyspy.record(argv, budget_s + 60, out_path, rate=rate)
    if "error" in rec:
        return rec
    summ = pyspy.summarize(out_path.read_text(), within=PYSPY_WITHIN, skip=PYSPY_SKIP)
    return {**rec, **summ}


def _pyspy_row(r: dict) -> Row:
    if "error" in r:
        return Row("pipeline", "pipeline: where a reset's time goes (py-spy)",
                   f"not run: {r['error']}", "", "info", None, None)
    return Row("pipeline", f"pipeline: where a reset's time goes (py-spy, {r['samples']} "
               "samples)", pyspy.stage_text(r["stages"]), "", "info", None, r["samples"])


def bench_keys(n_keys: int = 10_000, per_key: int = 100_000) -> dict:
    """The exact-count path (sinks/exact.py) the live loop runs once a second instead of
    labeling records: n_keys cause keys of distinct servers, labeled once each with the
    classifier's rules (classify/keylabel.py), then one update where each key counted per_key
    more records. Its cost is per key, not per record: records/s is what one second of that
    update would account for."""
    from nptrace.classify import Context
    from nptrace.classify.keylabel import KeyLabeler
    from nptrace.kernel.causekeys import CauseKey
    from nptrace.sinks.exact import ExactCounts
    ctx = Context(drop_name=lambda v: "NO_SOCKET" if v == NO_SOCKET else f"REASON_{v}",
                  rst_name=lambda v: "NO_SOCKET" if v == 1 else f"REASON_{v}")
    keys = [CauseKey(int(ev.EvType.RST_SENT), int(ev.Hook.TCP_SEND_RST), 1, 4026531840, 2, 0,
                     f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}", 9999, "0.0.0.0", 0, 2,
                     0, ev.TCP_SYN, 0, "0.0.0.0", 0) for i in range(n_keys)]
    ex = ExactCounts(KeyLabeler(ctx))
    t0 = time.perf_counter()
    ex.update({k: (1, 0) for k in keys}, 1)
    first = time.perf_counter() - t0
    raw = {k: (1 + per_key, 10) for k in keys}
    t0 = time.perf_counter()
    ex.update(raw, 2)
    again = time.perf_counter() - t0
    return {"keys": n_keys, "first_us_per_key": first / n_keys * 1e6,
            "update_us_per_key": again / n_keys * 1e6,
            "records_per_s": n_keys * per_key / again if again else None}


def bench_session_writer(n: int, rounds: int = 3) -> dict:
    """Session records written per CPU second (SessionWriter.write_event, what `run -w` adds
    per event), the median of ``rounds`` runs into a scratch directory."""
    import tempfile
    from nptrace.sessions import format as S
    rec = records(1, False)[0]
    rates = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="nptrace-bench-") as d:
            w = S.SessionWriter(Path(d), header=S.make_header(epoch_offset_ns=0),
                                max_file_bytes=256 << 20)
            t0 = time.process_time()
            for _ in range(n):
                w.write_event(rec)
            w.close()
            rates.append(n / max(time.process_time() - t0, 1e-9))
    return {"records": n, "records_per_s": sorted(rates)[len(rates) // 2]}


def run(b) -> Section:
    sec = Section("pipeline")
    dec = bench_decoder(b.scale(64 << 20, 16 << 20))
    n = b.scale(300_000, 60_000)
    budget = b.scale(10, 2)
    # CPU time: the loop is one thread, and the VM's neighbours move wall time (see above).
    # Three runs of each, alternated: a slow minute of the VM (which lowered one run of three
    # by a fifth once, the pure path's with it) moves one run, not the median.
    singles, mixes = [], []
    for _ in range(b.scale(3, 1)):
        singles.append(run_pipeline(n, False, budget, clock=time.process_time))
        mixes.append(run_pipeline(n // 4 if b.quick else n // 2, True, budget,
                                  clock=time.process_time))
    single, mix = median_run(singles), median_run(mixes)
    hot = profile_pipeline(b.scale(30_000, 10_000), b.scale(5, 1.5))
    # a higher rate in quick mode: its loop lasts well under a second
    spy = pyspy_pipeline(n, b.scale(8, 2), b.logdir / "pipeline.pyspy.txt",
                         rate=b.scale(250, 500))
    keys = bench_keys(b.scale(10_000, 2_000))
    rec = bench_session_writer(b.scale(200_000, 20_000), rounds=b.scale(3, 1))
    side = {m: compiled_vs_python(b.scale(200_000, 40_000) // (4 if m else 1), m, budget,
                              rounds=b.scale(3, 1)) for m in (False, True)}
    sec.data = {"decoder": dec, "pipeline": single, "pipeline_mix": mix, "profile": hot,
                "paths": paths_in_use(),
                "compiled_vs_python": {"single": side[False], "mix": side[True]},
                "pyspy": spy, "keys": keys, "session_writer": rec,
                "decoder_eps": dec["eps"], "decoder_target": DECODER_TARGET,
                "pipeline_rps": single["resets_per_s"], "pipeline_target": PIPELINE_TARGET,
                "pipeline_records_per_s": single["records_per_s"],
                "pipeline_mix_records_per_s": mix["records_per_s"]}
    sec.rows = [
        Row("pipeline", f"decoder: ring walk to tuples, events/s ({dec['records']} records, "
            f"{dec['ring_bytes'] >> 20} MiB ring)", si(dec["eps"], "/s"), "",
            f"{dec['eps'] / DECODER_TARGET:.2f}x / >= {si(DECODER_TARGET, '/s')}",
            dec["eps"] >= DECODER_TARGET, dec["eps"], None, dec["eps"] / DECODER_TARGET,
            f">= {DECODER_TARGET}/s"),
        Row("pipeline", "decoder: ring walk + events.decode_many (live path), events/s",
            si(dec["raw_decode_eps"], "/s"), "", "info", None, dec["raw_decode_eps"]),
        _pipe_row("pipeline: decode+classify+JSON, 1 record/reset, labeled records/s", single),
        _pipe_row("pipeline: storm mix, 4 records/reset, labeled records/s", mix),
        *(_side_row(f"pipeline: compiled (Cython) vs the same source as Python, {name}, records/s (CPU time, "
                    "median of pairs)", side[m]) for m, name in ((False, "1 record/reset"),
                                                                 (True, "storm mix"))),
        _pyspy_row(spy),
        Row("pipeline", f"exact counts by cause key ({keys['keys']} keys): us per new key "
            "(labeled once), per active key and second", f"{keys['first_us_per_key']:.1f} us; "
            f"{keys['update_us_per_key']:.2f} us",
            f"{si(keys['records_per_s'], '/s')} records accounted", "info", None,
            keys["records_per_s"]),
        Row("pipeline", f"session recorder (-w): records written/s, CPU time ({rec['records']} "
            "records)", si(rec["records_per_s"], "/s"), "", "info", None, rec["records_per_s"]),
    ]
    return sec


def _side_row(metric: str, r: dict) -> Row:
    if "error" in r:
        return Row("pipeline", metric, f"not run: {r['error']}", "", "info", None)
    return Row("pipeline", metric, si(r["compiled"], "/s"), f"{si(r['python'], '/s')} python",
               f"{r['ratio']:.2f}x", None, r["compiled"], r["python"], r["ratio"])


def _pipe_row(metric: str, r: dict) -> Row:
    """records/s against the target (>= 200k labeled records/s, the single-kind storm and the
    mix alike); resets/s beside it."""
    rps = r["records_per_s"]
    note = "" if r["complete"] else f" (stopped after {r['budget_s']:g}s: {r['resets']} resets)"
    runs = r.get("runs_records_per_s") or []
    if len(runs) > 1:
        note += f", median of {len(runs)} runs ({si(min(runs), '/s')}-{si(max(runs), '/s')})"
    if r["verdicts"] < r["resets"]:
        note += f" [{r['verdicts']} verdicts for {r['resets']} resets]"
    return Row("pipeline", metric + note, si(rps, "/s"), f"{si(r['resets_per_s'], '/s')} resets",
               f"{rps / PIPELINE_TARGET:.2f}x / >= {si(PIPELINE_TARGET, '/s')}",
               rps >= PIPELINE_TARGET and r["verdicts"] >= r["resets"],
               rps, r["resets_per_s"], rps / PIPELINE_TARGET, f">= {PIPELINE_TARGET}/s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nptrace.bench.pipeline")
    p.add_argument("--resets", type=int, default=200_000)
    p.add_argument("--mix", action="store_true", help="4 records per reset (the storm's mix)")
    p.add_argument("--budget", type=float, default=30.0, help="seconds at most")
    p.add_argument("--collapse", action="store_true", help="JSON sink collapses storms")
    p.add_argument("--cpu", action="store_true",
                   help="time the loop in this process's CPU time, not wall time")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = p.parse_args(argv)
    r = run_pipeline(a.resets, a.mix, a.budget, collapse=a.collapse,
                     clock=time.process_time if a.cpu else time.perf_counter)
    if a.json:
        import json
        print(json.dumps({**r, "paths": paths_in_use()}))
    else:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
