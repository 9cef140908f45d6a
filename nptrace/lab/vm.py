"""Apply a repro-lab scenario role to the real machine this runs on: a Vagrant lab VM.

The namespace lab (netns.py) makes every host a network namespace on one kernel. The
Vagrant lab (Vagrantfile, vagrant/) makes one VM per non-pod host of data/topology.toml
(client, mbox, node1, node2), one private network per [networks] entry, and pods as
network namespaces on their node VM, wired to its cni0 bridge by a veth as a CNI does.
Both run the same per-host commands, ``hostplan.host_steps``, from the same scenario
data; on a VM they pass through ``hostplan.apply_role`` with a ``run`` that adapts them:

1. NIC names. The lab's names (eth0, eth1, ul0, west, east) become the VM's real NICs,
   found by the MAC address the Vagrantfile gives each private network (vagrant/plan.json,
   generated from the topology by ``python -m nptrace.lab.vm vagrant-json``).
2. Default routes. A VM keeps Vagrant's management default route (SSH, apt, image
   pulls), so a lab ``default via G`` becomes one route via G per lab subnet the host is
   not attached to: everything ``default`` carried in the namespace lab.
3. Around them: a reset of what an earlier apply left (servers, pod namespaces, lab
   devices, addresses, routes, TX checksum offload back on, firewall, conntrack, and the
   sysctls scenarios changed, restored from the values first seen), then the preparation netns.make_namespaces
   gives a namespace: per-interface rp_filter 0 (so conf.all alone sets the mode) and no
   IPv6 on the lab NICs.

Profile ``k8s`` (a real k3s cluster, vagrant/k8s/): nodes get only their lab NICs,
routes and sysctls; kube-proxy's rules, the CNI's devices and routes, pods, servers and
the NetworkPolicy belong to the cluster.

``--dry-run`` prints every command as a shell script. A real apply needs root and the
marker file the provisioner writes (/etc/nptrace-lab-role), or ``--force``: it rewrites
this machine's network.
"""
from __future__ import annotations

import copy
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from . import hostplan, model
from .netns import resolve_prefix
from .errors import LabError, UsageError
from .model import BACKENDS, Spec

REPO = Path(__file__).resolve().parents[2]
PLAN_FILE = REPO / "vagrant" / "plan.json"
MARKER = Path("/etc/nptrace-lab-role")
STATE_DIR = Path(os.environ.get("NPT_LAB_VM_STATE_DIR", "/var/lib/nptrace-lab"))
PROFILES = ("netns", "k8s")
UNIT_PREFIX = "nptrace-lab-"
# VM order = `vagrant up` order: the fabric, then nodes (node1 is the k3s server), then clients.
_KIND_ORDER = {"router": 0, "node": 1, "client": 2}
_MAC_PREFIX = "02:6e:70:74"   # locally administered, "npt"


# ----------------------------------------------------------------------------- the VM plan

def _network_members(topo_networks: dict) -> dict[str, str]:
    return {m: net for net, members in topo_networks.items() for m in members}


def vagrant_plan(topo: dict | None = None) -> dict:
    """VMs, their private-network NICs (lab name, network, MAC, addresses) and the networks."""
    topo = topo if topo is not None else model.load_topology()
    hosts, networks = topo["hosts"], topo["networks"]
    member_net = _network_members(networks)
    names = sorted((h for h, d in hosts.items() if d["kind"] != "pod"),
                   key=lambda h: (_KIND_ORDER[hosts[h]["kind"]], h))
    vms = []
    for i, host in enumerate(names, 1):
        d = hosts[host]
        lab_nics = [n for n in d["ifaces"] if f"{host}:{n}" in member_net]
        nics = [{"lab": n, "network": member_net[f"{host}:{n}"], "mac": f"{_MAC_PREFIX}:{i:02x}:{j:02x}",
                 "addrs": list(d["ifaces"][n].get("addrs", []))} for j, n in enumerate(lab_nics, 1)]
        first = nics[0]["addrs"][0].split("/")[0] if nics and nics[0]["addrs"] else None
        pods = sorted(p for p, pd in hosts.items() if pd["kind"] == "pod" and pd.get("node") == host)
        # The NIC a VXLAN device rides on: k3s's --flannel-iface in the k8s profile.
        overlay = next((i["dev"] for i in d["ifaces"].values() if i.get("type") == "vxlan"), None)
        vms.append({"name": host, "kind": d["kind"], "hostname": f"npt-{host}", "primary_ip": first,
                    "overlay_nic": overlay, "pods": pods, "nics": nics})
    nets = {}
    for net, members in networks.items():
        subnets = set()
        for m in members:
            h, _, ifname = m.partition(":")
            for a in hosts[h]["ifaces"][ifname].get("addrs", []):
                subnets.add(str(ipaddress.ip_interface(a).network))
        nets[net] = {"name": f"nptrace-{net}", "members": list(members), "subnets": sorted(subnets)}
    return {
        "comment": "generated from nptrace/lab/data/topology.toml by `python3 -m nptrace.lab.vm "
                   "vagrant-json > vagrant/plan.json`; do not edit (tests/unit/test_vagrant.py checks it)",
        "cluster_cidr": topo["cluster_cidr"],
        "service_cidr": topo["service_cidr"],
        "networks": nets,
        "vms": vms,
    }


