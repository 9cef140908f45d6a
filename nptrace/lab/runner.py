"""The one runner of the repro lab: bring a scenario up, trigger it, tear it down."""
from __future__ import annotations

import json
import shutil
import subprocess
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import model, netns
from .errors import HostBusy, LabError, NotRunnable, NotUp, UsageError
from . import ipvsrules
from .real import lab as real_lab
from .hostplan import host_steps, kube_proxy_steps, node_ips, pod_veth
from nptrace.services import ipvs as ipvs_names
from .model import BACKENDS, Spec

PROBE = str(Path(__file__).with_name("probe.py"))
_TOOLS = {"iptables": "iptables-restore", "iptables-legacy": "iptables-legacy-restore", "nft": "nft",
          "ipvs": "ipvsadm"}
NO_IPVS = "not runnable here: no IPVS (ip_vs module)"
# Order hosts are configured in: the fabric first, then nodes, then what hangs off them.
_KIND_ORDER = {"router": 0, "node": 1, "pod": 2, "client": 3}


@dataclass(frozen=True)
class Attempt:
    src: str
    sport: int
    dst: str
    dport: int
    outcome: str        # ok | refused | reset | timeout | unreachable | closed | error
    error: str          # errno name or short text, "" when ok
    elapsed: float      # seconds from connect() to the outcome
    phase: str = ""     # "connect" or "reply": where the attempt ended
    reply: str = ""     # first line the server sent, e.g. "ok web-1 peer=10.244.0.0:41234"
    expected: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class LabInfo:
    scenario: str
    variant: str | None
    backend: str
    prefix: str
    story: str
    cause: str | None
    service: str
    namespaces: dict[str, str]              # host -> netns name
    watch: list[str]                        # "NETNS/IFNAME" of node interfaces to trace
    nodes: dict[str, list[str]]             # node -> addresses (CIDR) per interface "ifname addr"
    client: dict[str, list[str]]            # client interface -> addresses
    enter: list[str] = field(default_factory=list)   # shell commands to get a shell in each host
    try_: list[str] = field(default_factory=list)    # what to try next
    notes: str = ""
    env: dict = field(default_factory=dict)          # a tracer's environment (the real tier's API)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["try"] = d.pop("try_")
        return d


def _check_tools(backend: str, spec: Spec | None = None) -> None:
    need = ("ip", "sysctl", _TOOLS[backend]) + (("ipset", "iptables-restore") if backend == "ipvs" else ())
    missing = [t for t in need if not shutil.which(t)]
    if missing:
        raise LabError(f"missing tool(s) {', '.join(missing)}: install iproute2, procps, iptables, "
                       f"nftables, ipvsadm and ipset")
    # what the scenario's own host keys run (ethtool for `offload`, conntrack for `conntrack_fill`)
    used = {st.argv[0] for h in (spec.hosts if spec else ()) for st in host_steps(spec, h, backend)
            if st.kind == "run" and not st.argv[0].startswith("/")}
    missing = sorted(t for t in used if not shutil.which(t))
    if missing:
        raise LabError(f"missing tool(s) {', '.join(missing)} this scenario runs: install them "
                       f"(Debian packages of the same names; `make setup` does)")


def _info(spec: Spec, backend: str, prefix: str) -> LabInfo:
    ns = netns.lab_namespaces(spec, prefix)
    gone = {h for h, d in spec.hosts.items() if d.get("gone") or d.get("pending")}   # not there now
    watch = [f"{ns[n]}/{i}" for n in spec.nodes() for i in spec.hosts[n].get("watch", spec.hosts[n]["ifaces"])]
    nodes = {n: [f"{i} {a}" for i, d in spec.hosts[n]["ifaces"].items() for a in d.get("addrs", [])]
             for n in spec.nodes()}
    client = {i: d.get("addrs", []) for i, d in spec.hosts.get("client", {}).get("ifaces", {}).items()}
    enter = [f"ip netns exec {ns[h]} bash" for h in spec.hosts if h not in gone]
    cli = "nptrace lab" + ("" if prefix == netns.DEFAULT_PREFIX else f" --prefix {prefix}")
    try_ = [f"{cli} trigger {spec.name} --count 50"]
    for t in spec.trigger:
        src = f"from {t['src']} " if t.get("src") else ""
        try_.append(f"connect {src}to {t['dst']}:{t['port']} in {ns[t['from']]}: expect {'/'.join(t['expect'])}")
    for v in spec.lb_view:
        try_.append(f"health check {v['dst']}:{v['port']} from {ns[v['from']]}: expect HTTP {v['status']}")
    if spec.nodes():
        first = ns[spec.nodes()[0]]
        if backend == "nft":
            try_.append(f"ip netns exec {first} nft list table ip kube-proxy")
        else:
            binary = "iptables-legacy-save" if backend == "iptables-legacy" else "iptables-save"
            try_.append(f"ip netns exec {first} {binary} -c")
        try_.append(f"ip netns exec {first} conntrack -L")
    try_.append(f"{cli} down {spec.name}")
    return LabInfo(scenario=spec.name, variant=spec.variant, backend=backend, prefix=prefix, story=spec.story,
                   cause=spec.cause, service=spec.service, namespaces={h: ns[h] for h in ns if h not in gone},
                   watch=watch, nodes=nodes, client=client, enter=enter, try_=try_, notes=spec.notes)


