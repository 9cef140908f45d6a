"""nptrace/daemon/sdnotify.py against a real datagram socket (path and abstract), no systemd."""
import os
import socket

import pytest

from nptrace.daemon.sdnotify import Notifier


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify")
        s.bind(name)
    else:
        name = f"@npt-test-{os.getpid()}"
        s.bind("\0" + name[1:])
    s.settimeout(2)
    yield name, s
    s.close()


def test_ready_and_status_reach_the_socket(listener):
    name, s = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": name})
    assert n.enabled and n.ready("tracing 3 probes")
    assert s.recv(4096) == b"READY=1\nSTATUS=tracing 3 probes"
    assert n.stopping() and s.recv(4096) == b"STOPPING=1"


def test_watchdog_every_half_interval(listener):
    name, s = listener
    now = [100.0]
    n = Notifier(name, watchdog_usec=10_000_000, clock=lambda: now[0])
    assert n.tick() and s.recv(100) == b"WATCHDOG=1"
    now[0] += 4.9
    assert not n.tick()
    now[0] += 0.2
    assert n.tick() and s.recv(100) == b"WATCHDOG=1"


def test_watchdog_for_another_pid_is_not_ours(listener):
    name, _ = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "1000000",
                           "WATCHDOG_PID": str(os.getpid() + 1)})
    assert n.interval == 0 and not n.tick()


def test_no_socket_is_a_no_op_and_a_dead_socket_is_ignored(tmp_path):
    assert not Notifier.from_env({}).ready()
    assert not Notifier.from_env({}).tick()
    gone = Notifier(str(tmp_path / "nobody"), watchdog_usec=1)
    assert not gone.ready() and not gone.tick()
