"""A small HTTP/1.x server for the metrics and health paths, bounded against what a node's
network can send it: one thread runs a selector loop over every connection, and one worker
thread runs the slow answers (a /metrics scrape).

The endpoint is reachable by every pod of a hostNetwork DaemonSet and every neighbour of a
host, and the tracer runs as root under a memory limit (768 MiB in the shipped unit and
DaemonSet). A thread per connection with no timeout (http.server's ThreadingHTTPServer, as
prometheus_client's start_http_server uses it) keeps a thread for every half-sent request
for ever; about 110 connections that send large headers and stall pushed the process past
that limit. Here a connection costs a socket and at most `max_request` bytes, and:

  max_conns    64     connections open at once. One past it closes the oldest connection still
                      sending its request (a slow client is the one to lose its place; a probe
                      finishes in a millisecond); when every open one has sent its request, the
                      new one is closed at once. Never a thread each.
  request_s    5 s    to send the request line and headers, whole: a slowloris sending a byte
                      a second is closed at 5 s, not kept alive by each byte.
  max_request  8 KiB  the request line and headers; past it: 431, closed.
  response_s   10 s   from a complete request to the last byte of its answer: a scrape that
                      is not ready by then gets 503, a client that does not read is closed.

A fast route (health) is answered on the loop's thread, so it answers while a slow one (a
scrape walking per-CPU kernel maps) runs on the worker; a server with no slow route (the
probe listener, --health-addr) starts no worker.

With `tls` (sinks/tls.py: the SSLContext of --metrics-tls-*), each accepted connection does
its TLS handshake inside the same loop, non-blocking, within the same request_s deadline as
its request: a client that presents no certificate the client CA signed fails the handshake
and is closed (`tls_refused`) before any HTTP is read, and a stalled handshake costs what a
stalled request does. A connection that the client aborts,
resets or never finishes is closed and counted in `stats`; nothing is printed for it (the
stderr of the tracer is its status lines). Every answer closes its connection
(`Connection: close`), as http.server's HTTP/1.0 default does; Prometheus reconnects.

Starting the threads is the only place a thread is made: where the process cannot start one
(thread exhaustion), start() raises NptraceError and no connection ever needs one.
"""
from __future__ import annotations

import collections
import errno
import queue
import selectors
import socket
import ssl
import threading
import time
from typing import Callable, NamedTuple

from nptrace.errors import NptraceError

__all__ = ["Answer", "Limits", "Request", "Server"]


class Limits(NamedTuple):
    max_conns: int = 64
    request_s: float = 5.0
    max_request: int = 8 << 10
    response_s: float = 10.0


class Request(NamedTuple):
    method: str
    path: str                  # without the query
    headers: dict              # lower-case names


class Answer(NamedTuple):
    code: int
    body: bytes
    ctype: str = "text/plain; charset=utf-8"
    on_sent: Callable[[], None] | None = None   # called once its last byte left


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable"}
_READ = 4096
_ACCEPTS_PER_TURN = 256


class _Conn:
    __slots__ = ("sock", "buf", "deadline", "out", "head", "waiting", "on_sent", "reading",
                 "handshake", "events")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.buf = bytearray()
        self.deadline = deadline
        self.out: collections.deque = collections.deque()   # memoryviews still to send
        self.head = False            # HEAD: the body is not sent
        self.waiting = False         # handed to the worker
        self.on_sent = None
        self.reading = True          # still receiving its request
        self.handshake = False       # TLS handshake still under way
        self.events = selectors.EVENT_READ   # what the selector watches it for


def parse_request(head: bytes) -> Request | int:
    """The Request in a request line and headers (ending at the blank line), or the status
    code to refuse it with."""
    lines = head.decode("latin-1").replace("\r\n", "\n").split("\n")   # any bytes decode
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return 400
    method, target = parts[0], parts[1]
    headers = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return 400
        headers[name.lower()] = value.strip()
    if method not in ("GET", "HEAD"):
        return 405
    return Request(method, target.split("?", 1)[0], headers)


