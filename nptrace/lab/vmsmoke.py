"""The Vagrant lab booted for real: `make vagrant-smoke`.

    python -m nptrace.lab.vmsmoke [--keep] [--count N] [--markdown FILE] [SCENARIO ...]

Brings the shipped Vagrantfile's default profile up on libvirt with a box built here from
Debian's archive (scripts/vagrant-box.sh; no box registry is needed), provisioned as the
Vagrantfile provisions any box (`make setup` in every VM, then `nptrace lab apply-role`). Then,
for each scenario: `vagrant provision --provision-with lab` applies it to every VM, `nptrace
run` traces node1 on the NICs apply-role names (virtio NICs, VXLAN over the underlay NIC) as on
a production node, the client VM makes the connections with `nptrace lab vm-trigger`, and the
tracer's JSON lines are read back. Every VM and network the run made is destroyed at the end,
whatever happened (--keep leaves them up for a look). Prints a table: scenario, expected cause,
labeled cause, interface, time.

libvirt's driver is NPTRACE_LIBVIRT_DRIVER (the Vagrantfile's setting), qemu (TCG) unless set:
KVM is the exception on the machines this runs on. Needs root, apt and the Debian archive; says
in one line what it lacks otherwise (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from . import model

ROOT = Path(__file__).resolve().parents[2]
BOX = "nptrace/bookworm"
# The role that traces and, per scenario, where the namespace lab's traced run puts the label
# (`make demo DEMO=...`): the lab NIC of node1 (mapped to the VM's NIC), or a pod namespace's.
TRACED = "node1"
SMOKE = {
    # web-0's own reset, or web-1's and web-2's coming back from node2 over the underlay
    "no-listener": ["npt-web-0/eth0", "ul0"],
    "rp-filter-asymmetric": ["eth1"],
    "wrong-interface": ["eth0"],
}
HOST_PACKAGES = {"vagrant": "vagrant", "virsh": "libvirt-clients", "libvirtd": "libvirt-daemon-system",
                 "qemu-system-x86_64": "qemu-system-x86", "qemu-img": "qemu-utils",
                 "dnsmasq": "dnsmasq-base"}
POOL_DIR = Path("/var/lib/libvirt/images")
TRIGGER_TIMEOUT = 600
LOG_DIR = ROOT / "results" / "vagrant-smoke"


class SmokeError(Exception):
    """What the smoke lacks to run here, in one line (exit 2)."""


def log(msg: str) -> None:
    print(f"vagrant-smoke: {msg}", file=sys.stderr, flush=True)


def _run(cmd, *, check=True, timeout=None, env=None, capture=True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout, env=env)
    if check and p.returncode != 0:
        tail = ((p.stderr or "") + (p.stdout or "")).strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {p.returncode}:\n  " + "\n  ".join(tail))
    return p


def virsh(*args, check=True) -> str:
    return _run(["virsh", "-c", "qemu:///system", *args], check=check).stdout


def host_ready() -> None:
    """Vagrant, libvirt and qemu installed, libvirt's daemons running, a default storage pool."""
    if os.geteuid() != 0:
        raise SmokeError("needs root (libvirt's system instance, the box build)")
    missing = sorted({pkg for tool, pkg in HOST_PACKAGES.items()
                      if not shutil.which(tool) and not Path("/usr/sbin", tool).exists()})
    if missing:
        log("installing " + " ".join(missing))
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if _run(["apt-get", "update", "-qq"], check=False, env=env).returncode != 0 or \
           _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
                check=False, env=env).returncode != 0:
            raise SmokeError(f"could not install {' '.join(missing)} with apt")
    if _run(["vagrant", "plugin", "list"], check=False).stdout.find("vagrant-libvirt") < 0:
        raise SmokeError("the vagrant-libvirt plugin is missing (Debian package vagrant-libvirt)")
    if _run(["virsh", "-c", "qemu:///system", "version"], check=False).returncode != 0:
        # without systemd (containers, this project's CI) the daemons are started by hand
        if Path("/run/systemd/system").is_dir():
            _run(["systemctl", "start", "libvirtd"], check=False)
        else:
            _run(["virtlogd", "-d"], check=False)
            _run(["libvirtd", "-d"], check=False)
        for _ in range(50):
            if _run(["virsh", "-c", "qemu:///system", "version"], check=False).returncode == 0:
                break
            time.sleep(0.2)
        else:
            raise SmokeError("libvirtd does not answer on qemu:///system")
    if "default" not in virsh("pool-list", "--all", "--name").split():
        POOL_DIR.mkdir(parents=True, exist_ok=True)
        virsh("pool-define-as", "default", "dir", "--target", str(POOL_DIR))
    if "default" not in virsh("pool-list", "--name").split():
        virsh("pool-start", "default")


