"""Pod names from the Kubernetes API (node/kubeapi.py) against a fake API server speaking the
watch protocol: a LIST with a resourceVersion, a watch stream of JSON lines, a 410 Gone (as an
ERROR event and as the HTTP status) that makes the client list again; the node-scoped field
selector and the bearer token; a dead API that never blocks a lookup; the fallback to crictl;
the `pod` fields of the JSON lines and their replay."""
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nptrace import events as ev
from nptrace.classify import Classifier, Context
from nptrace.node import kubeapi
from nptrace.node.pods import PodNames
from nptrace.sinks.jsonl import verdict_dict, verdict_line


def pod(ns, name, ip, rv, host_network=False):
    return {"metadata": {"namespace": ns, "name": name, "resourceVersion": str(rv)},
            "spec": {"nodeName": "node-1", "hostNetwork": host_network},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}]}}


SLICE = {"metadata": {"namespace": "shop", "name": "web-abc12", "resourceVersion": "3"},
         "endpoints": [{"addresses": ["10.1.0.9"], "nodeName": "node-2",
                        "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-remote"}},
                       {"addresses": ["192.0.2.50"]}]}   # not a pod: an external endpoint


class FakeAPI:
    """Scripted answers, in order, per (path, watch?); the last one repeats."""

    def __init__(self, script):
        self.script = {k: list(v) for k, v in script.items()}
        self.requests = []
        api = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                u = urllib.parse.urlsplit(self.path)
                q = dict(urllib.parse.parse_qsl(u.query))
                api.requests.append((u.path, q, self.headers.get("Authorization")))
                key = (u.path, "watch" in q)
                steps = api.script[key]
                step = steps.pop(0) if len(steps) > 1 else steps[0]
                status, body = step(q) if callable(step) else step
                if isinstance(body, list):       # a watch: chunked JSON lines
                    self.send_response(status)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for item in body:
                        if isinstance(item, float):
                            time.sleep(item)
                            continue
                        data = (json.dumps(item) + "\n").encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def api():
    made = []

    def make(script):
        made.append(FakeAPI(script))
        return made[-1]
    yield make
    for a in made:
        a.close()


def test_list_watch_and_410_relist(api):
    a = api({
        (kubeapi.PODS, False): [
            (200, {"kind": "PodList", "metadata": {"resourceVersion": "5"},
                   "items": [pod("shop", "web-1", "10.0.0.1", 4),
                             pod("kube-system", "kube-proxy-x", "192.0.2.1", 4, host_network=True)]}),
            (200, {"metadata": {"resourceVersion": "20"},
                   "items": [pod("shop", "web-2", "10.0.0.2", 6), pod("shop", "db-0", "10.0.0.3", 19)]}),
        ],
        (kubeapi.PODS, True): [
            (200, [{"type": "ADDED", "object": pod("shop", "web-2", "10.0.0.2", 6)},
                   {"type": "DELETED", "object": pod("shop", "web-1", "10.0.0.1", 7)},
                   0.3,
                   {"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                "reason": "Expired"}}]),
            (410, {"kind": "Status", "code": 410}),       # the relisted RV is gone too
            (200, [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "21"}}}, 0.2]),
        ],
        (kubeapi.SLICES, False): [(200, {"metadata": {"resourceVersion": "3"}, "items": [SLICE]})],
        (kubeapi.SLICES, True): [(200, [0.2])],
    })
    w = kubeapi.PodWatch(kubeapi.ApiConfig(a.base, "tok"), "node-1", backoff=(0.05, 0.1))
    w.start()
    try:
        assert w.synced.wait(5)
        assert wait_for(lambda: w.pod_of("10.0.0.2") == "shop/web-2")
        assert wait_for(lambda: w.pod_of("10.0.0.1") is None)      # DELETED
        assert wait_for(lambda: w.lists[kubeapi.PODS] >= 3)         # ERROR 410, then HTTP 410
        assert w.pod_of("10.0.0.3") == "shop/db-0"                  # from the relist
        assert w.pod_of("192.0.2.1") is None                        # hostNetwork: the node's
        assert w.pod_of("10.1.0.9") == "shop/web-remote"            # another node's, via its slice
        assert w.pod_of("192.0.2.50") is None
        assert wait_for(lambda: any(q.get("resourceVersion") == "21" for p, q, _ in a.requests
                                    if p == kubeapi.PODS))    # resumed after the bookmark
    finally:
        t0 = time.monotonic()
        w.close()
        assert time.monotonic() - t0 < 3
    pods = [q for p, q, _ in a.requests if p == kubeapi.PODS]
    assert all(q["fieldSelector"] == "spec.nodeName=node-1" for q in pods)
    watches = [q for q in pods if "watch" in q]
    assert watches[0]["resourceVersion"] == "5" and watches[1]["resourceVersion"] == "20"
    assert {h for _, _, h in a.requests} == {"Bearer tok"}


