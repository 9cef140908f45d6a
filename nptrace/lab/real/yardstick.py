"""The real tier's yardstick: each scenario a real control plane and a real kube-proxy set up,
traced by `nptrace run --json` as the generated tier's yardstick traces it, scored per
connection.

    python -m nptrace.lab.real.yardstick [--release current] [--mode iptables --mode nft]
        [--form lab --form plain] [--count 10] [--markdown docs/k8s.md] [SCENARIO[/VARIANT] ...]

Forms: ``lab``, the lab's node devices given with -i (the yardstick's form); ``plain``, one
`nptrace run` in the root namespace with no -i; ``node``, the shipped form: one plain
`nptrace run` in each lab node's namespace, as a node runs it (docs/shipped.md). Per case: the failed connections (the client
saw anything but ok), how many of them every incident labels with the scenario's cause, how
many name its Service, incidents per failed connection, and the wall time. A line is about a
connection when it shows the client's port, or a port the lab's conntrack tables say a
masquerade gave that connection (--random-fully: the endpoint's node sees that port alone). A healthy
scenario's row counts the incidents about its connections (there should be none).
Exit 0 when every row is 100%, 1 otherwise, 2 when the release is not built.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LabError, NotRunnable, UsageError
from ..harness import Case, ports_of, scenario_events, trace_labs
from ..model import load_scenarios
from . import releases

FORMS = ("lab", "plain", "node")
DEFAULT_MODES = ("iptables", "nft")


@dataclass
class Row:
    release: str
    mode: str
    kernel: str
    case: str
    form: str
    expected: str
    connections: int = 0          # attempts
    failed: int = 0               # attempts the client saw fail
    right: int = 0                # failed connections whose every incident has the expected cause
    named: int = 0                # failed connections whose every incident names the Service
    incidents: int = 0            # incidents about failed connections
    stray: int = 0                # incidents about connections that worked
    seconds: float = 0.0
    error: str = ""
    examples: list = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        if self.error:
            return False
        if self.expected == "none":
            return self.failed == 0 and self.stray == 0
        return self.failed > 0 and self.right == self.failed and self.named == self.failed

    def cells(self) -> list[str]:
        pct = (lambda n: f"{100 * n / self.failed:.0f}%" if self.failed else "-")
        per = f"{self.incidents / self.failed:.2f}" if self.failed else "-"
        return [self.release, self.mode, self.kernel, self.case, self.form, self.expected,
                f"{self.failed}/{self.connections}", pct(self.right), pct(self.named), per,
                str(self.stray), f"{self.seconds:.0f} s", "ok" if self.ok else (self.error or "FAIL")]


HEADER = ["release", "mode", "kernel", "scenario", "form", "cause", "failed/conns", "cause right",
          "Service named", "lines/conn", "stray", "time", "result"]


def real_cases(names=()) -> list[tuple[str, str | None, str, str, tuple[str, ...]]]:
    """(scenario, variant, expected cause, Service, its rules backends) of every form the
    real tier runs (a scenario whose fault one mode's rules cannot make, conntrack-invalid's
    KUBE-FORWARD drop in nftables mode, lists only the others)."""
    out = []
    for sc in load_scenarios():
        for v in sc.real:
            label = sc.name + (f"/{v}" if v else "")
            if names and label not in names:
                continue
            out.append((sc.name, v or None, sc.cause or "none", sc.service, sc.backends))
    if names and not out:
        raise UsageError(f"no real-tier scenario {' '.join(names)}")
    return out


def _ports(e: dict) -> set[int]:
    """The ports an incident shows: its tuple's, its conntrack entry's and its evidence's (a
    --random-fully masquerade gives the pod side another port; the client side keeps it)."""
    ports = {e.get("sport"), e.get("dport")}
    if e.get("conntrack"):
        ports.add(e["conntrack"]["orig"][1])
    for x in e.get("evidence", ()):
        ports |= ports_of(x.get("detail", ""))
    return ports


def lab_namespaces(case) -> list[str]:
    """The namespaces of an up lab (its nodes' conntrack tables are among them)."""
    from nptrace import lab
    return list((lab.status(prefix=case.prefix) or {}).get("namespaces", []))


def masq_ports(namespaces) -> dict[int, int]:
    """{port a masquerade gave: the client's port} from the conntrack tables of the lab's
    nodes (read while the lab is up). A node's tracer sees a connection another node
    masqueraded (--random-fully picks a new port) by that port alone: the scorer ties it to its
    client with the kernel's own table, as an SRE would with conntrack -L."""
    out: dict[int, int] = {}
    for ns in namespaces:
        r = subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-L", "-p", "tcp"],
                           capture_output=True, text=True)
        for line in r.stdout.splitlines():
            kv = [w.split("=", 1) for w in line.split() if "=" in w]
            vals = [v for k, v in kv if k in ("src", "dst", "sport", "dport")]
            if len(vals) < 8:
                continue
            (osrc, odst, osport, _), (_, rdst, _, rdport) = vals[0:4], vals[4:8]
            if rdst != osrc and rdport.isdigit() and osport.isdigit():
                out[int(rdport)] = int(osport)
    return out