def ipvs_available(proc: Path = Path("/proc"), load=None) -> bool:
    """Whether this kernel has IPVS: /proc/net/ip_vs once ip_vs is loaded (``load``: a
    callable that tries to load it, `modprobe ip_vs` by default)."""
    if (proc / "net" / "ip_vs").exists():
        return True
    if load is None:
        def load():
            subprocess.run(["modprobe", "-q", "ip_vs"], capture_output=True, timeout=30)
    try:
        load()
    except (OSError, subprocess.SubprocessError):
        return False
    return (proc / "net" / "ip_vs").exists()


def up(name: str, backend: str | None = None, prefix: str | None = None, variant: str | None = None,
       slot: int = 0, real: bool = False, release: str | None = None) -> LabInfo:
    """Bring scenario ``name`` up with kube-proxy ``backend`` (None: the scenario's first);
    ``slot``: its address plan moved there (slots.py), to be up beside other labs; ``real``:
    a real control plane and kube-proxy (Kubernetes ``release``, k8s/releases) write the rules
    (nptrace/lab/real/) instead of the generated tier."""
    prefix = netns.resolve_prefix(prefix)
    if backend is not None and backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r} (one of {', '.join(BACKENDS)})")
    spec = model.compile_spec(name, variant, slot)
    backend = backend or spec.backends[0]
    if real:
        check_real(spec, backend)
    elif backend not in spec.backends:
        raise UsageError(f"scenario {name!r} has no {backend} form (backends: {', '.join(spec.backends)})")
    netns.require_root()
    if backend == "ipvs" and not ipvs_available():
        raise NotRunnable(NO_IPVS)
    _check_tools(backend, spec)
    st = netns.load_state(prefix)
    if st:
        raise LabError(f"scenario {st['scenario']} is already up under prefix {prefix!r}; "
                       f"run `nptrace lab down {st['scenario']}` first")
    ns = netns.lab_namespaces(spec, prefix)
    pending = {h for h, d in spec.hosts.items() if d.get("pending")}   # appear in a step
    live = {h: n for h, n in ns.items() if h not in pending}
    holder = netns.other_holder(prefix)
    if holder:   # its lowered limits would drop this lab's connections
        raise HostBusy(f"lab {holder} holds host-wide sysctls changed (nf_conntrack_max); "
                       f"take it down before bringing up another")
    leftovers = sorted(set(ns.values()) & netns.existing_namespaces())
    if leftovers:
        raise LabError(f"namespace(s) {', '.join(leftovers)} exist from an earlier run; "
                       f"run `nptrace lab down --all` first")
    state = {"scenario": name, "variant": variant, "slot": slot, "backend": backend, "prefix": prefix,
             "namespaces": sorted(live.values()), "pids": [], "started": time.time(), "real": None}
    netns.save_state(prefix, state)  # before anything exists, so `down` can clean a half-made lab
    try:
        netns.make_namespaces(live.values(), ipv6=spec.ipv6)
        netns.wire(spec, ns)
        procs, wide = [], {}
        for host in sorted(set(spec.hosts) - pending, key=lambda h: _KIND_ORDER[spec.hosts[h]["kind"]]):
            steps, host_wide = netns.split_host_wide(host_steps(spec, host, backend, real))
            wide.update(host_wide)
            for argv in netns.run_batched(ns[host], steps):
                procs.append(netns.spawn(ns[host], argv, netns.log_dir(prefix) / f"{host}.log"))
                state["pids"].append(procs[-1].pid)
        netns.save_state(prefix, state)
        netns.wait_ready(procs)
        # last: the lab's own tables are filled, and nothing of it is left half made
        netns.set_host_wide(wide, state, set(live.values()))
        if real:
            real_lab.up(spec, ns, backend, state, lambda: netns.save_state(prefix, state),
                        netns.log_dir(prefix), release)
        elif backend == "ipvs":
            _write_ipvs_names(spec, ns)
        for pod in [h for h, d in spec.hosts.items() if d.get("gone")]:
            # deleted after kube-proxy last synced. Its veth goes first: a deleted namespace is
            # torn down later by the kernel's cleanup work, and until then it still answers on
            # its address (RST from a dead listener: refused, not the timeout of a gone pod)
            _delete_pod(spec, pod, ns, state)
        netns.save_state(prefix, state)
    except BaseException:
        _teardown(prefix, state)
        raise
    info = _info(spec, backend, prefix)
    info.env = real_lab.kube_env(state)
    if real:
        cfg = real_lab.kubeconfig_path(state)
        info.try_.insert(0, f"KUBECONFIG={cfg} {Path(real_lab.release_bin(state)) / 'kubectl'} get pods,svc,endpointslices -A -o wide")
    return info