def test_a_dead_api_never_blocks_and_is_retried_with_backoff():
    logs = []
    w = kubeapi.PodWatch(kubeapi.ApiConfig("http://127.0.0.1:9", "tok"), "node-1",
                         log=logs.append, backoff=(0.05, 0.2))
    w.start()
    try:
        t0 = time.monotonic()
        assert w.pod_of("10.0.0.1") is None
        assert time.monotonic() - t0 < 0.01
        time.sleep(0.6)
    finally:
        w.close()
    # one line per kind of failure, however many retries
    assert len(logs) == 2 and all("retrying with backoff" in l for l in logs), logs


def test_forbidden_names_the_rbac(api):
    a = api({(kubeapi.PODS, False): [(403, {"kind": "Status", "code": 403})],
             (kubeapi.SLICES, False): [(403, {"kind": "Status", "code": 403})]})
    logs = []
    w = kubeapi.PodWatch(kubeapi.ApiConfig(a.base, "tok"), "n", log=logs.append, backoff=(0.05, 0.1))
    w.start()
    try:
        assert wait_for(lambda: len(logs) == 2)
    finally:
        w.close()
    assert all("ClusterRole" in l for l in logs), logs


def test_the_cache_is_bounded():
    t = kubeapi.Table(lambda p: {ip: kubeapi._key(p) for ip in kubeapi.pod_ips(p)}, max_entries=3)
    for i in range(10):
        t.put(pod("ns", f"p{i}", f"10.0.0.{i}", i))
    assert list(t.addrs) == ["10.0.0.7", "10.0.0.8", "10.0.0.9"]


def test_in_cluster_config(tmp_path):
    assert kubeapi.from_env({}, tmp_path) is None
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert kubeapi.from_env(env, tmp_path) is None          # no token: not in a cluster
    (tmp_path / "token").write_text("abc\n")
    (tmp_path / "ca.crt").write_text("")
    c = kubeapi.from_env(env, tmp_path)
    assert c == kubeapi.ApiConfig("https://10.96.0.1:443", "abc", str(tmp_path / "ca.crt"),
                                  str(tmp_path / "token"))
    c6 = kubeapi.from_env({**env, "KUBERNETES_SERVICE_HOST": "fd00::1"}, tmp_path)
    assert c6.base == "https://[fd00::1]:443"


def test_without_an_api_pods_come_from_crictl():
    calls = []

    def crictl(netns=None):
        calls.append(1)
        netns[4026532999] = "shop/web-7"
        return {"10.0.0.7": "shop/web-7"}
    p = PodNames("node-1", api=None, crictl=crictl, refresh_s=0.05).start()
    try:
        assert wait_for(lambda: p.pod_of("10.0.0.7") == "shop/web-7")
        assert wait_for(lambda: len(calls) >= 2)      # refreshed
        assert p.source.startswith("crictl")
        assert p.pod_of_netns(4026532999) == "shop/web-7" and p.pod_of_netns(1) is None
    finally:
        p.close()


def _reset(**kw):
    return ev.decode(ev.encode(ts_ns=1000, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST,
                               reason=1, aux=ev.TCP_SYN, **kw))


