"""tc programs on real traffic between namespaces made for the test (npt-tc<pid>-*).

One bcc object (tc programs only) for the module; each test builds its own topology, attaches
through nptrace.kernel.tc.TcAttachments, makes traffic with short python3 processes inside the
namespaces, and reads the events the ring buffer delivered.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from nptrace import events as ev
from nptrace.config import Config, IfaceSpec

pytestmark = [pytest.mark.privileged,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # bcc 0.26 str args

PID = os.getpid()
PY = "/usr/bin/python3"     # any python3 will do inside the namespaces: stdlib only

CONNECT = r"""
import socket, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
s.settimeout(timeout)
try:
    s.connect((host, port))
    print("connected", s.getsockname()[1])
except OSError as e:
    print(type(e).__name__, s.getsockname()[1])
"""

LISTEN = r"""
import socket, sys
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print("ready", flush=True)
sys.stdin.read()
"""


def sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


class Lab:
    """Namespaces and listeners of one test; close() deletes them all."""

    def __init__(self, tag: str):
        self.tag = tag
        self.ns: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def netns(self, suffix: str) -> str:
        name = f"npt-tc{PID}-{self.tag}{suffix}"
        sh("ip", "netns", "add", name)
        self.ns.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def run(self, ns: str, *cmd: str) -> str:
        return sh("ip", "netns", "exec", ns, *cmd)

    def connect(self, ns: str, host: str, port: int, timeout: float = 1.0) -> tuple[str, int]:
        out = self.run(ns, PY, "-c", CONNECT, host, str(port), str(timeout)).split()
        return out[0], int(out[1])

    def listen(self, ns: str, host: str, port: int) -> None:
        p = subprocess.Popen(["ip", "netns", "exec", ns, PY, "-c", LISTEN, host, str(port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        assert p.stdout.readline().strip() == "ready"

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        for name in reversed(self.ns):
            subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
def lab(root_and_bcc, request):
    lab = Lab(request.node.name.split("test_", 1)[-1][:4])
    try:
        yield lab
    finally:
        lab.close()


def inode(ns: str) -> int:
    return os.stat(f"/run/netns/{ns}").st_ino


def ifindex(ns: str, dev: str) -> int:
    return int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/ifindex"))


class Collector:
    def __init__(self, probes):
        self.probes = probes
        self.events: list[ev.Event] = []
        probes.open_ring(lambda raw: self.events.append(ev.decode(raw)))

    def drain(self) -> None:
        self.probes.poll(0)
        self.events.clear()

    def wait(self, pred, timeout: float = 3.0) -> list[ev.Event]:
        """Events matching pred, polling until at least one arrived (or timeout)."""
        end = time.monotonic() + timeout
        while True:
            self.probes.poll(50)
            got = [e for e in self.events if pred(e)]
            if got or time.monotonic() > end:
                return got

    def settle(self, pred, secs: float = 0.3) -> list[ev.Event]:
        end = time.monotonic() + secs
        while time.monotonic() < end:
            self.probes.poll(50)
        return [e for e in self.events if pred(e)]


@pytest.fixture(scope="module")
def probes(root_and_bcc):
    from nptrace import reasons
    from nptrace.kernel import btf, loader, offsets, tc
    b = btf.default()
    drops, _ = reasons.load_tables(b)
    cfg = Config(ifaces=(IfaceSpec(None, "placeholder"),))
    p = loader.Probes(cfg, offsets.cflags(b) + tc.tc_cflags(cfg), drops, set())
    try:
        tc.configure(p, cfg)
        p.collector = Collector(p)
        yield p
    finally:
        p.close()


@pytest.fixture
def attach(probes, tmp_path):
    """attach(*"ns/ifname") -> context manager on the module's programs."""
    from nptrace.kernel import tc

    def make(*specs: str):
        ing, egr = probes.tc_program_fds()
        return tc.TcAttachments([IfaceSpec.parse(s) for s in specs], ing, egr,
                                state_dir=tmp_path, on_attach=tc.iface_map_filler(probes))
    probes.collector.drain()
    return make


def veth_pair(lab: Lab, a: str, adev: str, b: str, bdev: str, aaddr: str, baddr: str):
    sh("ip", "link", "add", adev, "netns", a, "type", "veth", "peer", bdev, "netns", b)
    for ns, dev, addr in ((a, adev, aaddr), (b, bdev, baddr)):
        for x in filter(None, addr.split(",")):
            sh("ip", "-n", ns, "addr", "add", x, "dev", dev, *(["nodad"] if ":" in x else []))
        sh("ip", "-n", ns, "link", "set", dev, "up")