K3S_SOURCES = ("https://get.k3s.io", "https://github.com", "https://registry-1.docker.io/v2/")


def k8s_reachable() -> str | None:
    """None, or the first of the k8s profile's download sites this machine cannot reach."""
    for url in K3S_SOURCES:
        if _run(["curl", "-sS", "-o", "/dev/null", "--max-time", "15", url], check=False).returncode != 0:
            return url
    return None


def box_packages() -> str:
    """The Debian packages a lab VM's `make setup` installs, plus the kernel headers it would
    fetch: put into the box so that four VMs under TCG do not each spend many minutes in dpkg."""
    p = _run(["bash", str(ROOT / "scripts" / "setup.sh"), "--packages"],
             env={**os.environ, "NPTRACE_SETUP": "runtime"})
    return p.stdout.strip() + " linux-headers-amd64"


def vagrant_env() -> dict:
    return {**os.environ, "VAGRANT_CWD": str(ROOT), "VAGRANT_DEFAULT_PROVIDER": "libvirt",
            "VAGRANT_CHECKPOINT_DISABLE": "1", "NPTRACE_BOX": os.environ.get("NPTRACE_BOX", BOX),
            "NPTRACE_LIBVIRT_DRIVER": os.environ.get("NPTRACE_LIBVIRT_DRIVER", "qemu")}


def vagrant(*args, env=None, timeout=None, logname=None, check=True) -> str:
    """Run vagrant; its output goes to a log file under results/ as it comes (`tail -f` it:
    a `vagrant up` under TCG runs for many minutes), and is returned."""
    e = {**vagrant_env(), **(env or {})}
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    path = LOG_DIR / f"{logname or 'vagrant'}.log"
    with path.open("w") as f:
        p = subprocess.run(["vagrant", *args], stdout=f, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, env=e)
    out = path.read_text()
    if check and p.returncode != 0:
        tail = out.strip().splitlines()[-12:]
        raise RuntimeError(f"vagrant {' '.join(args)} exited {p.returncode} ({path}):\n  " + "\n  ".join(tail))
    return out


