"""lab/real/yardstick.py rows_in_guest: what a guest's run wrote comes back as rows; a guest
that could not run or wrote nothing is one row saying so (both yardsticks use it)."""
import dataclasses
import json

from nptrace.lab import kernels
from nptrace.lab.real import yardstick


def test_a_guest_s_rows_come_back_and_a_silent_guest_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "CACHE", tmp_path)
    row = yardstick.Row("generated", "ipvs", "6.1.0-50-amd64", "ipvs-no-endpoints", "node",
                        "no_endpoints", connections=10, failed=10, right=10, named=10)
    calls = []

    def ran(kernel, cmd, out):
        calls.append(cmd)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rows.json").write_text(json.dumps([dataclasses.asdict(row)]))
        return "6.1.0-50-amd64", "TCG"
    monkeypatch.setattr(kernels, "run_in_guest", ran)
    [got] = yardstick.rows_in_guest("6.1", "nptrace.lab.shipped", "shipped-6.1", ["--count", "10"])
    assert got.ok and got.case == "ipvs-no-endpoints"
    assert calls[0].startswith("nptrace.lab.shipped --in-guest --rows-json ")

    monkeypatch.setattr(kernels, "run_in_guest", lambda k, c, out: ("6.1.0-50-amd64", "TCG"))
    [why] = yardstick.rows_in_guest("6.1", "nptrace.lab.shipped", "shipped-6.1", [])
    assert not why.ok and why.error == "no result"
