"""The yardstick: every lab scenario traced by the real `nptrace run --json --max-rate 0`
(one process in the root namespace, tc on the lab nodes' interfaces, every record sent),
100 connection attempts each (each dual-stack form, variant ipv6 or NAME+ipv6, on iptables and
on a second rules backend, nft or else iptables-legacy: scorecard.runs); and one burst under
the default storm sampling. At least 99% of the kernel events behind the scenario's own
incidents carry the scenario's cause and Service; healthy and app-reset traffic gets no network-fault label. The confusion matrix is
printed (pytest -s, or the -rA summary) and kept in docs/confusion.md. Where a scenario
names ``hint`` words (the interface, device or numbers at fault), 99% of its incidents' hints
must contain them. Each case also checks the lab's own symptom while it is up: what its
client and its load balancer's health checks see (symptoms.py). The cases run one after
another in this one process: conntrack-table-full
lowers the host-wide nf_conntrack_max while it is up, and the lab refuses to bring up another
scenario meanwhile (nptrace/lab/netns.py set_host_wide)."""
import json
import os
import sys

import pytest

from nptrace import lab
from nptrace.lab import model
from nptrace.lab.errors import HostBusy, NotRunnable
from nptrace.lab.scorecard import HEALTHY, FAULTLESS, cases, matrix_markdown, score
from symptoms import check_symptom  # noqa: E402

pytestmark = pytest.mark.privileged
COUNT = int(os.environ.get("NPT_ATTRIBUTION_COUNT", "100"))
PREFIX = f"npt-at{os.getpid() % 10000}-"
CASES = cases(lab.scenarios())
SCORES = []
# Cases the lab reproduces and nptrace does not yet label right: strict, so a fix shows up as
# a failure that asks for the entry to go.
KNOWN_GAPS: dict = {}


# Cases whose score moves between runs of the same code (to be made deterministic, not
# hidden: each entry's value names its flake).
FLAKY: dict = {}


def _case(sc, b, v):
    gap = KNOWN_GAPS.get((sc.name, b, v))
    marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
    if not gap and sc.name in FLAKY and not v:
        marks = [pytest.mark.xfail(strict=False, reason="flaky: " + FLAKY[sc.name])]
    return pytest.param(sc, b, v, marks=marks, id=f"{sc.name}{'/' + v if v else ''}@{b}")


@pytest.fixture(scope="module", autouse=True)
def matrix():
    yield
    if SCORES:
        print("\n" + matrix_markdown(SCORES))


@pytest.mark.parametrize("sc,backend,variant", [_case(*c) for c in CASES])
def test_scenario_gets_its_cause(sc, backend, variant):
    hint = model.compile_spec(sc.name, variant).hint
    views = []      # what the load balancer's health checks see, while the lab is up
    try:
        s = score(sc.name, sc.cause, COUNT, backend=backend, variant=variant, prefix=PREFIX,
                  observe=sc.observe, hint=hint,
                  after=lambda c: views.append(lab.lb_view(c.name, prefix=c.prefix)))
    except HostBusy as e:   # a host-wide limit (conntrack-table-full) it may not lower now
        pytest.skip(str(e))
    except NotRunnable as e:   # the kernel lacks the backend (ipvs scenarios without ip_vs)
        pytest.skip(str(e))
    expect = sc.expect
    if variant:   # a variant may change what the client sees (reject instead of drop)
        expect = tuple(lab.runner.expected_outcomes(sc.name, variant)) if hasattr(
            lab.runner, "expected_outcomes") else tuple(s.outcomes)
    SCORES.append(s)
    assert sum(s.outcomes[o] for o in expect) >= 0.98 * s.attempts, (s.outcomes, s.stderr[-500:])
    check_symptom(sc.name, s.tries, views[0])     # the lab's own symptom (symptoms.py)
    if s.expected == HEALTHY or s.expected in FAULTLESS:
        faults = {c: n for c, n in s.labels.items() if c not in FAULTLESS}
        assert not faults, f"network fault labels on {sc.name}: {faults}"
    if s.expected != HEALTHY:
        assert s.total >= s.attempts, f"too few events seen: {dict(s.labels)}\n{s.stderr[-800:]}"
        if s.hit_rate < 0.99 and s.mislabeled:
            # past pytest's capture: a flaky case's xfail shows no message, and the incidents
            # themselves are what tells the next occurrence apart (CI keeps stderr)
            print(f"yardstick {sc.name}@{backend}: mislabeled incidents:\n"
                  + "\n".join(json.dumps(e) for e in s.mislabeled), file=sys.__stderr__)
        assert s.hit_rate >= 0.99, f"{sc.name}@{backend}: {dict(s.labels)}"
        wrong_svc = {k: n for k, n in s.services.items() if k != sc.service}
        assert sum(wrong_svc.values()) <= 0.01 * s.total, f"services: {dict(s.services)}"
        # the interface, device or numbers at fault, where the scenario names them
        assert s.hint_missing <= 0.01 * s.labels[s.expected], \
            f"{s.hint_missing} events' hints lack one of {hint}: {s.hint_example}"


def test_default_sampling_keeps_each_flow_whole():
    """conntrack-invalid's 100 clients fail at once, each with ~10 records of four kinds on
    both sides of the DNAT: past the default --max-burst. The kernel samples whole flows, so
    what arrives still names the cause (per-kind sampling kept some resets without their
    INVALID drop: ~5% peer_reset)."""
    sc = next(s for s in lab.scenarios() if s.name == "conntrack-invalid")
    s = score(sc.name, sc.cause, COUNT, prefix=PREFIX, observe=sc.observe, max_rate=None)
    assert s.total >= s.attempts, f"too few events seen: {dict(s.labels)}\n{s.stderr[-800:]}"
    assert s.hit_rate >= 0.99, dict(s.labels)


def test_labs_under_one_traced_run_keep_their_causes_apart():
    """The kernel matrix's form (scorecard.score_labs): several labs up at once under one
    `nptrace run`, each scored by its own namespaces and client ports. missing-snat's SYN-ACKs
    are still retransmitted while no-listener's client connects: with the same address plan,
    only disjoint client ports keep their tuples apart."""
    from nptrace.lab.harness import Case
    from nptrace.lab.scorecard import score_labs
    scs = {sc.name: sc for sc in lab.scenarios()}
    names = ("missing-snat", "no-listener", "rp-filter-asymmetric")
    seen = []
    got = score_labs([(Case(n, "iptables", None, f"{PREFIX}b{i}-"), scs[n].cause,
                       model.compile_spec(n).hint) for i, n in enumerate(names)], 20,
                     observe=2.0, after=lambda c: seen.append(c.name))
    assert seen == list(names)
    for n, s in zip(names, got):
        assert s.scenario == n and s.total >= s.attempts == 20, (n, dict(s.labels))
        assert s.hit_rate == 1.0, (n, dict(s.labels))
