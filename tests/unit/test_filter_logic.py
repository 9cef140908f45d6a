"""The on-call filters (nptrace.classify.filters): parsing, matching on incidents, and the
offline commands' bad input (one line, exit 2)."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nptrace import events as ev
from nptrace.classify import Context, Verdict
from nptrace.classify.filters import (FilterError, FilteredSink, build, parse_causes,
                                      parse_time, resolve_service)
from nptrace.explain import Facts
from nptrace.explain.predict import service_map

NOW = 1_767_265_200 * 10**9   # 2026-01-01T11:00:00Z
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "explain"


def E(**kw):
    base = dict(ts_ns=1, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, dir=ev.Dir.UNKNOWN, skb=1,
                ifindex=2, netns=1, reason=0, saddr="192.168.10.100", sport=40000,
                daddr="192.168.10.11", dport=30080, family=2, l4proto=6, tcpflags=2, state=0,
                flags=0, mark=0, aux=0, aux2=0, seq=0, ack_seq=0, location=0)
    base.update(kw)
    return ev.Event(**base)


def V(cause="rp_filter", service=None, **kw):
    return Verdict(event=E(**kw), kind="drop", direction=None, hook="kfree_skb", reason="X",
                   cause=cause, confidence=1.0, hint="", iface=None, service=service)


def smap():
    d = json.loads((FIX / "healthy-0.json").read_text())
    return service_map(Facts.from_dict(d["facts"]))


def test_times():
    assert parse_time("2026-01-01T10:40:00Z", NOW) == NOW - 20 * 60 * 10**9
    assert parse_time("2026-01-01T12:40:00.500+02:00", NOW) == NOW - 20 * 60 * 10**9 + 500 * 10**6
    assert parse_time("2026-01-01T10:40:00", NOW) == NOW - 20 * 60 * 10**9
    assert parse_time("10m", NOW) == NOW - 600 * 10**9
    assert parse_time("1.5h", NOW) == NOW - 5400 * 10**9
    for bad in ("yesterday", "10x", "2026-13-01T00:00:00Z", ""):
        with pytest.raises(FilterError, match="bad --since"):
            parse_time(bad, NOW)


def test_causes_are_the_classifier_vocabulary():
    assert parse_causes(["rp_filter", "snat,no_listener"]) == {"rp_filter", "snat", "no_listener"}
    with pytest.raises(FilterError, match="unknown --cause 'rpfilter'"):
        parse_causes(["rpfilter"])


def test_service_resolves_to_frontends_and_endpoints():
    sel = resolve_service("default/web", smap())
    assert sel.names == {"default/web:http"}
    assert ("10.244.1.10", 8080) in sel.ends and "10.96.0.80" in sel.addrs
    assert sel.node_ports == {30080}
    assert resolve_service("default/web-local:http", smap()).node_ports == {30081}
    with pytest.raises(FilterError, match="unknown Service 'default/nope'"):
        resolve_service("default/nope", smap())
    with pytest.raises(FilterError, match="bad --service"):
        resolve_service("Default_web", smap())


def test_matching():
    m = smap()
    f = build(service="default/web", services=lambda: m)
    assert f.matches(V(service="default/web:http", dport=1))
    assert f.matches(V(daddr="10.244.1.10", dport=8080))          # an endpoint, after DNAT
    assert f.matches(V())                                         # the NodePort
    assert not f.matches(V(daddr="10.244.1.10", dport=9, sport=1))
    assert not f.matches(V(service="default/web-local:http", dport=30081))
    f = build(causes=["snat"], pods=["10.244.1.0/24"])
    assert f.matches(V(cause="snat", saddr="10.244.1.11"))
    assert not f.matches(V(cause="snat"))
    assert not f.matches(V(cause="rp_filter", saddr="10.244.1.11"))
    f = build(since="2026-01-01T10:40:00Z", until="5m", node="node-a", now_ns=NOW)
    t = NOW - 10 * 60 * 10**9
    assert f.matches(V(), t, "node-a")
    assert not f.matches(V(), t, "node-b")
    assert not f.matches(V(), NOW - 30 * 60 * 10**9, "node-a")
    assert not f.matches(V(), NOW - 60 * 10**9, "node-a")
    assert not build()


def test_service_follows_rule_changes():
    m = {"map": smap()}
    clock = {"t": 0}
    f = build(service="default/web", services=lambda: m["map"], clock=lambda: clock["t"])
    assert f.matches(V(daddr="10.244.0.10", dport=8080))
    from nptrace.services import ServiceMap
    m["map"] = ServiceMap()        # rules gone: the name alone is matched from now on
    clock["t"] = 11 * 10**9
    assert not f.matches(V(daddr="10.244.0.10", dport=8080))
    assert f.matches(V(service="default/web:http"))


def test_pod_names_need_a_resolver():
    with pytest.raises(FilterError, match="give the pod's address"):
        build(pods=["default/web-0"])
    f = build(pods=["default/web-0"], pod_resolver=lambda ns, n: ["10.244.0.10"])
    assert f.matches(V(daddr="10.244.0.10"))
    with pytest.raises(FilterError, match="unknown pod"):
        build(pods=["default/x"], pod_resolver=lambda ns, n: [])


def test_filtered_sink():
    got = []

    class S:
        def write(self, v):
            got.append(v)
        def summary(self):
            return "s"
    fs = FilteredSink(S(), build(causes=["snat"]))
    fs.write(V(cause="rp_filter"))
    fs.write(V(cause="snat"))
    assert [v.cause for v in got] == ["snat"] and fs.summary() == "s"


@pytest.mark.parametrize("cmd", ["replay", "report", "merge"])
@pytest.mark.parametrize("args,msg", [
    (["--cause", "bogus"], "unknown --cause"),
    (["--since", "soon"], "bad --since"),
    (["--until", "2026-02-30T00:00:00Z"], "bad --until"),
    (["--service", "nope"], "bad --service"),
    (["--pod", "10.0.0.300"], "bad --pod"),
])
def test_offline_bad_input_is_one_line_exit_2(cmd, args, msg, tmp_path):
    from nptrace.cli import main_group
    r = CliRunner().invoke(main_group, [cmd, str(tmp_path), *args])
    assert r.exit_code == 2, r.output
    assert msg in r.output and "Traceback" not in r.output


def test_filtered_sink_filters_batches_too():
    got = []

    class S:
        def write(self, v):
            got.append(v)
        def write_many(self, vs):
            got.extend(vs)
    FilteredSink(S(), build(causes=["snat"])).write_many([V(cause="rp_filter"), V(cause="snat")])
    assert [v.cause for v in got] == ["snat"]


def test_kernel_gate_ends_of_a_service():
    """run --service in the kernel: the ends bpf/npt_common.h filter_svc holds."""
    f = build(service="default/web", services=smap)
    ends = f.kernel_ends()
    assert ("10.244.1.10", 8080) in ends           # an endpoint: addr and port
    assert ("10.96.0.80", 0) in ends               # the ClusterIP: any port
    assert ("", 30080) in ends                     # the NodePort: any address
    assert build(causes=["snat"]).kernel_ends() is None
    assert build(service="default/web").kernel_ends() is None    # name only: no gate
    from nptrace.config import Config
    from nptrace.kernel.cflags import build_cflags
    assert "-DNPT_FILTER_SVC=0" in build_cflags(Config())
    assert "-DNPT_FILTER_SVC=1" in build_cflags(Config(service_gate=True))


def test_filtered_sink_filters_kernel_summary_rows():
    """Records the gate held back are counted and summarized: only the Service's rows print."""
    from nptrace.classify.keylabel import KeyLabel
    from nptrace.sinks.exact import SummaryRow
    got = []

    class S:
        def write_summary(self, rows):
            got.extend(rows)

    def row(cause, svc):
        return SummaryRow(KeyLabel("drop", cause, None, "eth0", svc, "kfree_skb", "X"), 3, 0, 1)
    fs = FilteredSink(S(), build(service="default/web", services=smap))
    fs.write_summary([row("no_endpoints", "default/web:http"), row("no_listener", None),
                      row("no_listener", "default/other:http")])
    assert [r.label.service for r in got] == ["default/web:http"]
    got.clear()
    FilteredSink(S(), build(causes=["snat"])).write_summary([row("snat", None), row("x", None)])
    assert [r.label.cause for r in got] == ["snat"]
