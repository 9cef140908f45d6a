"""nptrace's Kubernetes client (node/kubeapi.py) against a real kube-apiserver, with
deploy/daemonset.yaml's ServiceAccount, ClusterRole and binding applied for real and a token
requested for that ServiceAccount: pod names (this node's pods, and other nodes' through the
EndpointSlices the real controller writes), a watch that survives the token's rotation, a 410
Gone from a real etcd compaction, an API server restart mid-run, and one clear line when RBAC
refuses it."""
from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from nptrace.lab.real import controlplane
from nptrace.lab.real.api import ApiError
from nptrace.node import kubeapi

ROOT = Path(__file__).resolve().parents[2]
NS = "shop"


def wait_for(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def shipped_rbac(cluster):
    """deploy/daemonset.yaml applied as shipped (its DaemonSet makes no pod: no node runs a
    kubelet here) and the namespace the tests' pods live in."""
    r = subprocess.run([*cluster.kubectl(), "apply", "-f", str(ROOT / "deploy" / "daemonset.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cluster.api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    for node in ("node1", "node2"):   # the EndpointSlice controller skips pods of unknown nodes
        cluster.api.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    return cluster


def token_for(cluster, sa: str, namespace: str, bound_secret: str | None = None) -> str:
    """A TokenRequest for ``sa``, bound to a Secret when ``bound_secret`` (deleting it
    revokes the token at once: how a test makes a token stop working)."""
    spec: dict = {"expirationSeconds": 3600}
    if bound_secret:
        sec = cluster.api.create(f"/api/v1/namespaces/{namespace}/secrets",
                                 {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": bound_secret}})
        spec["boundObjectRef"] = {"kind": "Secret", "apiVersion": "v1", "name": bound_secret,
                                  "uid": sec["metadata"]["uid"]}
    got = cluster.api.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
                             {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
    return got["status"]["token"]


def make_pod(cluster, name: str, node: str, ip: str, labels=None) -> None:
    cluster.api.create(f"/api/v1/namespaces/{NS}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "nptrace.local/none:1"}]}})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cluster.api.patch(f"/api/v1/namespaces/{NS}/pods/{name}/status", {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}})


def watch(cluster, token_file: Path, node: str = "node1", logs=None) -> kubeapi.PodWatch:
    pki = controlplane.pki_of(cluster.plan)
    cfg = kubeapi.ApiConfig(cluster.plan.local_server, token_file.read_text().strip(), str(pki.ca),
                            str(token_file))
    return kubeapi.PodWatch(cfg, node, log=(logs.append if logs is not None else lambda m: None),
                            backoff=(0.2, 1.0)).start()


def test_pod_names_through_the_shipped_serviceaccount(shipped_rbac, tmp_path):
    c = shipped_rbac
    make_pod(c, "web-a", "node1", "10.244.0.21")
    make_pod(c, "web-b", "node2", "10.244.1.21", labels={"app": "web"})
    c.api.create(f"/api/v1/namespaces/{NS}/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    tok = tmp_path / "token"
    tok.write_text(token_for(c, "nptrace", "nptrace"))
    w = watch(c, tok)
    try:
        assert wait_for(lambda: w.pod_of("10.244.0.21") == f"{NS}/web-a")      # this node's pod
        # another node's pod, named through the EndpointSlice kube-controller-manager wrote
        assert wait_for(lambda: w.pod_of("10.244.1.21") == f"{NS}/web-b")
    finally:
        w.close()


def test_the_watch_survives_the_tokens_rotation(shipped_rbac, tmp_path):
    """The kubelet writes a new token over the old one; the old one stops working (here: its
    bound Secret deleted, at once); the API server restarts, so the client must authenticate
    again with what the file holds now."""
    c = shipped_rbac
    tok = tmp_path / "token"
    tok.write_text(token_for(c, "nptrace", "nptrace", bound_secret="rot-1"))
    w = watch(c, tok)
    try:
        assert wait_for(lambda: w.synced.is_set())
        tok.write_text(token_for(c, "nptrace", "nptrace", bound_secret="rot-2"))
        c.api.delete("/api/v1/namespaces/nptrace/secrets/rot-1")
        controlplane.restart_apiserver(c.plan)
        make_pod(c, "after-rotation", "node1", "10.244.0.31")
        assert wait_for(lambda: w.pod_of("10.244.0.31") == f"{NS}/after-rotation", timeout=30)
    finally:
        w.close()


def _etcd(cluster, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.plan.etcd_port}{path}",
                                 data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def test_a_real_compaction_gives_410_and_a_relist(shipped_rbac, tmp_path):
    """The client lists, then (before its watch from the list's resourceVersion starts) pods
    change and etcd compacts past that version: the API server answers the watch 410 Gone and
    the client lists again."""
    c = shipped_rbac
    tok = tmp_path / "token"
    tok.write_text(token_for(c, "nptrace", "nptrace"))
    pki = controlplane.pki_of(c.plan)
    cfg = kubeapi.ApiConfig(c.plan.local_server, tok.read_text().strip(), str(pki.ca), str(tok))
    w = kubeapi.PodWatch(cfg, "node1", backoff=(0.2, 1.0))
    real_list, compacted = w._list, []

    def list_then_compact(path, table, params):
        rv = real_list(path, table, params)
        if path == kubeapi.PODS and not compacted:
            make_pod(c, "during-gap", "node1", "10.244.0.41")
            rev = _etcd(c, "/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"]
            _etcd(c, "/v3/kv/compaction", {"revision": rev, "physical": True})
            compacted.append(rev)
        return rv
    w._list = list_then_compact
    w.start()
    try:
        assert wait_for(lambda: w.pod_of("10.244.0.41") == f"{NS}/during-gap")
        assert compacted and w.lists[kubeapi.PODS] >= 2          # the 410 made it list again
    finally:
        w.close()


def test_an_api_server_restart_mid_run(shipped_rbac, tmp_path):
    c = shipped_rbac
    tok = tmp_path / "token"
    tok.write_text(token_for(c, "nptrace", "nptrace"))
    w = watch(c, tok)
    try:
        assert wait_for(lambda: w.synced.is_set())
        controlplane.restart_apiserver(c.plan, down_s=2.0)
        make_pod(c, "after-restart", "node1", "10.244.0.51")
        assert wait_for(lambda: w.pod_of("10.244.0.51") == f"{NS}/after-restart", timeout=30)
    finally:
        w.close()


def test_rbac_refusal_is_one_clear_line(shipped_rbac, tmp_path):
    """A ServiceAccount the ClusterRole is not bound to: each resource says once, in one line,
    what was refused and which RBAC it needs; lookups still answer (nothing)."""
    c = shipped_rbac
    try:
        c.api.create(f"/api/v1/namespaces/{NS}/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "unbound"}})
    except ApiError as e:
        assert e.status == 409
    tok = tmp_path / "token"
    tok.write_text(token_for(c, "unbound", NS))
    logs: list[str] = []
    w = watch(c, tok, logs=logs)
    try:
        assert wait_for(lambda: len(logs) >= 2)
        time.sleep(1.5)                                     # retried meanwhile, said once each
        assert len(logs) == 2, logs
        for line in logs:
            assert "\n" not in line and "403" in line and "deploy/daemonset.yaml's ClusterRole" in line
        assert w.pod_of("10.244.0.21") is None
    finally:
        w.close()