class Ssh:
    """ssh into the VMs with the config `vagrant ssh-config` prints: one vagrant start, not one
    per command (each costs seconds)."""

    def __init__(self):
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.config = LOG_DIR / "ssh-config"
        self.config.write_text(_run(["vagrant", "ssh-config"], env=vagrant_env()).stdout)

    def argv(self, vm: str, command: str) -> list[str]:
        return ["ssh", "-F", str(self.config), "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", vm, command]

    def run(self, vm: str, command: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return _run(self.argv(vm, command), timeout=timeout, check=check)

    def popen(self, vm: str, command: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(vm, command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)


def parse_apply(out: str, vm: str) -> tuple[dict[str, str], list[str]]:
    """(lab NIC -> VM NIC, the `trace here` interfaces) from the VM's lines of `vagrant provision`."""
    nics, watch = {}, []
    for line in out.splitlines():
        line = re.sub(rf"^\s*{re.escape(vm)}:\s?", "", line) if re.match(rf"^\s*{re.escape(vm)}:", line) else None
        if line is None:
            continue
        if line.strip().startswith("NICs:"):
            nics = dict(p.split("=", 1) for p in line.split(":", 1)[1].split())
        elif "trace here:" in line:
            watch = re.findall(r"--iface (\S+)", line)
    return nics, watch


def summarize(lines: list[dict]) -> dict:
    """Causes and interfaces of the traced run's incident lines (summaries carry no flow)."""
    incidents = [e for e in lines if e.get("kind") in ("rst", "drop", "anomaly") and e.get("cause")]
    causes = Counter(e["cause"] for e in incidents)
    ifaces = {c: dict(Counter(e.get("iface") or "-" for e in incidents if e["cause"] == c).most_common())
              for c in causes}
    return {"incidents": len(incidents), "causes": dict(causes.most_common()), "ifaces": ifaces,
            "losses": [e.get("loss") for e in lines if e.get("kind") == "loss"]}


def verdict(scenario: str, expected: str, summary: dict, nics: dict[str, str]) -> tuple[bool, str, str]:
    """(passes, labeled cause, interface) of one scenario: the expected cause is the most common
    label, and its lines' most common interface is one the topology gives (the VM's NIC for a
    lab NIC)."""
    if not summary["causes"]:
        return False, "none", "-"
    labeled = next(iter(summary["causes"]))
    iface = next(iter(summary["ifaces"][labeled]))
    want = {nics.get(i, i) for i in SMOKE.get(scenario, [])}
    return labeled == expected and (not want or iface in want), labeled, iface


def run_scenario(ssh: Ssh, scenario: str, count: int) -> dict:
    spec = model.compile_spec(scenario, None)
    start = time.monotonic()
    out = vagrant("provision", "--provision-with", "lab", env={"NPTRACE_LAB_SCENARIO": scenario},
                  timeout=1800, logname=f"apply-{scenario}")
    nics, watch = parse_apply(out, TRACED)
    if not watch:
        raise RuntimeError(f"apply-role on {TRACED} printed no `trace here` line (see {LOG_DIR}/apply-{scenario}.log)")
    ready, jsonl = "/run/nptrace-smoke.ready", "/run/nptrace-smoke.jsonl"
    ssh.run(TRACED, f"sudo rm -f {ready} {jsonl}")
    cmd = (f"sudo sh -c 'exec nptrace run --json --ready-file {ready} "
           + " ".join(f"--iface {w}" for w in watch) + f" > {jsonl}'")
    tracer = ssh.popen(TRACED, cmd)
    try:
        deadline = time.monotonic() + 900       # compile and attach take minutes under TCG
        while ssh.run(TRACED, f"test -e {ready}", check=False).returncode != 0:
            if tracer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nptrace run on {TRACED} did not become ready: "
                                   f"{(tracer.communicate()[1] or '').strip()[-600:]}")
            time.sleep(2)
        attached = time.monotonic() - start
        trig = ssh.run("client", f"nptrace lab vm-trigger {scenario} --count {count}", timeout=TRIGGER_TIMEOUT,
                       check=False)
        time.sleep(3)      # the last resets' records through the ring and the labeling barrier
    finally:
        ssh.run(TRACED, "sudo pkill -INT -f '^/.*nptrace run --json --ready-file'", check=False)
        try:
            _, err = tracer.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            tracer.kill()
            _, err = tracer.communicate()
    raw = ssh.run(TRACED, f"sudo cat {jsonl}").stdout
    (LOG_DIR / f"run-{scenario}.jsonl").write_text(raw)
    (LOG_DIR / f"run-{scenario}.err").write_text(err or "")
    (LOG_DIR / f"trigger-{scenario}.txt").write_text(trig.stdout + trig.stderr)
    lines = [json.loads(x) for x in raw.splitlines() if x.startswith("{")]
    summary = summarize(lines)
    ok, labeled, iface = verdict(scenario, spec.cause or "none", summary, nics)
    lab = {real: name for name, real in nics.items()}.get(iface)
    iface = f"{iface} (lab {lab})" if lab else iface
    symptom = next((x for x in trig.stdout.splitlines() if "showed the expected symptom" in x), "no trigger output")
    return {"scenario": scenario, "expected": spec.cause or "none", "labeled": labeled, "iface": iface,
            "ok": ok and trig.returncode == 0, "seconds": round(time.monotonic() - start),
            "to_ready": round(attached), "client": symptom.split(" attempts")[0], **summary}


def leftovers(before_domains: set[str], before_nets: set[str]) -> tuple[set[str], set[str]]:
    doms = set(virsh("list", "--all", "--name", check=False).split()) - before_domains
    nets = set(virsh("net-list", "--all", "--name", check=False).split()) - before_nets
    return doms, nets


def teardown(before_domains: set[str], before_nets: set[str]) -> tuple[set[str], set[str]]:
    """Destroy what the run made: vagrant's way first, then whatever libvirt still holds."""
    vagrant("destroy", "-f", timeout=900, logname="destroy", check=False)
    doms, nets = leftovers(before_domains, before_nets)
    for d in doms:
        virsh("destroy", d, check=False)
        virsh("undefine", d, "--remove-all-storage", "--nvram", check=False)
    for n in nets:
        virsh("net-destroy", n, check=False)
        virsh("net-undefine", n, check=False)
    return leftovers(before_domains, before_nets)


def table(rows: list[dict], timings: dict) -> str:
    out = ["| scenario | expected cause | labeled cause | interface | incidents | client | ready | time | result |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['scenario']} | {r['expected']} | {r['labeled']} | {r['iface']} | {r['incidents']} | "
                   f"{r['client']} | {r['to_ready']} s | {r['seconds']} s | {'ok' if r['ok'] else 'FAILED'} |")
    out.append("")
    out.append("; ".join(f"{k} {v} s" for k, v in timings.items()))
    return "\n".join(out)


def report(text: str, rows: list[dict]) -> str:
    """The table as docs/vagrant-smoke.md keeps it: when, at which commit, on what."""
    commit = _run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], check=False).stdout.strip()
    cpus, kernel = os.cpu_count(), os.uname().release
    causes = "; ".join(f"{r['scenario']}: {r.get('causes')}" for r in rows)
    return (f"# The Vagrant lab, booted (`make vagrant-smoke`)\n\n"
            f"Last run {time.strftime('%Y-%m-%d')} at commit {commit}, on a {cpus}-core host (kernel {kernel}), "
            f"libvirt driver {vagrant_env()['NPTRACE_LIBVIRT_DRIVER']}, box {vagrant_env()['NPTRACE_BOX']} "
            f"(scripts/vagrant-box.sh). `ready` is from the scenario's apply to the tracer attached on "
            f"{TRACED}; `time` adds the trigger and the stop. Interfaces are the VM's own NIC names, with "
            f"the lab's name where it is a lab NIC (ul0: the underlay the VXLAN runs over).\n\n"
            f"{text}\n\nEvery label of each traced run: {causes}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nptrace.lab.vmsmoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios", nargs="*", default=list(SMOKE))
    ap.add_argument("--count", type=int, default=20, help="connections per scenario")
    ap.add_argument("--keep", action="store_true", help="leave the VMs up afterwards")
    ap.add_argument("--markdown", type=Path, help="also write the table to this file")
    a = ap.parse_args(argv)
    for s in a.scenarios:
        model.compile_spec(s, None)
    if os.environ.get("NPTRACE_LAB_PROFILE", "netns") != "netns":
        lacks = k8s_reachable()
        why = (f"this machine cannot reach {lacks}, where it downloads k3s and the pods' image" if lacks
               else "it is run by hand: vagrant/README.md")
        print(f"vagrant-smoke: runs the netns profile only; not the k8s profile: {why}", file=sys.stderr)
        return 2
    try:
        host_ready()
    except SmokeError as e:
        print(f"vagrant-smoke: {e}", file=sys.stderr)
        return 2
    before_domains = set(virsh("list", "--all", "--name").split())
    before_nets = set(virsh("net-list", "--all", "--name").split())
    timings, rows, failed = {}, [], []
    t0 = time.monotonic()
    try:
        env = {**os.environ, "NPT_BOX_PACKAGES": box_packages()}
        if _run(["bash", str(ROOT / "scripts" / "vagrant-box.sh")], env=env, check=False,
                capture=False).returncode != 0:
            raise SmokeError("the box could not be built (scripts/vagrant-box.sh said why above)")
        timings["box"] = round(time.monotonic() - t0)
        t = time.monotonic()
        log(f"vagrant up (libvirt driver {vagrant_env()['NPTRACE_LIBVIRT_DRIVER']}): boot and provision 4 VMs "
            f"(its output: {LOG_DIR / 'up.log'})")
        vagrant("up", "--provider", "libvirt", timeout=4 * 3600, logname="up")
        timings["up+provision"] = round(time.monotonic() - t)
        ssh = Ssh()
        for s in a.scenarios:
            log(f"scenario {s}")
            try:
                rows.append(run_scenario(ssh, s, a.count))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failed.append(f"{s}: {e}")
                rows.append({"scenario": s, "expected": model.compile_spec(s, None).cause, "labeled": "error",
                             "iface": "-", "incidents": 0, "client": "-", "to_ready": 0, "seconds": 0, "ok": False})
            log(f"  {rows[-1]['labeled']} on {rows[-1]['iface']} ({rows[-1]['incidents']} incidents)")
    except SmokeError as e:
        print(f"vagrant-smoke: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        failed.append(str(e))
    finally:
        if a.keep:
            log("--keep: the VMs stay up (`vagrant destroy -f` removes them)")
        else:
            t = time.monotonic()
            doms, nets = teardown(before_domains, before_nets)
            timings["destroy"] = round(time.monotonic() - t)
            if doms or nets:
                failed.append(f"left behind: domains {sorted(doms)}, networks {sorted(nets)}")
    timings["total"] = round(time.monotonic() - t0)
    text = table(rows, timings)
    print(text)
    if a.markdown:
        a.markdown.write_text(report(text, rows))
    for f in failed:
        print(f"vagrant-smoke: {f}", file=sys.stderr)
    return 0 if rows and all(r["ok"] for r in rows) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
