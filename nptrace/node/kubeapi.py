"""The pods behind addresses, from the Kubernetes API: a node-scoped watch of Pods
(fieldSelector=spec.nodeName=<node>) and a watch of EndpointSlices (their endpoints' targetRef
names the pods of other nodes a Service sends to), in a background thread.

In-cluster only: KUBERNETES_SERVICE_HOST/PORT and the service account's token and CA
(/var/run/secrets/kubernetes.io/serviceaccount/); without them `from_env` gives None and pods
are named from the node alone (nptrace/node/pods.py). With ``services``, a watch of Services
too: their frontends name IPVS virtual servers, which carry no name on the node
(service_frontends). The RBAC it needs (list and watch of pods, services and
endpointslices.discovery.k8s.io) is in deploy/daemonset.yaml.

The watch protocol (Kubernetes API concepts, "Efficient detection of changes"): LIST gives the
items and a resourceVersion; GET ...?watch=1&resourceVersion=RV streams one JSON object a line,
{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}; a resourceVersion too old
for the server's history is answered 410 Gone (as the HTTP status or as an ERROR event whose
object is a Status with code 410), and the client lists again. The server ends a watch after
timeoutSeconds; the client resumes from the last resourceVersion it saw.

Lookups never block and never touch the network: `pod_of(addr)` reads a dict the thread keeps.
The dict is bounded (max_entries, the oldest dropped first), a failed connection is retried
with exponential backoff (1 s doubling to 60 s), and every failure is logged once per kind.
urllib only: no Kubernetes client dependency.
"""
from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["ApiConfig", "PodWatch", "from_env", "SA_DIR"]

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PODS = "/api/v1/pods"
SLICES = "/apis/discovery.k8s.io/v1/endpointslices"
SERVICES = "/api/v1/services"
WATCH_TIMEOUT_S = 300          # the server closes a watch after this; we resume from its RV
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 60.0
MAX_ENTRIES = 65536            # addresses held (a pod with dual-stack IPs holds two)
LIST_PAGE = 500                # items per LIST response (client-go's pager uses 500)


TOKEN_RELOAD_S = 60.0          # client-go re-reads a projected token this often


@dataclass(frozen=True)
class ApiConfig:
    base: str                     # https://10.96.0.1:443
    token: str                    # the token read at start (or given)
    ca_file: str | None = None    # None: the system's trust store (a test's plain http ignores it)
    token_file: str | None = None  # re-read: the kubelet rotates a projected token in place

    def context(self) -> ssl.SSLContext | None:
        if not self.base.startswith("https:"):
            return None
        return ssl.create_default_context(cafile=self.ca_file)


