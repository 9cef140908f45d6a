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
import os
import platform
import sys
import time
from pathlib import Path

from .errors import LabError, NotRunnable
from .harness import Case, trace_labs
from .model import load_scenarios
from .real.yardstick import Row, finish, lab_namespaces, masq_ports, rows_in_guest, score, show

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
        forms = [x for f in a.form or () for x in ("--form", f)]
        for k in a.kernel:
            rows += rows_in_guest(k, "nptrace.lab.shipped", f"shipped-{k}",
                                  ["--count", str(a.count), *forms, *a.scenarios])
    else:
        for name in a.scenarios or list(known):
            for form in a.form or ("node",):
                rows.append(show(run_case(known[name], form, a.count)))
    return finish(rows, a, "shipped")


if __name__ == "__main__":
    sys.exit(main())
