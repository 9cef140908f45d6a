"""`nptrace doctor`: what this kernel, this process and this node allow, and what is lost.

One row per probe (nptrace/kernel/features.py) and per node check (nptrace/node/checks.py): area, check,
status (ok, warn, missing, fail, unknown), detail, and for anything not ok what nptrace cannot
see because of it. The hook rows (tracepoints, kprobes, tc, netfilter bpf: the hook table's,
nptrace/kernel/hooks.py) carry what `nptrace run` does about them, from the same plan run
uses (nptrace/kernel/attach.py), so doctor and run cannot disagree. Exit 0 when tracing is possible, 1 when it is not (a required probe failed),
with a one-line reason on stderr. Trial loads (fentry, ...) go through nptrace.kernel.loader and bcc,
imported only inside the command and only on the real root. The `hot path` row says whether
this install runs the hot path compiled (setup.py, nptrace/compiled.py) or as Python, and why;
`nptrace run` says the same once at start when it runs as Python.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from nptrace.errors import one_line_errors
from nptrace.config import Config
from nptrace.kernel import attach
from nptrace.kernel import features as feat
from nptrace.node import checks as nodemod

__all__ = ["Report", "Row", "build_report", "doctor_command", "exit_code", "hot_path",
           "hot_path_line", "render"]

STATUSES = ("ok", "warn", "missing", "fail", "unknown")
_COLORS = {"ok": {"fg": "green"}, "warn": {"fg": "yellow", "bold": True},
           "missing": {"fg": "yellow"}, "fail": {"fg": "red", "bold": True},
           "unknown": {"fg": "cyan"}}
_DETAIL_WIDTH = 64   # pad details up to this; longer ones just push their cost right


@dataclass(frozen=True)
class Row:
    area: str
    check: str
    status: str
    detail: str
    cost: str = ""      # what is lost; shown only when status is not ok
    remedy: str = ""

    def to_dict(self) -> dict:
        return {"area": self.area, "check": self.check, "status": self.status,
                "detail": self.detail, "cost": self.cost, "remedy": self.remedy}


@dataclass(frozen=True)
class Report:
    kernel: str
    rows: tuple[Row, ...]
    ok: bool            # tracing is possible
    reason: str         # one line; "" when ok

    def to_dict(self) -> dict:
        return {"ok": self.ok, "exit_code": exit_code(self), "reason": self.reason,
                "kernel": self.kernel, "rows": [r.to_dict() for r in self.rows]}


# The hot path compiled by Cython from its own sources (setup.py, nptrace/compiled.py), and
# what running it as Python costs (make bench's pipeline figures).
HOT_PATH_COST = "a storm's records are labeled more slowly: the ring fills sooner"
HOT_PATH_REMEDY = ("make setup; or apt-get install gcc libc6-dev python3-dev, pip install Cython, "
                   "then pip install -e . again in nptrace's venv")


def hot_path() -> str:
    """"compiled" when the hot path's modules run compiled, else "python: <module>: <why>"."""
    from nptrace import compiled
    return compiled.hot_path()


def _hot_path_remedy(state: str) -> str:
    return "unset NPTRACE_PURE" if "NPTRACE_PURE=1" in state else HOT_PATH_REMEDY


def hot_path_line(state: str) -> str | None:
    """`nptrace run`'s one start-up line when it runs the pure paths (None when compiled), so
    a node that keeps up less is explainable from its log."""
    if state == "compiled":
        return None
    return f"hot path: {state}; {HOT_PATH_COST} (remedy: {_hot_path_remedy(state)})"


def build_report(features: feat.Features, node_checks: nodemod.NodeChecks | None = None,
                 cfg: Config | None = None, header_source=None,
                 hot_path: str | None = None, plan_load=None) -> Report:
    """`cfg`: the run configuration the hook rows are planned for (default: `nptrace run`'s).
    `header_source`: kernel/headers.py find()'s answer, a row of its own (fail when none).
    `hot_path`: hot_path()'s answer, a row of its own (warn when "python: ...").
    `plan_load`: a function of the plan giving attach.trial()'s (ok, line): the plan compiled
    and loaded for real, a row of its own; its failure makes tracing impossible."""
    plan = attach.plan(features, cfg or Config())
    loaded = plan_load(plan) if plan_load is not None and not features.failures else None
    hook_rows = set(feat.HOOK_ROWS)
    rows = [Row(r.area, r.name, r.status, plan.detail(r) if r.name in hook_rows else r.detail,
                "" if r.status == "ok" else r.cost)
            for r in features.results]
    hs = header_source
    if hs is not None:
        rows.append(Row("kernel", "headers", "fail" if hs.kind == "none" else "ok",
                        f"{hs.kind}: {hs.detail}", "bcc cannot compile the probes" if
                        hs.kind == "none" else ""))
    if hot_path is not None:
        pure = hot_path != "compiled"
        from nptrace.compiled import MODULES
        detail = hot_path if pure else "compiled (" + ", ".join(m.split(".", 1)[1] for m in MODULES) + ")"
        rows.append(Row("nptrace", "hot path", "warn" if pure else "ok", detail,
                        HOT_PATH_COST if pure else "", _hot_path_remedy(hot_path) if pure else ""))
    if loaded is not None:
        rows.append(Row("bpf", "plan load", "ok" if loaded[0] else "fail", loaded[1],
                        "" if loaded[0] else "nptrace run cannot start on this kernel"))
    if node_checks is not None:
        area = f"node ({node_checks.netns})" if node_checks.netns else "node"
        rows += [Row(area, f.check, f.status, f.detail, "" if f.status == "ok" else f.cost,
                     f.remedy) for f in node_checks.findings]
    fails = features.failures
    reason = ""
    if fails or (hs is not None and hs.kind == "none"):
        why = [feat.PROBES[r.name].fail_reason or f"{r.name}: {r.detail}" for r in fails]
        why += [f"no kernel headers ({hs.detail})"] if hs is not None and hs.kind == "none" else []
        reason = "tracing is not possible: " + "; ".join(why)
    elif loaded is not None and not loaded[0]:
        reason = f"tracing is not possible: the plan `run` would use does not load ({loaded[1]})"
    return Report(features.kernel, tuple(rows), not reason, reason)


