"""`make demo`: bring a lab scenario up, trace it with the real `nptrace run`, trigger the
failure, print the labeled events, and always clean up.

    python -m nptrace.lab.demo [SCENARIO] [--count N]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

from nptrace.lab.harness import scenario_events, trace_scenario


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="nptrace-demo", description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?", default="no-listener")
    ap.add_argument("--count", type=int, default=5)
    ap.add_argument("--backend", default="iptables")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("nptrace demo: error: needs root (network namespaces and BPF): run with sudo",
              file=sys.stderr)
        return 2
    from nptrace import lab
    known = {s.name: s for s in lab.scenarios()}
    if a.scenario not in known:
        print(f"nptrace demo: error: unknown scenario {a.scenario!r}; one of: "
              f"{', '.join(sorted(known))}", file=sys.stderr)
        return 2
    sc = known[a.scenario]
    print(f"== scenario {sc.name}: {sc.story}")
    print(f"== expected cause: {sc.cause}")
    inodes: dict = {}
    info, attempts, events, err = trace_scenario(a.scenario, a.count, a.backend, settle=sc.observe,
                                                 inode_sink=inodes)
    outcomes = Counter(getattr(x, "outcome", "?") for x in attempts)
    print(f"== client saw: {dict(outcomes)}")
    mine = scenario_events(attempts, events, set(inodes.values()))   # only this lab's
    print(f"== nptrace reported {len(mine)} incidents for these connections "
          f"({sum(e.get('events', 1) for e in mine)} kernel events):")
    for e in mine[:12]:
        flow = (f"{e['client']} -> {e['frontend']} -> {e['endpoint']}" if e.get("client")
                else f"{e['saddr']}:{e['sport']} -> {e['daddr']}:{e['dport']}")
        print(f"  {e['kind']:<7} {e.get('direction') or '':<9} {e['cause']:<18} {flow}"
              f"  {e.get('iface') or '-'}"
              f"  [{e['hook']} {e['reason']}] svc={e.get('service') or '-'} events={e.get('events', 1)}")
    if len(mine) > 12:
        print(f"  ... and {len(mine) - 12} more")
    if mine:
        first = mine[0]
        print(f"== hint: {first['hint']}")
        print("== evidence of the first incident:")
        for x in first.get("evidence", [])[:10]:
            print(f"     {x['hook']:<26} {x['what']:<16} {x.get('iface') or '-':<22} {x['detail']}")
    causes = Counter(e["cause"] for e in mine)
    print(f"== causes: {dict(causes)} (expected: {sc.cause or 'none'})")
    for line in err.splitlines():
        if "attached" in line or "lost" in line:
            print(f"== {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