class Token:
    """The bearer token to send: ``cfg.token`` until ``cfg.token_file`` is read again, every
    TOKEN_RELOAD_S and at once after a 401 (the old token expired or its object went), as
    client-go's cached file token source does. An unreadable or empty file keeps the last."""

    def __init__(self, cfg: ApiConfig, reload_s: float = TOKEN_RELOAD_S, clock=time.monotonic):
        self.cfg, self.reload_s, self.clock = cfg, reload_s, clock
        self._value, self._read_at = cfg.token, clock()
        self._lock = threading.Lock()

    def value(self, force: bool = False) -> str:
        with self._lock:
            if self.cfg.token_file and (force or self.clock() - self._read_at >= self.reload_s):
                self._read_at = self.clock()
                try:
                    got = Path(self.cfg.token_file).read_text().strip()
                except OSError:
                    got = ""
                if got:
                    self._value = got
            return self._value


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """An API server answers these requests itself; a redirect (to another host, say) would
    carry the bearer token along (urllib copies every header but the body's), so none is
    followed: the 3xx is an error."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def from_env(env=os.environ, sa_dir: Path = SA_DIR) -> ApiConfig | None:
    """The in-cluster API, as client-go's rest.InClusterConfig() finds it; outside a pod,
    NPTRACE_KUBE_API (https://HOST:PORT) with NPTRACE_KUBE_TOKEN_FILE and NPTRACE_KUBE_CA (a
    node's agent token, or a ServiceAccount token made for nptrace); None otherwise."""
    if env.get("NPTRACE_KUBE_API"):
        tf = env.get("NPTRACE_KUBE_TOKEN_FILE", "")
        try:
            token = Path(tf).read_text().strip() if tf else ""
        except OSError:
            token = ""
        return ApiConfig(env["NPTRACE_KUBE_API"].rstrip("/"), token, env.get("NPTRACE_KUBE_CA") or None,
                         tf or None) if token else None
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return None
    try:
        token = (sa_dir / "token").read_text().strip()
    except OSError:
        return None
    if not token:
        return None
    ca = sa_dir / "ca.crt"
    if ":" in host:
        host = f"[{host}]"        # an IPv6 service address
    return ApiConfig(f"https://{host}:{port}", token, str(ca) if ca.exists() else None,
                     str(sa_dir / "token"))


class Gone(Exception):
    """410: the resourceVersion is too old; list again."""


def pod_ips(pod: dict) -> list[str]:
    """A pod's own addresses; none for a hostNetwork pod (its address is the node's)."""
    if (pod.get("spec") or {}).get("hostNetwork"):
        return []
    st = pod.get("status") or {}
    ips = [x.get("ip") for x in st.get("podIPs") or []]
    if not ips and st.get("podIP"):
        ips = [st["podIP"]]
    return [ip for ip in ips if ip]


def slice_pods(es: dict) -> dict[str, str]:
    """{address: "ns/name"} of an EndpointSlice's endpoints that are pods."""
    out = {}
    for ep in es.get("endpoints") or []:
        ref = ep.get("targetRef") or {}
        if ref.get("kind") != "Pod" or not ref.get("name"):
            continue
        name = f"{ref.get('namespace') or (es.get('metadata') or {}).get('namespace', '')}/{ref['name']}"
        for a in ep.get("addresses") or []:
            out[a] = name
    return out


def service_frontends(svc: dict) -> dict[str, str]:
    """{"PROTO ADDR:PORT": "ns/name:port KIND [local]"} of a Service's frontends, the lines of
    the IPVS names table (services/ipvs.py parse_names): its ClusterIPs, external IPs and
    load-balancer IPs with each port, and each NodePort as ``*:PORT`` (every node address).
    IPVS programs these virtual servers and names none of them: on such a node the API is
    where a Service's name comes from."""
    meta, spec = svc.get("metadata") or {}, svc.get("spec") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    local = " local" if spec.get("externalTrafficPolicy") == "Local" else ""
    ips = [ip for ip in (spec.get("clusterIPs") or [spec.get("clusterIP")]) if ip and ip != "None"]
    ext = list(spec.get("externalIPs") or [])
    lbs = [i.get("ip") for i in ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
           if i.get("ip")]
    out = {}
    for p in spec.get("ports") or []:
        if not isinstance(p, dict) or not isinstance(p.get("port"), int):
            continue
        proto = str(p.get("protocol") or "TCP").lower()
        svc_port = f"{name}:{p['name']}" if p.get("name") else name

        def put(addr, port, kind, tail=""):
            host = f"[{addr}]" if ":" in addr else addr
            out[f"{proto} {host}:{port}"] = f"{svc_port} {kind}{tail}"
        for ip in ips:
            put(ip, p["port"], "clusterip")
        for ip in ext:
            put(ip, p["port"], "externalip", local)
        for ip in lbs:
            put(ip, p["port"], "loadbalancer", local)
        if isinstance(p.get("nodePort"), int) and p["nodePort"]:
            put("*", p["nodePort"], "nodeport", local)
    return out


def _key(obj: dict) -> str:
    m = obj.get("metadata") or {}
    return f"{m.get('namespace', '')}/{m.get('name', '')}"


class Table:
    """One resource's view: object key -> the addresses it named, and address -> pod name.
    Bounded: past max_entries addresses the oldest are dropped (a lookup then says None)."""

    def __init__(self, extract: Callable[[dict], dict[str, str]], max_entries: int):
        self.extract = extract
        self.max = max_entries
        self.by_obj: dict[str, dict[str, str]] = {}
        self.addrs: OrderedDict[str, str] = OrderedDict()

    def put(self, obj: dict) -> None:
        self.delete(obj)
        got = self.extract(obj)
        self.by_obj[_key(obj)] = got
        for a, name in got.items():
            self.addrs[a] = name
            self.addrs.move_to_end(a)
        while len(self.addrs) > self.max:
            self.addrs.popitem(last=False)

    def delete(self, obj: dict) -> None:
        for a, name in self.by_obj.pop(_key(obj), {}).items():
            if self.addrs.get(a) == name:
                del self.addrs[a]

    def replace(self, items: list[dict]) -> None:
        self.by_obj.clear()
        self.addrs.clear()
        for obj in items:
            self.put(obj)


def _shutdown(r) -> None:
    """End a response another thread is blocked reading. Its socket is shut down, not the
    response closed: closing takes the buffered reader's lock, which the blocked readline
    holds, so close() from here waited for the next watch event (minutes on a quiet cluster,
    measured against a real API server over TLS). The reading thread closes it after."""
    sock = getattr(getattr(getattr(r, "fp", None), "raw", None), "_sock", None)
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        else:
            r.close()
    except Exception:
        pass


class PodWatch:
    """Start with start(); pod_of(addr) answers from the cache at once; close() stops."""

    def __init__(self, api: ApiConfig, node: str, log: Callable[[str], None] = lambda m: None,
                 max_entries: int = MAX_ENTRIES, watch_timeout_s: int = WATCH_TIMEOUT_S,
                 backoff: tuple[float, float] = (BACKOFF_MIN_S, BACKOFF_MAX_S), services: bool = False):
        self.api, self.node, self.log = api, node, log
        self.watch_timeout_s = watch_timeout_s
        self.backoff = backoff
        self._ssl = api.context()
        self._token = Token(api)
        self._open = urllib.request.build_opener(
            _NoRedirect, *((urllib.request.HTTPSHandler(context=self._ssl),) if self._ssl else ())).open
        self.pods = Table(lambda p: {ip: _key(p) for ip in pod_ips(p)}, max_entries)
        self.slices = Table(slice_pods, max_entries)
        self.services = Table(service_frontends, max_entries)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._responses: set = set()
        self._logged: set[str] = set()
        # how many LISTs each resource needed (tests); Services only when asked for
        self.lists = {PODS: 0, SLICES: 0, **({SERVICES: 0} if services else {})}
        self.synced = threading.Event()        # set once both first LISTs arrived

    # -- lookups (the classifier's thread) ------------------------------------------------
    def pod_of(self, addr: str) -> str | None:
        return self.pods.addrs.get(addr) or self.slices.addrs.get(addr)

    def service_names(self) -> str:
        """The Services' frontends as the IPVS names table's text (services/ipvs.py); "" until
        the first LIST."""
        return "".join(f"{k} {v}\n" for k, v in list(self.services.addrs.items()))

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "PodWatch":
        sel = {"fieldSelector": f"spec.nodeName={self.node}"} if self.node else {}
        for path, table, params in ((PODS, self.pods, sel), (SLICES, self.slices, {}),
                                    (SERVICES, self.services, {})):
            if path not in self.lists:
                continue
            t = threading.Thread(target=self._loop, args=(path, table, params), daemon=True,
                                 name=f"nptrace-watch{path.replace('/', '-')}")
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self._stop.set()
        for r in list(self._responses):     # unblock a watch waiting for its next line
            _shutdown(r)
        for t in self._threads:
            t.join(timeout=2)

    # -- the watch loop (one thread per resource) --------------------------------------------
    def _get(self, path: str, params: dict, timeout: float):
        url = f"{self.api.base}{path}?{urllib.parse.urlencode(params)}"
        for attempt in (0, 1):
            req = urllib.request.Request(url, headers={
                "Authorization": f"Bearer {self._token.value(force=attempt == 1)}",
                "Accept": "application/json"})
            try:
                return self._open(req, timeout=timeout)
            except urllib.error.HTTPError as e:
                if e.code == 410:
                    raise Gone() from None
                if e.code == 401 and attempt == 0 and self.api.token_file:
                    continue                     # rotated: read the token again, once
                raise
        raise AssertionError("unreachable")

    def _list(self, path: str, table: Table, params: dict) -> str:
        """Every item, LIST_PAGE at a time (limit/continue: a large cluster's pods in pages,
        not one response), then the collection's resourceVersion to watch from."""
        items: list[dict] = []
        cont = ""
        while True:
            q = {**params, "limit": str(LIST_PAGE), **({"continue": cont} if cont else {})}
            with self._get(path, q, timeout=30) as r:
                doc = json.load(r)
            items += doc.get("items") or []
            meta = doc.get("metadata") or {}
            cont = meta.get("continue") or ""
            if not cont:
                break
        table.replace(items)
        self.lists[path] += 1
        if all(self.lists.values()):
            self.synced.set()
        return meta.get("resourceVersion", "")

    def _watch(self, path: str, table: Table, params: dict, rv: str) -> str:
        q = {**params, "watch": "1", "resourceVersion": rv, "allowWatchBookmarks": "true",
             "timeoutSeconds": str(self.watch_timeout_s)}
        r = self._get(path, q, timeout=self.watch_timeout_s + 30)
        self._responses.add(r)
        try:
            while not self._stop.is_set():
                line = r.readline()
                if not line:
                    return rv                    # the server ended the watch: resume
                if not line.strip():
                    continue
                ev = json.loads(line)
                kind, obj = ev.get("type"), ev.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise OSError(f"watch error {obj.get('code')}: {obj.get('message', '')}")
                if kind in ("ADDED", "MODIFIED"):
                    table.put(obj)
                elif kind == "DELETED":
                    table.delete(obj)
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
            return rv
        finally:
            self._responses.discard(r)
            r.close()

    def _loop(self, path: str, table: Table, params: dict) -> None:
        delay = self.backoff[0]
        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list(path, table, params)
                rv = self._watch(path, table, params, rv)
                delay = self.backoff[0]
            except Gone:
                rv = None                        # too old: list again, at once
            except Exception as e:               # network, TLS, 401/403, bad JSON
                if self._stop.is_set():
                    return
                what = f"{path}: {type(e).__name__}"
                if what not in self._logged:
                    self._logged.add(what)
                    hint = (" (the service account needs list and watch on it: "
                            "deploy/daemonset.yaml's ClusterRole)"
                            if isinstance(e, urllib.error.HTTPError) and e.code in (401, 403)
                            else "")
                    self.log(f"kubernetes API {path}: {e}{hint}; retrying with backoff, "
                             "pods named from the node meanwhile")
                rv = None
                self._stop.wait(delay)
                delay = min(delay * 2, self.backoff[1])