def score(row: Row, service: str, attempts, events, inodes: dict,
          alias: dict[int, int] | None = None) -> Row:
    mine = scenario_events(attempts, events, set(inodes.values()))
    if alias:                # a node's lines about connections another node masqueraded
        known = {id(e) for e in mine}
        ports = {a.sport for a in attempts}
        mine += [e for e in events if id(e) not in known
                 and any(alias.get(p) in ports for p in _ports(e) if p)
                 and e.get("netns") in set(inodes.values())]
    failed = {a.sport for a in attempts if a.outcome != "ok"}
    row.connections, row.failed = len(attempts), len(failed)
    by_port: dict[int, list[dict]] = {p: [] for p in failed}
    for e in mine:
        seen = _ports(e)
        hit = (seen | {alias[p] for p in seen if alias and p in alias}) & failed
        if not hit:
            row.stray += 1
        for p in hit:
            by_port[p].append(e)
    for p, incs in by_port.items():
        row.incidents += len(incs)
        if incs and all(e["cause"] == row.expected for e in incs):
            row.right += 1
        elif len(row.examples) < 3:
            row.examples.append((p, [(e["cause"], e.get("service"), e.get("summary_line") or e.get("hint", ""))
                                     for e in incs]))
        if incs and all(e.get("service") == service for e in incs):
            row.named += 1
    return row


def run_case(rel: releases.Release, mode: str, form: str, name: str, variant: str | None,
             expected: str, service: str, count: int) -> Row:
    row = Row(rel.version, mode, platform.release(), name + (f"/{variant}" if variant else ""), form, expected)
    t0 = time.monotonic()
    try:
        observe = next(s.observe for s in load_scenarios() if s.name == name)
        alias: dict[int, int] = {}
        done, events, _err = trace_labs([Case(name, mode, variant, observe=observe, real=True,
                                              release=rel.name)], count, settle=observe,
                                        extra_args=("--max-rate", "0"), watch=form == "lab",
                                        nodes=form == "node", after=lambda c: alias.update(
                                            masq_ports(lab_namespaces(c))))
        _, attempts, inodes = done[0]
        score(row, service, attempts, events, inodes, alias)
    except NotRunnable as e:
        row.error = f"not runnable: {e}"
    except (LabError, RuntimeError) as e:
        row.error = str(e).splitlines()[0][:120]
    row.seconds = time.monotonic() - t0
    return row


def markdown(rows: list[Row], commit: str, earlier: str = "") -> str:
    """The table of ``rows``, each dated with ``commit``; rows of ``earlier`` (the table as it
    was) for a release, mode, kernel, scenario and form this run did not measure are kept,
    with their own date and commit (a guest's IPVS rows take an hour under TCG)."""
    day = datetime.date.today().isoformat()
    new = {tuple(r.cells()[:5]): "| " + " | ".join([*r.cells(), f"{day} {commit}"]) + " |" for r in rows}
    kept = []
    for line in earlier.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(HEADER) + 1 and cells[0] not in ("release", "---") \
                and tuple(cells[:5]) not in new:
            kept.append(line)
    lines = ["| " + " | ".join([*HEADER, "measured"]) + " |", "|" + "---|" * (len(HEADER) + 1)]
    return "\n".join(lines + list(new.values()) + kept) + "\n"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=releases.K8S_DIR.parent, timeout=10).stdout.strip() or "?"
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nptrace.lab.real.yardstick", description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", action="append", help="k8s/releases name or version (repeatable) [current]")
    ap.add_argument("--mode", action="append", choices=("iptables", "nft", "ipvs"),
                    help="kube-proxy mode (repeatable) [iptables, nft]")
    ap.add_argument("--form", action="append", choices=FORMS, help="tracer form (repeatable) [lab]")
    ap.add_argument("--count", type=int, default=10, help="connections per case [10]")
    ap.add_argument("--markdown", type=Path, help="write the table into this file (between its markers)")
    ap.add_argument("--kernel", action="append", choices=("6.1", "6.12", "5.10"),
                    help="also run the cases in this Debian kernel under qemu (lab/kernels.py), "
                         "where IPVS is (repeatable)")
    ap.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows-json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("cases", nargs="*", help="SCENARIO or SCENARIO/VARIANT [every real-tier form]")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("yardstick: needs root (network namespaces, BPF)", file=sys.stderr)
        return 2
    if a.in_guest:
        from ..kernels import prepare_guest
        prepare_guest()
    try:
        rels = [releases.get(r) for r in (a.release or [None])]
        for r in rels:
            for comp in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-proxy"):
                releases.binary(r, comp)
        cases = real_cases(a.cases)
    except (NotRunnable, UsageError) as e:
        print(f"yardstick: {e}", file=sys.stderr)
        return 2
    rows = []
    for k in a.kernel or ():
        rows += guest_rows(k, a)
    for rel in rels:
        for mode in a.mode or DEFAULT_MODES:
            if a.kernel and not a.in_guest and mode == "ipvs":
                continue            # this kernel's IPVS: the guests ran it
            for form in a.form or ("lab",):
                for name, variant, expected, service, backends in cases:
                    if mode != "ipvs" and mode not in backends:
                        continue
                    rows.append(show(run_case(rel, mode, form, name, variant, expected,
                                              service, a.count)))
    return finish(rows, a, "yardstick")


