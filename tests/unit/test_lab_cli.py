"""The `lab` click group without root: listing, and one-line errors with the right exit codes."""
import json

import pytest
from click.testing import CliRunner

from nptrace.lab import netns
from nptrace.lab.cli import lab


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path)
    monkeypatch.delenv("NPT_LAB_PREFIX", raising=False)
    return CliRunner()


def test_list_shows_story_and_cause(runner):
    r = runner.invoke(lab, ["list"])
    assert r.exit_code == 0
    assert "no-listener" in r.output and "cause=no_listener" in r.output and "targetPort" in r.output
    r = runner.invoke(lab, ["list", "--json"])
    rows = [json.loads(x) for x in r.output.splitlines()]
    assert {"name", "story", "cause", "service", "backends", "variants", "expect"} <= set(rows[0])


def test_unknown_scenario_is_a_usage_error(runner):
    r = runner.invoke(lab, ["up", "no-such-thing"])
    assert r.exit_code == 2 and "unknown scenario 'no-such-thing'" in r.output
    assert "Traceback" not in r.output


def test_unknown_backend_and_variant(runner):
    assert runner.invoke(lab, ["up", "no-listener", "--backend", "ipvs"]).exit_code == 2
    r = runner.invoke(lab, ["up", "no-listener", "--variant", "x"])
    assert r.exit_code == 2 and "no variant" in r.output
    r = runner.invoke(lab, ["up", "networkpolicy-drop", "--backend", "nft"])
    assert r.exit_code == 2 and "no nft form" in r.output


def test_not_root(runner, monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    r = runner.invoke(lab, ["up", "no-listener"])
    assert r.exit_code == 1 and "needs root" in r.output and len(r.output.strip().splitlines()) == 1


def test_trigger_when_not_up(runner, monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    r = runner.invoke(lab, ["--prefix", "npt-unit-", "trigger", "no-listener"])
    assert r.exit_code == 1 and "not up" in r.output


def test_down_needs_a_name_or_all_and_prefix_is_checked(runner):
    assert runner.invoke(lab, ["down"]).exit_code == 2
    r = runner.invoke(lab, ["--prefix", "x-", "status"])
    assert r.exit_code == 2 and "must start with 'npt-'" in r.output


def test_status_when_nothing_is_up(runner):
    r = runner.invoke(lab, ["--prefix", "npt-unit-", "status"])
    assert r.exit_code == 0 and "nothing is up" in r.output
