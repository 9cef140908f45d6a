"""The real tier's part of a lab's life: `lab up` (the control plane, the objects, one
kube-proxy per node, the wait for their rules), each step (what it changes through the API)
and `lab down`. runner.py calls these where the generated tier renders rules."""
from __future__ import annotations

import datetime
import time
from pathlib import Path

from .. import hostplan, netns
from ..errors import LabError
from ..model import Spec
from . import controlplane, kubeproxy, objects
from .api import Api, ApiError
from .controlplane import Plan
from .releases import Release, bin_dir, get as get_release


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def plan_of(state: dict) -> Plan:
    r = state["real"]
    return Plan(slot=r["slot"], dir=Path(r["dir"]))


def api_of(state: dict) -> Api:
    return controlplane.admin_api(plan_of(state))


def _ensure_namespace(api: Api, name: str) -> None:
    try:
        api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    except ApiError as e:
        if e.status != 409:
            raise


def create_pod(api: Api, spec: Spec, st: objects.PodState) -> None:
    _ensure_namespace(api, st.namespace)
    api.create(f"/api/v1/namespaces/{st.namespace}/pods", objects.pod_object(spec, st))
    api.patch(f"/api/v1/namespaces/{st.namespace}/pods/{st.host}/status", objects.pod_status(spec, st, _now()))


def _set_ready(api: Api, spec: Spec, pod: str, ready: bool) -> None:
    st = objects.pod_state(spec, pod)
    st = objects.PodState(st.host, st.namespace, st.node, st.services, ready)
    api.patch(f"/api/v1/namespaces/{st.namespace}/pods/{pod}/status", objects.pod_status(spec, st, _now()))


def expected_endpoints(spec: Spec, services) -> dict[tuple[str, str], set[str]]:
    """{(namespace, service): ready endpoint addresses} the slices must show."""
    out = {}
    by_name = objects.endpoint_pods(spec, services)
    for s in services:
        if s.namespace == "scale":
            continue
        pods = by_name.get(s.name, {})
        out[(s.namespace, s.name)] = {ip for p, ready in pods.items() if ready
                                      for ip in objects.pod_addrs(spec, p) if ":" not in ip}
    return out


