"""Concurrent TCP client for the repro lab: many real connections at once, each classified.

Run by path (stdlib only) inside the client namespace; reads a JSON spec on stdin:
``{"targets": [{"src": ADDR|null, "dst": ADDR, "port": N, "count": N, "timeout": S,
"payload": STR}]}`` and writes a JSON list of attempts on stdout.

A target with ``"then": {"payload": STR, "timeout": S}`` holds its connection open after the
first answer (a long-lived connection): once every attempt is answered or failed, the probe
prints ``{"held": N}`` on stdout and waits for one line on stdin (the runner changes the lab
meanwhile: a rollout), then sends the second payload on every held connection; the attempt's
outcome is then the second exchange's, in phase "after".

All sockets are non-blocking and started together, so 100 attempts against a silent drop
cost one timeout, not 100. Outcome of one attempt, from what the socket API reports:
  ok           connected, sent the payload, got at least one byte back
  refused      ECONNREFUSED: a RST answered the SYN, or ICMP port-unreachable
  reset        ECONNRESET/EPIPE after the connection was established
  timeout      no answer before the deadline (phase says: "connect" or "reply")
  unreachable  EHOSTUNREACH/ENETUNREACH (ICMP host/net unreachable, or no route)
  closed       the peer closed (FIN) without answering
  error        anything else (errno name in "error")
"""
import errno
import json
import random
import resource
import selectors
import socket
import sys
import time

_CONNECT_ERRORS = {
    errno.ECONNREFUSED: "refused",
    errno.ECONNRESET: "reset",
    errno.EHOSTUNREACH: "unreachable",
    errno.ENETUNREACH: "unreachable",
    errno.ETIMEDOUT: "timeout",
}


class _Attempt:
    __slots__ = ("sock", "src", "sport", "dst", "dport", "t0", "deadline", "phase",
                 "payload", "outcome", "error", "elapsed", "reply", "read_all", "buf", "then", "held")

    def __init__(self, t, now):
        self.src, self.dst, self.dport = t.get("src") or "", t["dst"], int(t["port"])
        self.payload = t.get("payload", "hello\n").encode()
        self.t0, self.deadline = now, now + float(t.get("timeout", 2.0))
        self.sport, self.phase, self.sock = 0, "connect", None
        self.outcome = self.error = self.reply = None
        self.elapsed = 0.0
        self.read_all, self.buf = bool(t.get("read_all")), b""
        self.then, self.held = t.get("then"), False

    def finish(self, outcome, error=""):
        self.outcome, self.error = outcome, error
        self.elapsed = round(time.monotonic() - self.t0, 4)

    def as_dict(self):
        return {"src": self.src, "sport": self.sport, "dst": self.dst, "dport": self.dport,
                "outcome": self.outcome, "error": self.error, "phase": self.phase,
                "elapsed": self.elapsed, "reply": self.reply or "",
                "body": self.buf.decode(errors="replace") if self.read_all else ""}


def _errname(e):
    return errno.errorcode.get(e, str(e))


