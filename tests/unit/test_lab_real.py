"""The lab's real tier without a cluster: the objects a scenario stands for, what its steps
change through the API, the pinned releases and kube-proxy's sync wait."""
from __future__ import annotations

import re

import pytest

from nptrace.lab import model
from nptrace.lab.errors import UsageError
from nptrace.lab.real import kubeproxy, objects, releases


def _pods(spec):
    return {p.host: p for p in objects.pod_states(spec)}


def test_no_listener_pods_and_service():
    spec = model.compile_spec("no-listener")
    pods = _pods(spec)
    assert {p: (s.services, s.ready, s.node) for p, s in pods.items()} == {
        "web-0": (("web",), True, "node1"), "web-1": (("web",), True, "node2"),
        "web-2": (("web",), True, "node2")}
    assert objects.pod_object(spec, pods["web-0"])["metadata"]["labels"] == {
        "app": "web-0", "lab.nptrace.io/web": "endpoint"}
    svc = objects.service_object(spec.services[0])
    assert svc["metadata"] == {"name": "web", "namespace": "default"}
    assert svc["spec"]["type"] == "NodePort" and svc["spec"]["selector"] == {"lab.nptrace.io/web": "endpoint"}
    assert svc["spec"]["ports"] == [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080,
                                     "nodePort": 30080}]
    st = objects.pod_status(spec, pods["web-1"], "2026-01-01T00:00:00Z")["status"]
    assert st["podIP"] == "10.244.1.10" and st["hostIP"] == "192.168.10.12"
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"


def test_etp_local_is_a_load_balancer_without_node1_endpoints():
    spec = model.compile_spec("etp-local-no-endpoint")
    svc = objects.service_object(spec.services[0])["spec"]
    assert svc["type"] == "LoadBalancer" and svc["externalTrafficPolicy"] == "Local"
    assert svc["healthCheckNodePort"] == 32080
    pods = _pods(spec)
    assert pods["web-0"].services == ()           # not selected: node1 has no local endpoint
    assert pods["web-1"].services == ("web",) and pods["web-1"].ready


def test_no_endpoints_pods_not_ready():
    spec = model.compile_spec("no-endpoints")
    assert all(p.services == ("web",) and not p.ready for p in objects.pod_states(spec))


def test_node_object():
    spec = model.compile_spec("no-listener")
    node = objects.node_object(spec, "node1")
    assert node["spec"]["podCIDR"] == "10.244.0.0/24"
    addrs = objects.node_status(spec, "node1", "t")["status"]["addresses"]
    assert {"type": "InternalIP", "address": "192.168.10.11"} in addrs


def test_rollout_step_deletes_the_old_pod_gracefully():
    spec = model.compile_spec("rollout-in-flight", "address-reused")
    pods = _pods(spec)
    assert pods["web-0"].ready and not pods["web-1"].ready and pods["web-1"].services == ("web",)
    assert "other-0" not in pods                       # pending: it appears in a step
    i = next(i for i, st in enumerate(spec.steps) if st["kind"] == "rules")
    ready, unready, delete = objects.step_changes(spec, i, spec.services)
    assert ready == ["web-1", "web-2"] and unready == [] and delete == ["web-0"]
    assert objects.selected_by(spec).get("other-0") is None   # another workload


def test_healthy_pods_carry_both_services():
    spec = model.compile_spec("healthy")
    sel = objects.selected_by(spec)
    assert any(len(v) == 2 for v in sel.values())


def test_stale_endpoint_keeps_the_gone_pod_ready():
    spec = model.compile_spec("stale-endpoint")
    assert _pods(spec)["web-2"].ready                  # its node never reported it dead


def test_slot_moves_objects():
    spec = model.compile_spec("no-listener", slot=2)
    assert objects.node_ip(spec, "node1") == "192.168.12.11"
    assert objects.service_object(spec.services[0])["spec"]["clusterIP"] == "10.98.0.80"


def test_releases_parse_and_get(tmp_path):
    (tmp_path / "releases").write_text("# c\ncurrent v1.36.3 kube-proxy etcd\nolder v1.32.13 kube-proxy\n")
    rels = releases.all_releases(tmp_path)
    assert [r.version for r in rels] == ["v1.36.3", "v1.32.13"]
    assert releases.get(None, tmp_path).name == "current"
    assert releases.get("v1.32.13", tmp_path).minor == 32
    with pytest.raises(UsageError, match="no Kubernetes release 'v9'"):
        releases.get("v9", tmp_path)


def test_shipped_releases_pin_a_current_and_an_older_one():
    rels = releases.all_releases()
    minors = [r.minor for r in rels]
    assert max(minors) >= 36 and min(minors) <= 32
    for r in rels:
        gomod = (releases.K8S_DIR / r.version / "go.mod").read_text()
        assert re.search(rf"^(require |\t)k8s\.io/kubernetes {re.escape(r.version)}$", gomod, re.M)
        assert f"k8s.io/client-go => k8s.io/client-go v0.{r.version[3:]}" in gomod


@pytest.mark.parametrize("state,since,now,want", [
    (None, 100.0, 200.0, False),
    ({"last_timestamp_seconds": 150.0}, 100.0, 151.0, True),          # synced after the change
    ({"last_timestamp_seconds": 90.0, "last_queued_timestamp_seconds": 80.0}, 100.0, 100.5, False),
    ({"last_timestamp_seconds": 90.0, "last_queued_timestamp_seconds": 80.0}, 100.0, 101.5, True),
    ({"last_timestamp_seconds": 90.0, "last_queued_timestamp_seconds": 95.0}, 100.0, 105.0, False),
    ({"last_timestamp_seconds": 90.0, "endpoint_changes_pending": 1.0}, 100.0, 105.0, False),
])
def test_kube_proxy_synced(state, since, now, want):
    assert kubeproxy.synced(state, since, now) is want


def test_kube_proxy_argv_refuses_legacy():
    from nptrace.lab.errors import LabError
    rel = releases.Release("current", "v1.36.3", ("kube-proxy",))
    with pytest.raises(LabError, match="not iptables-legacy"):
        kubeproxy.argv(rel, "/k", "node1", "iptables-legacy", "10.244.0.0/16")


def test_yardstick_table_keeps_rows_it_did_not_measure(tmp_path):
    from nptrace.lab.real import yardstick as y
    guest = y.Row("v1.36.3", "ipvs", "6.1.0-50-amd64", "no-listener", "lab", "no_listener", 10, 10, 10, 10, 10)
    page = tmp_path / "k8s.md"
    page.write_text("# prose\n")
    y.write_table(page, y.markdown([guest], "aaa"))
    host = y.Row("v1.36.3", "nft", "6.18", "no-listener", "lab", "no_listener", 10, 10, 9, 10, 12)
    y.write_table(page, y.markdown([host], "bbb", y.read_table(page)))
    text = page.read_text()
    assert text.startswith("# prose\n") and text.count(y.BEGIN) == 1
    assert "| v1.36.3 | ipvs | 6.1.0-50-amd64 | no-listener |" in text and " aaa |" in text
    assert "| 90% |" in text and " bbb |" in text and "FAIL" in text
    again = y.Row("v1.36.3", "ipvs", "6.1.0-50-amd64", "no-listener", "lab", "no_listener", 10, 10, 10, 10, 10)
    y.write_table(page, y.markdown([again], "ccc", y.read_table(page)))
    assert page.read_text().count("| ipvs |") == 1 and " aaa |" not in page.read_text()
