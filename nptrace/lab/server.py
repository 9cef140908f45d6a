"""TCP servers for the repro lab: a pod's application and kube-proxy's healthCheckNodePort.

Run by path (stdlib only, no package imports) with the lab's interpreter inside a
namespace: ``ip netns exec NS python server.py --listen 8080:echo``. Prints ``ready``
once every socket listens, then detaches stdout so the parent may go away.

Listener modes, ``PORT:MODE[:ARG]``:
  echo            read one request, answer ``ok <name> peer=<addr>:<port>`` (the peer shows
                  whether the client address survived: SNAT or not), close.
  delay:S         like echo but wait S seconds before answering (idle connection).
  hold            answer every request line like echo and keep the connection open until
                  the peer closes: a long-lived connection (a rollout's in-flight traffic).
  reset           read one request, then close with SO_LINGER {on, 0}: the kernel sends a
                  RST instead of a FIN (tcp_disconnect from tcp_close), i.e. the app aborts.
  hc:NS/NAME:N    kube-proxy's healthCheckNodePort answer for Service NS/NAME with N local
                  endpoints: 200 if N > 0 else 503, JSON body and headers as
                  pkg/proxy/healthcheck/service_health.go writes them.
"""
import argparse
import os
import socket
import struct
import sys
import threading
import time

BACKLOG = 1024


def _read_request(conn, timeout=3.0):
    conn.settimeout(timeout)
    try:
        return conn.recv(4096)
    except OSError:
        return b""


def _echo(conn, peer, name, delay=0.0):
    if not _read_request(conn):
        return
    if delay:
        time.sleep(delay)
    conn.sendall(f"ok {name} peer={peer[0]}:{peer[1]}\n".encode())


def _hold(conn, peer, name):
    conn.settimeout(None)
    while conn.recv(4096):
        conn.sendall(f"ok {name} peer={peer[0]}:{peer[1]}\n".encode())


def _reset(conn, peer, name):
    _read_request(conn)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def hc_response(namespace, svc, local_endpoints, proxy_healthy=True):
    """The HTTP response kube-proxy's hcHandler.ServeHTTP writes, for any path."""
    ok = local_endpoints != 0 and proxy_healthy
    body = (
        "{\n"
        "\t\"service\": {\n"
        f"\t\t\"namespace\": \"{namespace}\",\n"
        f"\t\t\"name\": \"{svc}\"\n"
        "\t},\n"
        f"\t\"localEndpoints\": {local_endpoints},\n"
        f"\t\"serviceProxyHealthy\": {'true' if proxy_healthy else 'false'}\n"
        "}"
    ).encode()
    status = "200 OK" if ok else "503 Service Unavailable"
    head = (
        f"HTTP/1.1 {status}\r\n"
        "Content-Type: application/json\r\n"
        "X-Content-Type-Options: nosniff\r\n"
        f"X-Load-Balancing-Endpoint-Weight: {local_endpoints}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body


def _hc(conn, peer, name, arg):
    nsname, count = arg.rsplit(":", 1)
    namespace, svc = nsname.split("/", 1)
    if _read_request(conn):
        conn.sendall(hc_response(namespace, svc, int(count)))


def _handler(mode, arg):
    if mode == "echo":
        return lambda c, p, n: _echo(c, p, n)
    if mode == "delay":
        return lambda c, p, n: _echo(c, p, n, float(arg))
    if mode == "reset":
        return _reset
    if mode == "hold":
        return _hold
    if mode == "hc":
        return lambda c, p, n: _hc(c, p, n, arg)
    raise SystemExit(f"server: unknown mode {mode!r}")


def _serve_one(conn, peer, handler, name):
    try:
        handler(conn, peer, name)
    except OSError:
        pass
    finally:
        conn.close()


def _accept_loop(sock, handler, name):
    while True:
        conn, peer = sock.accept()
        threading.Thread(target=_serve_one, args=(conn, peer, handler, name), daemon=True).start()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", action="append", required=True, help="PORT:MODE[:ARG]")
    ap.add_argument("--name", default=socket.gethostname())
    ap.add_argument("--ipv6", action="store_true", help="listen on :: for both families (dual-stack)")
    args = ap.parse_args(argv)
    threads = []
    for spec in args.listen:
        port, _, rest = spec.partition(":")
        mode, _, arg = rest.partition(":")
        handler = _handler(mode or "echo", arg)
        s = socket.socket(socket.AF_INET6 if args.ipv6 else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if args.ipv6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::" if args.ipv6 else "0.0.0.0", int(port)))
        s.listen(BACKLOG)
        threads.append(threading.Thread(target=_accept_loop, args=(s, handler, args.name), daemon=True))
    for t in threads:
        t.start()
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    for t in threads:
        t.join()


if __name__ == "__main__":
    sys.exit(main())
