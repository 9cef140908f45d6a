"""The auto_ifaces bench's pure parts (nptrace/bench/auto_ifaces.py): what it reads from
nptrace's start lines, the kernel's numbers it sums, and its rows. No root, no bcc."""
import json
import subprocess
import sys

from nptrace.bench import auto_ifaces as ai

AUTO = """nptrace: plan: tc:ingress/egress: on (the node's devices, chosen at start and followed; tc mode auto: tcx links)
nptrace: interfaces chosen automatically: eth0 (default route, 10.251.44.2), flannel.1 (vxlan overlay, 10.251.47.0), cni0 (bridge, 10.251.46.1 +1); left out: kube-ipvs0 (dummy: holds addresses, carries no packets), 200 pod veths; --iface names them instead, --iface none attaches to none
nptrace: attached skb/kfree_skb, tcp/tcp_send_reset, netfilter:post_routing@101, tc:eth0, tc:flannel.1, tc:cni0 (tc via tcx) on node vm in 1.99s (BPF object cache; kprobes: absent)
"""
NONE = ("nptrace: attached skb/kfree_skb, netfilter:post_routing@101 on node vm in 2.23s "
        "(BPF object compiled; kprobes: absent)\n")


def test_split_top_keeps_parentheses_whole():
    assert ai.split_top("a (x, y), b, c (z)") == ["a (x, y)", "b", "c (z)"]
    assert ai.split_top("a (x; y); b", "; ") == ["a (x; y)", "b"]
    assert ai.split_top("") == []


def test_parse_chosen_names_and_left_out():
    names, left = ai.parse_chosen(AUTO)
    assert names == ["eth0", "flannel.1", "cni0"]
    assert left == "kube-ipvs0 (dummy: holds addresses, carries no packets), 200 pod veths"


def test_parse_chosen_none_yet_and_absent():
    line = ("nptrace: interfaces chosen automatically: none yet; --iface names them instead, "
            "--iface none attaches to none\n")
    assert ai.parse_chosen(line) == ([], "")
    assert ai.parse_chosen(NONE) is None


def test_parse_attached_line():
    assert ai.parse_attached_line(AUTO) == (["eth0", "flannel.1", "cni0"], "cache")
    assert ai.parse_attached_line(NONE) == ([], "compiled")
    assert ai.parse_attached_line("nothing\n") == ([], None)


def test_link_packets_sums_both_ways():
    doc = [{"ifname": "eth0", "stats64": {"rx": {"packets": 10, "bytes": 1},
                                          "tx": {"packets": 32, "bytes": 2}}}]
    assert ai.link_packets(json.dumps(doc)) == 42


def test_sched_cls_sums_tc_programs_only():
    d = {1: {"type": 3, "runs": 10, "ns": 800}, 2: {"type": 3, "runs": 5, "ns": 400},
         3: {"type": 32, "runs": 99, "ns": 9999}, 4: {"type": 5, "runs": 7, "ns": 70}}
    assert ai.sched_cls(d) == (15, 1200)


def _form(**kw):
    base = {"start_s": 1.0, "rest_cpu_rate": 0.002, "rss": 100 << 20, "rss_anon": 70 << 20,
            "churn_cpu_s": 0.5,
            "chosen": list(ai.NODE_DEVS), "traced": list(ai.NODE_DEVS),
            "bulk": {"ns_per_packet": 0.0, "runs": 0}}
    base.update(kw)
    return base


def _data(auto=None, **forms):
    return {"pods": 200, "churn": 20, "churn_gap_s": 0.2, "rest_s": 10,
            "unit": {"choice_s": 0.095, "scope_s": 0.06},
            "forms": {"none": _form(chosen=[], traced=[]),
                      "auto": auto or _form(start_s=1.5, rest_cpu_rate=0.003, churn_cpu_s=1.5,
                                            bulk={"ns_per_packet": 160.0, "runs": 200,
                                                  "runs_per_packet": 2.0, "ns_per_run": 80.0}),
                      "list": _form(rest_cpu_rate=0.008), **forms}}


