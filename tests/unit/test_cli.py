"""CLI errors: one line on stderr, exit code 2, no traceback (click's CliRunner, no root)."""
import subprocess
import sys

import pytest
from click.testing import CliRunner

from nptrace import cli
from nptrace.daemon import tracer
from nptrace.errors import PrivilegeError


def run_main(args):
    """Through nptrace.cli.main, exactly as the console script runs it."""
    r = subprocess.run([sys.executable, "-c", "import sys; from nptrace.cli import main; main(sys.argv[1:])",
                        *args], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["run", "--duration", "abc"], "'abc' is not a finite number of seconds"),
    (["run", "--duration", "-1"], "-1 is not above 0"),
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


# Values `run` refuses before it loads anything; dump-bpf, which takes run's options to print
# what run would compile, must refuse them alike.
REFUSED = [["--metrics-addr", "host:abc"], ["--metrics-addr", "127.0.0.1:٩٤٦٤"],
           ["--metrics-addr", "999.1.1.1:9464"], ["--duration", "nan"], ["--duration", "inf"],
           ["--duration", "١٠"], ["--ring-pages", "١٠٢٤"], ["--ring-pages", str(2**40)],
           ["--ring-pages", "1000"], ["--max-rate", str(10**19)], ["--max-rate", "٥"],
           ["--count", "²"], ["--metrics-final-scrape", "nan"], ["--snaplen", "٨"]]


def _error_line(args) -> tuple[int, str]:
    r = CliRunner().invoke(cli.main_group, args)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, errors[0] if len(errors) == 1 else r.output


@pytest.mark.parametrize("flag", REFUSED, ids=lambda f: f[0] + "=" + f[1])
def test_run_and_dump_bpf_refuse_the_same_values_with_the_same_line(flag):
    rc, line = _error_line(["run", *flag])
    assert rc == 2 and flag[0] in line, line
    assert _error_line(["dump-bpf", *flag]) == (rc, line)


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