def render_plan(plan: dict | None = None) -> str:
    return json.dumps(plan if plan is not None else vagrant_plan(), indent=2) + "\n"


def load_plan(path: Path = PLAN_FILE) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return vagrant_plan()   # an installed copy without the vagrant/ folder
    except json.JSONDecodeError as e:
        raise LabError(f"{path} is not valid JSON ({e}); regenerate it with "
                       f"`python3 -m nptrace.lab.vm vagrant-json > {path}`") from None


def plan_vm(plan: dict, role: str) -> dict:
    for vm in plan["vms"]:
        if vm["name"] == role:
            return vm
    raise UsageError(f"role {role!r} is not a lab VM (VMs: {', '.join(v['name'] for v in plan['vms'])}; "
                     f"pods run as namespaces on their node)")


# ----------------------------------------------------------------------------- NICs

def read_macs(net_dir: Path = Path("/sys/class/net")) -> dict[str, str]:
    """MAC (lower case) -> interface name, for every interface of this namespace."""
    out = {}
    try:
        entries = sorted(net_dir.iterdir())
    except OSError:
        return out
    for dev in entries:
        try:
            mac = (dev / "address").read_text().strip().lower()
        except OSError:
            continue
        out.setdefault(mac, dev.name)
    return out


def parse_nic_overrides(pairs) -> dict[str, str]:
    out = {}
    for p in pairs:
        lab, sep, real = p.partition("=")
        if not sep or not lab or not real or len(real) > 15 or "/" in real:
            raise UsageError(f"--nic wants LAB=REAL (e.g. eth0=ens6), got {p!r}")
        out[lab] = real
    return out


def nic_map(vm: dict, macs: dict[str, str], overrides: dict[str, str] | None = None) -> tuple[dict, list]:
    """(lab name -> real name, [lab NICs not found]) for one VM of the plan."""
    overrides = overrides or {}
    unknown = sorted(set(overrides) - {n["lab"] for n in vm["nics"]})
    if unknown:
        raise UsageError(f"--nic names {', '.join(unknown)}: {vm['name']} has lab NICs "
                         f"{', '.join(n['lab'] for n in vm['nics'])}")
    found, missing = {}, []
    for nic in vm["nics"]:
        real = overrides.get(nic["lab"]) or macs.get(nic["mac"].lower())
        if real:
            found[nic["lab"]] = real
        else:
            missing.append(nic["lab"])
    return found, missing


# ----------------------------------------------------------------------------- adapting commands

_IPT_TEXT = re.compile(r"(?P<opt>(?:^|\s)(?:-i|-o|--in-interface|--out-interface)\s+)(?P<name>[\w.+-]+)")
_NFT_TEXT = re.compile(r"(?P<opt>\b(?:iifname|oifname|iif|oif|device)\s+(?:!=\s*)?)(?P<q>\"?)(?P<name>[\w.+-]+)(?P=q)")
_SYSCTL_KEY = re.compile(r"^(?P<head>net[./]ipv[46][./](?:conf|neigh)[./])(?P<name>[^./=]+)(?P<tail>[./].*)$")


def rename_text(text: str, nics: dict[str, str]) -> str:
    """Interface names in iptables-restore (-i/-o) and nft (iifname/oifname, a netdev chain's
    device) text."""
    if not nics or not text:
        return text

    def ipt(m):
        return m.group("opt") + nics.get(m.group("name"), m.group("name"))

    def nft(m):
        return m.group("opt") + m.group("q") + nics.get(m.group("name"), m.group("name")) + m.group("q")

    return _NFT_TEXT.sub(nft, _IPT_TEXT.sub(ipt, text))


def rename_sysctl(arg: str, nics: dict[str, str]) -> str:
    key, sep, value = arg.partition("=")
    m = _SYSCTL_KEY.match(key)
    if m and m.group("name") in nics:
        key = m.group("head") + nics[m.group("name")] + m.group("tail")
    return key + sep + value


