"""How the lab makes hosts out of network namespaces: create, wire, run inside, tear down.

Every namespace is ``<prefix><host>`` (plus ``<prefix>sw`` holding the bridges of networks
with more than two members). Veths are created with both ends directly inside namespaces
(``ip link add A netns X type veth peer name B netns Y``), so the root namespace never
sees an interface, a route or a rule of the lab. Processes in a namespace keep it alive
after ``ip netns del``, so teardown kills what ``ip netns pids`` lists first.

State (scenario, backend, namespaces, server pids) is kept in /run/nptrace/lab/ so that
up, trigger and down can run from separate processes.

A few sysctls a scenario gives a host are host-wide on one kernel (HOST_WIDE): they are set
in the root namespace, with the value they had kept in the state and put back by teardown
(also after a failed up, a Ctrl-C, or `lab down --all` after a crash).
"""
from __future__ import annotations

import functools
import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

from .errors import HostBusy, LabError, NotRoot, UsageError
from .hostplan import SERVER, pod_veth
from .model import Spec

STATE_DIR = Path(os.environ.get("NPT_LAB_STATE_DIR", "/run/nptrace/lab"))
DEFAULT_PREFIX = "npt-"
SWITCH = "sw"


def resolve_prefix(prefix: str | None) -> str:
    p = prefix if prefix is not None else os.environ.get("NPT_LAB_PREFIX", DEFAULT_PREFIX)
    if not p or "/" in p or not p.startswith("npt-"):
        raise UsageError(f"lab prefix {p!r} must start with 'npt-' and contain no '/'")
    return p


def require_root() -> None:
    if os.geteuid() != 0:
        raise NotRoot("the lab needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to create network namespaces; "
                      "run it with sudo")


def sh(argv, input=None, check=True, timeout=30) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        cmd = " ".join(argv)
        raise LabError(f"`{cmd}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()[:500]}")
    return r


# ----------------------------------------------------------------------------- state

def state_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}state.json"


def load_state(prefix: str) -> dict | None:
    try:
        return json.loads(state_path(prefix).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def save_state(prefix: str, state: dict) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = state_path(prefix).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(state_path(prefix))


def drop_state(prefix: str) -> None:
    state_path(prefix).unlink(missing_ok=True)


def log_dir(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}logs"


# ----------------------------------------------------------------------------- namespaces

def existing_namespaces() -> set[str]:
    r = sh(["ip", "-json", "netns", "list"], check=False)
    if r.returncode != 0 or not r.stdout.strip():
        return set()
    return {e["name"] for e in json.loads(r.stdout)}


def lab_namespaces(spec: Spec, prefix: str) -> dict[str, str]:
    """host -> namespace name, including the switch namespace when a network needs a bridge."""
    out = {h: f"{prefix}{h}" for h in spec.hosts}
    if any(len(m) > 2 for m in spec.networks.values()):
        out[SWITCH] = f"{prefix}{SWITCH}"
    return out


def make_namespaces(names, ipv6: bool = False) -> None:
    """Each namespace with lo up; IPv6 off unless the scenario is dual-stack (``ipv6``)."""
    if ipv6:   # on, but quiet: no router solicitations, RAs or DAD (addresses are nodad anyway)
        six = [f"net.ipv6.conf.{c}.{k}={v}" for c in ("all", "default")
               for k, v in (("disable_ipv6", 0), ("accept_ra", 0), ("router_solicitations", 0),
                            ("accept_dad", 0), ("dad_transmits", 0))]
    else:
        six = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
    for ns in names:
        sh(["ip", "netns", "add", ns])
        sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        # Quiet and deterministic: no IPv6 chatter (RS/MLD) in traces, and per-interface
        # rp_filter 0 on every interface created later, so conf.all alone sets the mode.
        sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *six,
            "net.ipv4.conf.default.rp_filter=0", "net.ipv4.conf.all.rp_filter=0"])