def slice_endpoints(api: Api, namespace: str, name: str) -> set[str]:
    items = api.get(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
                    f"?labelSelector=kubernetes.io%2Fservice-name%3D{name}")["items"]
    return {a for es in items for e in es.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready") for a in e.get("addresses", [])}


def wait_slices(api: Api, want: dict[tuple[str, str], set[str]],
                timeout: float = controlplane.START_TIMEOUT_S) -> None:
    api.wait("the EndpointSlice controller", lambda: all(slice_endpoints(api, ns, n) == addrs
                                                         for (ns, n), addrs in want.items()), timeout)


def up(spec: Spec, ns: dict[str, str], backend: str, state: dict, save, log_dir: Path,
       release: str | None = None) -> None:
    """The control plane, the scenario's Nodes, Services and Pods, one kube-proxy per node;
    returns once every kube-proxy has applied the slices."""
    rel: Release = get_release(release)
    plan = Plan(slot=spec.slot, dir=log_dir / "k8s")
    nodes = spec.nodes()
    state["real"] = {"release": rel.version, "slot": spec.slot, "dir": str(plan.dir), "pids": [],
                     "bin": str(bin_dir(rel))}
    save()
    controlplane.link_up(plan, [ns[n] for n in nodes])

    def on_pid(pid):
        state["real"]["pids"].append(pid)
        save()
    api = controlplane.start(plan, rel, spec.service_cidr, on_pid)
    for n in nodes:
        api.create("/api/v1/nodes", objects.node_object(spec, n))
        api.patch(f"/api/v1/nodes/{n}/status", objects.node_status(spec, n, _now()))
    for svc in spec.services:
        if svc.namespace == "scale":
            continue
        _ensure_namespace(api, svc.namespace)
        api.create(f"/api/v1/namespaces/{svc.namespace}/services", objects.service_object(svc))
    for st in objects.pod_states(spec):
        create_pod(api, spec, st)
    tracer_access(plan, api)
    wait_slices(api, expected_endpoints(spec, spec.services))
    since = time.time()
    kubeconfig = controlplane.write_kubeconfig(plan, controlplane.pki_of(plan), "kube-proxy")
    procs = []
    for n in nodes:
        args = kubeproxy.argv(rel, kubeconfig, n, backend, spec.cluster_cidr)
        procs.append(controlplane.spawn(["ip", "netns", "exec", ns[n], *args],
                                        plan.dir / "logs" / f"kube-proxy-{n}.log"))
        state["pids"].append(procs[-1].pid)
    save()
    kubeproxy.wait_synced([plan.node_ip(i) for i in range(len(nodes))], since, procs,
                          controlplane.START_TIMEOUT_S)
    for n in nodes:
        node_sysctls_again(spec, n, ns[n])
    for fault in sorted(spec.faults):
        for n in nodes:
            apply_fault(fault, ns[n], backend)


SHIPPED = Path(__file__).resolve().parents[3] / "deploy" / "daemonset.yaml"
RBAC_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding")


def tracer_access(plan: Plan, api: Api) -> None:
    """What a tracer on this lab's nodes needs to read the API as the DaemonSet does: the
    shipped ServiceAccount, ClusterRole and binding (deploy/daemonset.yaml, created through
    the API as kubectl would) and a token for that ServiceAccount in the lab's folder;
    kube_env() says how `nptrace run` finds them."""
    import yaml
    for doc in yaml.safe_load_all(SHIPPED.read_text()):
        if not doc or doc.get("kind") not in RBAC_KINDS:
            continue
        ns = (doc.get("metadata") or {}).get("namespace")
        group = doc["apiVersion"]
        base = f"/api/{group}" if "/" not in group else f"/apis/{group}"
        plural = {"Namespace": "namespaces", "ServiceAccount": "serviceaccounts",
                  "ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings"}[doc["kind"]]
        path = f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"
        try:
            api.create(path, doc)
        except ApiError as e:
            if e.status != 409:
                raise
    sa = next(d for d in yaml.safe_load_all(SHIPPED.read_text()) if d and d.get("kind") == "ServiceAccount")
    ns, name = sa["metadata"]["namespace"], sa["metadata"]["name"]
    got = api.create(f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token",
                     {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                      "spec": {"expirationSeconds": 86400}})
    (plan.dir / "nptrace.token").write_text(got["status"]["token"])


def kube_env(state: dict) -> dict[str, str]:
    """The environment that points `nptrace run` at this lab's API with the shipped
    ServiceAccount's token (node/kubeapi.py from_env); empty for a generated lab."""
    if not state.get("real"):
        return {}
    plan = plan_of(state)
    return {"NPTRACE_KUBE_API": plan.local_server, "NPTRACE_KUBE_TOKEN_FILE": str(plan.dir / "nptrace.token"),
            "NPTRACE_KUBE_CA": str(controlplane.pki_of(plan).ca)}


def release_bin(state: dict) -> str:
    return state["real"]["bin"]


def kubeconfig_path(state: dict) -> Path | None:
    """The lab's admin kubeconfig (kubectl with it sees and changes everything)."""
    return plan_of(state).dir / "admin.kubeconfig" if state.get("real") else None


def node_sysctls_again(spec: Spec, node: str, netns_name: str) -> None:
    """kube-proxy writes conntrack sysctls when it starts (nf_conntrack_tcp_timeout_established
    to its 24 h default, close_wait to 1 h): the node's own netfilter values are applied again
    after it, as a node's tuning applied after kube-proxy would be."""
    for step in hostplan.sysctl_steps(spec, node):
        args = [a for a in step.argv[3:] if a.startswith("net.netfilter.") and a.partition("=")[0]
                not in netns.HOST_WIDE]
        if args:
            netns.sh(["ip", "netns", "exec", netns_name, "sysctl", "-q", "-w", *args])


def apply_fault(fault: str, node_ns: str, backend: str) -> None:
    """What goes wrong on a real node after kube-proxy wrote its rules (kuberules.FAULTS):
    no-masquerade-jump, a firewall reload that flushed the nat POSTROUTING jump into
    kube-proxy's masquerade chain (kube-proxy writes it again at its next full sync)."""
    if fault != "no-masquerade-jump":
        raise LabError(f"the real tier cannot make fault {fault!r}")
    run = ["ip", "netns", "exec", node_ns]
    if backend == "nft":
        out = netns.sh([*run, "nft", "-a", "list", "chain", "ip", "kube-proxy", "nat-postrouting"]).stdout
        handles = [line.rsplit("# handle", 1)[1].strip() for line in out.splitlines()
                   if "jump masquerading" in line and "# handle" in line]
        if not handles:
            raise LabError("kube-proxy's nat-postrouting chain has no jump to masquerading")
        for h in handles:
            netns.sh([*run, "nft", "delete", "rule", "ip", "kube-proxy", "nat-postrouting", "handle", h])
        return
    netns.sh([*run, "iptables", "-w", "-t", "nat", "-D", "POSTROUTING", "-m", "comment", "--comment",
              "kubernetes postrouting rules", "-j", "KUBE-POSTROUTING"])


def rules_step(spec: Spec, index: int, before, state: dict) -> None:
    """A ``rules`` step as a rollout makes it: the new pods become Ready, the ones that leave
    are deleted with their grace period (terminating first) or turn not Ready."""
    api = api_of(state)
    ready, unready, delete = objects.step_changes(spec, index, before)
    for p in ready:
        _set_ready(api, spec, p, True)
    for p in unready:
        _set_ready(api, spec, p, False)
    for p in delete:
        st = objects.pod_state(spec, p)
        api.delete(f"/api/v1/namespaces/{st.namespace}/pods/{p}", grace=objects.TERMINATION_GRACE_S)


def pod_deleted(spec: Spec, pod: str, state: dict) -> None:
    """The kubelet's last word on a pod whose sandbox is gone: the object deleted at once."""
    namespace = spec.hosts[pod].get("k8s_namespace", "default")
    api_of(state).delete(f"/api/v1/namespaces/{namespace}/pods/{pod}", grace=0)


def pod_added(spec: Spec, pod: str, state: dict) -> None:
    st = objects.pod_state(spec, pod)
    create_pod(api_of(state), spec, objects.PodState(st.host, st.namespace, st.node, st.services, True))


def down(state: dict) -> None:
    """The control plane's processes (only ours: their binary is under the release's bin
    folder) and the management links."""
    r = state.get("real")
    if not r:
        return
    mine = []
    for pid in r.get("pids", []):
        try:
            if Path(f"/proc/{pid}/exe").resolve().is_relative_to(r["bin"]):
                mine.append(pid)
        except OSError:
            pass
    controlplane.stop(mine)
    controlplane.link_down(r["slot"])
