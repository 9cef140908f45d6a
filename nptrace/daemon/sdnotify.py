"""sd_notify(3) without libsystemd: readiness, watchdog keep-alives and status for Type=notify.

    n = Notifier.from_env()      # reads NOTIFY_SOCKET / WATCHDOG_USEC / WATCHDOG_PID, once
    n.ready("tracing 6 probes")  # READY=1 + STATUS=..., after the probes are attached
    n.tick()                     # WATCHDOG=1, at most every WatchdogSec/2; call it freely
    n.stopping()                 # STOPPING=1

NOTIFY_SOCKET is a datagram AF_UNIX path, or an abstract name when it starts with "@"
(systemd.exec(5)); unset (not under systemd, or Type=simple) makes every call a no-op. A send
that fails is ignored: the service manager going away must not stop the tracer.
"""
from __future__ import annotations

import os
import socket
import time


def _address(value: str) -> str | bytes:
    return b"\0" + value[1:].encode() if value.startswith("@") else value


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int = 0, clock=time.monotonic):
        self.address = _address(address) if address else None
        self.interval = watchdog_usec / 2e6 if watchdog_usec > 0 else 0.0
        self.clock = clock
        self.last = float("-inf")
        self.sent: list[str] = []     # what went out, for status and tests

    @classmethod
    def from_env(cls, env=os.environ) -> "Notifier":
        usec = 0
        try:
            pid = int(env.get("WATCHDOG_PID", "0") or 0)
            if not pid or pid == os.getpid():
                usec = int(env.get("WATCHDOG_USEC", "0") or 0)
        except ValueError:
            usec = 0
        return cls(env.get("NOTIFY_SOCKET") or None, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        if self.address is None:
            return False
        msg = "\n".join(fields)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(msg.encode(), self.address)
        except OSError:
            return False
        self.sent.append(msg)
        return True

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *( [f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def tick(self) -> bool:
        """WATCHDOG=1 when half the watchdog interval has passed since the last one."""
        if not self.interval or self.address is None:
            return False
        now = self.clock()
        if now - self.last < self.interval:
            return False
        self.last = now
        return self.send("WATCHDOG=1")