def _ports():
    """The namespace's ephemeral ports in a random order, each handed out once per run. Left
    to the kernel, a port is free again the moment its connection is reset (a port bound as
    0 is not held by the open socket), and a later attempt of the same burst got it: its SYN
    met the first connection's state at the server, which answered with a RST (`refused`
    instead of `reset`, and two attempts with one client port; measured: 7 of 1,200
    wrong-interface attempts)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = map(int, f.read().split())
    ports = list(range(lo, hi + 1))
    random.shuffle(ports)
    return iter(ports)


def _start(a, sel, ports):
    six = ":" in a.dst
    s = socket.socket(socket.AF_INET6 if six else socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    a.sock = s
    try:
        for port in ports:
            try:
                s.bind((a.src or ("::" if six else "0.0.0.0"), port))
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
        else:
            raise OSError(errno.EADDRNOTAVAIL, "no free ephemeral port")
        err = s.connect_ex((a.dst, a.dport))
    except OSError as e:
        a.finish("error", _errname(e.errno))
        return
    try:
        a.src, a.sport = s.getsockname()[:2]
    except OSError:
        pass
    if err in (0, errno.EINPROGRESS):
        sel.register(s, selectors.EVENT_WRITE, a)
    else:
        a.finish(_CONNECT_ERRORS.get(err, "error"), _errname(err))


def _on_event(a, sel):
    s = a.sock
    if a.phase == "connect":
        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            sel.unregister(s)
            a.finish(_CONNECT_ERRORS.get(err, "error"), _errname(err))
            return
        a.phase = "reply"
        try:
            s.send(a.payload)
        except OSError as e:
            sel.unregister(s)
            a.finish("reset" if e.errno in (errno.ECONNRESET, errno.EPIPE) else "error", _errname(e.errno))
            return
        sel.modify(s, selectors.EVENT_READ, a)
        return
    try:
        data = s.recv(4096)
    except BlockingIOError:
        return
    except OSError as e:
        sel.unregister(s)
        a.finish("reset" if e.errno in (errno.ECONNRESET, errno.EPIPE) else
                 _CONNECT_ERRORS.get(e.errno, "error"), _errname(e.errno))
        return
    if a.read_all and data:
        a.buf += data
        return
    sel.unregister(s)
    if a.read_all and a.buf:
        data = a.buf
    if data and a.then and not a.held:
        a.held, a.reply = True, data.decode(errors="replace").splitlines()[0][:200]
        return
    if data:
        a.reply = data.decode(errors="replace").splitlines()[0][:200] if data.strip() else ""
        a.finish("ok")
    else:
        a.finish("closed", "EOF")


def _second(a, sel, now):
    """Phase 2 of a held connection: send the second payload, wait for its answer."""
    a.phase, a.t0 = "after", now
    a.deadline = now + float(a.then.get("timeout", 2.0))
    try:
        a.sock.send(a.then.get("payload", "again\n").encode())
    except OSError as e:
        a.finish("reset" if e.errno in (errno.ECONNRESET, errno.EPIPE) else "error", _errname(e.errno))
        return
    sel.register(a.sock, selectors.EVENT_READ, a)


def run(targets, control=None):
    sel = selectors.DefaultSelector()
    now = time.monotonic()
    attempts = [_Attempt(t, now) for t in targets for _ in range(int(t.get("count", 1)))]
    ports = _ports()
    for a in attempts:
        _start(a, sel, ports)
    _loop(attempts, sel)
    held = [a for a in attempts if a.held and a.outcome is None]
    if any(a.then for a in attempts):
        if control is not None:
            control(len(held))
        now = time.monotonic()
        for a in held:
            _second(a, sel, now)
        _loop(attempts, sel)
    for a in attempts:
        if a.sock is not None:
            a.sock.close()
    sel.close()
    return [a.as_dict() for a in attempts]


def _loop(attempts, sel):
    while True:
        pending = [a for a in attempts if a.outcome is None and not (a.held and a.phase != "after")]
        if not pending:
            break
        now = time.monotonic()
        for a in pending:
            if now >= a.deadline:
                sel.unregister(a.sock)
                if a.buf:
                    a.reply = a.buf.decode(errors="replace").splitlines()[0][:200]
                    a.finish("ok")
                else:
                    a.finish("timeout", f"no answer ({a.phase})")
        wait = min((a.deadline for a in pending if a.outcome is None), default=now) - now
        if wait <= 0:
            continue
        for key, _ in sel.select(timeout=wait):
            _on_event(key.data, sel)


def _wait_for_go(n):
    sys.stdout.write(json.dumps({"held": n}) + "\n")
    sys.stdout.flush()
    sys.stdin.readline()


def main():
    spec = json.loads(sys.stdin.readline())
    # one socket per attempt, all open at once: lift the soft fd limit (often 1024) to the hard one
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    json.dump(run(spec["targets"], _wait_for_go), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
