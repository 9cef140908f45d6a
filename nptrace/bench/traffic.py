"""Traffic generators the benchmarks run inside their namespaces (`ip netns exec NS python -m
nptrace.bench.traffic CMD ...`). Standard library only, so a generator starts in tens of ms.
Each prints one JSON line with what it did, and stops by itself (bounded by count or time).

  syn      SYNs to one address:port from distinct (source address, port) pairs, written as
           whole Ethernet frames to an AF_PACKET socket (one send per frame, no socket per
           flow): the fastest reset source Python has; --rate limits it (flow churn)
  accept   accept() and close() forever, each connection once the client's FIN is in (the
           server end of a connection-rate run: it closes second and keeps no TIME_WAIT)
  connect  non-blocking connects kept --conc in flight for --secs; each sends its FIN at the
           handshake's end (the client closes first and keeps the TIME_WAIT) and counts once
           the server's FIN arrives (bench/connrate.py says why this order); --serve runs
           once per line of stdin instead and lets the connections in flight end after each
  sink / source   bulk TCP without iperf3 (fallback)
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import select
import socket
import struct
import sys
import time

SPORT_LO, SPORT_N = 1024, 64000
_IP_TCP = struct.Struct("!BBHHHBBH4s4sHHIIBBHHH")


def _fold(s: int) -> int:
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def _words(b: bytes) -> int:
    return sum(struct.unpack(f"!{len(b) // 2}H", b))


class SynFrames:
    """Ethernet+IPv4+TCP SYN frames, flow i = (src_net[i // SPORT_N], SPORT_LO + i % SPORT_N).
    Checksums are filled incrementally: only the source address and port vary."""

    def __init__(self, src_net: str, dst: str, dport: int, smac: str, dmac: str):
        self.net = ipaddress.ip_network(src_net)
        self.base = int(self.net.network_address) + 1
        self.hosts = max(1, self.net.num_addresses - 2)
        self.dst = socket.inet_aton(dst)
        self.dport = dport
        self.eth = bytes.fromhex(dmac.replace(":", "")) + bytes.fromhex(smac.replace(":", "")) \
            + b"\x08\x00"
        d = _words(self.dst)
        # IP header sum without the source address; TCP pseudo-header + header without
        # the source address and port (seq = 1, flags SYN, window 64240, data offset 5).
        self.ip_base = _words(struct.pack("!BBHHHBB", 0x45, 0, 40, 0, 0x4000, 64, 6)) + d
        self.tcp_base = d + 6 + 20 + dport + 1 + (5 << 12 | 0x02) + 64240

    def frame(self, i: int) -> bytes:
        src = self.base + (i // SPORT_N) % self.hosts
        sport = SPORT_LO + i % SPORT_N
        s = (src >> 16) + (src & 0xFFFF)
        ipc = ~_fold(self.ip_base + s) & 0xFFFF
        tcpc = ~_fold(self.tcp_base + s + sport) & 0xFFFF
        return self.eth + _IP_TCP.pack(0x45, 0, 40, 0, 0x4000, 64, 6, ipc,
                                       src.to_bytes(4, "big"), self.dst, sport, self.dport,
                                       1, 0, 5 << 4, 0x02, 64240, tcpc, 0)


def cmd_syn(a) -> dict:
    smac = open(f"/sys/class/net/{a.dev}/address").read().strip()
    gen = SynFrames(a.src_net, a.dst, a.dport, smac, a.dmac)
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    s.bind((a.dev, 0))
    send = s.send
    start = a.first
    if a.rate:                       # paced: batches of 1/100 s, by wall time
        batch = max(1, int(a.rate / 100))
        end = time.monotonic() + a.secs
        t0 = time.monotonic()
        i = start
        while time.monotonic() < end:
            for k in range(i, i + batch):
                send(gen.frame(k))
            i += batch
            ahead = (i - start) / a.rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
        return {"sent": i - start, "secs": time.monotonic() - t0}
    frames = [gen.frame(k) for k in range(start, start + a.count)]   # built before timing
    t0 = time.monotonic()
    for f in frames:
        send(f)
    return {"sent": a.count, "secs": time.monotonic() - t0}


def cmd_accept(a) -> dict:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accept() returns a connection once a segment after the handshake is in: here the
    # client's FIN, so the close() is always second. The handshake's bare ACK is dropped
    # (TcpExtTCPDeferAcceptDrop, one kfree_skb) and the FIN completes the handshake.
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 5)
    s.bind(("0.0.0.0", a.port))
    s.listen(4096)
    print(json.dumps({"ready": True}), flush=True)
    acc = s.accept
    while True:
        c, _ = acc()
        c.close()


class Connector:
    """Non-blocking connects to addr kept `conc` in flight; run(secs) counts the ones done."""

    def __init__(self, addr: tuple[str, int], conc: int):
        self.addr, self.conc = addr, conc
        self.ep = select.epoll()
        self.socks: dict[int, socket.socket] = {}
        self.shut: set[int] = set()   # connected, our FIN sent: waiting for the server's
        self.failed = 0

    # edge-triggered, one registration: EPOLLOUT once the handshake is done, EPOLLRDHUP once
    # the server's FIN is in (an epoll_ctl per connection less than re-arming in between)
    FLAGS = select.EPOLLOUT | select.EPOLLRDHUP | select.EPOLLET

    def start(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        r = s.connect_ex(self.addr)
        if r not in (0, errno.EINPROGRESS):
            self.failed += 1
            s.close()
            return
        self.socks[s.fileno()] = s
        self.ep.register(s.fileno(), self.FLAGS)

    def step(self, timeout: float, refill: bool) -> int:
        """Handle one poll's events; connections done. refill: start one for each that ends."""
        done = 0
        for fd, ev in self.ep.poll(timeout):
            if ev & select.EPOLLERR:
                self.failed += 1
            elif fd not in self.shut:
                # not before the handshake's end: shutdown() in SYN_SENT closes without a FIN
                self.socks[fd].shutdown(socket.SHUT_WR)
                self.shut.add(fd)
                if not ev & select.EPOLLRDHUP:
                    continue
                done += 1
            elif ev & select.EPOLLRDHUP:
                done += 1
            else:
                continue       # another edge (our FIN's ACK): the server's FIN is still due
            self.shut.discard(fd)
            self.socks.pop(fd).close()
            if refill:
                self.start()
        return done

    def run(self, secs: float) -> dict:
        self.failed = 0
        t0 = time.monotonic()
        end = t0 + secs
        done = 0
        for _ in range(self.conc - len(self.socks)):   # a connect that fails at once is
            self.start()                                # counted, not retried in a loop
        while time.monotonic() < end:
            done += self.step(0.05, True)
        return {"done": done, "failed": self.failed, "secs": time.monotonic() - t0}

    def drain(self, limit: float = 5.0) -> int:
        """Let the connections in flight end, uncounted, so that the next run starts from none
        (as a fresh process would); those still open after `limit` seconds are closed."""
        end = time.monotonic() + limit
        while self.socks and time.monotonic() < end:
            self.step(0.05, False)
        left = len(self.socks)
        for s in self.socks.values():
            s.close()
        self.socks.clear()
        self.shut.clear()
        return left


def cmd_connect(a) -> dict:
    c = Connector((a.host, a.port), a.conc)
    if not a.serve:
        return c.run(a.secs)
    # --serve: one run per line of stdin (its seconds), one JSON line each; EOF ends. The
    # connection-rate bench keeps its clients between runs, so that the runs it pairs are
    # adjacent (no process start between them) and each starts with none in flight.
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        r = c.run(float(line))
        r["stuck"] = c.drain()
        print(json.dumps(r), flush=True)
    return {"done": 0, "failed": 0, "secs": 0.0}


def cmd_sink(a) -> dict:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", a.port))
    s.listen(8)
    print(json.dumps({"ready": True}), flush=True)
    while True:
        c, _ = s.accept()
        buf = bytearray(1 << 20)
        while c.recv_into(buf):
            pass
        c.close()


def cmd_source(a) -> dict:
    s = socket.create_connection((a.host, a.port))
    buf = b"\0" * (1 << 20)
    n = 0
    t0 = time.monotonic()
    end = t0 + a.secs
    while time.monotonic() < end:
        n += s.send(buf)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    secs = time.monotonic() - t0
    s.close()
    return {"bytes": n, "secs": secs, "bps": n * 8 / secs}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nptrace.bench.traffic")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("syn")
    s.add_argument("--dev", required=True)
    s.add_argument("--dmac", required=True)
    s.add_argument("--src-net", required=True)
    s.add_argument("--dst", required=True)
    s.add_argument("--dport", type=int, required=True)
    s.add_argument("--count", type=int, default=100000)
    s.add_argument("--first", type=int, default=0, help="index of the first flow")
    s.add_argument("--rate", type=float, default=0, help="frames/s (0: as fast as possible)")
    s.add_argument("--secs", type=float, default=10, help="with --rate: how long")
    s = sub.add_parser("accept")
    s.add_argument("--port", type=int, required=True)
    s = sub.add_parser("connect")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--secs", type=float, default=2)
    s.add_argument("--conc", type=int, default=128)
    s.add_argument("--serve", action="store_true",
                   help="one run per line of stdin (its seconds), one JSON line each")
    s = sub.add_parser("sink")
    s.add_argument("--port", type=int, required=True)
    s = sub.add_parser("source")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--secs", type=float, default=2)
    return p


COMMANDS = {"syn": cmd_syn, "accept": cmd_accept, "connect": cmd_connect, "sink": cmd_sink,
            "source": cmd_source}


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        out = COMMANDS[a.cmd](a)
    except (OSError, ValueError) as e:
        print(f"traffic {a.cmd}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