REAL_BACKENDS = ("iptables", "nft", "ipvs")


def check_real(spec: Spec, backend: str) -> None:
    """What the real tier runs: kube-proxy's iptables, nftables and IPVS modes, IPv4 (the
    dual-stack forms and the 2,000-Service scale stay on the generated tier)."""
    if backend not in REAL_BACKENDS:
        raise UsageError(f"the real tier runs kube-proxy in {', '.join(REAL_BACKENDS)} mode, not {backend}")
    if (spec.variant or "") not in model.get(spec.name).real:
        forms = [f or "the scenario itself" for f in model.get(spec.name).real]
        raise UsageError(f"scenario {spec.name}" + (f" variant {spec.variant}" if spec.variant else "")
                         + " stays on the generated tier (kube-proxy does not make its fault)"
                         + (f"; the real tier runs: {', '.join(forms)}" if forms else ""))
    if spec.ipv6:
        raise UsageError(f"scenario {spec.name}: the real tier is IPv4 only; its dual-stack form is generated")
    if any(s.namespace == "scale" for s in spec.services):
        raise UsageError(f"scenario {spec.name} variant {spec.variant}: the real tier has no scale form")
    if backend == "ipvs" and not ipvs_available():
        raise NotRunnable(NO_IPVS)


def _write_ipvs_names(spec: Spec, ns: dict, services=None) -> None:
    """What kube-proxy knows and IPVS does not: each node's virtual servers' Service names,
    where nptrace's rules source reads them (services/ipvs.py names_path)."""
    for node in spec.nodes():
        path = ipvs_names.names_path(ns[node])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(ipvsrules.service_names(spec.services if services is None else services, node,
                                                node_ips(spec, node)))


def _drop_ipvs_names(namespaces) -> None:
    for n in namespaces:
        ipvs_names.names_path(n).unlink(missing_ok=True)


def _ipvs_rules_step(spec: Spec, st: dict, ns: dict, before: list) -> None:
    """kube-proxy's next IPVS sync: the ipsets refilled, the real servers that left deleted
    and new ones added (ipvsadm -d/-a; the connection entries bound to a deleted one stay),
    the addresses of new Services bound; the iptables rules do not depend on Services."""
    after = st["compiled"]
    for node in spec.nodes():
        run = netns.ns_runner(ns[node])
        run(["ipset", "-exist", "restore"], ipvsrules.render_ipset(after, node))
        for a in ipvsrules.bound_addresses(after):
            run(["ip", "addr", "replace", f"{a}/32", "dev", ipvsrules.DUMMY])
        for argv in ipvsrules.sync_commands(before, after, node, node_ips(spec, node)):
            run(argv)
    _write_ipvs_names(spec, ns, after)