def test_json_lines_name_the_pod_and_keep_the_fast_path_text():
    pods = {"10.244.1.5": "shop/web-1"}
    ctx = Context(rst_name=lambda v: "NO_SOCKET", pod_of=pods.get)
    c = Classifier(ctx)
    [v] = list(c.feed(_reset(saddr="10.244.1.5", sport=8081, daddr="192.0.2.10", dport=40000))) \
        + list(c.flush())
    d = verdict_dict(v, 0)
    assert d["pod"] == "shop/web-1"
    assert json.loads(verdict_line(v, 0)) == d
    # no pod known: no key, and the fast path writes the dict's text
    c2 = Classifier(Context(rst_name=lambda v: "NO_SOCKET"))
    [v2] = list(c2.feed(_reset(saddr="10.0.0.2", sport=8081, daddr="192.0.2.10", dport=40000))) \
        + list(c2.flush())
    assert "pod" not in verdict_dict(v2, 0)
    assert verdict_line(v2, 0) == json.dumps(verdict_dict(v2, 0), separators=(",", ":"))


def test_replay_names_the_pods_the_live_run_named(tmp_path):
    from nptrace.reasons import ReasonTable
    from nptrace.sessions.header import make_header
    from nptrace.sessions.writer import SessionWriter
    from nptrace.sessions.replay import Replay
    from nptrace.sinks.recorder import Recorder
    rsts = ReasonTable({1: "SK_RST_REASON_NO_SOCKET"}, "SK_RST_REASON_")
    drops = ReasonTable({3: "SKB_DROP_REASON_NO_SOCKET"}, "SKB_DROP_REASON_")
    w = SessionWriter(tmp_path, header=make_header(epoch_offset_ns=0, drops=drops, resets=rsts,
                                                   node="node-1", kernel="6.18.0"))
    rec = Recorder(w)
    pods = {"10.244.1.5": "shop/web-1"}
    c = Classifier(Context(rst_name=rsts.name, drop_name=drops.name,
                           pod_of=rec.lookup("pod_of", pods.get)))
    live = []
    for i, addr in enumerate(("10.244.1.5", "10.244.1.6")):
        raw = ev.encode(ts_ns=10**9 * i, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST,
                        reason=1, aux=ev.TCP_SYN, saddr=addr, sport=8081, daddr="192.0.2.10",
                        dport=40000 + i)
        rec.on_raw(raw)
        live += [verdict_dict(v, 0) for v in c.feed(ev.decode(raw))]
    live += [verdict_dict(v, 0) for v in c.flush()]
    rec.close()
    got = [verdict_dict(it.verdict, 0) for it in Replay(tmp_path).items()]
    assert [d.get("pod") for d in live] == ["shop/web-1", None]
    assert [d.get("pod") for d in got] == [d.get("pod") for d in live]


def test_console_run_session_replays_with_pods(tmp_path):
    """The pod lookup is the classifier's, per incident: a run that printed no JSON (the
    console, the DaemonSet's default) records the answers, and replay --json names the pods."""
    from nptrace.reasons import ReasonTable
    from nptrace.sessions.header import make_header
    from nptrace.sessions.writer import SessionWriter
    from nptrace.sessions.replay import Replay
    from nptrace.sinks.console import Console
    from nptrace.sinks.recorder import Recorder
    rsts = ReasonTable({1: "SK_RST_REASON_NO_SOCKET"}, "SK_RST_REASON_")
    drops = ReasonTable({3: "SKB_DROP_REASON_NO_SOCKET"}, "SKB_DROP_REASON_")
    w = SessionWriter(tmp_path, header=make_header(epoch_offset_ns=0, drops=drops, resets=rsts,
                                                   node="node-1", kernel="6.18.0"))
    rec = Recorder(w)
    pods, netns = {"10.244.1.5": "shop/web-1"}, {4026532100: "shop/db-0"}
    c = Classifier(Context(rst_name=rsts.name, drop_name=drops.name,
                           pod_of=rec.lookup("pod_of", pods.get),
                           pod_of_netns=rec.lookup("pod_of_netns", netns.get)))
    import io
    console = Console(0, stream=io.StringIO())
    live = []
    for i, (addr, ns) in enumerate((("10.244.1.5", 0), ("127.0.0.1", 4026532100),
                                    ("10.0.0.9", 4026532101))):
        raw = ev.encode(ts_ns=10**9 * i, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST,
                        reason=1, aux=ev.TCP_SYN, saddr=addr, sport=8081, daddr=addr,
                        dport=40000 + i, netns=ns)
        rec.on_raw(raw)
        live += list(c.feed(ev.decode(raw)))
    live += list(c.flush())
    for v in live:
        console.write(v)                         # what the live run printed: no JSON
    rec.close()
    got = [verdict_dict(it.verdict, 0) for it in Replay(tmp_path).items()]
    assert [d.get("pod") for d in got] == ["shop/web-1", "shop/db-0", None]
    assert [v.pods and v.pods.get("pod") for v in live] == ["shop/web-1", "shop/db-0", None]


