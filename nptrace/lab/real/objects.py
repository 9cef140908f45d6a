"""Pure: the Kubernetes objects a scenario's data stands for, and what each step changes.

The scenario says, per Service, which pods are its endpoints (``endpoints``) and which of them
are not ready (``not_ready``); a ``rules`` step says the endpoints after a change. The
generated tier renders rules from that directly. Here it becomes what a cluster has:
  - every pod host that is ever an endpoint of a Service carries that Service's selector
    label (lab.nptrace.io/<service name>=endpoint, one per Service); every pod carries
    app=<its own name> besides (a pod of no Service is another workload);
  - a selected pod is Ready while the scenario lists it as a ready endpoint of one of its
    Services, and not Ready otherwise (a new pod not ready yet, failing its readiness probe);
  - a pod a ``rules`` step removes and a later ``delete_pod`` step deletes is deleted through
    the API with its grace period when it leaves (terminating first, as a rollout does); one
    that stays is marked not Ready;
  - ``delete_pod``: the kubelet's final delete once the pod's sandbox is gone (grace 0);
  - ``add_pod``: a new pod object, Running and Ready on its node, with the host's addresses;
  - a ``gone`` pod (stale-endpoint) keeps its Ready object: its node never reported it dead.
kube-controller-manager's EndpointSlice controller turns Pods and Services into slices.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model import Spec

SELECTOR = "lab.nptrace.io/{service}"
TERMINATION_GRACE_S = 30


def pod_addrs(spec: Spec, pod: str) -> list[str]:
    return [a.split("/")[0] for a in spec.hosts[pod]["ifaces"]["eth0"]["addrs"]]


def node_ip(spec: Spec, node: str) -> str:
    """The node's InternalIP: the first address of its first interface (eth0)."""
    return spec.first_addr(node, next(iter(spec.hosts[node]["ifaces"])))


def pod_cidr(spec: Spec, node: str) -> str | None:
    """The node's pod range: its bridge's (cni0) network."""
    import ipaddress
    for i in spec.hosts[node]["ifaces"].values():
        if i.get("type") == "bridge":
            for a in i.get("addrs", []):
                if ":" not in a:
                    return str(ipaddress.ip_interface(a).network)
    return None


def _pod_of_ip(spec: Spec) -> dict[str, str]:
    """The pod host behind each address: one there from the start before one that takes its
    address in a step (a reused address is the first pod's while that pod is an endpoint)."""
    out: dict[str, str] = {}
    for h in [*spec.pods(), *(p for p in spec.pods(pending=True) if p not in spec.pods())]:
        for ip in pod_addrs(spec, h):
            out.setdefault(ip, h)
    return out


def endpoint_pods(spec: Spec, services) -> dict[str, dict[str, bool]]:
    """{service name: {pod host: ready}} of ``services`` (Spec.services or a step's compiled)."""
    by_ip = _pod_of_ip(spec)
    out: dict[str, dict[str, bool]] = {}
    for s in services:
        if s.namespace == "scale":
            continue
        out.setdefault(s.name, {})
        for e in s.endpoints:
            if e.ip in by_ip:
                out[s.name][by_ip[e.ip]] = out[s.name].get(by_ip[e.ip], False) or e.ready
    return out


def selected_by(spec: Spec) -> dict[str, tuple[str, ...]]:
    """{pod host: the Services whose selector it carries}, over the base and every step."""
    out: dict[str, tuple[str, ...]] = {}
    for svcs in [spec.services, *(st["compiled"] for st in spec.steps if st.get("kind") == "rules")]:
        for svc, pods in endpoint_pods(spec, svcs).items():
            for p in pods:
                if svc not in out.get(p, ()):
                    out[p] = (*out.get(p, ()), svc)
    return out


def selector(service: str) -> dict[str, str]:
    return {SELECTOR.format(service=service): "endpoint"}


def node_object(spec: Spec, node: str) -> dict:
    ip = node_ip(spec, node)
    obj = {"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux"}},
           "spec": {}}
    cidr = pod_cidr(spec, node)
    if cidr:
        obj["spec"] = {"podCIDR": cidr, "podCIDRs": [cidr]}
    return obj