def rename_argv(argv, nics: dict[str, str]) -> list[str]:
    """One command with the lab's NIC names replaced by this machine's."""
    argv = list(argv)
    if not nics:
        return argv
    tool = os.path.basename(argv[0])
    if tool in ("ip", "ethtool"):
        return [nics.get(a, a) for a in argv]
    if tool == "sysctl":
        return [rename_sysctl(a, nics) for a in argv]
    if tool.startswith("iptables") and not tool.endswith("restore"):
        return [nics.get(a, a) if i and argv[i - 1] in ("-i", "-o", "--in-interface", "--out-interface") else a
                for i, a in enumerate(argv)]
    return argv


def lab_subnets(spec: Spec) -> set[ipaddress.IPv4Network]:
    """Subnets of every interface that sits on a lab network ([networks] members)."""
    out = set()
    for members in spec.networks.values():
        for m in members:
            h, _, ifname = m.partition(":")
            for a in spec.hosts[h]["ifaces"][ifname].get("addrs", []):
                out.add(ipaddress.ip_interface(a).network)
    return out


def attached_subnets(spec: Spec, host: str) -> set[ipaddress.IPv4Network]:
    return {ipaddress.ip_interface(a).network for i in spec.hosts[host].get("ifaces", {}).values()
            for a in i.get("addrs", [])}


def expand_default_route(argv, spec: Spec, host: str) -> list[list[str]]:
    """`ip route add default via G ...` -> one route via G per lab subnet not attached here."""
    argv = list(argv)
    if argv[:3] != ["ip", "route", "add"] or len(argv) < 4 or argv[3] not in ("default", "0.0.0.0/0"):
        return [argv]
    missing = sorted(lab_subnets(spec) - attached_subnets(spec, host), key=lambda n: int(n.network_address))
    return [["ip", "route", "add", str(n), *argv[4:]] for n in missing]


# ----------------------------------------------------------------------------- the role's commands

@dataclass(frozen=True)
class Cmd:
    """One command of a role: ``section`` is "reset", "prepare", "finish" or the lab host it
    belongs to (the VM's role or one of its pods); ``daemon`` names the systemd unit of a
    long-running server (``argv`` is the server itself, ``netns`` where it runs)."""
    section: str
    argv: tuple[str, ...]
    input: str | None = None
    check: bool = True
    daemon: str | None = None
    netns: str | None = None

    def full_argv(self) -> list[str]:
        argv = list(self.argv)
        if self.daemon and self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        if self.daemon:
            argv = ["systemd-run", f"--unit={self.daemon}", "--collect", "--quiet", "--", *argv]
        return argv

    def shell(self) -> str:
        s = shlex.join(self.full_argv())
        if self.input is not None:
            s += " <<'NPTRACE_EOF'"
        if not self.check:
            s += " || true"
        if self.input is not None:
            body = self.input if self.input.endswith("\n") else self.input + "\n"
            s += f"\n{body}NPTRACE_EOF"
        return s

    def ports(self) -> list[int]:
        a = list(self.argv)
        return [int(a[i + 1].split(":", 1)[0]) for i, x in enumerate(a[:-1]) if x == "--listen"]


def in_netns(ns: str, argv) -> list[str]:
    """A command run inside namespace ``ns``, as netns.ns_runner runs it."""
    argv = list(argv)
    if argv[0] == "ip":
        return ["ip", "-n", ns, *argv[1:]]
    return ["ip", "netns", "exec", ns, *argv]


def k8s_view(spec: Spec, host: str) -> Spec:
    """The scenario as the host side of a real cluster sees ``host`` (a node): its lab NICs,
    routes and sysctls only. The CNI owns cni0/flannel.1 and their routes and neighbours,
    kube-proxy its rules and health-check servers, the NetworkPolicy controller the policy."""
    view = copy.copy(spec)
    view.hosts = copy.deepcopy(spec.hosts)
    d = view.hosts[host]
    cni = {n for n, i in d.get("ifaces", {}).items() if i.get("type")}
    d["ifaces"] = {n: i for n, i in d.get("ifaces", {}).items() if n not in cni}
    d["routes"] = [r for r in d.get("routes", []) if not cni & set(r.split())]
    d["neigh"] = [n for n in d.get("neigh", []) if not cni & set(n.split())]
    for k in ("server", "iptables_restore", "nft"):
        d.pop(k, None)
    # host_steps adds pod veth ports, kube-proxy rules and health-check servers to kind
    # "node" only: the view is a plain host.
    d["kind"] = "router"
    return view