def test_rows_ratios_against_none():
    rows = {r.metric: r for r in ai.rows(_data())}
    start = rows["start, launch -> ready file: no --iface"]
    assert start.ratio == 1.5 and start.base_value == 1.0 and start.nptrace == "1.50 s"
    rest = rows["CPU at rest (10 s): --iface eth0,cni0,flannel.1"]
    assert abs(rest.ratio - 4.0) < 1e-9 and rest.nptrace == "8.00 ms/s"
    churn = [r for m, r in rows.items() if m.startswith("CPU for 20 pod veths")
             and m.endswith("no --iface")][0]
    assert abs(churn.ratio - 3.0) < 1e-9 and "75.0 ms/pod" in churn.nptrace
    pkt = rows["tc ns per packet forwarded, bulk TCP pod -> outside: no --iface"]
    assert pkt.value == 160.0 and "2.0 runs" in pkt.nptrace and pkt.ratio_target == "+160 ns"
    assert any(r.value == 0.095 and r.base_value == 0.06 for r in rows.values())


def test_the_choice_row_fails_on_a_pod_veth_or_a_missing_device():
    ok = ai.rows(_data())[0]
    assert ok.met is True and ok.nptrace == "eth0, cni0, flannel.1"
    pod = ai.rows(_data(auto=_form(traced=["eth0", "cni0", "flannel.1", "vethp7"])))[0]
    assert pod.met is False
    missing = ai.rows(_data(auto=_form(traced=["eth0", "cni0"], chosen=["eth0", "cni0"])))[0]
    assert missing.met is False


def test_rows_survive_a_missing_baseline():
    d = _data()
    del d["forms"]["none"]
    rows = ai.rows(d)
    assert rows and all(r.ratio is None for r in rows[1:] if r.base_value is None)


def test_imports_without_bcc_or_pyroute2():
    code = ("import sys, nptrace.bench.auto_ifaces\n"
            "bad = [m for m in ('bcc', 'pyroute2') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_rows_say_the_difference_beside_the_ratio():
    rows = {r.metric: r for r in ai.rows(_data())}
    assert rows["CPU at rest (10 s): no --iface"].ratio_target == "1.50x (+1.00 ms/s)"
    churn = [r for m, r in rows.items() if m.startswith("CPU for 20") and "eth0," in m][0]
    assert churn.ratio_target == "1.00x (+0.0 ms)"
    assert ai._plus(1.0, 3.0, ai._s) == "-2.00 s" and ai._plus(None, 1, ai._s) == "n/a"


def test_a_failed_transfer_is_an_error_row_and_the_rest_stands():
    d = _data()
    d["forms"]["list"]["bulk"] = {"error": "iperf3: no answer in 32s"}
    rows = ai.rows(d)
    bad = [r for r in rows if r.error]
    assert len(bad) == 1 and "eth0,cni0" in bad[0].metric and bad[0].verdict == "error"
    assert sum(1 for r in rows if r.metric.startswith("CPU at rest")) == 2


def test_status_bytes_and_the_rss_row_compares_the_anonymous_part():
    status = "Name:\tpython\nVmRSS:\t  94208 kB\nRssAnon:\t   68608 kB\nRssFile:\t25600 kB\n"
    assert ai.status_bytes(status, "RssAnon") == 68608 * 1024
    assert ai.status_bytes(status, "VmRSS") == 94208 * 1024
    assert ai.status_bytes(status, "RssShmem") is None
    d = _data()
    d["forms"]["auto"].update(rss=140 << 20, rss_anon=77 << 20)
    row = [r for r in ai.rows(d) if r.metric == "RSS at rest, anonymous (VmRSS): no --iface"][0]
    assert row.nptrace == "77 MiB (140 MiB)" and abs(row.ratio - 1.1) < 1e-9


def test_the_node_scope_s_veths_row_beside_its_sort():
    d = _data()
    assert not any("veths read" in r.metric for r in ai.rows(d))     # older data: no row
    d["unit"]["veths_s"] = 0.0031
    row = [r for r in ai.rows(d) if "veths read" in r.metric][0]
    assert row.nptrace == "3.1 ms" and row.value == 0.0031 and row.base_value == 0.06
    assert "60.0 ms the sort, made only when they changed" == row.baseline
