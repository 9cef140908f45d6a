"""deploy/nptrace.service as shipped: `nptrace run` under the unit's own directives traces a
lab reset and exits 0 on SIGTERM; a usage error exits 2, which RestartPreventExitStatus keeps
from looping; the instance lock's failures are one line and exit 2.

PID 1 here is not systemd, so the sandbox is emulated from the unit file
(nptrace/lab/unit_sandbox.py: private mount namespace, read-only tree but for the unit's
writable paths, setpriv bounding set and no_new_privs); where systemd is PID 1 the same
directives go to `systemd-run --wait -p ...`. The unit's ExecStart arguments are kept; only
the executable is this checkout's (python -m nptrace.cli), and --json is added so the test
reads the labels.
"""
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nptrace.lab import unit_sandbox as us

pytestmark = pytest.mark.privileged
ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy/nptrace.service"
PREFIX = f"npt-us{os.getpid() % 10000}-"
ENV = {"PYTHONPATH": str(ROOT)}

if us.pid1_is_systemd():   # pragma: no cover - not this VM kind
    pytest.skip("systemd is PID 1: tests/privileged/test_unit_systemd_run.py runs the unit "
                "with systemd-run instead", allow_module_level=True)


def nptrace(*args):
    return [sys.executable, "-m", "nptrace.cli", *args]


def unit_command(unit, *extra):
    return nptrace(*unit.exec_start()[1:], *extra)


@pytest.fixture
def unit():
    return us.Unit.parse(UNIT)


def run_once(sandbox, command, timeout=120):
    with sandbox as sb:
        p = sb.popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def test_the_sandbox_is_the_units(unit, tmp_path):
    assert unit.skipped()   # every directive is emulated or skipped with a reason
    probe = ("touch /usr/npt-probe 2>/dev/null && echo usr-writable; "
             "touch /var/lib/nptrace/ok && echo state-writable; "
             "touch /run/nptrace/ok && rm /run/nptrace/ok && echo run-writable; "
             "ls /root | wc -l; grep CapBnd /proc/self/status; grep NoNewPrivs /proc/self/status")
    rc, out, err = run_once(us.Sandbox(unit, binds={"/var/lib/nptrace": str(tmp_path / "state")}),
                            ["sh", "-c", probe])
    assert rc == 0, err
    assert "usr-writable" not in out
    assert "state-writable" in out and "run-writable" in out
    assert (tmp_path / "state/ok").exists() and oct((tmp_path / "state").stat().st_mode)[-3:] == "700"
    bnd = int(out.split("CapBnd:")[1].split()[0], 16)
    # CAP_NET_ADMIN 12, CAP_SYS_ADMIN 21, CAP_PERFMON 38, CAP_BPF 39 (CAP_SYS_RESOURCE 24 only
    # where the caller's bounding set holds it)
    assert bnd & ~(1 << 24) == (1 << 12) | (1 << 21) | (1 << 38) | (1 << 39)
    assert "NoNewPrivs:\t1" in out


