"""How well nptrace names causes: every lab scenario traced by the real `nptrace run --json`,
the labels of the scenario's own flows counted into a confusion matrix.

    python -m nptrace.lab.scorecard [--count 100] [--markdown docs/confusion.md] [SCENARIO ...]

A flow belongs to a scenario's trigger when one of its ports is a client port of an attempt
(masquerade keeps the client's port; ephemeral ports are unique within one run).
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field

from nptrace.lab.harness import scenario_events, trace_scenario

HEALTHY = "none"          # the expected label of scenarios with no network fault
FAULTLESS = {"app_reset"}  # labels that do not blame the network


@dataclass
class Score:
    scenario: str
    expected: str
    attempts: int
    outcomes: Counter
    labels: Counter = field(default_factory=Counter)
    services: Counter = field(default_factory=Counter)
    stderr: str = ""
    as_expected: int = 0       # attempts whose client-visible outcome is the scenario's
    # the first incidents labeled otherwise than expected, whole: what a flaky case needs read
    mislabeled: list = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.labels.values())

    @property
    def hit_rate(self) -> float:
        if self.expected == HEALTHY:
            return 1.0 if not self.total else 0.0
        return self.labels[self.expected] / self.total if self.total else 0.0


def score(name: str, expected: str | None, count: int, backend: str = "iptables",
          variant: str | None = None, prefix: str | None = None, watch: bool = True,
          observe: float = 1.0, max_rate: int | None = 0) -> Score:
    """max_rate 0 (the yardstick): attribution given every record; None: nptrace's default
    storm sampling, which sends whole flows or none (bpf/npt_common.h npt_rate_ok)."""
    inodes: dict = {}
    extra = () if max_rate is None else ("--max-rate", str(max_rate))
    info, attempts, events, err = trace_scenario(name, count, backend=backend, prefix=prefix,
                                                 watch=watch, variant=variant, settle=observe,
                                                 inode_sink=inodes, extra_args=extra)
    mine = scenario_events(attempts, events, set(inodes.values()))
    s = Score(name + (f"/{variant}" if variant else "") + (f"@{backend}" if backend != "iptables" else ""),
              expected or HEALTHY, len(attempts), Counter(a.outcome for a in attempts), stderr=err,
              as_expected=sum(1 for a in attempts if getattr(a, "expected", True)))
    for e in mine:
        # an incident gathers several kernel events; each of them got this label
        n = e.get("events", 1)
        s.labels[e["cause"]] += n
        s.services[e.get("service") or "-"] += n
        if expected and e["cause"] != expected and len(s.mislabeled) < 5:
            s.mislabeled.append(e)
    return s


def runs(sc) -> list[tuple[str, str | None]]:
    """(backend, variant) of every yardstick case of a scenario: each backend it has; each
    variant on iptables; each dual-stack form also on a second rules family (nft, or
    iptables-legacy where the scenario has no nft form)."""
    out = [(b, None) for b in sc.backends] + [("iptables", v) for v in sc.variants]
    second = next((b for b in ("nft", "iptables-legacy") if b in sc.backends), None)
    if second:
        out += [(second, v) for v in sc.variants if v == "ipv6" or v.endswith("+ipv6")]
    return out


def matrix_markdown(scores: list[Score]) -> str:
    causes = sorted({c for s in scores for c in s.labels} | {s.expected for s in scores} - {HEALTHY})
    head = "| scenario | expected | events | " + " | ".join(causes) + " | hit |"
    sep = "|" + "---|" * (len(causes) + 4)
    rows = [head, sep]
    for s in scores:
        cells = []
        for c in causes:
            n = s.labels[c]
            pct = f"{100 * n / s.total:.0f}%" if s.total and n else ""
            cells.append(pct)
        rows.append(f"| {s.scenario} | {s.expected} | {s.total} | " + " | ".join(cells)
                    + f" | {100 * s.hit_rate:.1f}% |")
    return "\n".join(rows)


def main(argv=None) -> int:
    from nptrace import lab
    ap = argparse.ArgumentParser(prog="nptrace-scorecard")
    ap.add_argument("scenarios", nargs="*")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--markdown")
    a = ap.parse_args(argv)
    scores = []
    for sc in lab.scenarios():
        if a.scenarios and sc.name not in a.scenarios:
            continue
        for backend, variant in runs(sc):
            s = score(sc.name, sc.cause, a.count, backend=backend, variant=variant,
                      observe=sc.observe)
            scores.append(s)
            print(f"{s.scenario:<32} {dict(s.outcomes)} {dict(s.labels)}", file=sys.stderr)
    md = matrix_markdown(scores)
    print(md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("# Attribution confusion matrix\n\n"
                    "Each lab scenario traced by `nptrace run --json --max-rate 0` (tc on the nodes' "
                    "interfaces), "
                    f"{a.count} client connection attempts each; cells are the share of the "
                    "scenario's own resets and drops given each cause. Regenerate with "
                    "`python -m nptrace.lab.scorecard --markdown docs/confusion.md`.\n\n" + md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
