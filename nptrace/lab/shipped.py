"""The shipped form's yardstick: each generated-tier scenario traced as a node runs nptrace
(the systemd unit, the DaemonSet): one plain `nptrace run`, no --iface, inside each lab node's
namespace (harness.trace_labs nodes=True; node/scope.py), scored per connection as the real
tier's yardstick scores it (lab/real/yardstick.py score): every failed connection labeled with
the scenario's cause and its Service by every line any node printed about it.

    python -m nptrace.lab.shipped [--form node --form lab] [--count 10] [--kernel 6.1 ...]
        [--markdown docs/shipped.md] [SCENARIO ...]

Each scenario on its first rules backend, one scenario a traced run (the object cache warm
after the first). IPVS scenarios need a kernel with IPVS: a guest's (--kernel). Exit 0 when
every row is right, 1 otherwise, 2 on bad usage.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

from .errors import LabError, NotRunnable
from .harness import Case, trace_labs
from .model import load_scenarios
from .real.yardstick import (Row, commit, lab_namespaces, markdown, masq_ports, read_table, score,
                             write_table)

FORMS = ("node", "lab", "plain")


def run_case(sc, form: str, count: int) -> Row:
    backend = sc.backends[0]
    row = Row("generated", backend, platform.release(), sc.name, form, sc.cause or "none")
    t0 = time.monotonic()
    try:
        alias: dict[int, int] = {}
        done, events, _ = trace_labs([Case(sc.name, backend, observe=sc.observe)], count,
                                     settle=sc.observe, extra_args=("--max-rate", "0"),
                                     watch=form == "lab", nodes=form == "node",
                                     after=lambda c: alias.update(masq_ports(lab_namespaces(c))))
        _, attempts, inodes = done[0]
        score(row, sc.service, attempts, events, inodes, alias)
    except NotRunnable as e:
        row.error = f"not runnable: {e}"
    except (LabError, RuntimeError) as e:
        row.error = str(e).splitlines()[0][:120]
    row.seconds = time.monotonic() - t0
    return row


def guest_rows(kernel: str, a) -> list[Row]:
    """The same cases run by this module inside Debian's ``kernel`` under qemu: its rows."""
    from .kernels import CACHE, MatrixError, run_in_guest
    out = CACHE / "runs" / f"shipped-{kernel}"
    args = ["nptrace.lab.shipped", "--in-guest", "--rows-json", str(out / "rows.json"),
            "--count", str(a.count), *[x for f in a.form or () for x in ("--form", f)],
            *a.scenarios]
    (out / "rows.json").unlink(missing_ok=True)
    print(f"== kernel {kernel} under qemu", file=sys.stderr, flush=True)
    try:
        run_in_guest(kernel, " ".join(args), out)
    except MatrixError as e:
        return [Row("generated", "-", kernel, "-", "-", "-", error=f"not runnable: {e}")]
    if not (out / "rows.json").exists():
        return [Row("generated", "-", kernel, "-", "-", "-", error=f"no rows: see {out}/guest.log")]
    keep = {f.name for f in dataclasses.fields(Row)}
    return [Row(**{k: v for k, v in r.items() if k in keep})
            for r in json.loads((out / "rows.json").read_text())]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nptrace.lab.shipped",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--form", action="append", choices=FORMS, help="tracer form (repeatable) [node]")
    ap.add_argument("--count", type=int, default=10, help="connections per scenario [10]")
    ap.add_argument("--kernel", action="append", choices=("6.1", "6.12", "5.10"),
                    help="run the cases in this Debian kernel under qemu instead (repeatable)")
    ap.add_argument("--markdown", type=Path, help="write the table into this file (between its markers)")
    ap.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows-json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("scenarios", nargs="*", help="scenario names [all]")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("shipped: needs root (network namespaces, BPF)", file=sys.stderr)
        return 2
    known = {sc.name: sc for sc in load_scenarios()}
    unknown = [n for n in a.scenarios if n not in known]
    if unknown:
        print(f"shipped: no scenario {' '.join(unknown)}", file=sys.stderr)
        return 2
    if a.in_guest:
        from .kernels import prepare_guest
        prepare_guest()
    rows: list[Row] = []
    if a.kernel and not a.in_guest:
        for k in a.kernel:
            rows += guest_rows(k, a)
    else:
        for name in a.scenarios or list(known):
            for form in a.form or ("node",):
                row = run_case(known[name], form, a.count)
                rows.append(row)
                print("  ".join(row.cells()), flush=True)
                for p, incs in row.examples:
                    print(f"    port {p}: {incs}", flush=True)
    if a.rows_json:
        a.rows_json.write_text(json.dumps([dataclasses.asdict(r) for r in rows]))
    if a.markdown:
        write_table(a.markdown, markdown(rows, commit(), read_table(a.markdown)))
    bad = [r for r in rows if not r.ok]
    print(f"shipped: {len(rows) - len(bad)} passed, {len(bad)} failed", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