def show(row: Row) -> Row:
    """A row's line, and the incidents of up to three connections it got wrong."""
    print("  ".join(row.cells()), flush=True)
    for p, incs in row.examples:
        print(f"    port {p}: {incs}", flush=True)
    return row


def finish(rows: list[Row], a, name: str) -> int:
    """The rows to --rows-json (a guest's answer) and --markdown; 0 when every row is ok."""
    if a.rows_json:
        a.rows_json.write_text(json.dumps([dataclasses.asdict(r) for r in rows]))
    if a.markdown:
        write_table(a.markdown, markdown(rows, commit(), read_table(a.markdown)))
    bad = [r for r in rows if not r.ok]
    print(f"{name}: {len(rows) - len(bad)} passed, {len(bad)} failed", file=sys.stderr)
    return 1 if bad else 0


def guest_rows(kernel: str, a) -> list[Row]:
    """The same cases run by this module inside Debian's ``kernel`` under qemu: its rows."""
    args = ["--count", str(a.count)]
    for opt, vals in (("--release", a.release), ("--mode", a.mode), ("--form", a.form)):
        for v in vals or ():
            args += [opt, v]
    return rows_in_guest(kernel, "nptrace.lab.real.yardstick", f"real-{kernel}", [*args, *a.cases])


def rows_in_guest(kernel: str, module: str, run: str, args: list[str]) -> list[Row]:
    """``python -m module --in-guest --rows-json ... args`` in Debian's ``kernel`` under qemu
    (lab/kernels.py; output in its runs/``run``): the rows it wrote, or one row saying why
    there are none."""
    from ..kernels import CACHE, MatrixError, run_in_guest
    out = CACHE / "runs" / run
    (out / "rows.json").unlink(missing_ok=True)
    print(f"== kernel {kernel} under qemu: {module} {' '.join(args)}", file=sys.stderr, flush=True)
    try:
        release, _accel = run_in_guest(
            kernel, " ".join([module, "--in-guest", "--rows-json", str(out / "rows.json"), *args]), out)
    except MatrixError as e:
        return [Row("-", "-", kernel, "-", "-", "-", error=f"not runnable: {e}")]
    if not (out / "rows.json").exists():
        tail = (out / "guest.log").read_text(errors="replace").strip().splitlines()[-2:] \
            if (out / "guest.log").exists() else []
        return [Row("-", "-", release, "-", "-", "-", error="; ".join(tail)[-200:] or "no result")]
    rows = []
    for d in json.loads((out / "rows.json").read_text()):
        d.pop("examples", None)
        rows.append(show(Row(**d)))
    return rows


BEGIN, END = "<!-- real-tier table: begin -->", "<!-- real-tier table: end -->"


def read_table(path: Path) -> str:
    text = path.read_text() if path.exists() else ""
    return text.partition(BEGIN)[2].partition(END)[0]


def write_table(path: Path, table: str) -> None:
    """The table between the file's markers (the rest of the page is prose kept as it is)."""
    text = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


if __name__ == "__main__":
    sys.exit(main())
