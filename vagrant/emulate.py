"""Check the Vagrant lab's in-VM code path without VMs: each VM of vagrant/plan.json becomes a
network namespace whose NICs carry the plan's MACs under VM-like names (eth1, eth2, ...), each
private network a veth pair or a bridge; then the real commands run inside them, as the
provisioner runs them on a VM: `python -m nptrace.lab.vm apply-role SCENARIO --role VM`
(NICs found by MAC, reset, apply, pods and servers) and `vm-trigger` on the client.

    sudo .venv/bin/python vagrant/emulate.py                  # every scenario and variant
    sudo .venv/bin/python vagrant/emulate.py healthy no-listener etp-local-no-endpoint:reject:nft

Arguments are SCENARIO[:VARIANT[:BACKEND]]. The scenarios are applied one after another on the
same namespaces, so each apply also exercises the reset of the one before. Exit status 1 if a
scenario's connections do not show its expected symptom. Each VM also gets a stand-in for
Vagrant's management NIC (eth0, a veth to nowhere holding the default route). What this cannot show:
the providers' networks, systemd units (servers start without systemd here), kernels other
than this one, and sysctls that are host-wide on one kernel (conntrack-table-full's
nf_conntrack_max is read-only in a namespace: that case is reported as not emulated).

Namespaces are named npt-vmx-*; all are deleted at the end, also after a failure.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFIX = "npt-vmx-"


def sh(*argv, check=True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {(r.stderr or r.stdout).strip()[:400]}")
    return r


def make_vms(plan: dict) -> None:
    """One namespace per VM; NIC j of a VM is eth<j>. eth0 stands for Vagrant's management NIC
    (a veth to nowhere holding the default route), so a lab `default via` must not replace it."""
    nic = {}
    switch = PREFIX + "sw"
    sh("ip", "netns", "add", switch)
    for v in plan["vms"]:
        ns = PREFIX + v["name"]
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"m-{v['name']}"[:15],
           "netns", switch)
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "addr", "add", "10.0.2.15/24", "dev", "eth0")
        sh("ip", "-n", ns, "route", "add", "default", "via", "10.0.2.2")
        for j, n in enumerate(v["nics"], 1):
            nic[f"{v['name']}:{n['lab']}"] = (ns, f"eth{j}", n["mac"])
    for net, d in plan["networks"].items():
        ends = [nic[m] for m in d["members"]]
        if len(ends) == 2:
            (na, ia, ma), (nb, ib, mb) = ends
            sh("ip", "link", "add", ia, "netns", na, "address", ma, "type", "veth",
               "peer", "name", ib, "netns", nb, "address", mb)
            continue
        br = f"br-{net}"[:15]
        sh("ip", "-n", switch, "link", "add", br, "type", "bridge")
        sh("ip", "-n", switch, "link", "set", br, "up")
        for k, (ns, ifname, mac) in enumerate(ends):
            port = f"p{k}-{net}"[:15]
            sh("ip", "link", "add", ifname, "netns", ns, "address", mac, "type", "veth",
               "peer", "name", port, "netns", switch)
            sh("ip", "-n", switch, "link", "set", port, "master", br)
            sh("ip", "-n", switch, "link", "set", port, "up")


def remove_vms() -> None:
    names = [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(PREFIX)]
    for n in names:
        for pid in sh("ip", "netns", "pids", n, check=False).stdout.split():
            try:
                os.kill(int(pid), 9)
            except (OSError, ValueError):
                pass
    for n in names:
        sh("ip", "netns", "del", n, check=False)


def vm_command(vm: str, state: Path, *args) -> subprocess.CompletedProcess:
    # Per-VM state (sysctl baseline, server pids) and pod namespace names, as if on separate
    # machines: /run/netns and /var/lib are shared here.
    env = {**os.environ, "NPT_LAB_VM_STATE_DIR": str(state / vm), "NPT_LAB_PREFIX": f"{PREFIX}{vm}-",
           "PYTHONPATH": str(REPO)}
    return subprocess.run(["ip", "netns", "exec", PREFIX + vm, sys.executable, "-m", "nptrace.lab.vm", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=180)


def run_case(plan: dict, state: Path, scenario: str, variant: str | None, backend: str, count: int) -> bool:
    sys.path.insert(0, str(REPO))
    from nptrace.lab import model, netns
    spec = model.compile_spec(scenario, variant)
    wide = sorted({k for d in spec.hosts.values() for k in d.get("sysctl", {}) if k in netns.HOST_WIDE})
    if wide:   # conntrack-table-full: a VM has its own; the namespace lab sets it at the root
        print(f"   not emulated: {', '.join(wide)} is host-wide on one kernel (read-only in a namespace)")
        return True
    var = ["--variant", variant] if variant else []
    for v in plan["vms"]:
        r = vm_command(v["name"], state, "apply-role", scenario, "--role", v["name"], "--force",
                       "--backend", backend, *var)
        if r.returncode != 0:
            print(f"   apply-role on {v['name']} failed: {r.stderr.strip()}")
            return False
    r = vm_command("client", state, "vm-trigger", scenario, "--role", "client", "--count", str(count), *var)
    print("   " + (r.stdout + r.stderr).strip().replace("\n", "\n   "))
    m = re.search(r"^(\d+)/(\d+) attempts showed the expected symptom", r.stdout, re.M)
    statuses = re.findall(r"-> HTTP (\d+) \(expect (\d+)\)", r.stdout)
    return bool(m) and m.group(1) == m.group(2) and all(a == b for a, b in statuses)


def all_cases() -> list[str]:
    sys.path.insert(0, str(REPO))
    from nptrace.lab import model
    return [f"{s.name}:{v}" if v else s.name for s in model.load_scenarios() for v in (None, *s.variants)]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if os.geteuid() != 0:
        print("emulate: error: needs root (network namespaces): run it with sudo", file=sys.stderr)
        return 2
    plan = json.loads((REPO / "vagrant" / "plan.json").read_text())
    cases = argv or all_cases()
    failed = []
    remove_vms()
    with tempfile.TemporaryDirectory(prefix="npt-vmx-") as tmp:
        try:
            make_vms(plan)
            for case in cases:
                scenario, _, rest = case.partition(":")
                variant, _, backend = rest.partition(":")
                print(f"== {scenario}{' variant ' + variant if variant else ''} (backend {backend or 'iptables'})",
                      flush=True)
                if not run_case(plan, Path(tmp), scenario, variant or None, backend or "iptables", 6):
                    failed.append(case)
        finally:
            remove_vms()
    print(f"{len(cases) - len(failed)}/{len(cases)} cases showed their expected symptom"
          + (f"; failed: {' '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
