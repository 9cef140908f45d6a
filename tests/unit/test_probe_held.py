"""The lab probe's held connections (rollout scenarios): the first exchange, then a pause for
the runner's steps, then the second exchange on the same connection; without root, on
loopback."""
import socket
import threading

from nptrace.lab import probe


def _server(mode):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)

    def serve():
        while True:
            c, _ = s.accept()
            threading.Thread(target=handle, args=(c,), daemon=True).start()

    def handle(c):
        c.recv(100)
        c.sendall(b"ok one\n")
        c.recv(100)
        if mode == "reset":
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            c.close()
        else:
            c.sendall(b"ok two\n")
    threading.Thread(target=serve, daemon=True).start()
    return s.getsockname()[1]


def test_second_exchange_after_the_pause():
    port = _server("echo")
    seen = []
    out = probe.run([{"dst": "127.0.0.1", "port": port, "count": 3, "timeout": 2,
                      "then": {"payload": "again\n", "timeout": 2}}], seen.append)
    assert seen == [3]
    assert [(a["outcome"], a["phase"], a["reply"]) for a in out] == [("ok", "after", "ok two")] * 3


def test_reset_in_the_second_exchange():
    port = _server("reset")
    out = probe.run([{"dst": "127.0.0.1", "port": port, "count": 2, "timeout": 2,
                      "then": {"timeout": 2}}], lambda n: None)
    assert {(a["outcome"], a["phase"]) for a in out} == {("reset", "after")}