def test_unit_traces_a_lab_reset_and_exits_0(unit, tmp_path, shipped_headers):
    from nptrace import lab
    ifaces = [a for w in lab.up("no-listener", prefix=PREFIX).watch for a in ("--iface", w)]
    state = tmp_path / "state"
    # a 1 s watchdog instead of the unit's 30 s, so this short run must feed it several times
    sb = us.Sandbox(unit, binds={"/var/lib/nptrace": str(state)},
                    env={**ENV, "WATCHDOG_USEC": "1000000"})
    try:
        with sb:
            p = sb.popen(unit_command(unit, "--json", *ifaces), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
            try:
                sb.wait_ready(p)
                attempts = lab.trigger("no-listener", count=5, prefix=PREFIX)
                time.sleep(2.5)
            finally:
                p.send_signal(signal.SIGTERM)
                out, err = p.communicate(timeout=60)
    finally:
        lab.down("no-listener", prefix=PREFIX)
    assert p.returncode == 0, err[-3000:]
    assert attempts and all(a.outcome == "refused" for a in attempts)
    events = [json.loads(l) for l in out.splitlines() if l.strip()]
    ports = {a.sport for a in attempts}
    ours = [e for e in events if e["kind"] == "rst" and e["direction"] == "sent"
            and e.get("dport") in ports]
    assert ours and all(e["cause"] == "no_listener" for e in ours), (events[:3], err[-2000:])
    assert sb.notify.has("READY=1") and sb.notify.count("WATCHDOG=1") >= 2, sb.notify.messages
    assert sb.notify.has("STOPPING=1")
    assert list(state.glob("*")), "no session written to the StateDirectory"
    assert "Traceback" not in err
    # ProtectKernelModules=yes hides the node's headers: the minimal tree is compiled against
    assert f"kernel headers: shipped (nptrace's minimal tree {shipped_headers})" in err, err[-2000:]
    # the full view under the unit: no CAP_SYSLOG means kallsyms addresses read 0, which made
    # bcc swap in the legacy bpf_probe_read (refused in tc and netfilter programs)
    assert "(tc via tcx)" in err and "without kernel sk_buff reads" not in err, err[-3000:]
    assert "netfilter:post_routing" in err and "netfilter-hook view not attached" not in err, \
        err[-3000:]
    assert " insns" not in err and "unknown func" not in err, err[-3000:]   # no verifier log


def test_usage_error_exits_2_and_is_not_restarted(unit):
    rc, out, err = run_once(us.Sandbox(unit, env=ENV), unit_command(unit, "--no-such-flag"))
    assert rc == 2, err
    assert not unit.should_restart(rc)               # RestartPreventExitStatus=2
    assert unit.should_restart(-signal.SIGKILL)      # a crash is restarted
    assert unit.should_restart(1)


def _one_line_exit_2(rc, err, want):
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and want in lines[0], lines


def test_held_lock_is_one_line_exit_2(unit):
    lock = Path("/run/nptrace/nptrace.lock")
    lock.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rc, out, err = run_once(us.Sandbox(unit, env=ENV), unit_command(unit))
    finally:
        os.close(fd)
    _one_line_exit_2(rc, err, "another nptrace is already tracing")


def test_read_only_runtime_directory_is_one_line_exit_2(unit):
    del unit.values["RuntimeDirectory"]      # no RuntimeDirectory: /run read-only
    rc, out, err = run_once(us.Sandbox(unit, env=ENV), unit_command(unit))
    _one_line_exit_2(rc, err, "cannot open the instance lock /run/nptrace/nptrace.lock")


def test_missing_runtime_directory_is_one_line_exit_2(unit):
    missing = f"/run/npt-missing-{os.getpid()}/nptrace.lock"
    rc, out, err = run_once(us.Sandbox(unit, env={**ENV, "NPTRACE_LOCK_FILE": missing}),
                            unit_command(unit))
    _one_line_exit_2(rc, err, f"cannot open the instance lock {missing}")
    assert not Path(missing).parent.exists()


def test_restart_after_a_crash_cleans_up_and_traces(unit, tmp_path, shipped_headers):
    """Restart=on-failure after SIGKILL, for real: the unit's second start, under the same
    directives, finds the clsact filters the killed run left (tc state in the preserved
    RuntimeDirectory), removes them, and traces a reset."""
    from nptrace import lab
    from nptrace.kernel import netlink
    info = lab.up("no-listener", prefix=PREFIX)
    [watch] = info.watch[:1]
    ns, dev = watch.split("/")
    binds = {"/var/lib/nptrace": str(tmp_path / "state")}
    cmd = unit_command(unit, "--json", "--iface", watch, "--tc-mode", "clsact")

    def our_filters():
        with netlink.open_netns(ns) as r:
            idx = r.link(dev).ifindex
            return [f.name for p in (netlink.PARENT_INGRESS, netlink.PARENT_EGRESS)
                    for f in r.filters(idx, p) if (f.name or "").startswith("npt_")]
    try:
        with us.Sandbox(unit, binds=binds, env=ENV) as sb:
            first = sb.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            sb.wait_ready(first)
            first.kill()
            _, err1 = first.communicate(timeout=30)
        assert first.returncode == -signal.SIGKILL
        assert our_filters() == [f"npt_{first.pid}_ing", f"npt_{first.pid}_egr"]
        assert unit.should_restart(first.returncode)       # Restart=on-failure: start again
        with us.Sandbox(unit, binds=binds, env=ENV) as sb:
            second = sb.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                sb.wait_ready(second)
                left = our_filters()
                attempts = lab.trigger("no-listener", count=3, prefix=PREFIX)
                time.sleep(2)
            finally:
                second.send_signal(signal.SIGTERM)
                out, err = second.communicate(timeout=60)
    finally:
        lab.down("no-listener", prefix=PREFIX)
    assert second.returncode == 0, err[-3000:]
    assert f"removed tc leftovers of dead nptrace run {first.pid}" in err, err[-3000:]
    assert left == [f"npt_{second.pid}_ing", f"npt_{second.pid}_egr"], left
    ports = {a.sport for a in attempts}
    events = [json.loads(l) for l in out.splitlines() if l.strip()]
    assert any(e["cause"] == "no_listener" and e.get("dport") in ports for e in events), events[:3]
    assert "Traceback" not in err
    print("\n--- first start (SIGKILLed) ---\n" + err1 + "--- second start ---\n" + err)