def node_status(spec: Spec, node: str, now: str) -> dict:
    return {"status": {
        "addresses": [{"type": "InternalIP", "address": node_ip(spec, node)},
                      {"type": "Hostname", "address": node}],
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "the lab stands in for the kubelet",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}]}}


def service_object(svc) -> dict:
    local = svc.etp == "Local"
    typ = "LoadBalancer" if svc.health_check_node_port else "NodePort" if svc.node_port else "ClusterIP"
    port = {"name": svc.port_name or None, "protocol": svc.protocol.upper(), "port": svc.port,
            "targetPort": svc.endpoints[0].port if svc.endpoints else svc.port}
    if svc.node_port:
        port["nodePort"] = svc.node_port
    spec = {"type": typ, "selector": selector(svc.name), "clusterIP": svc.cluster_ip,
            "ports": [{k: v for k, v in port.items() if v is not None}]}
    if typ != "ClusterIP":
        spec["externalTrafficPolicy"] = "Local" if local else "Cluster"
    if svc.health_check_node_port:
        spec["healthCheckNodePort"] = svc.health_check_node_port
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": svc.name, "namespace": svc.namespace}, "spec": spec}


def target_ports(spec: Spec, services: tuple[str, ...]) -> list[int]:
    return sorted({s.endpoints[0].port for s in spec.services if s.name in services and s.endpoints}) or [8080]


@dataclass(frozen=True)
class PodState:
    host: str
    namespace: str
    node: str
    services: tuple[str, ...]     # whose selector it carries
    ready: bool


def pod_state(spec: Spec, pod: str, services=None) -> PodState:
    """A pod host with its Services and its readiness under ``services`` (default: the
    scenario's own)."""
    sel = selected_by(spec).get(pod, ())
    eps = endpoint_pods(spec, spec.services if services is None else services)
    ready = any(eps.get(s, {}).get(pod, False) for s in sel) if sel else True
    d = spec.hosts[pod]
    return PodState(pod, d.get("k8s_namespace", "default"), d["node"], sel, ready)


def pod_states(spec: Spec, services=None) -> list[PodState]:
    """Every pod host that exists now (not pending)."""
    return [pod_state(spec, h, services) for h in spec.pods()]


def pod_object(spec: Spec, st: PodState) -> dict:
    labels = {"app": st.host}
    for s in st.services:
        labels.update(selector(s))
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": st.host, "namespace": st.namespace, "labels": labels},
            "spec": {"nodeName": st.node, "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
                     "containers": [{"name": "app", "image": "nptrace.local/lab-pod:1",
                                     "ports": [{"containerPort": p, "protocol": "TCP"}
                                               for p in target_ports(spec, st.services)]}]}}


def pod_status(spec: Spec, st: PodState, now: str) -> dict:
    ips = pod_addrs(spec, st.host)
    cond = "True" if st.ready else "False"
    hostip = node_ip(spec, st.node)
    return {"status": {
        "phase": "Running", "podIP": ips[0], "podIPs": [{"ip": ip} for ip in ips],
        "hostIP": hostip, "hostIPs": [{"ip": hostip}], "startTime": now,
        "conditions": [{"type": t, "status": s, "lastTransitionTime": now}
                       for t, s in (("PodScheduled", "True"), ("Initialized", "True"),
                                    ("ContainersReady", cond), ("Ready", cond))]}}


def step_changes(spec: Spec, index: int, before) -> tuple[list[str], list[str], list[str]]:
    """What ``rules`` step ``index`` does to pods, from the Services ``before`` it:
    (pods made Ready, pods made not Ready, pods deleted with their grace period)."""
    st = spec.steps[index]
    old, new = endpoint_pods(spec, before), endpoint_pods(spec, st["compiled"])
    deleted_later = {s["host"] for s in spec.steps[index + 1:] if s.get("kind") == "delete_pod"}
    ready, unready, delete = [], [], []
    for svc in sorted(set(old) | set(new)):
        was, now = old.get(svc, {}), new.get(svc, {})
        for p in sorted(set(was) | set(now)):
            if now.get(p) and not was.get(p):
                ready.append(p)
            elif was.get(p) and not now.get(p):
                (delete if p in deleted_later else unready).append(p)
    return ready, unready, delete
