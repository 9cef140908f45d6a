"""etcd, kube-apiserver and kube-controller-manager for one lab, in the root namespace.

They are reached from the lab's node namespaces over a management link: a bridge in the root
namespace (npk8s<slot>, 10.255.<slot>.1/24) with one veth into each node (k8s0,
10.255.<slot>.<10+i>), as a node's management NIC reaches its control plane. The API server
listens on 6443+slot, etcd on 2379+10*slot (clients) and the next port (peers), so labs in
other slots run their own. TLS with client certificates, RBAC and the Node authorizer,
ServiceAccount tokens: as a cluster has them. kube-controller-manager runs every controller but
node lifecycle (nothing posts the nodes' heartbeats: the lab stands in for their kubelets only
when it writes) with per-controller ServiceAccount credentials.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import LabError
from ..netns import kill, sh
from . import pki as pkimod
from .api import Api
from .releases import Release, binary

BRIDGE = "npk8s{slot}"
NODE_LINK = "k8s0"
# How long the control plane, the slices and kube-proxy's first sync may take: seconds here,
# minutes in a guest under TCG (the kernel matrix sets it higher)
START_TIMEOUT_S = float(os.environ.get("NPT_K8S_TIMEOUT", "60"))


@dataclass(frozen=True)
class Plan:
    slot: int
    dir: Path               # certificates, kubeconfigs, etcd's data, logs

    @property
    def bridge(self) -> str:
        return BRIDGE.format(slot=self.slot)

    @property
    def host_ip(self) -> str:
        return f"10.255.{self.slot}.1"

    def node_ip(self, i: int) -> str:
        return f"10.255.{self.slot}.{10 + i}"

    @property
    def api_port(self) -> int:
        return 6443 + self.slot

    @property
    def etcd_port(self) -> int:
        return 2379 + 10 * self.slot

    @property
    def server(self) -> str:
        return f"https://{self.host_ip}:{self.api_port}"

    @property
    def local_server(self) -> str:
        """The root namespace's way in: the bridge's address, where alone the server listens
        (not every address of the machine)."""
        return self.server


def link_up(plan: Plan, node_ns: list[str]) -> None:
    """The management bridge in the root namespace (the API server listens on its address
    only) and a veth from it into each node."""
    br = plan.bridge
    sh(["ip", "link", "add", br, "type", "bridge"])
    sh(["ip", "addr", "add", f"{plan.host_ip}/24", "dev", br])
    sh(["ip", "link", "set", br, "up"])
    for i, ns in enumerate(node_ns):
        host_end = f"{br}n{i}"
        sh(["ip", "link", "add", host_end, "type", "veth", "peer", "name", NODE_LINK, "netns", ns])
        sh(["ip", "link", "set", host_end, "master", br, "up"])
        sh(["ip", "-n", ns, "addr", "add", f"{plan.node_ip(i)}/24", "dev", NODE_LINK])
        sh(["ip", "-n", ns, "link", "set", NODE_LINK, "up"])


def link_down(slot: int) -> None:
    br = BRIDGE.format(slot=slot)
    links = sh(["ip", "-o", "link", "show"], check=False).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name == br or name.startswith(f"{br}n"):
            sh(["ip", "link", "del", name], check=False)


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    """A daemon of the real tier, its output to ``log``, in a session of its own."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)


def write_kubeconfig(plan: Plan, pki: pkimod.Pki, who: str, server: str | None = None) -> Path:
    path = plan.dir / f"{who}.kubeconfig"
    path.write_text(pkimod.kubeconfig(pki, who, server or plan.server))
    return path


def pki_of(plan: Plan) -> pkimod.Pki:
    return pkimod.Pki(plan.dir / "pki")


def admin_api(plan: Plan) -> Api:
    pki = pki_of(plan)
    return Api(plan.local_server, str(pki.ca), str(pki.cert("admin")), str(pki.key("admin")))


