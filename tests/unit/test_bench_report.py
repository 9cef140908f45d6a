"""The benchmark's pure parts: report rows and rendering, the parsers for what the measured
tools print, the synthetic SYN frames and ring, and the row builders of each section.
No root, no bcc, no kernel."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from nptrace.bench import report as rp


# --- numbers and rows -----------------------------------------------------------------------
def test_spread_of_samples():
    s = rp.spread([3, 1, 2, None, float("nan")])
    assert s["n"] == 3 and s["median"] == 2 and s["min"] == 1 and s["max"] == 3
    assert s["p25"] == 1.5 and s["p75"] == 2.5
    assert rp.spread([]) == {"n": 0}
    assert rp.spread([5])["p25"] == rp.spread([5])["p75"] == 5


def test_ratios_and_rates():
    assert rp.paired_ratios([9, 10, 5], [10, 10, 0]) == [0.9, 1.0]
    assert rp.per_100k(2.0, 400_000) == 0.5
    assert rp.per_100k(1.0, 0) is None
    assert rp.si(1_234_567, "/s") == "1.23M/s"
    assert rp.si(950) == "950"
    assert rp.si(None) == "n/a"
    assert rp.pct(0.981) == "98.1%"


def test_verdicts():
    assert rp.Row("s", "m", "1", met=True).verdict == "met"
    assert rp.Row("s", "m", "1", met=False).verdict == "missed"
    assert rp.Row("s", "m", "1").verdict == "-"
    assert rp.Row("s", "m", "1", met=True, error="boom").verdict == "error"


def _rows():
    return [rp.Row("tc_cost", "tc ingress ns/packet", "101 ns", "86 ns empty", "+15 / <= +30",
                   True, 101, 86, 15),
            rp.Row("throughput", "bulk | TCP", "8 Gbit/s", "8.4 Gbit/s", "95% / >= 98%", False),
            rp.Row("connrate", "conn/s", "", error="iperf3 gone")]


def test_table_has_the_five_columns_and_a_gap_between_sections():
    text = rp.render_table(_rows())
    head = text.splitlines()[0].split()
    assert head == ["metric", "nptrace", "baseline", "ratio/target", "verdict"]
    lines = text.splitlines()
    assert "" in lines                              # sections are separated
    assert lines[2].endswith("met") and "missed" in text and "error: iperf3 gone" in text


def test_markdown_escapes_pipes():
    md = rp.render_markdown(_rows())
    assert md.splitlines()[0] == "| metric | nptrace | baseline | ratio/target | verdict |"
    assert "bulk \\| TCP" in md
    assert md.count("\n") == 4


def test_document_keeps_every_section_and_counts_verdicts():
    secs = [rp.Section(n, [r]) for n, r in zip(("tc_cost", "throughput", "connrate"), _rows())]
    secs[0].data = {"x": float("nan"), "t": (1, 2)}
    doc = rp.document(secs, {"mode": "quick"})
    assert doc["summary"] == {"met": 1, "missed": 1, "error": 1, "-": 0}
    assert set(doc["sections"]) == {"tc_cost", "throughput", "connrate"}
    back = json.loads(rp.dumps(doc))
    assert back["sections"]["tc_cost"]["rows"][0]["verdict"] == "met"
    assert back["sections"]["tc_cost"]["data"]["t"] == [1, 2]


# --- parsers ------------------------------------------------------------------------------
def test_parse_nptrace_stderr():
    err = ("nptrace: attached skb/kfree_skb, tc:npt-x/s0 in 0.97s (kprobes: absent)\n"
           "nptrace: stopped: 192 events decoded, 3 lost\n")
    assert rp.parse_stopped(err) == (192, 3)
    assert rp.parse_attached(err) == 0.97
    assert rp.parse_stopped("nptrace: attached x in 1s") is None
    assert rp.parse_sampled(err) == 0
    assert rp.parse_sampled("nptrace: 1178504 events over --max-rate were counted in the "
                            "kernel, not sent\n") == 1178504
    assert rp.parse_attached("nothing") is None


def test_parse_tcpdump_exit_stats():
    err = ("tcpdump: listening on s0, link-type EN10MB (Ethernet), snapshot length 262144 bytes\n"
           "98228 packets captured\n100000 packets received by filter\n"
           "0 packets dropped by kernel\n")
    assert rp.parse_tcpdump(err) == {"captured": 98228, "received": 100000, "dropped": 0}


def test_bcc_output_counts():
    out = "PID     TID     COMM   FUNC   -\n1 1 py tcp_send_reset 1\n\n2 2 py tcp_send_reset 1\n"
    assert rp.count_bcc_events(out) == 2
    assert rp.parse_bcc_lost("Possibly lost 2246 samples\nPossibly lost 8 samples\n") == 2254


def _pcap(order: str, lens: list[int], cut: int = 0) -> bytes:
    magic = 0xA1B2C3D4
    head = struct.pack(order + "IHHiIII", magic, 2, 4, 0, 0, 262144, 1)
    body = b"".join(struct.pack(order + "IIII", 0, 0, n, n) + bytes(n) for n in lens)
    data = head + body
    return data[:len(data) - cut] if cut else data


@pytest.mark.parametrize("order", ["<", ">"])
def test_pcap_count(order):
    assert rp.pcap_count(_pcap(order, [54, 54, 60])) == 3
    assert rp.pcap_count(_pcap(order, [54, 54, 60], cut=10)) == 2     # torn last record
    assert rp.pcap_count(b"") == 0
    with pytest.raises(ValueError):
        rp.pcap_count(b"\0" * 40)


def test_proc_readers():
    stat = "123 (py thon) S 1 2 3 4 5 6 7 8 9 10 100 50 7 3 20 0 1 0 99"
    assert rp.proc_cpu_ticks(stat) == 160
    assert rp.proc_rss_bytes("Name:\tpy\nVmRSS:\t  2048 kB\n") == 2 * 2**20
    assert rp.proc_rss_bytes("Name:\tpy\n") is None


def test_snmp_counter():
    snmp = ("Ip: Forwarding DefaultTTL\nIp: 1 64\n"
            "Tcp: RtoAlgorithm RtoMin OutRsts InCsumErrors\nTcp: 1 200 300000 0\n")
    assert rp.snmp_counter(snmp, "Tcp", "OutRsts") == 300000
    with pytest.raises(KeyError):
        rp.snmp_counter(snmp, "Tcp", "Nope")


def test_iperf3_and_bpf_fdinfo_and_tc_json():
    assert rp.iperf3_bps({"end": {"sum_received": {"bits_per_second": 8e9}}}) == 8e9
    with pytest.raises(KeyError):
        rp.iperf3_bps({"end": {}})
    info = "pos:\t0\nprog_type:\t3\nprog_id:\t2369\nrun_time_ns:\t500\nrun_cnt:\t5\n"
    assert rp.bpf_prog_fdinfo(info) == {"prog_type": 3, "prog_id": 2369, "run_time_ns": 500,
                                        "run_cnt": 5}
    tc = [{"kind": "bpf"}, {"kind": "bpf", "options": {"bpf_name": "npt_9_ing",
                                                        "prog": {"id": 7, "name": "x"}}}]
    assert rp.tc_filter_progs(tc) == {"npt_9_ing": 7}


def test_count_port_lines():
    lines = [b'{"kind":"rst","saddr":"10.251.6.2","sport":9999,"daddr":"10.0.0.1","dport":1024,}',
             b'{"kind":"drop","saddr":"10.0.0.1","sport":1024,"daddr":"10.251.6.2","dport":9999,}',
             b'{"kind":"rst","saddr":"10.0.0.1","sport":99990,"dport":80,}']
    assert rp.count_port_lines(lines, 9999) == 2


# --- synthetic traffic and ring -------------------------------------------------------------
def _csum(b: bytes) -> int:
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


@pytest.mark.parametrize("i", [0, 1, 63_999, 64_000, 5_000_000])
def test_syn_frames_have_valid_checksums_and_distinct_flows(i):
    from nptrace.bench.traffic import SynFrames
    g = SynFrames("10.251.128.0/17", "10.251.6.2", 9999, "aa:bb:cc:dd:ee:ff", "02:00:00:00:00:01")
    f = g.frame(i)
    assert len(f) == 54 and f[12:14] == b"\x08\x00"
    ip, tcp = f[14:34], f[34:54]
    assert _csum(ip) == 0xFFFF
    pseudo = ip[12:20] + b"\x00\x06" + struct.pack("!H", 20)
    assert _csum(pseudo + tcp) == 0xFFFF
    assert tcp[13] == 0x02 and struct.unpack("!H", tcp[2:4])[0] == 9999
    assert g.frame(i)[26:38] != g.frame(i + 1)[26:38]       # next flow differs in src addr/port


def test_synthetic_ring_reads_back_every_record():
    from nptrace import events as ev
    from nptrace.kernel import ringbuf as rb
    from nptrace.bench import pipeline as pl
    recs = pl.records(10, mix=True)
    assert len(recs) == 40 and all(len(r) == ev.SIZE for r in recs)
    cons, area, n = pl.full_ring(recs, 1 << 16)
    assert n == (1 << 16) // rb.stride_of(ev.SIZE)
    reader = rb.RingReader.over_memory(cons, area, 1 << 16, page=pl.PAGE)
    got = reader.read_batch(100000, raw=True)
    reader.close()
    assert len(got) == n and got[:40] == recs
    e = ev.decode(recs[1])
    assert e.type == ev.EvType.RST_SENT and e.sport == 9999 and e.daddr == "10.251.128.1"
    assert ev.decode(recs[0]).dport == 9999 and ev.decode(recs[0]).sport == 1024


def test_pipeline_labels_every_reset_of_a_small_storm():
    from nptrace.bench import pipeline as pl
    r = pl.run_pipeline(50, False, budget_s=30)
    assert r["complete"] and r["resets"] == 50 and r["verdicts"] == 50
    m = pl.run_pipeline(20, True, budget_s=30)
    assert m["records"] == 80 and m["verdicts"] == 20


def test_pipeline_rows_judge_records_per_second_for_both_runs():
    from nptrace.bench import pipeline as pl
    run = {"resets": 10, "records": 40, "verdicts": 10, "complete": True, "budget_s": 1,
           "resets_per_s": 60_000.0, "records_per_s": 240_000.0}
    row = pl._pipe_row("mix", run)
    assert row.met is True and row.value == 240_000.0 and row.base_value == 60_000.0
    assert row.target == ">= 200000/s"
    slow = pl._pipe_row("single", {**run, "records_per_s": 150_000.0})
    assert slow.met is False and slow.ratio == 0.75


def test_pipeline_row_is_the_median_run_with_the_range_beside_it():
    from nptrace.bench import pipeline as pl
    runs = [{"resets": 10, "records": 10, "verdicts": 10, "complete": True, "budget_s": 1,
             "resets_per_s": x, "records_per_s": x} for x in (230_000.0, 170_000.0, 210_000.0)]
    m = pl.median_run(runs)
    assert m["records_per_s"] == 210_000.0
    assert m["runs_records_per_s"] == [230_000.0, 170_000.0, 210_000.0]
    row = pl._pipe_row("single", m)
    assert row.met is True and row.value == 210_000.0
    assert "median of 3 runs (170k/s-230k/s)" in row.metric
    assert pl.median_run(runs[:2])["records_per_s"] == 170_000.0   # even: the lower middle


# --- section row builders -------------------------------------------------------------------
def test_alternation_is_abba_and_ratio_row():
    from nptrace.bench.throughput import alternate, ratio_row
    order = []
    w, wo = alternate(3, lambda: order.append("wo") or 10.0,
                      lambda i: order.append(f"w{i}") or 9.9)
    assert order == ["wo", "w0", "w1", "wo", "wo", "w2"]
    row, data = ratio_row("throughput", "bulk", lambda x: f"{x:g}", w, wo, 0.98)
    assert row.met is True and data["ratios"] == [0.99, 0.99, 0.99]
    assert row.ratio_target.startswith("99.0% [99.0%-99.0%]")
    row, _ = ratio_row("throughput", "bulk", str, [], [], 0.98)
    assert row.met is None and row.ratio_target == "n/a"


def _tool(name, cpu100k, missed, **kw):
    return dict({"tool": name, "resets": 1000, "storm_rate": 5e4, "cpu_per_100k": cpu100k,
                 "node_cpu_per_100k": (cpu100k or 0) + 1.0, "missed": missed}, **kw)


def test_storm_rows_verdicts():
    from nptrace.bench.reset_storm import rows
    tools = {"none": _tool("none", None, None),
             "nptrace": _tool("nptrace", 0.5, 10, lost=40, every_loss_counted=True,
                              decoded_per_s=1e5),
             "tcpdump": _tool("tcpdump", 1.0, 0, kernel_dropped=0),
             "trace": _tool("trace", 2.0, 3, lost_reported=3),
             "tcpdrop": {"tool": "tcpdrop", "note": "does not run here: " + "x" * 200}}
    out = {r.metric: r for r in rows(tools, 1000)}
    cpu = out["storm: observer CPU s per 100k resets (vs tcpdump -w)"]
    assert cpu.met is True and cpu.ratio == 0.5
    missed = "storm: resets with no line of their own, of 1000 (vs tcpdump)"
    assert out[missed].met is True and "all counted" in out[missed].nptrace
    drop = out["storm: bcc tcpdrop-bpfcc"]
    assert drop.verdict == "-" and len(drop.baseline) <= 70
    assert not any("max-rate 0" in m for m in out)
    tools["nptrace_unlimited"] = _tool("nptrace_unlimited", 3.0, 500, lost=2000, sampled=0,
                                       every_loss_counted=True, decoded_per_s=2e4)
    tools["nptrace"].update(sampled=900, lost=0)
    out = {r.metric: r for r in rows(tools, 1000)}
    assert "900 over --max-rate" in out[missed].nptrace
    unl = [r for m, r in out.items() if "max-rate 0" in m]
    assert len(unl) == 1 and unl[0].value == 3.0
    tools["nptrace"].update(every_loss_counted=False, killed=True)
    out = {r.metric: r for r in rows(tools, 1000)}
    assert out[missed].met is False and "killed" in out[missed].nptrace


def test_startup_rows():
    from nptrace.bench.startup import _data, rows
    mib = 2**20
    samples = [{"t": 0.0, "rss": 100 * mib, "cpu": 0.0}, {"t": 5.0, "rss": 120 * mib, "cpu": 1.0},
               {"t": 10.0, "rss": 125 * mib, "cpu": 2.0}]
    launches = [{"wall_s": 1.2, "self_s": 1.0, "stop_s": 0.3, "killed": False},
                {"wall_s": 1.6, "self_s": 1.4, "stop_s": 5.0, "killed": True}]
    d = _data(samples, launches, 10, 3000, 30000)
    assert d["rss_max"] == 125 * mib and abs(d["second_half_growth"] - 5 / 120) < 1e-9
    assert d["killed"] == 1 and d["cpu_share_during_churn"] == 0.2
    out = rows(d)
    assert out[0].met is True and out[0].value == 1.4     # the median is judged
    assert [r.met for r in out[2:4]] == [True, True]
    d = _data(samples[:1] + [{"t": 5.0, "rss": 100 * mib, "cpu": 1},
                             {"t": 10.0, "rss": 200 * mib, "cpu": 2}], launches, 10, 3000, 1)
    assert rows(d)[3].met is False


def test_chart_renders_or_says_why(tmp_path):
    from nptrace.bench.chart import render
    doc = {"meta": {"mode": "quick"}, "sections": {
        "tc_cost": {"data": {"paths": {"veth": {"ingress": {"nptrace_ns": 100, "empty_ns": 80},
                                                "egress": {"nptrace_ns": 120, "empty_ns": 80}}}}},
        "throughput": {"data": {"ratios": [0.97, 1.01], "target": 0.98}},
        "startup": {"data": {"samples": [{"t": 0, "rss": 2**27}, {"t": 1, "rss": 2**27}]}}}}
    why = render(doc, tmp_path / "c.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert why and "matplotlib" in why
    else:
        assert why is None and (tmp_path / "c.png").stat().st_size > 1000
    assert render({"sections": {}}, tmp_path / "d.png") is not None


# --- boundaries -----------------------------------------------------------------------------
def test_bench_modules_import_without_bcc_or_pyroute2():
    mods = ["report", "topology", "tracer_proc", "bpfprog", "context", "workloads", "traffic",
            "tc_cost", "throughput", "connrate", "reset_storm", "pipeline", "startup", "chart",
            "__main__"]
    code = ("import sys\n"
            + "".join(f"import nptrace.bench.{m}\n" if m != "__main__"
                      else "import importlib; importlib.import_module('nptrace.bench.__main__')\n"
                      for m in mods)
            + "bad = [m for m in ('bcc', 'pyroute2') if m in sys.modules]\n"
              "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_main_refuses_non_root_in_one_line(monkeypatch, capsys):
    from nptrace.bench import __main__ as m
    monkeypatch.setattr(m.os, "geteuid", lambda: 1000)
    assert m.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "root" in err[0]


def test_main_rejects_unknown_section(capsys):
    from nptrace.bench import __main__ as m
    with pytest.raises(SystemExit) as e:
        m.main(["--only", "nope"])
    assert e.value.code == 2


def test_prometheus_text_sums():
    text = ('# HELP nptrace_kernel_events_total x\n'
            'nptrace_kernel_events_total{type="RST_SENT",hook="tcp:tcp_send_reset",'
            'reason="NO_SOCKET",iface="npt-bn1-rs-s/s0"} 300000.0\n'
            'nptrace_kernel_events_total{type="RST_SENT",hook="tcp:tcp_send_reset",'
            'reason="NO_SOCKET",iface="other"} 5.0\n'
            'nptrace_kernel_events_total{type="DROP",hook="skb:kfree_skb",reason="NO_SOCKET",'
            'iface="npt-bn1-rs-s/s0"} 7.0\n'
            'nptrace_events_lost_total 12.0\n')
    s = rp.prom_samples(text)
    assert len(s) == 4
    assert rp.prom_sum(s, "nptrace_kernel_events_total", type="RST_SENT",
                       iface="npt-bn1-rs-s") == 300000
    assert rp.prom_sum(s, "nptrace_kernel_events_total", type="RST_SENT") == 300005
    assert rp.prom_sum(s, "nptrace_events_lost_total") == 12
    assert rp.prom_sum(s, "nptrace_events_emitted_total") is None
