"""sinks/health.py: /healthz only after attach and while the loop turns, /livez from the
loop's progress, nptrace_probe_up for missing probes, nptrace_build_info; node/identity.py."""
import json
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from nptrace.config import IfaceSpec
from nptrace.node.identity import node_name
from nptrace.sinks import health


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_ready_only_after_attach_and_live_only_while_the_loop_turns():
    c = Clock()
    h = health.Health(stale_after=30, clock=c)
    assert h.live()[0] and not h.readiness()[0]            # compiling: alive, not ready
    c.t += 5
    h.ready("skb:kfree_skb")
    assert h.readiness() == (True, "attached skb:kfree_skb; main loop turned 0.0s ago")
    c.t += 31
    assert not h.live()[0] and not h.readiness()[0]        # the loop stopped turning
    assert "stuck" in h.live()[1]
    h.beat()
    assert h.live()[0] and h.readiness()[0]
    h.stop()
    assert not h.readiness()[0] and h.live()[0]


def test_server_routes_health_and_metrics():
    reg = CollectorRegistry()
    Counter("npt_test", "x", registry=reg).inc()
    reg.register(health.build_info_collector("9.9", node="node-a"))
    c = Clock()
    h = health.Health(stale_after=30, clock=c)
    srv = health.serve("127.0.0.1:0", reg, h)
    try:
        base = srv.url.rsplit("/", 1)[0]
        assert get(base + "/healthz")[0] == 503
        assert get(base + "/livez")[0] == 200
        h.ready("x")
        assert get(base + "/healthz") == (200, "ok: attached x; main loop turned 0.0s ago\n")
        assert get(base + "/readyz")[0] == 200
        code, body = get(srv.url)
        assert code == 200 and "npt_test_total 1.0" in body
        assert 'nptrace_build_info{' in body and 'node="node-a"' in body and 'version="9.9"' in body
        assert get(base + "/nope")[0] == 404
        c.t += 60
        assert get(base + "/livez")[0] == 503 and get(base + "/healthz")[0] == 503
    finally:
        srv.close()


def test_address_in_use_is_one_line():
    reg = CollectorRegistry()
    srv = health.serve("127.0.0.1:0", reg)
    try:
        with pytest.raises(Exception, match="in use"):
            health.serve(f"127.0.0.1:{srv.port}", reg)
    finally:
        srv.close()


def test_probe_up_is_0_for_missing_and_failed_probes_tc_included():
    class E:
        def __init__(self, netns, ifname):
            self.netns, self.ifname = netns, ifname

    class Tc:
        attached = [E(None, "eth0")]
    st = health.probe_states(["skb/kfree_skb", "tcp/tcp_send_reset"],
                             ["skb/kfree_skb", "kprobe:tcp_v4_rcv"],
                             [IfaceSpec(None, "eth0"), IfaceSpec("ns1", "eth1")], Tc())
    assert st == {"skb:kfree_skb": 1, "tcp:tcp_send_reset": 0, "netfilter:post_routing": 0,
                  "kprobe:tcp_v4_rcv": 1, "tc:eth0": 1, "tc:ns1/eth1": 0}
    assert "netfilter:post_routing" not in health.probe_states([], [], nf_planned=False)


def test_node_name_order():
    assert node_name("n1", {"NODE_NAME": "n2"}) == ("n1", "--node-name")
    assert node_name(None, {"NODE_NAME": " n2 "}) == ("n2", "NODE_NAME")
    name, src = node_name("", {})
    assert src == "hostname" and name


def test_every_json_line_names_the_node():
    import io

    from nptrace.classify import Verdict
    from nptrace.sinks.jsonl import JsonLines
    import inspect
    out = io.StringIO()
    sink = JsonLines(0, stream=out, node='node-"a"')
    # the prefix turns any line the encoder makes into one with "node" first
    line = sink.node_prefix + '{"ts":1,"kind":"rst"}'[1:]
    assert json.loads(line) == {"node": 'node-"a"', "ts": 1, "kind": "rst"}
    assert JsonLines(0, stream=out).node_prefix == "{"
    assert "node" in inspect.signature(JsonLines).parameters and Verdict


def test_pcapng_section_names_the_node():
    from nptrace.sinks.pcapng import section_header
    assert b"node: node-a" in section_header("node-a")
    import socket      # no name given: the host's, as every other output falls back to
    assert f"node: {socket.gethostname()}".encode() in section_header()


def test_final_scrape_waits_for_a_scrape_that_begins_after_the_stop():
    import threading
    reg = CollectorRegistry()
    c = Counter("npt_final", "x", registry=reg)
    srv = health.serve("127.0.0.1:0", reg)
    try:
        get(srv.url)                                  # before the stop: does not count
        assert not srv.wait_scrape(0.2)
        c.inc()                                        # the stop's flush
        seen = []
        t = threading.Timer(0.2, lambda: seen.append(get(srv.url)[1]))
        t.start()
        assert srv.wait_scrape(5)
        t.join()
        assert "npt_final_total 1.0" in seen[0]
    finally:
        srv.close()
    assert not srv.wait_scrape(0.1)                   # closed: nothing to wait for
