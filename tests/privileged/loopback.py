"""Shared by the tests that count real resets: a fresh namespace with loopback up, and a
client that connects to a closed port there (each attempt: tcp_send_reset NO_SOCKET in the
namespace, tcp_receive_reset on the client socket)."""
import contextlib
import os
import subprocess

import pytest

TRACEPOINTS = {"skb/kfree_skb", "tcp/tcp_send_reset", "tcp/tcp_receive_reset",
               "icmp/icmp_send", "tcp/tcp_retransmit_synack"}
CLOSED_PORT = 9   # nothing listens on discard in a fresh namespace

GENERATOR = r"""
import socket, sys
n, port = int(sys.argv[1]), int(sys.argv[2])
refused = 0
for _ in range(n):
    s = socket.socket()
    try:
        s.connect(("127.0.0.1", port))
    except ConnectionRefusedError:
        refused += 1
    finally:
        s.close()
print(refused)
"""


def need_root_and_bcc() -> None:
    """Skip, with the reason, where BPF cannot be loaded from this process: not root, or bcc not
    importable (it comes from Debian's python3-bpfcc: run in the project's venv)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN)")
    try:
        import bcc  # noqa: F401
    except ImportError:
        pytest.skip("bcc is not importable (python3-bpfcc; use the project venv)")


@contextlib.contextmanager
def loopback_netns(prefix: str):
    """(name, inode) of a new namespace `<prefix><pid>` with lo up; always deleted."""
    need_root_and_bcc()
    name = f"{prefix}{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name, os.stat(f"/run/netns/{name}").st_ino
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
