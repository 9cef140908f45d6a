"""Repro lab: each NodePort failure mode made real in network namespaces on the local kernel.

Scenarios are data (data/topology.toml + data/scenarios/*.toml); one runner applies them.
Others call this API; the CLI is nptrace/lab/cli.py (click group ``lab``).

    scenarios() -> list[Scenario]
    up(name, backend=None, prefix=None, variant=None) -> LabInfo   (None: the scenario's first backend)
    trigger(name, count=50, prefix=None) -> list[Attempt]
    lb_view(name, prefix=None) -> list[dict]
    down(name, prefix=None); down_all(prefix=None) -> list[str]; status(prefix=None) -> dict | None

The namespace prefix defaults to $NPT_LAB_PREFIX, else "npt-". State lives in /run/nptrace/lab/.
"""
from .errors import LabError, NotRoot, NotUp, UsageError
from .model import BACKENDS, CAUSES, OUTCOMES, Scenario, load_scenarios
from .runner import Attempt, LabInfo, down, down_all, lb_view, status, trigger, up


def scenarios() -> list[Scenario]:
    """All scenarios, in file order, each with name, story, cause, service, backends, variants."""
    return load_scenarios()


__all__ = ["Attempt", "BACKENDS", "CAUSES", "LabError", "LabInfo", "NotRoot", "NotUp", "OUTCOMES",
           "Scenario", "UsageError", "down", "down_all", "lb_view", "scenarios", "status", "trigger", "up"]