def _baseline_file(state_dir: Path) -> Path:
    return state_dir / "sysctl-baseline.json"


def read_baseline(state_dir: Path) -> dict[str, str]:
    try:
        return json.loads(_baseline_file(state_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def reset_cmds(spec: Spec, role: str, nics: dict[str, str], profile: str, prefix: str,
               state_dir: Path) -> list[Cmd]:
    """Undo an earlier apply on this VM; every command may fail harmlessly (nothing to undo)."""
    d = spec.hosts[role]
    node = d["kind"] == "node"
    cluster_owned = profile == "k8s" and node
    out = [["systemctl", "stop", f"{UNIT_PREFIX}*"]]
    if node and not cluster_owned:
        for pod in spec.pods(role):
            out.append(["ip", "netns", "del", f"{prefix}{pod}"])
            out.append(["ip", "link", "del", hostplan.pod_veth(pod)])
        for name, i in d.get("ifaces", {}).items():
            if i.get("type"):
                out.append(["ip", "link", "del", name])
    for lab in d.get("ifaces", {}):
        if lab in nics:
            out.append(["ip", "route", "flush", "dev", nics[lab]])
            out.append(["ip", "addr", "flush", "dev", nics[lab]])
            out.append(["ethtool", "-K", nics[lab], "tx", "on"])   # an `offload` a scenario turned off
    if not cluster_owned:
        # iptables-nft's tables are nft tables: one flush covers both.
        out.append(["nft", "flush", "ruleset"])
        for table in ("filter", "nat", "mangle", "raw"):
            out.append(["iptables-legacy", "-w", "-t", table, "-F"])
            out.append(["iptables-legacy", "-w", "-t", table, "-X"])
    baseline = read_baseline(state_dir)
    if baseline:
        out.append(["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in sorted(baseline.items()))])
    if not cluster_owned:
        out.append(["conntrack", "-F"])
    return [Cmd("reset", tuple(a), check=False) for a in out]


def prepare_cmds(spec: Spec, role: str, nics: dict[str, str], profile: str, prefix: str) -> list[Cmd]:
    d = spec.hosts[role]
    real = [nics[n] for n in d.get("ifaces", {}) if n in nics]
    off = 0 if spec.ipv6 else 1     # the dual-stack form (variant ipv6) needs IPv6 on
    keys = ["net.ipv4.conf.default.rp_filter=0", f"net.ipv6.conf.default.disable_ipv6={off}"]
    for r in real:
        keys += [f"net.ipv4.conf.{r}.rp_filter=0", f"net.ipv6.conf.{r}.disable_ipv6={off}"]
    out = [Cmd("prepare", ("sysctl", "-q", "-w", *keys))]
    if d["kind"] == "node" and profile == "netns":
        for pod in spec.pods(role):
            ns = f"{prefix}{pod}"
            out += [Cmd("prepare", ("ip", "netns", "add", ns)),
                    Cmd("prepare", ("ip", "-n", ns, "link", "set", "lo", "up")),
                    Cmd("prepare", ("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                                    f"net.ipv6.conf.all.disable_ipv6={off}",
                                    f"net.ipv6.conf.default.disable_ipv6={off}",
                                    "net.ipv4.conf.default.rp_filter=0", "net.ipv4.conf.all.rp_filter=0")),
                    Cmd("prepare", ("ip", "link", "add", hostplan.pod_veth(pod), "type", "veth",
                                    "peer", "name", "eth0", "netns", ns))]
    return out


def drive(spec: Spec, role: str, backend: str, nics: dict[str, str], emit: Callable[[Cmd], None], *,
          profile: str = "netns", prefix: str = "npt-", state_dir: Path = STATE_DIR) -> None:
    """Every command of ``role``, in order, handed to ``emit`` (which runs or records it).

    The scenario's own commands come from ``hostplan.apply_role`` for the VM's host and,
    on a node in the netns profile, for each of its pods inside the pod's namespace."""
    if profile not in PROFILES:
        raise UsageError(f"profile must be one of {', '.join(PROFILES)}")
    for c in reset_cmds(spec, role, nics, profile, prefix, state_dir):
        emit(c)
    for c in prepare_cmds(spec, role, nics, profile, prefix):
        emit(c)

    node = spec.hosts[role]["kind"] == "node"
    host_spec = k8s_view(spec, role) if profile == "k8s" and node else spec

    def run(argv, input=None):
        for a in expand_default_route(argv, host_spec, role):
            emit(Cmd(role, tuple(rename_argv(a, nics)), rename_text(input, nics) if input else input))

    def spawn(argv):
        emit(Cmd(role, tuple(argv), daemon=f"{UNIT_PREFIX}{role}"))

    hostplan.apply_role(host_spec, role, run=run, spawn=spawn, backend=backend)

    if not (node and profile == "netns"):
        return
    gone = []
    for pod in spec.pods(role):
        ns = f"{prefix}{pod}"
        is_gone = bool(spec.hosts[pod].get("gone"))
        if is_gone:
            gone.append((pod, ns))

        def pod_run(argv, input=None, pod=pod, ns=ns):
            emit(Cmd(pod, tuple(in_netns(ns, argv)), input))

        def pod_spawn(argv, pod=pod, ns=ns, is_gone=is_gone):
            # A gone pod was deleted after kube-proxy's last sync: its server never answers.
            if not is_gone:
                emit(Cmd(pod, tuple(argv), daemon=f"{UNIT_PREFIX}{pod}", netns=ns))

        hostplan.apply_role(spec, pod, run=pod_run, spawn=pod_spawn, backend=backend)
    for pod, ns in gone:   # the veth first: the kernel tears a deleted namespace down later
        emit(Cmd("finish", ("ip", "link", "del", hostplan.pod_veth(pod))))
        emit(Cmd("finish", ("ip", "netns", "del", ns)))


def role_commands(spec: Spec, role: str, backend: str, nics: dict[str, str], **kw) -> list[Cmd]:
    """``drive`` recorded: what --dry-run prints and a real apply runs, in order."""
    out: list[Cmd] = []
    drive(spec, role, backend, nics, out.append, **kw)
    return out


# ----------------------------------------------------------------------------- running on this host

def read_marker(path: Path = MARKER) -> dict | None:
    """The provisioner's marker: ``role=NAME`` and ``profile=netns|k8s`` lines."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LabError(f"cannot read {path}: {e.strerror}") from None
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


class HostExecutor:
    """Runs Cmds on this machine; keeps the sysctl baseline; waits for servers to listen."""

    def __init__(self, state_dir: Path = STATE_DIR, timeout: float = 30.0):
        self.state_dir = state_dir
        self.timeout = timeout
        self.systemd = bool(shutil.which("systemd-run")) and Path("/run/systemd/system").is_dir()
        self.daemons = 0

    def __call__(self, c: Cmd) -> None:
        if c.daemon:
            self._spawn(c)
            return
        if c.argv[0] == "sysctl" and c.section not in ("reset", "prepare"):
            self._note_baseline(c.argv)
        try:
            r = subprocess.run(list(c.argv), input=c.input, capture_output=True, text=True, timeout=self.timeout)
        except FileNotFoundError:
            if c.check:
                raise LabError(f"`{c.argv[0]}` is not installed: run `make setup` (scripts/setup.sh) first") from None
            return
        except subprocess.TimeoutExpired:
            raise LabError(f"`{shlex.join(c.argv)}` did not finish in {self.timeout:.0f} s") from None
        if r.returncode != 0 and c.check:
            raise LabError(f"[{c.section}] `{shlex.join(c.argv)}` failed ({r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()[:400]}")

    def _note_baseline(self, argv) -> None:
        """Remember each sysctl's value before a scenario first changes it (for the next reset)."""
        base = read_baseline(self.state_dir)
        changed = False
        for a in argv[1:]:
            if "=" not in a or a.startswith("-"):
                continue
            key = a.split("=", 1)[0]
            if key in base:
                continue
            p = Path("/proc/sys") / key.replace(".", "/")
            try:
                base[key] = p.read_text().strip().replace("\t", " ")
                changed = True
            except OSError:
                pass
        if changed:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            tmp = _baseline_file(self.state_dir).with_suffix(".tmp")
            tmp.write_text(json.dumps(base, indent=1, sort_keys=True) + "\n")
            tmp.replace(_baseline_file(self.state_dir))

    def _spawn(self, c: Cmd) -> None:
        if self.systemd:
            argv = c.full_argv()
            r = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout)
            if r.returncode != 0:
                raise LabError(f"`{shlex.join(argv)}` failed: {(r.stderr or r.stdout).strip()[:400]}")
        else:
            argv = ["ip", "netns", "exec", c.netns, *c.argv] if c.netns else list(c.argv)
            logs = self.state_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            with (logs / f"{c.daemon}.log").open("ab") as f:
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)
            (self.state_dir / f"{c.daemon}.pid").write_text(f"{p.pid}\n")
        self._wait_listening(c)
        self.daemons += 1

    def _wait_listening(self, c: Cmd, timeout: float = 10.0) -> None:
        want = set(c.ports())
        ss = ["ss", "-Hltn"] if not c.netns else ["ip", "netns", "exec", c.netns, "ss", "-Hltn"]
        deadline = time.monotonic() + timeout
        while True:
            r = subprocess.run(ss, capture_output=True, text=True)
            have = {int(f.rsplit(":", 1)[1]) for line in r.stdout.splitlines()
                    for f in line.split()[3:4] if ":" in f and f.rsplit(":", 1)[1].isdigit()}
            if want <= have:
                return
            if time.monotonic() > deadline:
                where = f" in {c.netns}" if c.netns else ""
                raise LabError(f"lab server {c.daemon}{where} does not listen on {sorted(want - have)} after "
                               f"{timeout:.0f} s; see `journalctl -u {c.daemon}`")
            time.sleep(0.1)


def kill_fallback_daemons(state_dir: Path) -> None:
    """Servers started without systemd (pid files): stop them, if they are still ours."""
    for pidfile in sorted(state_dir.glob(f"{UNIT_PREFIX}*.pid")):
        try:
            pid = int(pidfile.read_text())
            if hostplan.SERVER.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, 15)
        except (OSError, ValueError):
            pass
        pidfile.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- commands

def _call(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except UsageError as e:
        raise click.UsageError(str(e)) from None
    except LabError as e:
        raise click.ClickException(str(e)) from None


def _context(role, profile, nic_pairs, plan_path=None, net_dir=Path("/sys/class/net"), marker_path=None):
    marker = read_marker(marker_path or MARKER)
    role = role or (marker or {}).get("role")
    if not role:
        raise UsageError(f"give --role (client, mbox, node1, node2): there is no {marker_path or MARKER} "
                         f"telling this machine's role")
    profile = profile or (marker or {}).get("profile") or "netns"
    if profile not in PROFILES:
        raise UsageError(f"profile {profile!r} (from {marker_path or MARKER}) is not one of {', '.join(PROFILES)}")
    plan = load_plan(plan_path or PLAN_FILE)
    vm = plan_vm(plan, role)
    nics, missing = nic_map(vm, read_macs(net_dir), parse_nic_overrides(nic_pairs))
    return marker, role, profile, vm, nics, missing


EPILOG = """\b
Examples (on a lab VM made by the Vagrantfile; the role comes from /etc/nptrace-lab-role):
  nptrace lab apply-role rp-filter-asymmetric --dry-run
  sudo nptrace lab apply-role rp-filter-asymmetric
  sudo nptrace lab apply-role etp-local-no-endpoint --variant reject --backend nft
  nptrace lab apply-role healthy --role node1 --nic eth0=ens6 --nic eth1=ens7 --nic ul0=ens8 --dry-run
Every apply first resets what an earlier one left. Without the marker file it refuses to
change this machine's network unless --force."""


@click.command("apply-role", epilog=EPILOG)
@click.argument("scenario")
@click.option("--role", default=None, help="Lab host this machine plays (default: from /etc/nptrace-lab-role).")
@click.option("--backend", type=click.Choice(BACKENDS), default="iptables", show_default=True,
              help="How the node's kube-proxy rules are loaded (netns profile).")
@click.option("--variant", default=None, help="A variant of the scenario (see `nptrace lab list`).")
@click.option("--profile", type=click.Choice(PROFILES), default=None,
              help="netns: the lab emulates kube-proxy and pods; k8s: a real cluster does "
                   "(default: from the marker file, else netns).")
@click.option("--nic", "nic_pairs", multiple=True, metavar="LAB=REAL",
              help="Map a lab NIC to this machine's interface by hand (default: by the plan's MAC).")
@click.option("--dry-run", is_flag=True, help="Print the commands as a shell script; change nothing.")
@click.option("--force", is_flag=True, help="Run on a machine without the lab marker, or as another role.")
def apply_role_command(scenario, role, backend, variant, profile, nic_pairs, dry_run, force):
    """Apply SCENARIO's share for this VM's role to its real interfaces, firewall and sysctls."""
    _call(_apply_role, scenario, role, backend, variant, profile, nic_pairs, dry_run, force)


def _apply_role(scenario, role, backend, variant, profile, nic_pairs, dry_run, force,
                plan_path=None, net_dir=Path("/sys/class/net"), marker_path=None, state_dir=None,
                executor=None):
    state_dir = state_dir or STATE_DIR
    marker_path = marker_path or MARKER
    spec = model.compile_spec(scenario, variant)
    if backend not in spec.backends:
        raise UsageError(f"scenario {scenario!r} has no {backend} form (backends: {', '.join(spec.backends)})")
    marker, role, profile, vm, nics, missing = _context(role, profile, nic_pairs, plan_path, net_dir, marker_path)
    prefix = resolve_prefix(None)
    if not dry_run:
        if marker is None and not force:
            raise LabError(f"this machine is not an nptrace lab VM (no {marker_path}): apply-role rewrites its "
                           f"interfaces, addresses, routes, firewall and sysctls. Use --dry-run to see the "
                           f"commands, or --force on a machine you can throw away")
        if marker is not None and marker.get("role") != role and not force:
            raise LabError(f"this VM is {marker.get('role')!r} ({marker_path}), not {role!r}; "
                           f"use --force to apply another role here")
        if missing:
            raise LabError(f"lab NIC(s) {', '.join(missing)} of {role} not found on this machine (MACs "
                           f"{', '.join(n['mac'] for n in vm['nics'] if n['lab'] in missing)}); give them with "
                           f"--nic LAB=REAL")
        if os.geteuid() != 0:
            raise LabError("apply-role changes interfaces, routes and the firewall: run it as root (sudo)")
    cmds = role_commands(spec, role, backend, nics, profile=profile, prefix=prefix, state_dir=state_dir)
    title = scenario + (f" --variant {variant}" if variant else "")
    if dry_run:
        click.echo(f"# nptrace lab apply-role {title} --role {role} --backend {backend} (profile {profile})")
        click.echo("# lab NIC -> this machine: " + ", ".join(
            f"{n['lab']}={nics.get(n['lab'], n['lab'] + '?')} ({n['network']}, {n['mac']})" for n in vm["nics"]))
        for lab in missing:
            click.echo(f"# {lab}: no interface with this MAC here; shown under its lab name")
        section = None
        for c in cmds:
            if c.section != section:
                section = c.section
                click.echo(f"# --- {section}")
            click.echo(c.shell())
        return
    ex = executor or HostExecutor(state_dir)
    if not getattr(ex, "systemd", True):
        kill_fallback_daemons(state_dir)
    for c in cmds:
        ex(c)
    _write_applied(state_dir, scenario, variant, backend, role, profile)
    watch = spec.hosts[role].get("watch", [])
    real_watch = [nics.get(w, w) for w in watch]
    click.echo(f"{role}: {title} applied (profile {profile}, backend {backend}): "
               f"{sum(1 for c in cmds if c.section not in ('reset',) and not c.daemon)} commands, "
               f"{sum(1 for c in cmds if c.daemon)} server(s)")
    click.echo("  NICs: " + " ".join(f"{k}={v}" for k, v in nics.items()))
    click.echo(f"  story: {spec.story}")
    click.echo(f"  expected cause: {spec.cause or 'none'}")
    if real_watch:
        click.echo("  trace here: sudo nptrace run " + " ".join(f"--iface {w}" for w in real_watch))


def _write_applied(state_dir: Path, scenario, variant, backend, role, profile) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "applied.json").write_text(json.dumps(
        {"scenario": scenario, "variant": variant, "backend": backend, "role": role, "profile": profile,
         "time": time.time()}) + "\n")


@click.command("vm-nics")
@click.option("--role", default=None, help="Default: from /etc/nptrace-lab-role.")
@click.option("--lab", "lab_name", default=None, help="Print only this lab NIC's real name (for scripts).")
@click.option("--json", "as_json", is_flag=True)
def nics_command(role, lab_name, as_json):
    """Which interface of this machine each lab NIC of the role is (found by MAC)."""
    _call(_nics, role, lab_name, as_json)


def _nics(role, lab_name, as_json, plan_path=None, net_dir=Path("/sys/class/net"), marker_path=None):
    _, role, _, vm, nics, missing = _context(role, None, (), plan_path, net_dir, marker_path)
    if lab_name:
        if lab_name not in {n["lab"] for n in vm["nics"]}:
            raise UsageError(f"{role} has no lab NIC {lab_name!r} ({', '.join(n['lab'] for n in vm['nics'])})")
        if lab_name in missing:
            raise LabError(f"no interface of this machine has {role}'s {lab_name} MAC "
                           f"{next(n['mac'] for n in vm['nics'] if n['lab'] == lab_name)}")
        click.echo(nics[lab_name])
        return
    rows = [{"lab": n["lab"], "real": nics.get(n["lab"]), "network": n["network"], "mac": n["mac"],
             "addrs": n["addrs"]} for n in vm["nics"]]
    if as_json:
        click.echo(json.dumps({"role": role, "nics": rows}))
        return
    for r in rows:
        click.echo(f"{r['lab']:6} {r['real'] or '(missing)':10} {r['network']:6} {r['mac']}  {' '.join(r['addrs'])}")


@click.command("vm-trigger")
@click.argument("scenario")
@click.option("--variant", default=None)
@click.option("--count", default=50, show_default=True, type=click.IntRange(1, 2000),
              help="Connections to make at once.")
@click.option("--role", default=None, help="Default: from /etc/nptrace-lab-role.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per attempt.")
def vm_trigger_command(scenario, variant, count, role, as_json):
    """Make the scenario's client connections from this VM and report what each saw."""
    _call(_vm_trigger, scenario, variant, count, role, as_json)


def _probe_here(targets: list[dict], timeout: float) -> list[dict]:
    probe = str(Path(hostplan.__file__).with_name("probe.py"))
    p = subprocess.run([sys.executable, probe], input=json.dumps({"targets": targets}),
                       capture_output=True, text=True, timeout=timeout + 30)
    if p.returncode != 0:
        raise LabError(f"probe failed: {p.stderr.strip()[-400:]}")
    return json.loads(p.stdout)


def _vm_trigger(scenario, variant, count, role, as_json, marker_path=None, probe=_probe_here):
    spec = model.compile_spec(scenario, variant)
    role = role or (read_marker(marker_path or MARKER) or {}).get("role")
    if not role:
        raise UsageError("give --role: there is no marker file telling this machine's role")
    entries = [t for t in spec.trigger if t["from"] == role]
    if not entries:
        hosts = sorted({t["from"] for t in spec.trigger})
        raise UsageError(f"scenario {scenario!r} connects from {', '.join(hosts)}, not from {role}")
    per = [count // len(entries) + (1 if i < count % len(entries) else 0) for i in range(len(entries))]
    targets = [{"src": t.get("src"), "dst": t["dst"], "port": t["port"], "count": n,
                "timeout": t.get("timeout", 2.0), "payload": t.get("payload", "hello\n")}
               for t, n in zip(entries, per) if n]
    results = probe(targets, max(t["timeout"] for t in targets))
    rows, i = [], 0
    for t, target in zip([t for t, n in zip(entries, per) if n], targets):
        for r in results[i:i + target["count"]]:
            rows.append({**r, "expected": r["outcome"] in t["expect"]})
        i += target["count"]
    if as_json:
        for r in rows:
            click.echo(json.dumps(r))
        return
    from collections import Counter
    by = Counter((r["dst"], r["dport"], r["outcome"], r["error"]) for r in rows)
    for (dst, dport, outcome, error), n in sorted(by.items()):
        click.echo(f"{n:5}  {dst}:{dport}  {outcome:11} {error}")
    click.echo(f"{sum(r['expected'] for r in rows)}/{len(rows)} attempts showed the expected symptom "
               f"({'/'.join(dict.fromkeys(o for t in entries for o in t['expect']))})")
    for v in [v for v in spec.lb_view if v["from"] == role]:
        target = {"dst": v["dst"], "port": v["port"], "count": 1, "timeout": 2.0, "read_all": True,
                  "payload": f"GET /healthz HTTP/1.1\r\nHost: {v['dst']}\r\n\r\n"}
        r = probe([target], 2.0)[0]
        text = r.get("body") or r["reply"]
        line = text.split("\r\n", 1)[0]
        code = int(line.split()[1]) if line.startswith("HTTP/") and len(line.split()) > 1 else 0
        body = text.split("\r\n\r\n", 1)[1] if "\r\n\r\n" in text else ""
        click.echo(f"health check {v['dst']}:{v['port']} -> HTTP {code} (expect {v['status']}) {' '.join(body.split())}")


@click.command("vagrant-json")
def vagrant_json_command():
    """Print the VM/NIC/address plan the Vagrantfile reads (vagrant/plan.json)."""
    click.echo(render_plan(), nl=False)


@click.group()
def main_group():
    """The Vagrant lab: VM plan, and applying a scenario role on a lab VM."""


for _cmd in (vagrant_json_command, apply_role_command, nics_command, vm_trigger_command):
    main_group.add_command(_cmd)


def main(argv=None):
    """One line on stderr for every expected failure, as `nptrace` itself does."""
    try:
        main_group.main(args=argv, prog_name="python3 -m nptrace.lab.vm", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"nptrace: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code or 2)
    except LabError as e:
        click.echo(f"nptrace: error: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
