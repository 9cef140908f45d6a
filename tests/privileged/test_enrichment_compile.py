"""Optional enrichment programs: the kprobes compile and pass the verifier even where they
cannot be attached (so they do not rot), and the netfilter-hook program sees a SYN just after
DNAT with its conntrack tuples.

The DNAT lab: client namespace npt-nfc<pid> (10.99.0.1) -- veth -- node namespace
npt-nfn<pid> (10.99.0.2) with `iptables -t nat -A PREROUTING -p tcp --dport 30080 -j DNAT
--to-destination 10.99.1.5:8080`; 10.99.1.5 (the "pod") is a local address of the node with
nothing listening, so the node answers the SYN with a reset.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nptrace import events as ev
from nptrace.kernel import nfhook
from nptrace.kernel import ringbuf as rb

privileged = pytest.mark.privileged

# every program in bpf/kprobes.bpf.c; loader.KPROBE_GROUPS must name exactly these
KPROBE_PROGRAMS = sorted((
    "npt_kp_nat_manip", "npt_kp_nat_packet", "npt_kp_fib_validate_entry",
    "npt_kp_fib_validate_ret", "npt_kp_tcp_reset", "npt_kp_nf_send_reset", "npt_kp_ipvs_in_entry",
    "npt_kp_ipvs_in_ret", "npt_kp_ipvs_out_entry", "npt_kp_ipvs_out_ret"))


def _base_cflags():
    from nptrace.kernel import btf, offsets
    from nptrace.config import Config
    from nptrace.kernel.cflags import build_cflags
    b = btf.default()
    return b, build_cflags(Config(ringbuf_pages=64), set(), offsets.cflags(b))


# --- pure parts (no root) --------------------------------------------------------------------
def test_decode_aux_and_cflags():
    p = nfhook.decode_aux(2 << 24 | 0 << 16 | (-99 & 0xFFFF))
    assert p == nfhook.HookPoint(nfhook.NFPROTO_IPV4, nfhook.NF_INET_PRE_ROUTING, -99)
    assert p.name == "ipv4/PRE_ROUTING@-99"
    assert nfhook.decode_aux(2 << 24 | 4 << 16 | 101).priority == 101
    flags = nfhook.cflags(None, (nfhook.AFTER_DNAT, nfhook.AFTER_SNAT))
    assert "-DNPT_WITH_NF_HOOK=1" in flags
    assert "-DNPT_NF_PRIO_H0=(-99)" in flags and "-DNPT_NF_PRIO_H4=(101)" in flags
    with pytest.raises(ValueError):
        nfhook.cflags(None, (nfhook.AFTER_DNAT, (0, 5)))


def test_loader_groups_name_every_kprobe_program():
    text = (Path(rb.__file__).resolve().parents[2] / "bpf" / "kprobes.bpf.c").read_text()
    assert len(re.findall(r"^int npt_kp_\w+\(struct pt_regs \*ctx\)", text, re.M)) == \
        len(KPROBE_PROGRAMS)
    for prog in KPROBE_PROGRAMS:
        assert f"int {prog}(struct pt_regs *ctx)" in text, prog


# --- kprobes --------------------------------------------------------------------------------
@pytest.mark.usefixtures("root_and_bcc")
@privileged
def test_kprobes_compile_and_verify():
    """Compiled and loaded through the verifier as BPF_PROG_TYPE_KPROBE, never attached:
    loading does not need CONFIG_KPROBES, attaching does."""
    from bcc import BPF
    from nptrace.kernel import loader
    _, flags = _base_cflags()
    b = loader.compile_families(("npt_common.h", "kprobes.bpf.c"),
                                flags + ["-DNPT_WITH_KPROBES=1"])
    try:
        progs = sorted({p for alts in loader.KPROBE_GROUPS.values() for alt in alts
                        for p, _, _ in alt})
        assert progs == KPROBE_PROGRAMS
        res = loader.verify_programs(b, progs, BPF.KPROBE)
        assert res == dict.fromkeys(progs, ""), res
    finally:
        b.cleanup()


@pytest.mark.usefixtures("root_and_bcc")
@privileged
def test_kprobes_attach_or_say_why_not():
    from nptrace.kernel import features, loader
    f = features.probe()
    r = f.result("kprobes")
    if not r.present:
        pytest.skip(f"enrichment kprobes not attached: kprobes absent ({r.detail}); "
                    f"compiled and verified by test_kprobes_compile_and_verify")
    _, flags = _base_cflags()
    b = loader.compile_families(("npt_common.h", "kprobes.bpf.c"),
                                flags + ["-DNPT_WITH_KPROBES=1"])
    try:
        res = loader.attach_kprobes(b)
        # nf_send_reset and fib_validate_source exist wherever IPv4 netfilter REJECT and
        # routing do; IPVS may be absent (a module, or not built).
        assert not res["rp_filter"].startswith("skipped"), res
        print(f"\nattached: {res}")
    finally:
        b.cleanup()


# --- netfilter hook program -------------------------------------------------------------------
def _nf_prog_supported() -> str | None:
    from nptrace.kernel import features
    r = features.probe().result("netfilter bpf")
    return None if r.present is not False else r.detail or "kernel < 6.4"


def sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


@pytest.fixture
def dnat_lab(root_and_bcc):
    if shutil.which("iptables") is None:
        pytest.skip("iptables not installed (scripts/setup.sh)")
    pid = os.getpid()
    cli, node = f"npt-nfc{pid}", f"npt-nfn{pid}"
    made = []
    try:
        for ns in (cli, node):
            sh("ip", "netns", "add", ns)
            made.append(ns)
        sh("ip", "link", "add", "nptc0", "netns", cli, "type", "veth", "peer", "name", "nptn0",
           "netns", node)
        sh("ip", "-n", cli, "addr", "add", "10.99.0.1/24", "dev", "nptc0")
        sh("ip", "-n", node, "addr", "add", "10.99.0.2/24", "dev", "nptn0")
        sh("ip", "-n", node, "addr", "add", "10.99.1.5/32", "dev", "lo")
        for ns, dev in ((cli, "nptc0"), (node, "nptn0")):
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "netns", "exec", node, "iptables", "-t", "nat", "-A", "PREROUTING", "-p", "tcp",
           "--dport", "30080", "-j", "DNAT", "--to-destination", "10.99.1.5:8080")
        yield cli, node
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False)


CONNECT = r"""
import socket, sys
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("10.99.0.2", 30080))
    print("connected")