def exit_code(report: Report) -> int:
    return 0 if report.ok else 1


def _style(text: str, status: str, color: bool) -> str:
    return click.style(text, **_COLORS.get(status, {})) if color else text


def render(report: Report, color: bool = False) -> str:
    head = ("AREA", "CHECK", "STATUS", "DETAIL", "COST")
    w = [max([len(head[i])] + [len(getattr(r, f)) for r in report.rows])
         for i, f in enumerate(("area", "check", "status"))]
    wd = min(_DETAIL_WIDTH, max([len(head[3])] + [len(r.detail) for r in report.rows]))
    has_cost = any(r.cost for r in report.rows)

    def line(area, check, status, detail, cost, st=None):
        cells = [area.ljust(w[0]), check.ljust(w[1]),
                 (_style(status, st, color) if st else status) + " " * (w[2] - len(status))]
        cells.append(detail.ljust(wd) if has_cost else detail)
        if has_cost:
            cells.append(cost)
        return "  ".join(cells).rstrip()

    out = [f"nptrace doctor: kernel {report.kernel or 'unknown'}", ""]
    out.append(line(*head[:4], head[4] if has_cost else ""))
    for r in report.rows:
        out.append(line(r.area, r.check, r.status, r.detail, r.cost, r.status))
    remedies = [r for r in report.rows if r.remedy]
    if remedies:
        out += ["", "remedies:"]
        out += [f"  {r.check}: {r.remedy}" for r in remedies]
    counts = {s: sum(r.status == s for r in report.rows) for s in STATUSES}
    tally = ", ".join(f"{n} {s}" for s, n in counts.items() if n and s != "ok")
    out.append("")
    if report.ok:
        out.append("result: tracing is possible" + (f" ({tally})" if tally else ""))
    else:
        out.append(_style("result: " + report.reason, "fail", color))
    return "\n".join(out) + "\n"


def _trial_function():
    """nptrace.kernel.loader.trial_load (bcc), or None when the loader cannot be imported."""
    try:
        from nptrace.kernel.loader import trial_load
    except Exception:
        return None
    return trial_load


@click.command("doctor", epilog="""\b
Examples:
  sudo nptrace doctor                 kernel, privileges and node settings
  sudo nptrace doctor --json | jq '.rows[] | select(.status != "ok")'
  sudo nptrace doctor --netns npt-node1   node settings inside a lab node
""")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@click.option("--netns", metavar="NAME",
              help="Check rp_filter, conntrack and kube-proxy rules inside this named "
                   "network namespace instead of the current one.")
@click.option("--trials/--no-trials", default=True, show_default=True,
              help="Trial-load programs the kernel may refuse (fentry), and compile and load "
                   "the plan `run` would use; needs root and bcc.")
@click.option("--mount-tracefs", is_flag=True,
              help="Mount tracefs at /sys/kernel/tracing if it is not mounted.")
@click.option("--color/--no-color", default=None, help="Colour the status column (default: on a tty).")
@click.option("--root", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default="/", hidden=True)
@click.pass_context
@one_line_errors
def doctor_command(ctx, as_json, netns, trials, mount_tracefs, color, root):
    """Report what this kernel and node allow, and what is lost without each feature.

    Exit status 0 when tracing is possible, 1 when it is not.
    """
    real = root == Path("/")
    trial_fn = None
    if trials and real and feat.has_bpf_caps(root):
        trial_fn = _trial_function()
    from nptrace.kernel import headers    # fixture trees (--root) carry no headers: real root only
    hs = headers.find(os.uname().release) if real else None
    if hs is not None and hs.kind != "none":
        headers.select(hs)     # the trials compile as `run` does, against the same headers
    features = feat.probe(root, trials=trial_fn, mount_tracefs=mount_tracefs and real)
    node_checks = nodemod.check(root, netns=netns)   # NodeError: one line, exit 2
    # the plan compiled and loaded for real: only with bcc, privileges and headers
    plan_load = attach.trial if trial_fn is not None and hs is not None and hs.kind != "none" \
        else None
    report = build_report(features, node_checks, header_source=hs, hot_path=hot_path(),
                          plan_load=plan_load)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(render(report, color=sys.stdout.isatty() if color is None else color),
                   nl=False, color=True)
    if not report.ok:
        click.echo(f"nptrace doctor: {report.reason}", err=True)
    ctx.exit(exit_code(report))