def test_pod_of_a_namespace_from_crictl_and_by_address():
    from nptrace.node import pods as P
    doc = {"status": {"network": {"ip": "10.244.1.5"}},
           "info": {"runtimeSpec": {"linux": {"namespaces": [
               {"type": "pid"}, {"type": "network", "path": "/var/run/netns/cni-1234"}]}}}}
    assert P.sandbox_netns(doc) == "/var/run/netns/cni-1234"
    assert P.sandbox_ips(doc) == ["10.244.1.5"]
    assert P.sandbox_netns({"status": {}}) is None                  # hostNetwork
    got = P.netns_pods_by_address({"10.244.1.5": "shop/web-1"}.get,
                                  lambda: {11: "cni-1234", 12: "npt-node1"},
                                  {"cni-1234": ("127.0.0.1", "10.244.1.5"),
                                   "npt-node1": ("192.168.10.11",)}.get)
    assert got == {11: "shop/web-1"}


def test_list_pages_with_limit_and_continue(api):
    """A LIST in pages: limit on each request, continue until the server gives none."""
    def page(q):
        if q.get("continue") == "p2":
            return 200, {"metadata": {"resourceVersion": "9"}, "items": [pod("b", "two", "10.1.0.2", 2)]}
        return 200, {"metadata": {"resourceVersion": "9", "continue": "p2"},
                     "items": [pod("a", "one", "10.1.0.1", 1)]}
    a = api({("/api/v1/pods", False): [page], ("/api/v1/pods", True): [(200, [1.0])],
             ("/apis/discovery.k8s.io/v1/endpointslices", False): [(200, {"metadata": {"resourceVersion": "1"},
                                                                         "items": []})],
             ("/apis/discovery.k8s.io/v1/endpointslices", True): [(200, [1.0])]})
    w = kubeapi.PodWatch(kubeapi.ApiConfig(a.base, "tok"), "node-1", backoff=(0.05, 0.1)).start()
    try:
        assert wait_for(lambda: w.pod_of("10.1.0.2") == "b/two" and w.pod_of("10.1.0.1") == "a/one")
        lists = [q for p, q, _ in a.requests if p == "/api/v1/pods" and "watch" not in q]
        assert [q.get("continue") for q in lists[:2]] == [None, "p2"]
        assert all(q["limit"] == str(kubeapi.LIST_PAGE) for q in lists)
    finally:
        w.close()