def _rules_step(spec: Spec, st: dict, ns: dict, backend: str) -> None:
    """kube-proxy's next sync: every node's rules re-rendered from the changed Services, loaded
    the way kube-proxy loads them (iptables-restore --noflush rewrites every chain it declares;
    nft replaces its table in one transaction). Conntrack entries are left alone, as kube-proxy
    leaves TCP entries alone."""
    import dataclasses
    after = dataclasses.replace(spec, services=st["compiled"], services6=st.get("compiled6", spec.services6))
    for node in spec.nodes():
        for step in kube_proxy_steps(after, node, backend):
            if step.argv[0] == "nft":
                fam = "ip6" if step.input.startswith("add table ip6 ") else "ip"
                netns.sh(["ip", "netns", "exec", ns[node], *step.argv],
                         input=f"delete table {fam} kube-proxy\n" + step.input)
            elif step.input is not None:   # the jumps are there already
                saved = netns.sh(["ip", "netns", "exec", ns[node],
                                  step.argv[0].replace("-restore", "-save"), "-t", "nat"])
                netns.sh(["ip", "netns", "exec", ns[node], *step.argv],
                         input=delete_stale_chains(step.input, saved.stdout))


_KUBE_CHAIN = re.compile(r"^:(KUBE-(?:SEP|SVC|EXT|SVL|FW|XLB)-\S+)", re.M)


def delete_stale_chains(restore: str, saved_nat: str) -> str:
    """The restore input with the per-Service and per-endpoint nat chains the node has and the
    new rules no longer declare (a removed endpoint's KUBE-SEP-*) declared and `-X`ed, as
    kube-proxy writes them: --noflush keeps every chain the input does not name."""
    stale = sorted(set(_KUBE_CHAIN.findall(saved_nat)) - set(_KUBE_CHAIN.findall(restore)))
    if not stale:
        return restore
    head, nat, rest = restore.partition("*nat\n")
    if not nat:
        return restore
    body, commit, tail = rest.partition("COMMIT\n")
    # declared (so flushed: nf_tables deletes only empty chains), then deleted
    return (head + nat + "".join(f":{c} - [0:0]\n" for c in stale) + body
            + "".join(f"-X {c}\n" for c in stale) + commit + tail)


def _delete_pod(spec: Spec, pod: str, ns: dict, state: dict) -> None:
    node = spec.hosts[pod]["node"]
    netns.sh(["ip", "-n", ns[node], "link", "del", pod_veth(pod)], check=False)
    netns.delete_namespaces([ns[pod]])
    state["namespaces"] = [n for n in state["namespaces"] if n != ns[pod]]


def _add_pod(spec: Spec, pod: str, ns: dict, backend: str, state: dict) -> None:
    node = spec.hosts[pod]["node"]
    bridge = next(i for i, d in spec.hosts[node]["ifaces"].items() if d.get("type") == "bridge")
    netns.make_namespaces([ns[pod]], ipv6=spec.ipv6)
    state["namespaces"] = sorted({*state["namespaces"], ns[pod]})
    netns.save_state(state["prefix"], state)
    v = pod_veth(pod)
    netns.sh(["ip", "-n", ns[node], "link", "add", v, "type", "veth", "peer", "name", "eth0", "netns", ns[pod]])
    netns.sh(["ip", "-n", ns[node], "link", "set", v, "master", bridge, "up"])
    procs = []
    for argv in netns.run_batched(ns[pod], host_steps(spec, pod, backend)):
        procs.append(netns.spawn(ns[pod], argv, netns.log_dir(state["prefix"]) / f"{pod}.log"))
        state["pids"].append(procs[-1].pid)
    netns.save_state(state["prefix"], state)
    netns.wait_ready(procs)


def run_steps(spec: Spec, state: dict, prefix: str) -> None:
    """Apply the scenario's [[step]] entries to the lab that is up (see model.py)."""
    ns = netns.lab_namespaces(spec, prefix)
    services = spec.services   # what the nodes' rules say now
    real = bool(state.get("real"))
    for i, st in enumerate(spec.steps):
        kind = st["kind"]
        if kind == "rules" and real:   # through the API: kube-proxy re-syncs at its own pace
            real_lab.rules_step(spec, i, services, state)
            services = st["compiled"]
        elif kind == "rules" and state["backend"] == "ipvs":
            _ipvs_rules_step(spec, st, ns, services)
            services = st["compiled"]
        elif kind == "rules":
            _rules_step(spec, st, ns, state["backend"])
        elif kind == "delete_pod":
            _delete_pod(spec, st["host"], ns, state)
            if real:
                real_lab.pod_deleted(spec, st["host"], state)
        elif kind == "add_pod":
            _add_pod(spec, st["host"], ns, state["backend"], state)
            if real:
                real_lab.pod_added(spec, st["host"], state)
        elif kind == "wait":
            time.sleep(float(st["seconds"]))
        elif kind == "run":
            netns.sh(["ip", "netns", "exec", ns[st["host"]], *map(str, st["argv"])])
        netns.save_state(prefix, state)