except ConnectionRefusedError:
    print("refused %d" % s.getsockname()[1])
"""


@privileged
def test_nf_hook_sees_syn_after_dnat(dnat_lab):
    why = _nf_prog_supported()
    if why:
        pytest.skip(f"BPF_PROG_TYPE_NETFILTER unavailable: {why}")
    from nptrace.kernel import loader
    cli, node = dnat_lab
    node_inode = os.stat(f"/run/netns/{node}").st_ino
    b, flags = _base_cflags()
    bpf = loader.compile_families(("npt_common.h", "nf_hook.bpf.c"),
                                  flags + nfhook.cflags(b) + ["-DNPT_NF_NAT_ONLY=0"])  # every SYN and RST, not only NATed SYNs
    try:
        prog_fd = loader.load_netfilter_prog(bpf)
        with nfhook.NfHookLinks(prog_fd) as links, \
                rb.RingReader(bpf["events"].map_fd) as reader:
            points = links.attach(node, (nfhook.AFTER_DNAT, nfhook.AFTER_SNAT))
            assert [p.name for p in points] == ["ipv4/PRE_ROUTING@-99", "ipv4/POST_ROUTING@101"]
            r = subprocess.run(["ip", "netns", "exec", cli, sys.executable, "-c", CONNECT],
                               capture_output=True, text=True, timeout=20)
            assert r.stdout.startswith("refused"), (r.stdout, r.stderr)
            cport = int(r.stdout.split()[1])
            got = []
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and len(got) < 2:
                got += [ev.from_tuple(t) for t in reader.poll(100)]
                got = [e for e in got if e.netns == node_inode and cport in (e.sport, e.dport)]
        views = {(nfhook.decode_aux(e.aux).hooknum, e.tcpflags & 0x06): e for e in got}
        for e in got:
            print(f"\n{nfhook.decode_aux(e.aux).name} flags={e.tcpflags:#x} {e.flow} ct={e.ct}")
        syn = views.get((nfhook.NF_INET_PRE_ROUTING, 0x02))
        assert syn is not None, got
        assert syn.type is ev.EvType.NF_VIEW and syn.hook is ev.Hook.NF_HOOK
        assert syn.dir is ev.Dir.INGRESS
        # after DNAT: the packet itself already goes to the pod
        assert (syn.saddr, syn.sport, syn.daddr, syn.dport) == ("10.99.0.1", cport,
                                                                "10.99.1.5", 8080)
        assert syn.ct is not None and syn.ct.dnat
        assert syn.ct.status & ev.IPS_DST_NAT_DONE
        assert (syn.ct.orig_src, syn.ct.orig_sport, syn.ct.orig_dst, syn.ct.orig_dport) == \
            ("10.99.0.1", cport, "10.99.0.2", 30080)
        assert (syn.ct.reply_src, syn.ct.reply_sport, syn.ct.reply_dst, syn.ct.reply_dport) == \
            ("10.99.1.5", 8080, "10.99.0.1", cport)
        # the node's reset, after the reply-direction un-DNAT at POST_ROUTING: from the NodePort
        rst = views.get((nfhook.NF_INET_POST_ROUTING, 0x04))
        assert rst is not None, got
        assert (rst.saddr, rst.sport, rst.daddr, rst.dport) == ("10.99.0.2", 30080,
                                                                "10.99.0.1", cport)
        assert rst.dir is ev.Dir.EGRESS
    finally:
        bpf.cleanup()


# --- the largest builds -----------------------------------------------------------------------
EVERY_GATE = """
import ipaddress
from nptrace.config import Config, IfaceSpec, PortRange
from nptrace.kernel import btf, loader, nfhook, offsets
from nptrace.kernel.cflags import build_cflags
b = btf.default()
base = offsets.cflags(b) + nfhook.cflags(b) + ["-DNPT_TC_KSKB=1"]
gates = {"ports": (PortRange(80, 80),), "hosts": (ipaddress.ip_network("10.0.0.0/8"),),
         "service_gate": True, "snaplen": 128}