def test_rst_both_directions_on_veth(lab, probes, attach):
    cli, srv = lab.netns("c"), lab.netns("s")
    veth_pair(lab, cli, "c0", srv, "s0", "10.231.0.1/24,fd31::1/64", "10.231.0.2/24,fd31::2/64")
    col = probes.collector
    with attach(f"{cli}/c0", f"{srv}/s0"):
        res, cport = lab.connect(cli, "10.231.0.2", 9)
        assert res == "ConnectionRefusedError"
        rst = lambda e: e.type == ev.EvType.WIRE_RST and e.dport == cport  # noqa: E731
        col.wait(lambda e: rst(e) and e.dir == ev.Dir.INGRESS)
        got = col.settle(rst)
        res6, cport6 = lab.connect(cli, "fd31::2", 9)
        assert res6 == "ConnectionRefusedError"
        got6 = col.wait(lambda e: e.type == ev.EvType.WIRE_RST and e.dport == cport6
                        and e.dir == ev.Dir.INGRESS)
    by_dir = {e.dir: e for e in got}
    assert set(by_dir) == {ev.Dir.EGRESS, ev.Dir.INGRESS}, got
    out, inn = by_dir[ev.Dir.EGRESS], by_dir[ev.Dir.INGRESS]
    assert (out.hook, out.ifindex, out.netns) == (ev.Hook.TC_EGRESS, ifindex(srv, "s0"), inode(srv))
    assert (inn.hook, inn.ifindex, inn.netns) == (ev.Hook.TC_INGRESS, ifindex(cli, "c0"),
                                                  inode(cli))
    for e in (out, inn):
        assert e.flow == ("10.231.0.2", 9, "10.231.0.1", cport)
        assert e.tcpflags & ev.TCP_RST and e.l4proto == socket.IPPROTO_TCP
        assert e.ack_seq != 0 and e.seq == 0      # reset of a SYN: seq 0, ack = ISN + 1
        assert not e.flags & ev.F_ENCAP
    assert out.skb != 0
    assert len(got6) == 1 and got6[0].family == socket.AF_INET6
    assert got6[0].flow == ("fd31::2", 9, "fd31::1", cport6)
    # a refused connect is not an anomaly of the path
    assert not [e for e in col.events if e.type in (ev.EvType.ASYM_IFACE, ev.EvType.ASYM_SRC,
                                                    ev.EvType.SYN_RETX)]


def test_rst_inside_vxlan_underlay(lab, probes, attach):
    a, b = lab.netns("a"), lab.netns("b")
    veth_pair(lab, a, "u0", b, "u1", "10.232.0.1/24", "10.232.0.2/24")
    for ns, dev, local, remote, addr in ((a, "u0", "10.232.0.1", "10.232.0.2", "10.233.0.1/24"),
                                         (b, "u1", "10.232.0.2", "10.232.0.1", "10.233.0.2/24")):
        sh("ip", "-n", ns, "link", "add", "vx0", "type", "vxlan", "id", "4242", "local", local,
           "remote", remote, "dstport", "4789", "dev", dev)
        sh("ip", "-n", ns, "addr", "add", addr, "dev", "vx0")
        sh("ip", "-n", ns, "link", "set", "vx0", "up")
    col = probes.collector
    with attach(f"{b}/u1"):
        res, cport = lab.connect(a, "10.233.0.2", 9)
        assert res == "ConnectionRefusedError"
        got = col.wait(lambda e: e.type == ev.EvType.WIRE_RST and e.dport == cport)
    assert len(got) == 1, got
    e = got[0]
    assert e.flow == ("10.233.0.2", 9, "10.233.0.1", cport)
    assert e.flags & ev.F_ENCAP and e.vni == 4242
    assert (e.outer_saddr, e.outer_daddr) == ("10.232.0.2", "10.232.0.1")
    assert (e.dir, e.ifindex, e.netns) == (ev.Dir.EGRESS, ifindex(b, "u1"), inode(b))


