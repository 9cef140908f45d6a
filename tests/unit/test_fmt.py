"""The output vocabulary helpers (sinks/fmt.py)."""
import os
import time

import pytest

from nptrace.errors import NptraceError
from nptrace.sinks import fmt


def test_timestamps_are_rfc3339_ms_utc():
    assert fmt.ts(1_767_264_000_250_999_999) == "2026-01-01T10:40:00.250Z"


def test_local_timestamps_carry_their_offset(monkeypatch):
    monkeypatch.setenv("TZ", "Europe/Paris")
    time.tzset()
    try:
        assert fmt.ts(1_767_264_000_250_000_000, local=True) == "2026-01-01T11:40:00.250+01:00"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_endpoints():
    assert fmt.endpoint("10.0.0.1", 80) == "10.0.0.1:80"
    assert fmt.endpoint("fd00::10", 5000) == "[fd00::10]:5000"
    assert fmt.endpoint("fd00::10", 0) == "fd00::10"


def test_output_mode():
    assert fmt.output_mode(None, False) == "text"
    assert fmt.output_mode(None, True) == "json"
    assert fmt.output_mode("table", False) == "table"
    with pytest.raises(NptraceError, match="conflicts"):
        fmt.output_mode("table", True)


def test_table():
    out = fmt.table([{"cause": "snat", "n": 3}, {"cause": "rp_filter", "n": None}], ["cause", "n"])
    assert out.splitlines() == ["CAUSE      N", "snat       3", "rp_filter  -"]
