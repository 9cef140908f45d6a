"""A full disk under every output, for real: a 64 KiB tmpfs filled to the last page, under
--record, --pcap, and stdout redirected to a file there. Each is one line on stderr and exit 2,
never a traceback, and the stop still runs every step (probes detached, the instance lock
released: a second start right after works). A session path nptrace may not read is one line
and exit 2 too."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_clean_stop import lock_free

pytestmark = pytest.mark.privileged
ROOT = Path(__file__).resolve().parents[2]
PREFIX = f"npt-nospc{os.getpid() % 10000}-"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def full_fs(tmp_path, root_and_bcc):
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(mnt)], check=True)
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt}/filler", "bs=4k"], capture_output=True)
        assert os.statvfs(mnt).f_bavail == 0
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def lab_up():
    from nptrace import lab
    lab.up("no-listener", prefix=PREFIX)
    yield lambda: lab.trigger("no-listener", count=5, prefix=PREFIX)
    lab.down("no-listener", prefix=PREFIX)


def run_nptrace(args, trigger, tmp_path, stdout=subprocess.DEVNULL, timeout=60):
    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, "-m", "nptrace.cli", "run", "--json", "--ready-file",
                          str(ready), *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                         env=ENV)
    end = time.monotonic() + timeout
    while p.poll() is None and not ready.exists() and time.monotonic() < end:
        time.sleep(0.05)
    if ready.exists() and p.poll() is None:
        trigger()
        try:
            p.wait(timeout=10)        # a full stdout ends the run by itself
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    return p.returncode, err


def one_error_line(rc, err, want):
    assert rc == 2 and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    errors = [l for l in err.splitlines() if l.startswith("nptrace: error:")]
    assert len(errors) == 1 and want in errors[0], err[-3000:]
    return errors[0]


def lock_is_free():
    return lock_free(Path("/run/nptrace/nptrace.lock"))


def test_full_stdout_is_one_line_exit_2_and_the_stop_still_runs(full_fs, lab_up, tmp_path):
    with open(full_fs / "out.json", "w") as out:
        rc, err = run_nptrace([], lab_up, tmp_path, stdout=out)
    line = one_error_line(rc, err, "No space left on device")
    assert "stdout" in line, line
    assert "nptrace: stopped:" in err, err[-2000:]       # the stop ran to its end
    assert lock_is_free()


def test_full_disk_under_pcap_is_one_line_exit_2(full_fs, lab_up, tmp_path):
    rc, err = run_nptrace(["--pcap", str(full_fs / "x.pcapng")], lab_up, tmp_path)
    line = one_error_line(rc, err, "No space left on device")
    assert f"--pcap {full_fs}/x.pcapng" in line, line
    assert lock_is_free()


def test_full_disk_under_record_is_one_line_exit_2(full_fs, lab_up, tmp_path):
    rc, err = run_nptrace(["--record", str(full_fs / "sessions")], lab_up, tmp_path)
    line = one_error_line(rc, err, "No space left on device")
    assert f"--record {full_fs}/sessions" in line, line
    assert lock_is_free()


def test_unreadable_session_path_is_one_line_exit_2(tmp_path):
    d = tmp_path / "sessions"
    d.mkdir(mode=0o700)
    (d / "npt-x.msgpack").write_bytes(b"")
    os.chmod(tmp_path, 0o755)
    r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                        sys.executable, "-m", "nptrace.cli", "report", str(d)],
                       capture_output=True, text=True, env=ENV, timeout=60)
    one_error_line(r.returncode, r.stderr, "ermission denied")