def _two_path_lab(lab):
    """client netns with two veths to a multi-homed server netns:
    A: ca 10.234.1.1 <-> sa 10.234.1.2, B: cb 10.234.2.1 <-> sb 10.234.2.2."""
    cli, srv = lab.netns("c"), lab.netns("s")
    veth_pair(lab, cli, "ca", srv, "sa", "10.234.1.1/24", "10.234.1.2/24")
    veth_pair(lab, cli, "cb", srv, "sb", "10.234.2.1/24", "10.234.2.2/24")
    for ns in (cli, srv):
        lab.run(ns, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0")
        for dev in ("ca", "cb") if ns == cli else ("sa", "sb"):
            lab.run(ns, "sysctl", "-qw", f"net.ipv4.conf.{dev}.rp_filter=0")
    return cli, srv


def test_asym_iface_only_on_asymmetric_path(lab, probes, attach):
    cli, srv = _two_path_lab(lab)
    lab.listen(srv, "0.0.0.0", 8080)
    col = probes.collector
    asym = lambda e: e.type == ev.EvType.ASYM_IFACE  # noqa: E731
    with attach(f"{srv}/sa", f"{srv}/sb"):
        # symmetric: in by sb, out by sb
        assert lab.connect(cli, "10.234.2.2", 8080)[0] == "connected"
        assert col.settle(asym) == []
        # the server's route back to 10.234.1.1 now leaves by sb: in by sa, out by sb
        lab.run(srv, "ip", "route", "add", "10.234.1.1/32", "via", "10.234.2.1", "dev", "sb")
        res, cport = lab.connect(cli, "10.234.1.2", 8080)
        got = col.wait(lambda e: asym(e) and e.dport == cport)
    assert res == "connected"
    assert len(got) == 1, got
    e = got[0]
    assert e.flow == ("10.234.1.2", 8080, "10.234.1.1", cport)
    assert (e.ifindex, e.aux) == (ifindex(srv, "sb"), ifindex(srv, "sa"))
    assert (e.dir, e.netns, e.tcpflags) == (ev.Dir.EGRESS, inode(srv), ev.TCP_SYN | ev.TCP_ACK)
    assert not [x for x in col.events if x.type == ev.EvType.ASYM_SRC]


def test_asym_src_for_un_nated_reply(lab, probes, attach):
    cli, srv = _two_path_lab(lab)
    lab.listen(srv, "0.0.0.0", 8080)
    # DNAT 30080 -> 8080, and keep the replies out of conntrack so they are not un-DNATed
    lab.run(srv, "iptables", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", "30080",
            "-j", "DNAT", "--to-destination", "10.234.1.2:8080")
    lab.run(srv, "iptables", "-t", "raw", "-A", "OUTPUT", "-p", "tcp", "--sport", "8080",
            "-j", "NOTRACK")
    col = probes.collector
    with attach(f"{srv}/sa"):
        res, cport = lab.connect(cli, "10.234.1.2", 30080, timeout=0.5)
        got = col.wait(lambda e: e.type == ev.EvType.ASYM_SRC and e.dport == cport)
    assert res != "connected"
    assert len(got) == 1, got
    e = got[0]
    assert e.flow == ("10.234.1.2", 8080, "10.234.1.1", cport)
    assert e.aux2 == 30080 and e.aux == ifindex(srv, "sa")
    assert bytes(e.raw[168:172]) == socket.inet_aton("10.234.1.2")   # outer_saddr


def test_syn_retransmission_when_server_drops(lab, probes, attach):
    cli, srv = lab.netns("c"), lab.netns("s")
    veth_pair(lab, cli, "c0", srv, "s0", "10.235.0.1/24", "10.235.0.2/24")
    lab.run(srv, "iptables", "-A", "INPUT", "-p", "tcp", "--dport", "8081", "-j", "DROP")
    col = probes.collector
    with attach(f"{srv}/s0"):
        res, cport = lab.connect(cli, "10.235.0.2", 8081, timeout=1.6)   # SYN at 0 s and 1 s
        got = col.wait(lambda e: e.type == ev.EvType.SYN_RETX and e.sport == cport)
    assert res == "TimeoutError"
    assert [e.aux for e in got] == [2], got
    e = got[0]
    assert e.flow == ("10.235.0.1", cport, "10.235.0.2", 8081)
    assert (e.dir, e.hook, e.ifindex) == (ev.Dir.INGRESS, ev.Hook.TC_INGRESS, ifindex(srv, "s0"))
    assert e.aux2 == ifindex(srv, "s0")


def test_wire_icmp_unreachable_with_conntrack(lab, probes, attach):
    cli, srv = lab.netns("c"), lab.netns("s")
    veth_pair(lab, cli, "c0", srv, "s0", "10.236.0.1/24", "10.236.0.2/24")
    # a NodePort-like DNAT to a port that rejects: the ICMP error leaves with the
    # connection's conntrack entry attached (RELATED), the quoted SYN un-DNATed
    lab.run(srv, "iptables", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", "30082",
            "-j", "DNAT", "--to-destination", "10.236.0.2:8082")
    lab.run(srv, "iptables", "-A", "INPUT", "-p", "tcp", "--dport", "8082", "-j", "REJECT")
    col = probes.collector
    with attach(f"{srv}/s0"):
        res, cport = lab.connect(cli, "10.236.0.2", 30082)
        got = col.wait(lambda e: e.type == ev.EvType.WIRE_ICMP and e.sport == cport)
    assert res == "ConnectionRefusedError"
    assert len(got) == 1, got
    e = got[0]
    assert e.flow == ("10.236.0.1", cport, "10.236.0.2", 30082)    # the quoted SYN
    assert e.flags & ev.F_ICMP_QUOTE and e.reason == (3 << 8 | 3)
    assert (e.outer_saddr, e.outer_daddr) == ("10.236.0.2", "10.236.0.1")
    assert e.dir == ev.Dir.EGRESS
    assert e.ct is not None and e.ct.dnat, e
    assert (e.ct.orig_dst, e.ct.orig_dport) == ("10.236.0.2", 30082)
    assert (e.ct.reply_src, e.ct.reply_sport) == ("10.236.0.2", 8082)


def test_wire_icmpv6_unreachable(lab, probes, attach):
    cli, srv = lab.netns("c"), lab.netns("s")
    veth_pair(lab, cli, "c0", srv, "s0", "fd36::1/64", "fd36::2/64")
    lab.run(srv, "ip6tables", "-A", "INPUT", "-p", "tcp", "--dport", "8083", "-j", "REJECT")
    col = probes.collector
    with attach(f"{cli}/c0"):
        # whether the client gives up at once is the stack's business (6.18 keeps retrying)
        res, cport = lab.connect(cli, "fd36::2", 8083, timeout=0.5)
        got = col.wait(lambda e: e.type == ev.EvType.WIRE_ICMP and e.sport == cport)
    assert res != "connected"
    assert len(got) == 1, got
    e = got[0]
    assert e.flow == ("fd36::1", cport, "fd36::2", 8083) and e.family == socket.AF_INET6
    assert e.l4proto == socket.IPPROTO_ICMPV6 and e.reason == (1 << 8 | 4)   # port unreachable
    assert (e.dir, e.hook) == (ev.Dir.INGRESS, ev.Hook.TC_INGRESS)
    # outer_saddr/daddr (bytes 168..199) hold the ICMPv6 packet's own IPv6 addresses
    assert bytes(e.raw[168:184]) == socket.inet_pton(socket.AF_INET6, "fd36::2")
    assert bytes(e.raw[184:200]) == socket.inet_pton(socket.AF_INET6, "fd36::1")


def test_stacked_bridge_and_port_no_false_anomaly(lab, probes, attach):
    """The same SYN crosses the bridge port and the bridge: neither a retransmission nor,
    when the SYN-ACK leaves by both, an asymmetric path."""
    cli, srv = lab.netns("c"), lab.netns("s")
    veth_pair(lab, cli, "c0", srv, "s0", "10.237.0.1/24", "")
    sh("ip", "-n", srv, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", srv, "link", "set", "s0", "master", "br0")
    sh("ip", "-n", srv, "addr", "add", "10.237.0.2/24", "dev", "br0")
    sh("ip", "-n", srv, "link", "set", "br0", "up")
    lab.listen(srv, "0.0.0.0", 8080)
    col = probes.collector
    with attach(f"{srv}/s0", f"{srv}/br0"):
        for _ in range(3):
            assert lab.connect(cli, "10.237.0.2", 8080, timeout=3)[0] == "connected"
        bad = col.settle(lambda e: e.type in (ev.EvType.ASYM_IFACE, ev.EvType.ASYM_SRC,
                                              ev.EvType.SYN_RETX))
    assert bad == []


def test_netns_from_iface_map_without_kernel_skb_reads(lab, tmp_path):
    """-DNPT_TC_KSKB=0: netns from tc_ifaces (filled on attach), no conntrack."""
    from nptrace import reasons
    from nptrace.kernel import btf, loader, offsets, tc
    b = btf.default()
    cfg = Config(ifaces=(IfaceSpec(None, "placeholder"),))
    flags = [f for f in tc.tc_cflags(cfg) if "NPT_TC_KSKB" not in f] + ["-DNPT_TC_KSKB=0"]
    p = loader.Probes(cfg, offsets.cflags(b) + flags, reasons.load_tables(b)[0], set())
    try:
        col = Collector(p)
        cli, srv = lab.netns("c"), lab.netns("s")
        veth_pair(lab, cli, "c0", srv, "s0", "10.238.0.1/24", "10.238.0.2/24")
        ing, egr = p.tc_program_fds()
        with tc.TcAttachments([IfaceSpec(srv, "s0")], ing, egr, state_dir=tmp_path,
                              on_attach=tc.iface_map_filler(p)):
            res, cport = lab.connect(cli, "10.238.0.2", 9)
            got = col.wait(lambda e: e.type == ev.EvType.WIRE_RST and e.dport == cport)
    finally:
        p.close()
    assert res == "ConnectionRefusedError"
    assert len(got) == 1 and got[0].netns == inode(srv) and got[0].skb == 0
