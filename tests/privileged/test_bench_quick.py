"""`python -m nptrace.bench --quick` end to end: it completes, prints the table, saves the JSON
with every section (each with rows and no error), and leaves no namespace behind. Speed is
measured, not asserted: no target is checked here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nptrace.bench.report import COLUMNS, SECTIONS

pytestmark = [pytest.mark.privileged, pytest.mark.long]


def test_quick_bench_completes_with_every_section(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, BPF)")
    pytest.importorskip("bcc", reason="bcc is not importable (python3-bpfcc; use the venv)")
    p = subprocess.Popen([sys.executable, "-m", "nptrace.bench", "--quick", "--out",
                          str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        out, err = p.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        p.terminate()            # the bench unwinds on SIGTERM and removes its namespaces
        out, err = p.communicate(timeout=60)
        pytest.fail(f"bench --quick did not finish in 420 s\n{err[-2000:]}")
    finally:
        leftovers = [n for n in _netns() if n.startswith(f"npt-bn{p.pid}-")]
        for n in leftovers:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
    print(out)
    assert not leftovers, f"namespaces left behind: {leftovers}"
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    assert out.splitlines()[0].split() == list(COLUMNS)
    reports = list(Path(tmp_path).glob("*/report.json"))
    assert len(reports) == 1
    doc = json.loads(reports[0].read_text())
    assert doc["meta"]["mode"] == "quick"
    assert set(doc["sections"]) == set(SECTIONS)
    for name, sec in doc["sections"].items():
        assert not sec["error"], f"{name}: {sec['error']}"
        assert sec["rows"] and sec["data"], name
        assert all(r["verdict"] in ("met", "missed", "-") for r in sec["rows"]), name
    assert (reports[0].parent / "table.txt").exists()


def _netns() -> list[str]:
    try:
        return os.listdir("/run/netns")
    except OSError:
        return []
