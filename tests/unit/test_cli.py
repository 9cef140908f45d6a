"""CLI errors: one line on stderr, exit code 2, no traceback (click's CliRunner, no root)."""
import subprocess
import sys

import pytest
from click.testing import CliRunner

from nptrace import cli, tracer
from nptrace.errors import PrivilegeError


def run_main(args):
    """Through nptrace.cli.main, exactly as the console script runs it."""
    r = subprocess.run([sys.executable, "-c", "import sys; from nptrace.cli import main; main(sys.argv[1:])",
                        *args], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["run", "--duration", "abc"], "'abc' is not a valid float"),
    (["run", "--duration", "-1"], "--duration must be a positive"),
    (["run", "--iface", "/eth0"], "bad interface"),
    (["run", "--port", "70000"], "bad port range"),
    (["run", "--host", "300.1.1.1"], "bad --host"),
    (["run", "--bogus"], "No such option"),
    (["nosuchcommand"], "No such command"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    rc, out, err = run_main(args)
    assert rc == 2, err
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""


def test_not_root_is_one_line_exit_2(monkeypatch):
    def deny():
        raise PrivilegeError("needs root or CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN to load BPF: run with sudo")
    monkeypatch.setattr(tracer, "check_privileges", deny)
    r = CliRunner().invoke(cli.main_group, ["run", "--duration", "1"])
    assert r.exit_code == 2
    assert "needs root" in r.output and "Traceback" not in r.output


def test_unknown_namespace_is_reported_before_loading(monkeypatch):
    monkeypatch.setattr(tracer, "check_privileges", lambda: None)
    r = CliRunner().invoke(cli.main_group, ["run", "--iface", "npt-does-not-exist/eth0", "--duration", "1"])
    assert r.exit_code == 2
    assert "network namespace 'npt-does-not-exist' not found" in r.output


def test_help_has_examples():
    r = CliRunner().invoke(cli.main_group, ["run", "--help"])
    assert r.exit_code == 0 and "Examples:" in r.output and "--json" in r.output