def wire(spec: Spec, ns: dict[str, str]) -> None:
    """Create the links between hosts: veth pairs, switch bridges, pod veths."""
    batch, sw_batch = [], []
    for net, members in spec.networks.items():
        ends = [m.split(":", 1) for m in members]
        if len(ends) == 2:
            (ha, ia), (hb, ib) = ends
            batch.append(f"link add {ia} netns {ns[ha]} type veth peer name {ib} netns {ns[hb]}")
            continue
        sw = ns[SWITCH]
        br = f"br-{net}"[:15]
        sh(["ip", "-n", sw, "link", "add", br, "type", "bridge"])
        sh(["ip", "-n", sw, "link", "set", br, "up"])
        for host, ifname in ends:
            port = f"{net}-{host}"[:15]
            batch.append(f"link add {ifname} netns {ns[host]} type veth peer name {port} netns {sw}")
            sw_batch.append(f"link set {port} master {br}")
            sw_batch.append(f"link set {port} up")
    for pod in spec.pods():
        node = spec.hosts[pod]["node"]
        batch.append(f"link add {pod_veth(pod)} netns {ns[node]} type veth peer name eth0 netns {ns[pod]}")
    sh(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
    if sw_batch:
        sh(["ip", "-n", ns[SWITCH], "-batch", "-"], input="\n".join(sw_batch) + "\n")


def ns_runner(netns: str):
    """run(argv, input) on the host that namespace ``netns`` stands for; ip commands are batched."""
    def run(argv, input=None):
        if argv[0] == "ip":
            return sh(["ip", "-n", netns, *argv[1:]], input=input)
        return sh(["ip", "netns", "exec", netns, *argv], input=input)
    return run


def run_batched(netns: str, steps) -> list:
    """Run a host's steps; consecutive ``ip`` commands go through one ``ip -batch``."""
    from .hostplan import Step  # local: avoid a cycle at import time
    run = ns_runner(netns)
    pending: list[str] = []
    daemons = []

    def flush():
        if pending:
            sh(["ip", "-n", netns, "-batch", "-"], input="\n".join(pending) + "\n")
            pending.clear()

    for step in steps:
        assert isinstance(step, Step)
        if step.kind == "run" and step.argv[0] == "ip" and step.input is None:
            pending.append(" ".join(step.argv[1:]))
            continue
        flush()
        if step.kind == "daemon":
            daemons.append(list(step.argv))
        else:
            run(list(step.argv), step.input)
    flush()
    return daemons


# ----------------------------------------------------------------------------- processes

def spawn(netns: str, argv, log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as err:
        return subprocess.Popen(["ip", "netns", "exec", netns, *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err, start_new_session=True)


# How long a lab server may take to start: well under a second here, far more in a guest under
# TCG whose root is a 9p share (the kernel matrix, nptrace/lab/kernels.py, sets it higher).
SERVER_TIMEOUT = float(os.environ.get("NPT_LAB_SERVER_TIMEOUT", "10"))


def wait_ready(procs: list[subprocess.Popen], timeout: float | None = None) -> None:
    """Each server prints "ready" once all its sockets listen."""
    deadline = time.monotonic() + (SERVER_TIMEOUT if timeout is None else timeout)
    for p in procs:
        left = deadline - time.monotonic()
        r, _, _ = select.select([p.stdout], [], [], max(left, 0))
        line = p.stdout.readline() if r else b""
        p.stdout.close()
        if line.strip() != b"ready":
            raise LabError(f"lab server {' '.join(p.args[3:6])} did not start (exit {p.poll()}); "
                           f"see the logs under {STATE_DIR}")


def _is_lab_process(pid: int) -> bool:
    try:
        return SERVER.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def kill(pids, grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL to whatever still runs ``grace`` seconds later (children reaped)."""
    pids = [p for p in pids if p != os.getpid()]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(p, 0)
            except ProcessLookupError:
                break
            try:  # reap our own children
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.02)
        else:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def ns_pids(netns: str) -> list[int]:
    r = sh(["ip", "netns", "pids", netns], check=False)
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []


def delete_namespaces(names, recorded_pids=()) -> None:
    """Kill every process inside the namespaces (only ours live there) and delete them."""
    present = existing_namespaces()
    pids = [p for p in recorded_pids if _is_lab_process(p)]
    for ns in names:
        if ns in present:
            pids += ns_pids(ns)
    kill(sorted(set(pids)))
    for ns in names:
        if ns in present:
            sh(["ip", "netns", "del", ns], check=False)


# ----------------------------------------------------------------------------- host-wide sysctls

# Read-only in a child namespace (nf_conntrack_standalone.c: "Don't allow non-init_net ns to
# alter global sysctls", mode 0444; 0444 measured on 6.18), while __nf_conntrack_alloc checks
# each namespace's own count against the one nf_conntrack_max.
HOST_WIDE = ("net.netfilter.nf_conntrack_max", "net.netfilter.nf_conntrack_expect_max",
             "net.netfilter.nf_conntrack_buckets")
PROC_SYS = Path("/proc/sys")
CT_COUNT = "net/netfilter/nf_conntrack_count"


# Per-namespace on the kernels this project is built on, global on older ones (5.10): there a
# namespace has no such file and the root namespace's limits apply (ICMP's: burst 50, 1000/s,
# enough for a scenario's trigger), so the lab leaves them out rather than fail.
LATE_NAMESPACED = ("net.ipv4.icmp_msgs_burst", "net.ipv4.icmp_msgs_per_sec")


@functools.cache
def namespaced(key: str) -> bool:
    """Whether a new network namespace has sysctl `key` (one `unshare --net` per key; True
    where that cannot be tried: without root the lab only plans)."""
    if os.geteuid() != 0:
        return True
    r = subprocess.run(["unshare", "--net", "test", "-e", str(_sysctl_path(key))],
                       capture_output=True)
    return r.returncode == 0


def split_host_wide(steps) -> tuple[list, dict[str, str]]:
    """(the host's steps without host-wide sysctls, {key: value} of those); LATE_NAMESPACED
    keys this kernel does not have per namespace are left out."""
    from .hostplan import Step
    out, wide = [], {}
    for st in steps:
        if st.argv[0] == "sysctl":
            args = [a for a in st.argv if a.partition("=")[0] in HOST_WIDE]
            wide.update(a.split("=", 1) for a in args)
            args += [a for a in st.argv if a.partition("=")[0] in LATE_NAMESPACED
                     and not namespaced(a.partition("=")[0])]
            keep = [a for a in st.argv if a not in args]
            if len(args) and not any("=" in a for a in keep):
                continue
            st = Step(st.kind, tuple(keep), st.input)
        out.append(st)
    return out, wide


def _sysctl_path(key: str) -> Path:
    return PROC_SYS / key.replace(".", "/")


def _ct_counts(skip: set[str]) -> dict[str, int]:
    """nf_conntrack_count of the root namespace and of every named one not in ``skip``."""
    out = {}
    try:
        out["the root namespace"] = int((PROC_SYS / CT_COUNT).read_text())
    except (OSError, ValueError):
        pass
    for ns in sorted(existing_namespaces() - skip):
        r = sh(["ip", "netns", "exec", ns, "cat", str(PROC_SYS / CT_COUNT)], check=False)
        if r.returncode == 0 and r.stdout.strip().isdigit():
            out[ns] = int(r.stdout)
    return out


def other_holder(prefix: str) -> str | None:
    """The prefix of another lab that holds a host-wide sysctl changed, if any."""
    for p in sorted(STATE_DIR.glob("*state.json")) if STATE_DIR.is_dir() else ():
        other = p.name[:-len("state.json")]
        st = load_state(other)
        if other != prefix and st and st.get("host_wide"):
            return f"{st['scenario']} (prefix {other!r})"
    return None


def set_host_wide(values: dict[str, str], state: dict, own: set[str]) -> None:
    """Set the host-wide sysctls, the old values saved in ``state`` first. A limit
    (nf_conntrack_max) is refused while a namespace outside the lab (``own``) holds more
    than half of it: lowering it would drop that namespace's new connections."""
    if not values:
        return
    holder = other_holder(state["prefix"])
    if holder:
        raise HostBusy(f"lab {holder} holds host-wide sysctls changed; take it down first")
    limit = values.get("net.netfilter.nf_conntrack_max")
    if limit is not None:
        busy = {ns: n for ns, n in _ct_counts(own).items() if n > int(limit) // 2}
        if busy:
            raise HostBusy("scenario lowers the host-wide nf_conntrack_max to " + limit + ", but "
                           + ", ".join(f"{ns} holds {n} conntrack entries" for ns, n in busy.items())
                           + ": its new connections would be dropped too; run it where the table is quieter")
    saved = state.setdefault("host_wide", {})
    for k, v in values.items():
        path = _sysctl_path(k)
        saved.setdefault(k, path.read_text().strip())
        save_state(state["prefix"], state)   # before the change: teardown must find it
        path.write_text(str(v))


def restore_host_wide(state: dict) -> None:
    """Put back what set_host_wide changed (no-op when nothing was)."""
    for k, v in (state.get("host_wide") or {}).items():
        try:
            _sysctl_path(k).write_text(v)
        except OSError as e:
            raise LabError(f"cannot restore {k}={v}: {e.strerror}; set it by hand "
                           f"(sysctl -w {k}={v})") from None
    state["host_wide"] = {}