# each gate alone and all at once: LLVM's stack layout moves with what gets inlined
for on in [(g,) for g in gates] + [tuple(gates)]:
    cfg = Config(ringbuf_pages=64, ifaces=(IfaceSpec.parse("ns/eth0"),), max_rate=100,
                 wake_every=256, **{g: gates[g] for g in on})
    loader.compile_families(loader.FAMILIES[:5], build_cflags(cfg, None, base)).cleanup()
    print("compiled", "+".join(on), flush=True)
"""


@pytest.mark.usefixtures("root_and_bcc")
@privileged
def test_every_gate_compiles():
    """Every hook family with tc, the netfilter hook, the sampler and each filter (then all
    of them) in one object: the BPF stack (512 bytes) of every program holds (tcp_send_reset's
    with --host once did not). LLVM ends the process on a stack overflow (the loader makes
    that one line and exit 2, tests/privileged/test_llvm_exit.py), so the compiles run in a
    child."""
    r = subprocess.run([sys.executable, "-c", EVERY_GATE], capture_output=True, text=True,
                       cwd=Path(rb.__file__).resolve().parents[2], timeout=300)
    # stdout says which builds went through; stderr's last line, LLVM's message for the next
    assert r.returncode == 0 and r.stdout.count("compiled") == 5, \
        f"exit {r.returncode} after: {r.stdout.strip()!r}; {r.stderr[-1500:]}"