class Server:
    """Serves `fast(request)` on the loop's thread (None: not a fast path) and `slow(request)`
    on the worker, on the bound listening socket `sock`. start(), close(), stats.
    slow=None: no worker, and what fast() does not answer is 404. tls: a function giving the
    SSLContext for the next connection (sinks/tls.py ServerTls.context), None: plain HTTP."""

    def __init__(self, sock: socket.socket, fast: Callable[[Request], Answer | None],
                 slow: Callable[[Request], Answer] | None, limits: Limits = Limits(),
                 clock: Callable[[], float] = time.monotonic,
                 tls: Callable[[], ssl.SSLContext] | None = None):
        self.lsock = sock
        self.fast, self.slow, self.limits, self.clock = fast, slow, limits, clock
        self.tls = tls
        self.stats: collections.Counter = collections.Counter()
        self._conns: dict[int, _Conn] = {}          # fd -> connection, oldest first
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w, sock):
            s.setblocking(False)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: collections.deque = collections.deque()   # (conn, answer) from the worker
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._accept_paused_until = 0.0

    def connections(self) -> collections.Counter:
        """Open connections by state: reading (its request), waiting (for the worker),
        writing (its answer)."""
        return collections.Counter("reading" if c.reading else "waiting" if c.waiting
                                   else "writing" for c in list(self._conns.values()))

    # -- threads ---------------------------------------------------------------------------
    def start(self) -> "Server":
        self._sel.register(self.lsock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        threads = [(self._loop, "nptrace-http")]
        if self.slow is not None:
            threads.append((self._work, "nptrace-scrape"))
        for target, name in threads:
            t = threading.Thread(target=target, name=name, daemon=True)
            try:
                t.start()
            except RuntimeError as e:      # "can't start new thread": the process is at its limit
                self.close()
                raise NptraceError(f"cannot start the metrics server's {name} thread ({e}): "
                                   "the process is at its thread limit (TasksMax, "
                                   "pids.max); lower it or free threads") from None
            self._threads.append(t)
        return self

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        self._jobs.put(None)
        self._wake()
        if self._threads:      # the loop's; the worker holds no socket and may be stuck in a
            self._threads[0].join(5.0)     # collector: it ends at its next job, or with us
        for c in list(self._conns.values()):
            self._drop(c)
        for s in (self.lsock, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:         # the pipe is full (it is being woken already) or closed
            pass

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, req = job
            if not conn.waiting:         # gone (closed, or answered 503) while queued
                continue
            try:
                ans = self.slow(req)
            except Exception as e:        # a failing route answers 500; the worker goes on
                self.stats["route_errors"] += 1
                ans = Answer(500, f"{type(e).__name__}: {e}\n".encode())
            self._done.append((conn, ans))
            self._wake()

    # -- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            try:
                self._turn()
            except Exception:     # never dies: a dead loop is a dead /livez
                self.stats["loop_errors"] += 1
                time.sleep(0.05)

    def _turn(self) -> None:
        now = self.clock()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self.lsock, selectors.EVENT_READ, "accept")
        timeout = 1.0
        for c in self._conns.values():
            timeout = min(timeout, c.deadline - now)
        for key, _ in self._sel.select(max(timeout, 0.0)):
            if self._stop:
                return
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                self._drain_wake()
            else:
                c = key.data
                if c.sock.fileno() == -1:
                    continue
                try:
                    if c.handshake:
                        self._handshake(c)
                    elif c.reading:
                        self._read(c)
                    elif c.out:
                        self._write(c)
                except Exception:     # that connection's end, never the loop's
                    self.stats["conn_errors"] += 1
                    self._drop(c)
        self._answer_done()
        self._expire(self.clock())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, _addr = self.lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: stop accepting for a moment instead of spinning on
                    # a listening socket that stays readable
                    self.stats["accept_errors"] += 1
                    self._sel.unregister(self.lsock)
                    self._accept_paused_until = self.clock() + 0.1
                    return
                continue       # ECONNABORTED and the like: that client's loss
            self.stats["accepted"] += 1
            if len(self._conns) >= self.limits.max_conns and not self._evict_one():
                self.stats["refused"] += 1
                _close(sock)
                continue
            sock.setblocking(False)
            handshake = False
            if self.tls is not None:
                try:
                    sock = self.tls().wrap_socket(sock, server_side=True,
                                                  do_handshake_on_connect=False)
                except (OSError, ValueError):     # gone before it could be wrapped
                    self.stats["aborted"] += 1
                    _close(sock)
                    continue
                handshake = True
            c = _Conn(sock, self.clock() + self.limits.request_s)
            c.handshake = handshake
            self._conns[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _evict_one(self) -> bool:
        """Close the oldest connection still sending its request; False when there is none."""
        for c in self._conns.values():
            if c.reading:
                self.stats["evicted"] += 1
                self._drop(c)
                return True
        return False

    def _watch(self, c: _Conn, events: int) -> None:
        if c.events != events:
            self._sel.modify(c.sock, events, c)
            c.events = events

    def _io(self, c: _Conn, op, arg, events: int = selectors.EVENT_READ):
        """op(arg) on c's socket (recv, send; `events`: what it waits for): its result, or
        None when it would block or the client is gone (then counted as aborted and closed).
        TLS may want the other direction first (a key update): it is watched for that, and
        for `events` again once op went through."""
        try:
            out = op(arg)
        except ssl.SSLWantReadError:
            self._watch(c, selectors.EVENT_READ)
            return None
        except ssl.SSLWantWriteError:
            self._watch(c, selectors.EVENT_WRITE)
            return None
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:            # reset, broken pipe, a TLS alert: that client's loss
            self.stats["aborted"] += 1
            self._drop(c)
            return None
        self._watch(c, events)
        return out

    def _handshake(self, c: _Conn) -> None:
        """One step of c's TLS handshake; once it is done, its request is read."""
        try:
            c.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(c, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._watch(c, selectors.EVENT_WRITE)
            return
        except ssl.SSLError:       # no certificate, one the CA did not sign, not TLS at all
            self.stats["tls_refused"] += 1
            self._drop(c)
            return
        except OSError:            # reset mid-handshake
            self.stats["aborted"] += 1
            self._drop(c)
            return
        c.handshake = False
        self._watch(c, selectors.EVENT_READ)
        self._read(c)              # the request may have come with the handshake's last flight

    def _read(self, c: _Conn) -> None:
        data = self._io(c, c.sock.recv, _READ)
        if data is None:
            return
        if not data:               # closed before its request was whole
            self.stats["aborted"] += 1
            self._drop(c)
            return
        c.buf += data
        # TLS: what is left of a record already read from the socket is in the SSL object,
        # and the selector will not say so
        pending = getattr(c.sock, "pending", None)
        while pending is not None and len(c.buf) <= self.limits.max_request and pending():
            more = self._io(c, c.sock.recv, _READ)
            if not more:
                break
            c.buf += more
        if c.sock.fileno() == -1:
            return
        end = c.buf.find(b"\r\n\r\n")
        cut = 4
        if end < 0:
            end, cut = c.buf.find(b"\n\n"), 2
        limit = self.limits.max_request
        if (end < 0 and len(c.buf) > limit) or end + cut > limit:
            self.stats["too_large"] += 1
            self._reply(c, Answer(431, b"request line and headers over "
                                  + str(limit).encode() + b" bytes\n"))
            return
        if end < 0:
            return
        req = parse_request(bytes(c.buf[:end]))
        c.buf = bytearray()
        if isinstance(req, int):
            self.stats["bad_requests"] += 1
            self._reply(c, Answer(req, b"GET or HEAD /metrics, /healthz, /readyz, /livez\n"))
            return
        c.head = req.method == "HEAD"
        try:
            ans = self.fast(req)
        except Exception as e:
            self.stats["route_errors"] += 1
            ans = Answer(500, f"{type(e).__name__}: {e}\n".encode())
        if ans is not None:
            self._reply(c, ans)
            return
        if self.slow is None:
            self._reply(c, Answer(404, b"not found\n"))
            return
        if self._jobs.qsize() >= self.limits.max_conns:
            # the worker is stuck (a collector that never returns): queued requests of
            # connections long closed must not pile up for days
            self.stats["busy"] += 1
            self._reply(c, Answer(503, b"metrics busy: earlier scrapes are still queued\n"))
            return
        # Unwatched while the worker answers (a half-closed client, `nc -N`, still reads its
        # answer; a gone one is found when the answer is written, or at the deadline).
        c.reading, c.waiting = False, True
        c.deadline = self.clock() + self.limits.response_s
        self._sel.unregister(c.sock)
        self._jobs.put((c, req))

    def _answer_done(self) -> None:
        while self._done:
            c, ans = self._done.popleft()
            if c.waiting and c.sock.fileno() != -1:
                self._reply(c, ans)

    def _reply(self, c: _Conn, ans: Answer) -> None:
        """Queue the answer and start sending it; the connection closes after it."""
        c.reading = c.waiting = False
        c.deadline = self.clock() + self.limits.response_s
        reason = REASONS.get(ans.code, "")
        head = (f"HTTP/1.1 {ans.code} {reason}\r\nServer: nptrace\r\n"
                f"Content-Type: {ans.ctype}\r\nContent-Length: {len(ans.body)}\r\n"
                "Connection: close\r\n\r\n").encode("latin-1")
        c.out.append(memoryview(head))
        if not c.head and ans.body:
            c.out.append(memoryview(ans.body))     # shared by every answer of one scrape
        c.on_sent = ans.on_sent
        try:
            self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
        except KeyError:         # unwatched while the worker answered
            self._sel.register(c.sock, selectors.EVENT_WRITE, c)
        c.events = selectors.EVENT_WRITE
        self._write(c)

    def _write(self, c: _Conn) -> None:
        while c.out:
            # TLS without partial writes: a send that would block is retried with the same
            # buffer, which OpenSSL requires (SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER lets it move)
            n = self._io(c, c.sock.send, c.out[0], selectors.EVENT_WRITE)
            if n is None:
                return
            if n < len(c.out[0]):
                c.out[0] = c.out[0][n:]
                return
            c.out.popleft()
        self.stats["answered"] += 1
        done, c.on_sent = c.on_sent, None
        try:
            c.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._drop(c)
        if done is not None:
            done()

    def _expire(self, now: float) -> None:
        for c in [c for c in self._conns.values() if c.deadline <= now]:
            if c.waiting:             # the scrape is not ready in time: say so
                self.stats["busy"] += 1
                self._reply(c, Answer(503, b"metrics busy: the scrape did not finish in "
                                      + str(self.limits.response_s).encode() + b" s\n"))
                if c.sock.fileno() != -1:
                    c.deadline = now + 1.0
            else:
                self.stats["timed_out"] += 1
                self._drop(c)

    def _drop(self, c: _Conn) -> None:
        fd = c.sock.fileno()
        if fd != -1:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            self._conns.pop(fd, None)
        c.waiting = c.reading = c.handshake = False
        c.out.clear()
        _close(c.sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def bind(host: str, port: int, backlog: int = 128) -> socket.socket:
    """The listening socket of host:port, as http.server binds one (SO_REUSEADDR; OSError,
    ValueError or UnicodeError as socket raises them)."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s