def start(plan: Plan, rel: Release, service_cidr: str, on_pid, apiserver_extra: tuple = ()) -> Api:
    """etcd, the API server and the controller manager; ``on_pid(pid)`` records each process
    at once (a failed start is still cleaned up). Returns the admin client once /readyz says
    so and the default ServiceAccount exists (the controllers run). ``apiserver_extra``: more
    kube-apiserver flags (a test's --watch-cache=false)."""
    plan.dir.mkdir(parents=True, exist_ok=True)
    pki = pkimod.make(plan.dir / "pki", [plan.host_ip])
    logs = plan.dir / "logs"
    peer = plan.etcd_port + 1
    etcd = spawn([binary(rel, "etcd"), "--name", "lab", "--data-dir", str(plan.dir / "etcd"),
                   "--listen-client-urls", f"http://127.0.0.1:{plan.etcd_port}",
                   "--advertise-client-urls", f"http://127.0.0.1:{plan.etcd_port}",
                   "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                   "--initial-cluster", f"lab=http://127.0.0.1:{peer}",
                   "--listen-metrics-urls", "", "--unsafe-no-fsync", "--log-level", "warn"],
                  logs / "etcd.log")
    on_pid(etcd.pid)
    apiserver = spawn([
        binary(rel, "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{plan.etcd_port}",
        f"--bind-address={plan.host_ip}", f"--secure-port={plan.api_port}", f"--advertise-address={plan.host_ip}",
        f"--service-cluster-ip-range={service_cidr}", "--service-node-port-range=30000-32767",
        f"--client-ca-file={pki.ca}", f"--tls-cert-file={pki.cert('apiserver')}",
        f"--tls-private-key-file={pki.key('apiserver')}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
        "--authorization-mode=Node,RBAC", "--allow-privileged=true",
        f"--cert-dir={plan.dir / 'apiserver-certs'}", "--profiling=false", "-v=1", *apiserver_extra],
        logs / "kube-apiserver.log")
    (plan.dir / "kube-apiserver.argv").write_text(json.dumps(apiserver.args))
    on_pid(apiserver.pid)
    api = admin_api(plan)
    write_kubeconfig(plan, pki, "admin")    # for kubectl: KUBECONFIG=<lab dir>/admin.kubeconfig
    _wait(api.ready, "kube-apiserver /readyz", [etcd, apiserver], logs)
    kcm = spawn([
        binary(rel, "kube-controller-manager"),
        f"--kubeconfig={write_kubeconfig(plan, pki, 'controller-manager', plan.local_server)}",
        f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca}",
        "--use-service-account-credentials=true", "--leader-elect=false",
        "--controllers=*,-node-lifecycle-controller", "--bind-address=127.0.0.1",
        f"--secure-port={10257 + plan.slot}", "-v=1"],
        logs / "kube-controller-manager.log")
    on_pid(kcm.pid)

    def default_sa():
        try:
            return api.get("/api/v1/namespaces/default/serviceaccounts/default")
        except LabError:
            return None
    _wait(default_sa, "kube-controller-manager (the default ServiceAccount)", [etcd, apiserver, kcm], logs)
    return api


def restart_apiserver(plan: Plan, down_s: float = 0.0) -> int:
    """The API server stopped (SIGTERM) and started again with the same flags, ``down_s``
    seconds later, as a control-plane upgrade or a crash-looping server does; returns the new
    process's pid once /readyz answers."""
    argv = json.loads((plan.dir / "kube-apiserver.argv").read_text())
    old = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p) == argv]
    stop(old)
    time.sleep(down_s)
    proc = spawn(argv, plan.dir / "logs" / "kube-apiserver.log")
    _wait(admin_api(plan).ready, "kube-apiserver /readyz after its restart", [proc], plan.dir / "logs")
    return proc.pid


def _cmdline(p: Path) -> list[str]:
    try:
        return p.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _wait(check, what: str, procs, logs: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not check():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            name = Path(dead[0].args[0]).name
            tail = (logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise LabError(f"{name} exited ({dead[0].returncode}) while waiting for {what}: "
                           f"{' | '.join(tail)[-400:]}")
        if time.monotonic() > deadline:
            raise LabError(f"timed out after {START_TIMEOUT_S:.0f} s waiting for {what}; logs in {logs}")
        time.sleep(0.1)


def stop(pids) -> None:
    """SIGTERM, then SIGKILL after 3 s, to the processes started here (etcd may take a
    moment to close its database)."""
    kill(pids, grace=3.0)
