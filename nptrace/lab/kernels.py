"""The kernel matrix: real older kernels booted under qemu, nptrace run inside each.

    python -m nptrace.lab.kernels [--kernel 6.12 --kernel 6.1 ...] [--count N] [--short]
                                  [--markdown docs/kernels.md] [SCENARIO ...]

Each kernel is Debian's own `linux-image` package of one suite (bullseye 5.10, bookworm 6.1,
trixie 6.12), fetched with apt through a temporary source list that reuses the URI of this
machine's own Debian source, unpacked under /var/lib/nptrace/kernels/<suite>/ with its modules
linked at /lib/modules/<release> (depmod run there). virtme-ng (`vng`, the tool kernel and BPF
developers boot test kernels with) boots it on a read-only 9p view of this machine's root, so
the guest runs this checkout and its venv; only the results folder is shared writable.

In the guest (`guest` subcommand): the modules the lab needs are loaded, bpf_stats is turned
on, `nptrace doctor --json` runs (it compiles and loads the plan `run` would use), then every
scenario's first yardstick case (nptrace/lab/scorecard.py, the host's yardstick), BATCH labs
under one traced run (score_labs), with each scenario's kprobe run counts read from bpftool
after its trigger while the tracer is still attached. The host prints one table: kernel,
accelerator, plan, per scenario the label score and the kprobe groups that fired. The guest
loads the modules whose functions the kprobe groups probe before `run` starts (on a node a
group whose module loads later stays skipped: `run` says so at start).

KVM is used when a guest really boots under it (a short trial boot, remembered per host
kernel); otherwise TCG, several times slower (on the development VM a KVM guest hangs after
the BIOS). Needs root, apt and PyPI; says in one line what it lacks otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path("/var/lib/nptrace/kernels")   # not /var/cache or /tmp: the guest has tmpfs there
VNG_VENV = Path("/var/lib/nptrace/vng")
VNG_VERSION = "1.42"
SUITES = {"5.10": "bullseye", "6.1": "bookworm", "6.12": "trixie"}
# newest first: 6.12 (tcx, BPF netfilter hooks, tcp_send_reset's reason) is the plan closest
# to current kernels, 6.1 lacks those three, 5.10 also kfree_skb's reason
DEFAULT_KERNELS = ("6.12", "6.1", "5.10")
# the short form .ci/run uses: doctor and three scenarios on one kernel
SHORT = ("6.1", ("no-listener", "rp-filter-asymmetric", "networkpolicy-drop"))
GUEST_MODULES = ("ip_vs", "ip_vs_rr", "sch_ingress", "veth", "vxlan", "bridge", "br_netfilter",
                 "nf_tables", "nf_conntrack", "nf_nat", "nf_reject_ipv4", "nf_reject_ipv6",
                 "xt_conntrack", "xt_MASQUERADE", "xt_REJECT", "xt_mark", "xt_comment",
                 "xt_set", "ip_set_hash_ip", "ip_set_hash_ipport", "ip_set_hash_ipportip",
                 "ip_set_hash_ipportnet", "ip_set_bitmap_port", "dummy", "nfnetlink_log")
BOOT_TIMEOUT = 3 * 3600
# scenarios traced by one `nptrace run` in the guest: its compile and attach (1-2 minutes
# under TCG) is paid once a batch
BATCH = 8


class MatrixError(Exception):
    """What the matrix lacks to run here, in one line (exit 2)."""


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# --- host: tools ------------------------------------------------------------------------------
def ensure_tools() -> Path:
    """qemu, busybox (virtme-ng's initramfs) and virtme-ng in its own venv; the vng path."""
    if os.geteuid() != 0:
        raise MatrixError("needs root (apt, /lib/modules, qemu): run with sudo")
    need = [p for p, exe in (("qemu-system-x86", "qemu-system-x86_64"), ("busybox-static", "busybox"))
            if not shutil.which(exe)]
    if need:
        r = _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *need],
                 env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if r.returncode:
            _run(["apt-get", "update", "-qq"])
            r = _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *need])
        if r.returncode:
            raise MatrixError(f"cannot install {' '.join(need)}: {r.stderr.strip()[-200:]}")
    vng = VNG_VENV / "bin" / "vng"
    if not vng.exists():
        r = _run(["/usr/bin/python3", "-m", "venv", str(VNG_VENV)])
        if r.returncode == 0:
            r = _run([str(VNG_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                      f"virtme-ng=={VNG_VERSION}"])
        if r.returncode or not vng.exists():
            raise MatrixError(f"cannot install virtme-ng {VNG_VERSION} from PyPI: "
                              f"{(r.stderr or r.stdout).strip()[-200:]}")
    return vng


def debian_uri(root: Path = Path("/")) -> str:
    """The URI of this machine's own Debian archive (not the security one)."""
    texts = []
    for f in sorted((root / "etc/apt/sources.list.d").glob("*.sources")):
        texts += re.findall(r"^URIs:\s*(\S+)", f.read_text(errors="replace"), re.M)
    lst = root / "etc/apt/sources.list"
    if lst.exists():
        texts += re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", lst.read_text(errors="replace"), re.M)
    for uri in texts:
        if "debian" in uri and "security" not in uri:
            return uri.rstrip("/")
    raise MatrixError("no Debian archive in /etc/apt sources: the kernels come from there")


@dataclass(frozen=True)
class Kernel:
    name: str          # "6.1"
    suite: str
    release: str       # "6.1.0-50-amd64"
    vmlinuz: Path


def fetch(name: str, cache: Path = CACHE) -> Kernel:
    """Debian's linux-image of the suite behind `name`, unpacked once, its modules linked."""
    suite = SUITES.get(name)
    if suite is None:
        raise MatrixError(f"unknown kernel {name!r}: one of {', '.join(SUITES)}")
    d = cache / suite
    root = d / "root"
    found = sorted(root.glob("boot/vmlinuz-*"))
    if not found:
        (d / "lists/partial").mkdir(parents=True, exist_ok=True)
        (d / "sources.list").write_text(
            f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {debian_uri()} "
            f"{suite} main\n")
        opts = ["-o", f"Dir::Etc::sourcelist={d / 'sources.list'}", "-o", "Dir::Etc::sourceparts=-",
                "-o", f"Dir::State::Lists={d / 'lists'}"]
        r = _run(["apt-get", *opts, "update", "-qq"])
        if r.returncode:
            raise MatrixError(f"apt cannot read {suite}: {r.stderr.strip()[-200:]}")
        r = _run(["apt-cache", *opts, "depends", "linux-image-amd64"])
        pkg = next(iter(re.findall(r"Depends: (linux-image-[0-9]\S*)", r.stdout)), None)
        if pkg is None:
            raise MatrixError(f"no linux-image package in {suite}")
        for old in d.glob("*.deb"):
            old.unlink()
        r = _run(["apt-get", *opts, "download", pkg], cwd=d)
        debs = list(d.glob("*.deb"))
        if r.returncode or not debs:
            raise MatrixError(f"cannot download {pkg}: {r.stderr.strip()[-200:]}")
        shutil.rmtree(root, ignore_errors=True)
        r = _run(["dpkg-deb", "-x", str(debs[0]), str(root)])
        if r.returncode:
            raise MatrixError(f"cannot unpack {debs[0].name}: {r.stderr.strip()}")
        found = sorted(root.glob("boot/vmlinuz-*"))
    vmlinuz = found[-1]
    release = vmlinuz.name[len("vmlinuz-"):]
    mods = next((m for m in (root / "lib/modules" / release, root / "usr/lib/modules" / release)
                 if m.is_dir()), None)
    if mods is None:
        raise MatrixError(f"{suite}'s package has no modules for {release}")
    if not (mods / "modules.dep").exists():
        if not (root / "lib/modules").exists():   # merged /usr (trixie): depmod looks in lib/
            (root / "lib").mkdir(exist_ok=True)
            (root / "lib/modules").symlink_to("../usr/lib/modules")
        _run(["depmod", "-b", str(root), release])
    link = Path("/lib/modules") / release
    if link.is_symlink() and Path(os.readlink(link)) != mods:
        link.unlink()
    if not link.exists():
        link.symlink_to(mods)
    elif not link.is_symlink():
        raise MatrixError(f"/lib/modules/{release} is a directory not made by nptrace: "
                          "remove it or boot another kernel")
    return Kernel(name, suite, release, vmlinuz)


def vng_command(vng: Path, k: Kernel, cmd: str, rwdir: Path, kvm: bool) -> list[str]:
    return [str(vng), "-r", str(k.vmlinuz), *(() if kvm else ("--disable-kvm",)), "--force-9p",
            "--cpus", "2", "--memory", "6G", "--rwdir", str(rwdir), "-e", cmd]


def _env(vng: Path) -> dict:
    return {**os.environ, "PATH": f"{vng.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


def kvm_works(vng: Path, k: Kernel, cache: Path = CACHE) -> bool:
    """Whether a guest really boots under KVM here: a trial boot of 60 s, remembered per
    host kernel (KVM_CREATE_VM can succeed on a host whose KVM guests then hang)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    memo = cache / f"kvm-{os.uname().release}"
    if memo.exists():
        return memo.read_text().strip() == "yes"
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        try:
            r = _run(vng_command(vng, k, f"echo ok > {tmp}/kvm", Path(tmp), True), timeout=60,
                     env=_env(vng))
            ok = r.returncode == 0 and (Path(tmp) / "kvm").exists()
        except subprocess.TimeoutExpired:
            ok = False
    memo.write_text("yes\n" if ok else "no\n")
    return ok


def merged(earlier: dict | None, now: dict) -> dict:
    """A run of some scenarios over the kernel's earlier full result: the scenarios run now
    replace theirs, the others are kept (marked with the commit they ran on)."""
    if not earlier or "error" in now or "error" in earlier:
        return now
    ran = {s["scenario"] for s in now.get("scenarios", [])}
    kept = [dict(s, earlier=s.get("earlier") or earlier.get("commit", "?"))
            for s in earlier.get("scenarios", [])
            if s["scenario"] not in ran]
    order = {s["scenario"]: i for i, s in enumerate(earlier.get("scenarios", []))}
    rows = sorted(kept + now.get("scenarios", []), key=lambda s: order.get(s["scenario"], len(order)))
    return {**now, "scenarios": rows}


def boot(vng: Path, k: Kernel, args: list[str], out: Path, kvm: bool, timeout: float) -> dict:
    """Run this module's `guest` in the kernel; its JSON result (or why it gave none)."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    if result.exists():
        result.rename(out / "result.previous.json")
    top = Path(__file__).resolve().parents[2]
    guest = (f"cd {top} && NPT_LAB_ATTACH_TIMEOUT=900 NPT_LAB_SERVER_TIMEOUT=300 {sys.executable} -m nptrace.lab.kernels guest --out {result} "
             + " ".join(args) + f" > {out}/guest.log 2>&1")
    t0 = time.monotonic()
    try:
        r = _run(vng_command(vng, k, guest, out, kvm), timeout=timeout, env=_env(vng))
        err = r.stderr.strip().splitlines()[-1:] if r.returncode else []
    except subprocess.TimeoutExpired:
        err = [f"guest did not finish within {timeout:.0f} s"]
    wall = time.monotonic() - t0
    if not result.exists():
        log = (out / "guest.log").read_text(errors="replace").strip().splitlines()[-3:] \
            if (out / "guest.log").exists() else []
        return {"kernel": k.release, "error": "; ".join(err + log) or "no result", "wall_s": wall}
    data = json.loads(result.read_text())
    data["wall_s"] = wall
    data["commit"] = _run(["git", "-C", str(top), "rev-parse", "--short", "HEAD"]).stdout.strip()
    return data


# --- guest ------------------------------------------------------------------------------------
def _sh(cmd: list[str]) -> str:
    r = _run(cmd)
    return r.stdout


def prog_runs() -> dict[str, int]:
    """BPF program name, as bpftool shows it, -> run count (bpf_stats)."""
    try:
        progs = json.loads(_sh(["bpftool", "prog", "show", "-j"]) or "[]")
    except ValueError:
        return {}
    out: dict[str, int] = {}
    for p in progs:
        out[p.get("name", "")] = out.get(p.get("name", ""), 0) + int(p.get("run_cnt", 0))
    return out


def kprobe_fired(runs: dict[str, int]) -> dict[str, int]:
    """kprobe group -> the run count of its programs (hooks.py)."""
    from nptrace.kernel import hooks
    out = {}
    for h in hooks.HOOKS:
        if h.kind == "kprobe":
            # bpftool names a program by its BTF function name where it has one, else by the
            # kernel's 15 characters; an entry/return pair counts its calls once
            out[h.group] = max(runs.get(p, runs.get(p[:15], 0)) for p in h.programs)
    return out


def _attached(stderr: str) -> tuple[list[str], list[str]]:
    """(kprobe groups on, groups skipped) from `nptrace run`'s start-up lines."""
    on = re.search(r"plan: kprobe:\*: on \(.*?groups ([\w, ]+)", stderr)
    groups = [g.strip() for g in on.group(1).split(",")] if on else []
    skipped = re.findall(r"kprobe (\w+) skipped", stderr)
    return [g for g in groups if g not in skipped], skipped


def _runnable(sc, backend) -> str:
    """Why a scenario cannot run in this guest ("" when it can)."""
    from nptrace.lab.runner import NO_IPVS, ipvs_available
    return NO_IPVS if backend == "ipvs" and not ipvs_available() else ""


def _host_wide(sc, backend, variant) -> bool:
    """Whether the scenario changes host-wide sysctls (nf_conntrack_max): it runs alone."""
    from nptrace.lab.hostplan import host_steps
    from nptrace.lab.model import compile_spec
    from nptrace.lab.netns import split_host_wide
    spec = compile_spec(sc.name, variant)
    return any(split_host_wide(host_steps(spec, h, backend))[1] for h in spec.hosts)


def batches(items, size: int, alone) -> list[list]:
    """items in runs of at most `size`, each item for which alone(item) in a run of its own."""
    out, cur = [], []
    for it in items:
        if alone(it):
            out.append([it])
            continue
        cur.append(it)
        if len(cur) == size:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def prepare_guest() -> None:
    """In a guest: the modules the lab needs, bpf_stats, bpffs."""
    for m in GUEST_MODULES:
        _run(["modprobe", m])
    _run(["sysctl", "-qw", "kernel.bpf_stats_enabled=1"])
    if not os.path.ismount("/sys/fs/bpf"):
        _run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"])


def run_in_guest(name: str, module_args: str, out: Path, timeout: float = BOOT_TIMEOUT) -> tuple[str, str]:
    """``python -m <module_args>`` in kernel ``name`` booted under qemu (KVM where a guest
    really runs under it), from this checkout, its output in ``out``/guest.log; returns
    (the kernel's release, the accelerator). MatrixError when the machine cannot boot it."""
    vng = ensure_tools()
    k = fetch(name)
    kvm = kvm_works(vng, k)
    out.mkdir(parents=True, exist_ok=True)
    top = Path(__file__).resolve().parents[2]
    cmd = (f"cd {top} && NPT_LAB_ATTACH_TIMEOUT=900 NPT_LAB_SERVER_TIMEOUT=300 NPT_K8S_TIMEOUT=900 {sys.executable} -m "
           f"{module_args} > {out}/guest.log 2>&1")
    try:
        _run(vng_command(vng, k, cmd, out, kvm), timeout=timeout, env=_env(vng))
    except subprocess.TimeoutExpired:
        raise MatrixError(f"the {k.release} guest did not finish within {timeout:.0f} s") from None
    return k.release, "KVM" if kvm else "TCG"


def guest(argv) -> int:
    ap = argparse.ArgumentParser(prog="nptrace-kernels guest")
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("scenarios", nargs="*")
    a = ap.parse_args(argv)
    prepare_guest()
    out = Path(a.out)
    for old in out.parent.glob("batch*.log"):
        old.unlink()
    res: dict = {"kernel": os.uname().release, "scenarios": []}
    t0 = time.monotonic()
    r = _run([sys.executable, "-m", "nptrace.cli", "doctor", "--json"])
    try:
        doc = json.loads(r.stdout)
        res["doctor"] = {"ok": doc["ok"], "reason": doc["reason"],
                         "rows": {x["check"]: [x["status"], x["detail"]] for x in doc["rows"]}}
    except (ValueError, KeyError):
        tail = (r.stderr.strip() or r.stdout.strip() or f"exit {r.returncode}, no output")
        res["doctor"] = {"ok": False, "reason": tail.splitlines()[-1]}
        (out.parent / "doctor.log").write_text(r.stdout + r.stderr)
    res["doctor_s"] = round(time.monotonic() - t0, 1)
    out.write_text(json.dumps(res))
    from nptrace import lab
    from nptrace.lab.harness import Case
    from nptrace.lab.model import compile_spec
    from nptrace.lab.scorecard import runs, score_labs
    todo = []
    for sc in lab.scenarios():
        if a.scenarios and sc.name not in a.scenarios:
            continue
        backend, variant = runs(sc)[0]
        why = _runnable(sc, backend)
        if why:
            res["scenarios"].append({"scenario": sc.name, "backend": backend,
                                     "expected": sc.cause or "none", "not_runnable": why})
            continue
        todo.append((sc, backend, variant))
    for i, group in enumerate(batches(todo, a.batch, lambda t: _host_wide(*t))):
        cases = [(Case(sc.name, b, v, f"npt-k{i}{j}-"), sc.cause, compile_spec(sc.name, v).hint)
                 for j, (sc, b, v) in enumerate(group)]
        fired: dict = {}
        last: dict = {}

        def sample(case, fired=fired, last=last):
            now = kprobe_fired(prog_runs())
            fired[case.name] = {g: n - last.get(g, 0) for g, n in now.items() if n > last.get(g, 0)}
            last.update(now)
        t1 = time.monotonic()
        raw: list = []
        try:
            scores = score_labs(cases, a.count, observe=max(max(sc.observe for sc, _, _ in group), 2.0),
                                after=sample, raw=raw)
        except Exception as e:   # one batch's failure is its rows, not the matrix's end
            for sc, b, _ in group:
                res["scenarios"].append({"scenario": sc.name, "backend": b, "expected": sc.cause or "none",
                                         "error": f"{type(e).__name__}: {e}"})
            out.write_text(json.dumps(res))
            continue
        took = round((time.monotonic() - t1) / len(group), 1)
        # what the traced run said and printed, for a row whose events are not what it expected
        log = out.parent / f"batch{i}.log"
        log.write_text(f"{[sc.name for sc, _, _ in group]}\n{len(raw)} events printed\n"
                       + "".join(json.dumps(e) + "\n" for e in raw[:50])
                       + (scores[0].stderr if scores else ""))
        for (sc, b, _), s in zip(group, scores):
            on, skipped = _attached(s.stderr)
            res["scenarios"].append({
                "scenario": sc.name, "backend": b, "expected": sc.cause or "none",
                "hit": s.hit_rate, "events": s.total, "labels": dict(s.labels),
                "services": dict(s.services), "outcomes": dict(s.outcomes), "attached": on,
                "skipped": skipped, "fired": fired.get(sc.name, {}), "s": took,
                "mislabeled": [{k: m.get(k) for k in ("cause", "hint", "evidence")}
                               for m in s.mislabeled[:2]]})
        out.write_text(json.dumps(res))
    return 0


# --- the table --------------------------------------------------------------------------------
def plan_summary(doctor: dict) -> str:
    rows = doctor.get("rows", {})

    def st(name):
        return rows.get(name, ["?"])[0]
    parts = [f"tcx {st('tcx')}", f"kprobes {st('kprobes')}", f"nf bpf {st('netfilter bpf')}",
             f"kfree reason {st('skb:kfree_skb reason')}", f"rst reason {st('tcp:tcp_send_reset reason')}"]
    return ", ".join(parts)


def table(results: list[dict]) -> str:
    lines = ["| kernel | accel | boot+run | doctor | plan | scenario | expected | score | events | "
             "kprobe groups attached | fired |", "|" + "---|" * 11]
    for r in results:
        head = [r.get("kernel", "?"), r.get("accel", "?"), f"{r.get('wall_s', 0):.0f} s"]
        if "error" in r:
            lines.append("| " + " | ".join(head + [f"error: {r['error']}"] + [""] * 7) + " |")
            continue
        doc = r.get("doctor", {})
        head += ["ok" if doc.get("ok") else f"fail: {doc.get('reason', '')}", plan_summary(doc)]
        lost = lost_causes(doc)
        for i, s in enumerate(r.get("scenarios", [])):
            cells = head if i == 0 else [""] * len(head)
            score = verdict(s, lost)[1] + (f" (commit {s['earlier']})" if s.get("earlier") else "")
            if "hit" not in s:
                ev, att, fired = "", "", ""
            else:
                ev = str(s["events"])
                att = ", ".join(s["attached"]) or "-"
                fired = ", ".join(f"{g} {n}" for g, n in sorted(s["fired"].items())) or "-"
            lines.append("| " + " | ".join(cells + [s["scenario"], s["expected"], score, ev, att, fired])
                         + " |")
    return "\n".join(lines)


def lost_causes(doctor: dict) -> dict[str, str]:
    """cause -> the doctor row whose missing field loses it on that kernel (hooks.Field.lost;
    the plan's lost_causes, read back from the guest's doctor rows)."""
    from nptrace.kernel import hooks
    rows = doctor.get("rows", {})
    return {c: f.row for h in hooks.HOOKS for f in h.fields if f.row
            and rows.get(f.row, ["ok"])[0] != "ok" for c in f.lost}


def verdict(s: dict, lost: dict[str, str]) -> tuple[bool, str]:
    """(passes, its score cell) of one scenario row. A scenario whose cause the kernel cannot
    give passes when nothing of it is mislabeled (unknown, or nothing, is the honest answer)."""
    if "not_runnable" in s:
        return True, f"not runnable: {s['not_runnable']}"
    if "error" in s:
        return False, f"error: {s['error'][:120]}"
    if s["expected"] in lost:
        wrong = {c: n for c, n in s["labels"].items() if c != "unknown"}
        return (not wrong, f"not attributable here ({lost[s['expected']]} missing)"
                + (f", mislabeled {wrong}" if wrong else ""))
    return s["hit"] >= 1.0, f"{s['hit'] * 100:.1f}%"


def failures(results: list[dict]) -> list[str]:
    """What makes the matrix fail: a kernel without result, a doctor that fails, a runnable
    scenario that errs or scores below 100%, or is mislabeled where not attributable."""
    out = []
    for r in results:
        if "error" in r:
            out.append(f"{r.get('kernel')}: {r['error']}")
            continue
        if not r.get("doctor", {}).get("ok"):
            out.append(f"{r['kernel']}: doctor: {r['doctor'].get('reason')}")
        lost = lost_causes(r.get("doctor", {}))
        for s in r.get("scenarios", []):
            ok, cell = verdict(s, lost)
            if not ok:
                out.append(f"{r['kernel']} {s['scenario']}: {cell}"
                           + (f" {s['labels']}" if "labels" in s else ""))
    return out


def kept_sections(page: str) -> str:
    """The sections below the generated table (from its first `## ` heading on): written by
    hand (notes, the inferred rows of kernels not booted here), kept across reruns."""
    m = re.search(r"^## ", page, re.M)
    return page[m.start():] if m else ""


def stored_results(cache: Path = CACHE) -> list[dict]:
    """Every kernel's last stored result, newest kernel first: the page shows all kernels
    ever run here, whichever of them this run booted."""
    out = []
    for f in (cache / "runs").glob("*/result.json"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: release_key(r.get("kernel", "")), reverse=True)


def release_key(release: str) -> tuple[int, ...]:
    """5.10.0-32-amd64 -> (5, 10, 0, 32): kernels in version order."""
    return tuple(int(n) for n in re.findall(r"\d+", release)[:4])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["guest"]:
        return guest(argv[1:])
    ap = argparse.ArgumentParser(prog="nptrace-kernels")
    ap.add_argument("--kernel", action="append", choices=sorted(SUITES))
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--short", action="store_true", help=f"doctor and {', '.join(SHORT[1])} on {SHORT[0]}")
    ap.add_argument("--markdown")
    ap.add_argument("--timeout", type=float, default=BOOT_TIMEOUT)
    ap.add_argument("--report", action="store_true",
                    help="the table of the kernels' last stored results, without booting")
    ap.add_argument("scenarios", nargs="*")
    a = ap.parse_args(argv)
    kernels = a.kernel or ([SHORT[0]] if a.short else list(DEFAULT_KERNELS))
    scen = a.scenarios or (list(SHORT[1]) if a.short else [])
    try:
        vng = ensure_tools()
        got = [fetch(k) for k in kernels]
    except MatrixError as e:
        print(f"nptrace-kernels: {e}", file=sys.stderr)
        return 2
    results = []
    for k in got:
        out = CACHE / "runs" / k.release
        if a.report:
            stored = out / "result.json"
            results.append(json.loads(stored.read_text()) if stored.exists()
                           else {"kernel": k.release, "error": "no stored result"})
            continue
        kvm = kvm_works(vng, k)
        accel = "KVM" if kvm else "TCG"
        print(f"== {k.release} ({k.suite}) under {accel}", file=sys.stderr, flush=True)
        r = boot(vng, k, ["--count", str(a.count), *scen], out, kvm, a.timeout)
        r["accel"] = accel
        if a.scenarios and (out / "result.previous.json").exists():
            r = merged(json.loads((out / "result.previous.json").read_text()), r)
        if "error" not in r:
            # with the time, commit and accelerator the guest cannot know: what --report and
            # a later run's merge show for these rows
            (out / "result.json").write_text(json.dumps(r, indent=1))
        results.append(r)
        print(table([r]), file=sys.stderr, flush=True)
    print(table(results))
    if a.markdown:
        ran = {r.get("kernel") for r in results}
        page = sorted(results + [r for r in stored_results() if r.get("kernel") not in ran],
                      key=lambda r: release_key(r.get("kernel", "")), reverse=True)
        md = table(page)
        commit = ", ".join(sorted({r["commit"] for r in page if r.get("commit")})) or \
            _run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        md_path = Path(a.markdown)
        notes = kept_sections(md_path.read_text() if md_path.exists() else "")
        md_path.write_text(
            "# Kernel matrix\n\nEach kernel is Debian's `linux-image` of its suite, booted under "
            "qemu by `make test-kernels` (python -m nptrace.lab.kernels; virtme-ng); in it "
            "`nptrace doctor` and each lab scenario's first yardstick case "
            f"({a.count} attempts; nptrace/lab/scorecard.py), with the kprobe programs' run "
            "counts (bpf_stats) read while the tracer is attached.\n\n"
            f"{time.strftime('%Y-%m-%d')}, commit {commit}.\n\n{md}\n" + (f"\n{notes}" if notes else ""))
    bad = failures(results)
    for line in bad:
        print(f"FAIL {line}", file=sys.stderr)
    ok = sum(1 for r in results if r.get("doctor", {}).get("ok")) + \
        sum(1 for r in results for s in r.get("scenarios", ())
            if "hit" in s and verdict(s, lost_causes(r.get("doctor", {})))[0])
    print(f"kernels: {ok} passed, {len(bad)} failed")   # doctors and scenarios
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