def _teardown(prefix: str, state: dict) -> None:
    try:
        real_lab.down(state)
        netns.restore_host_wide(state)
        _drop_ipvs_names(state.get("namespaces", []))
    finally:
        netns.delete_namespaces(state.get("namespaces", []), state.get("pids", []))
    netns.drop_state(prefix)
    shutil.rmtree(netns.log_dir(prefix), ignore_errors=True)


def _state_for(name: str, prefix: str) -> dict:
    st = netns.load_state(prefix)
    model.get(name)  # unknown names are a usage error, not "not up"
    if not st:
        raise NotUp(f"scenario {name} is not up under prefix {prefix!r}; run `nptrace lab up {name}` first")
    if st["scenario"] != name:
        raise NotUp(f"scenario {name} is not up under prefix {prefix!r} ({st['scenario']} is)")
    return st


def down(name: str, prefix: str | None = None) -> None:
    prefix = netns.resolve_prefix(prefix)
    netns.require_root()
    _teardown(prefix, _state_for(name, prefix))


def _lab_hosts() -> set[str]:
    """Every host name a scenario or variant of the lab may create, and the switch."""
    hosts = {netns.SWITCH}
    for sc in model.load_scenarios():
        for v in (None, *sc.variants):
            hosts |= set(model.compile_spec(sc.name, v).hosts)
    return hosts


def lab_prefixes(namespaces, hosts, state_names) -> set[str]:
    """The prefixes of the labs present: those with a state file (``state_names``: the files'
    names, PREFIXstate.json), and those a namespace named PREFIX + a lab host shows (the
    longest host that ends it: a crash may have left namespaces without state)."""
    out = {n[:-len("state.json")] for n in state_names
           if n.endswith("state.json") and n.startswith("npt-")}
    by_len = sorted(hosts, key=len, reverse=True)
    for ns in namespaces:
        h = next((h for h in by_len if ns.endswith(h) and len(ns) > len(h)), None)
        if h is not None and ns[:-len(h)].startswith("npt-"):
            out.add(ns[:-len(h)])
    return out


def down_every_prefix() -> dict[str, list[str]]:
    """down_all for every lab prefix found on the node (other users' labs included):
    {prefix: namespaces removed}."""
    netns.require_root()
    states = [f.name for f in netns.STATE_DIR.glob("*state.json")] if netns.STATE_DIR.is_dir() else []
    found = lab_prefixes(netns.existing_namespaces(), _lab_hosts(), states)
    return {p: down_all(prefix=p) for p in sorted(found)}


def down_all(prefix: str | None = None) -> list[str]:
    """Remove every lab namespace of ``prefix`` (also after a crash); returns the ones removed.
    Labs under other prefixes (another user's, a test's) are left alone: down_every_prefix
    removes those too."""
    prefix = netns.resolve_prefix(prefix)
    netns.require_root()
    st = netns.load_state(prefix) or {}
    hosts = _lab_hosts()
    names = {f"{prefix}{h}" for h in hosts} | set(st.get("namespaces", []))
    present = sorted(names & netns.existing_namespaces())
    try:
        real_lab.down(st)
        netns.restore_host_wide(st)
        _drop_ipvs_names(names)
    finally:
        netns.delete_namespaces(present, st.get("pids", []))
    netns.drop_state(prefix)
    shutil.rmtree(netns.log_dir(prefix), ignore_errors=True)
    return present


def status(prefix: str | None = None) -> dict | None:
    """The state of the lab under ``prefix`` (None when nothing is up), with live namespaces."""
    prefix = netns.resolve_prefix(prefix)
    st = netns.load_state(prefix)
    if st is None:
        return None
    present = netns.existing_namespaces()
    st["missing"] = [n for n in st["namespaces"] if n not in present]
    st["servers_alive"] = sum(1 for p in st["pids"] if Path(f"/proc/{p}").exists())
    return st


