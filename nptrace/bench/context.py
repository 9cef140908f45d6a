"""What every benchmark section gets: the mode (full or quick), where its logs go, and the
shared list of nptrace launches (start-up and stop figures of every run)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nptrace.bench.topology import Topology
from nptrace.bench.tracer_proc import Nptrace


@dataclass
class Bench:
    quick: bool
    logdir: Path
    launches: list[tuple[str, Nptrace]] = field(default_factory=list)

    def scale(self, full, quick):
        return quick if self.quick else full

    @property
    def stop_wait(self) -> float:
        """How long a SIGINT'd nptrace may take to drain and exit before it is killed."""
        return self.scale(10.0, 5.0)

    def nptrace(self, topo: Topology, section: str, tag: str, args: list[str],
                stdout_path: Path | None = None, env: dict[str, str] | None = None) -> Nptrace:
        """Start `nptrace run` (returns once its ready file exists) and log its start-up."""
        n = Nptrace(topo, self.logdir, tag, args, stdout_path, stop_wait=self.stop_wait,
                    env=env)
        self.launches.append((section, n))
        return n.start()

    def launch_records(self) -> list[dict]:
        return [n.record(section) for section, n in self.launches]