def test_a_rotated_token_is_read_again_after_a_401(api, tmp_path):
    """The kubelet rotates a projected token in place; the old one stops working (expired, or
    its bound object deleted): a 401 makes the client read the file again and retry."""
    tok = tmp_path / "token"
    tok.write_text("old")

    def answer(ok):
        def step(q):
            sent = a.requests[-1][2]        # this request's Authorization header
            return (200, ok) if sent == "Bearer new" else (401, {"kind": "Status", "code": 401})
        return step
    empty = {"metadata": {"resourceVersion": "1"}, "items": [pod("a", "p", "10.1.0.7", 1)]}
    a = api({("/api/v1/pods", False): [answer(empty)], ("/api/v1/pods", True): [(200, [1.0])],
             ("/apis/discovery.k8s.io/v1/endpointslices", False): [answer(empty)],
             ("/apis/discovery.k8s.io/v1/endpointslices", True): [(200, [1.0])]})
    tok.write_text("new")                 # rotated before the first request: the start's is stale
    w = kubeapi.PodWatch(kubeapi.ApiConfig(a.base, "old", None, str(tok)), "node-1",
                         backoff=(0.05, 0.1)).start()
    try:
        assert wait_for(lambda: w.pod_of("10.1.0.7") == "a/p")
        sent = [h for _, _, h in a.requests]
        assert sent[0] == "Bearer old" and "Bearer new" in sent
    finally:
        w.close()


def test_token_reload_interval():
    t = [0.0]
    cfg = kubeapi.ApiConfig("https://x", "one", None, "/nonexistent/token")
    tok = kubeapi.Token(cfg, reload_s=60, clock=lambda: t[0])
    assert tok.value() == "one"
    t[0] = 61.0
    assert tok.value() == "one"           # unreadable: the last token is kept


def test_a_redirect_is_not_followed_with_the_token(api):
    """An answer that redirects (to another host, say) is an error, never a second request
    carrying the bearer token."""
    b = api({("/api/v1/pods", False): [(200, {"metadata": {"resourceVersion": "1"}, "items": []})]})
    import http.server

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *x):
            pass

        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", b.base + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    logs = []
    w = kubeapi.PodWatch(kubeapi.ApiConfig(f"http://127.0.0.1:{srv.server_address[1]}", "secret"), "n",
                         log=logs.append, backoff=(0.05, 0.1)).start()
    try:
        assert wait_for(lambda: logs)
        time.sleep(0.2)
        assert not b.requests             # the token never went to the other host
    finally:
        w.close()
        srv.shutdown()
        srv.server_close()


def test_service_frontends_name_ipvs_virtual_servers():
    """A Service's frontends as the IPVS names table: IPVS carries no name, the API does."""
    from nptrace.services import ipvs
    svc = {"metadata": {"namespace": "default", "name": "web"},
           "spec": {"clusterIP": "10.96.0.80", "clusterIPs": ["10.96.0.80"], "externalTrafficPolicy": "Local",
                    "externalIPs": ["192.0.2.9"],
                    "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}]},
           "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.4"}]}}}
    got = kubeapi.service_frontends(svc)
    assert got == {"tcp 10.96.0.80:80": "default/web:http clusterip",
                   "tcp 192.0.2.9:80": "default/web:http externalip local",
                   "tcp 198.51.100.4:80": "default/web:http loadbalancer local",
                   "tcp *:30080": "default/web:http nodeport local"}
    text = "".join(f"{k} {v}\n" for k, v in got.items())
    st = ipvs.state_of("", names_text=text, names_from="api")
    vs = ipvs.VirtualServer("tcp", "192.168.10.11", 30080, "rr", ())
    assert st.name_of(vs).service == "default/web:http" and st.name_of(vs).local
    assert kubeapi.service_frontends({"metadata": {}, "spec": {"ports": [{"port": "x"}]}}) == {}


def test_api_outside_a_pod_from_nptrace_env(tmp_path):
    (tmp_path / "tok").write_text("t0k\n")
    env = {"NPTRACE_KUBE_API": "https://127.0.0.1:6443/", "NPTRACE_KUBE_TOKEN_FILE": str(tmp_path / "tok"),
           "NPTRACE_KUBE_CA": "/ca.crt"}
    assert kubeapi.from_env(env, tmp_path / "none") == kubeapi.ApiConfig(
        "https://127.0.0.1:6443", "t0k", "/ca.crt", str(tmp_path / "tok"))
    assert kubeapi.from_env({"NPTRACE_KUBE_API": "https://x"}, tmp_path / "none") is None   # no token
