"""How well nptrace names causes: every lab scenario traced by the real `nptrace run --json`,
the labels of the scenario's own flows counted into a confusion matrix.

    python -m nptrace.lab.scorecard [--count 100] [--markdown docs/confusion.md [--merge]] [SCENARIO ...]

``--merge`` re-runs only the SCENARIOs named and keeps every other row of the file as it was
(the full yardstick holds the machine for about ten minutes).

A flow belongs to a scenario's trigger when one of its ports is a client port of an attempt
(masquerade keeps the client's port; ephemeral ports are unique within one run).
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field

from nptrace.lab.errors import NotRunnable
from nptrace.lab.harness import Case, scenario_events, trace_labs, trace_scenario

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
    hint_missing: int = 0      # events of the expected cause whose hint lacks a word of `hint`
    hint_example: str = ""     # the first such hint
    tries: list = field(default_factory=list, repr=False)   # the attempts themselves
    incidents: list = field(default_factory=list, repr=False)   # the case's own, whole
    netns: dict = field(default_factory=dict, repr=False)   # its namespaces: name -> inode

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
          observe: float = 1.0, max_rate: int | None = 0, hint: tuple = (),
          after=None) -> Score:
    """max_rate 0 (the yardstick): attribution given every record; None: nptrace's default
    storm sampling, which sends whole flows or none (bpf/npt_common.h npt_rate_ok). ``hint``:
    words each incident of the expected cause must name (the scenario's ``hint``).
    ``after(case)``: called while the lab is still up, after the trigger (harness.trace_labs)."""
    inodes: dict = {}
    extra = () if max_rate is None else ("--max-rate", str(max_rate))
    info, attempts, events, err = trace_scenario(name, count, backend=backend, prefix=prefix,
                                                 watch=watch, variant=variant, settle=observe,
                                                 inode_sink=inodes, extra_args=extra,
                                                 after=after)
    return tally(Case(name, backend, variant, prefix), expected, attempts, events, inodes, err,
                 hint)


def score_labs(cases, count: int, observe: float = 1.0, after=None, raw: list | None = None,
               overlap: bool = False) -> list[Score]:
    """The yardstick for several cases under one traced run (harness.trace_labs): ``cases``
    are (Case, expected cause, hint words); ``after(case)`` runs after each case's trigger
    while the tracer is attached; ``raw`` gets every event the run printed, the cases' own
    or not; ``overlap``: each case triggered while the one before is still watched
    (harness.trace_labs). One Score per case, in order."""
    done, events, err = trace_labs([c for c, _, _ in cases], count, settle=observe,
                                   extra_args=("--max-rate", "0"), after=after,
                                   overlap=overlap)
    if raw is not None:
        raw.extend(events)
    return [tally(c, expected, attempts, events, inodes, err, hint)
            for (c, expected, hint), (_, attempts, inodes) in zip(cases, done)]


def tally(case: Case, expected: str | None, attempts, events, inodes: dict, err: str,
          hint: tuple = ()) -> Score:
    """The Score of one case: its own incidents (by its namespaces' inodes and client ports)
    counted by label."""
    mine = scenario_events(attempts, events, set(inodes.values()))
    s = Score(row_name(case.name, case.backend, case.variant), expected or HEALTHY,
              len(attempts), Counter(a.outcome for a in attempts), stderr=err,
              as_expected=sum(1 for a in attempts if getattr(a, "expected", True)),
              tries=list(attempts), incidents=mine, netns=dict(inodes))
    for e in mine:
        # an incident gathers several kernel events; each of them got this label
        n = e.get("events", 1)
        s.labels[e["cause"]] += n
        s.services[e.get("service") or "-"] += n
        if expected and e["cause"] != expected and len(s.mislabeled) < 5:
            s.mislabeled.append(e)
        if expected and e["cause"] == expected and not all(w in (e.get("hint") or "") for w in hint):
            s.hint_missing += n
            s.hint_example = s.hint_example or e.get("hint") or "(no hint)"
    return s


def runs(sc) -> list[tuple[str, str | None]]:
    """(backend, variant) of every yardstick case of a scenario: each backend it has; each
    variant on its first backend (iptables but for the ipvs scenarios); each dual-stack form
    also on a second rules family (nft, or iptables-legacy where the scenario has no nft
    form)."""
    out = [(b, None) for b in sc.backends] + [(sc.backends[0], v) for v in sc.variants]
    second = next((b for b in ("nft", "iptables-legacy") if b in sc.backends), None)
    if second:
        out += [(second, v) for v in sc.variants if v == "ipv6" or v.endswith("+ipv6")]
    return out


def cases(scenarios) -> list[tuple]:
    """(scenario, backend, variant) in the yardstick's order: each scenario's runs()."""
    return [(sc, b, v) for sc in scenarios for b, v in runs(sc)]


def row_name(name: str, backend: str, variant: str | None) -> str:
    return name + (f"/{variant}" if variant else "") + (f"@{backend}" if backend != "iptables" else "")


def parse_markdown(text: str) -> list[Score]:
    """The rows of a matrix_markdown table back as Scores (counts from the shares, rounded)."""
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    if not rows:
        return []
    head = [c.strip() for c in rows[0].strip().strip("|").split("|")]
    causes = head[3:-1]
    out = []
    for ln in rows[1:]:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        total = int(cells[2])
        labels = Counter({c: round(float(v.rstrip("%")) * total / 100)
                          for c, v in zip(causes, cells[3:-1]) if v})
        out.append(Score(cells[0], cells[1], 0, Counter(), labels))
    return out


def merge(old: list[Score], new: list[Score], order: list[str]) -> list[Score]:
    """``old`` with the rows ``new`` re-ran replaced, in the yardstick's ``order`` of row names."""
    rows = {s.scenario: s for s in old} | {s.scenario: s for s in new}
    rank = {n: i for i, n in enumerate(order)}
    return sorted(rows.values(), key=lambda s: rank.get(s.scenario, len(rank)))


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
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of the --markdown file that this run does not re-run")
    a = ap.parse_args(argv)
    from nptrace.lab.model import compile_spec
    if a.merge and not (a.markdown and a.scenarios):
        ap.error("--merge needs --markdown FILE and the SCENARIOs to re-run")
    all_cases = cases(lab.scenarios())
    scores = []
    for sc, backend, variant in all_cases:
        if a.scenarios and sc.name not in a.scenarios:
            continue
        try:
            s = score(sc.name, sc.cause, a.count, backend=backend, variant=variant,
                      observe=sc.observe, hint=compile_spec(sc.name, variant).hint)
        except NotRunnable as e:   # this kernel lacks what the case needs: said, not scored
            print(f"{row_name(sc.name, backend, variant):<32} {e}", file=sys.stderr)
            continue
        scores.append(s)
        print(f"{s.scenario:<32} {dict(s.outcomes)} {dict(s.labels)}", file=sys.stderr)
    if a.merge:
        try:
            with open(a.markdown) as f:
                old = parse_markdown(f.read())
        except FileNotFoundError:
            old = []
        scores = merge(old, scores, [row_name(sc.name, b, v) for sc, b, v in all_cases])
    md = matrix_markdown(scores)
    print(md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("# Attribution confusion matrix\n\n"
                    "Each lab scenario traced by `nptrace run --json --max-rate 0` (tc on the nodes' "
                    "interfaces), "
                    f"{a.count} client connection attempts each; cells are the share of the "
                    "scenario's own resets and drops given each cause. The `/ipv6` rows are the "
                    "dual-stack forms (IPv6 trigger, ip6tables or nft `ip6 kube-proxy` rules beside "
                    "IPv4's). Regenerate with "
                    "`python -m nptrace.lab.scorecard --markdown docs/confusion.md` (the whole "
                    "yardstick, tests/privileged/test_attribution.py's cases), or re-run some "
                    "scenarios' rows with `--merge SCENARIO ...`"
                    + (f" (this one: {', '.join(a.scenarios)} re-run, the other rows kept)" if a.merge else "")
                    + ".\n\n" + md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