def _run_probe(netns_name: str, targets: list[dict], timeout: float) -> list[dict]:
    p = subprocess.run(["ip", "netns", "exec", netns_name, sys.executable, PROBE],
                       input=json.dumps({"targets": targets}), capture_output=True, text=True,
                       timeout=timeout + 30)
    if p.returncode != 0:
        raise LabError(f"probe in {netns_name} failed: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout)


def _run_probe_held(netns_name: str, targets: list[dict], timeout: float, between) -> list[dict]:
    """The probe with held connections: ``between()`` runs once they are all established."""
    p = subprocess.Popen(["ip", "netns", "exec", netns_name, sys.executable, PROBE], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        p.stdin.write(json.dumps({"targets": targets}) + "\n")
        p.stdin.flush()
        line = p.stdout.readline()
        if not line.startswith("{\"held\""):
            raise LabError(f"probe in {netns_name} failed: {p.stderr.read().strip()[-500:]}")
        between()
        p.stdin.write("go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=timeout + 30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    if p.returncode != 0:
        raise LabError(f"probe in {netns_name} failed: {err.strip()[-500:]}")
    return json.loads(out)


def trigger(name: str, count: int = 50, prefix: str | None = None,
            after_steps=None) -> list[Attempt]:
    """Make ``count`` real connections (spread over the scenario's trigger entries) at once.
    A scenario with steps runs them while the connections are held; `after_steps()`, if
    given, runs after them, before the held connections' second exchange (what the node's
    state is with connections in flight: tests of `nptrace explain`)."""
    if count < 1:
        raise UsageError("count must be at least 1")
    prefix = netns.resolve_prefix(prefix)
    netns.require_root()
    st = _state_for(name, prefix)
    spec = model.compile_spec(name, st.get("variant"), st.get("slot", 0))
    entries = spec.trigger
    per = [count // len(entries) + (1 if i < count % len(entries) else 0) for i in range(len(entries))]
    by_host: dict[str, list[tuple[dict, dict]]] = {}
    for t, n in zip(entries, per):
        if n:
            target = {"src": t.get("src"), "dst": t["dst"], "port": t["port"], "count": n,
                      "timeout": t.get("timeout", 2.0), "payload": t.get("payload", "hello\n"),
                      "then": t.get("then")}
            by_host.setdefault(t["from"], []).append((target, t))
    if spec.steps:
        if st.get("stepped"):
            raise LabError(f"scenario {name} changed the lab in its first trigger (its steps: a rollout); "
                           f"run `nptrace lab down {name}` and `up` again to trigger it again")
        if len(by_host) != 1:
            raise LabError(f"scenario {name}: held connections must all come from one host")
    attempts = []
    for host, pairs in by_host.items():
        ns = f"{prefix}{host}"
        tmax = max(p[0]["timeout"] + (p[0]["then"] or {}).get("timeout", 0) for p in pairs)
        if spec.steps:
            def between():
                st["stepped"] = True
                run_steps(spec, st, prefix)
                if after_steps is not None:
                    after_steps()
            results = _run_probe_held(ns, [p[0] for p in pairs], tmax, between)
        else:
            results = _run_probe(ns, [p[0] for p in pairs], tmax)
        i = 0
        for target, t in pairs:
            for r in results[i:i + target["count"]]:
                attempts.append(Attempt(src=r["src"], sport=r["sport"], dst=r["dst"], dport=r["dport"],
                                        outcome=r["outcome"], error=r["error"], elapsed=r["elapsed"],
                                        phase=r["phase"], reply=r["reply"],
                                        expected=r["outcome"] in t["expect"]))
            i += target["count"]
    return attempts


def lb_view(name: str, prefix: str | None = None) -> list[dict]:
    """What a load balancer's health checks see: HTTP status and body per node."""
    prefix = netns.resolve_prefix(prefix)
    netns.require_root()
    st = _state_for(name, prefix)
    spec = model.compile_spec(name, st.get("variant"), st.get("slot", 0))
    out = []
    for v in spec.lb_view:
        target = {"dst": v["dst"], "port": v["port"], "count": 1, "timeout": 2.0, "read_all": True,
                  "payload": f"GET /healthz HTTP/1.1\r\nHost: {v['dst']}\r\n\r\n"}
        r = _run_probe(f"{prefix}{v['from']}", [target], 2.0)[0]
        text = r.get("body") or r["reply"]
        status_line = text.split("\r\n", 1)[0]
        code = int(status_line.split()[1]) if status_line.startswith("HTTP/") else 0
        body = text.split("\r\n\r\n", 1)[1] if "\r\n\r\n" in text else ""
        out.append({"node": v.get("node", v["dst"]), "dst": v["dst"], "port": v["port"], "status": code,
                    "expect": v["status"], "body": body, "outcome": r["outcome"]})
    return out
