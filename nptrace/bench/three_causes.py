"""A storm of three causes at once, and the truth of each counted without nptrace. Shared by
tests/privileged/test_exact_causes.py (the exactness test) and the reset_storm bench section
(its per-cause counting error rows).

A client namespace floods a server namespace over a veth (xc0 10.77.0.1 -- xs0 10.77.0.2)
with hping3, three floods side by side:
  * SYNs to a closed port           -> no_listener resets, truth: the server's TcpOutRsts
  * spoofed-source SYNs (strict rp_filter, the route back leaves by another interface)
                                    -> rp_filter drops, truth: TcpExtIPReversePathFilter
  * SYNs DNATed to a pod-like port a filter rule drops (a NetworkPolicy-style DROP)
                                    -> policy_drop drops, truth: the rule's packet counter
The caller makes (and removes) the two namespaces; build() adds everything inside them.
"""
from __future__ import annotations

import json
import re
import subprocess
import urllib.request

CLOSED, NODEPORT, POD_PORT = 9, 30080, 8080
SPOOF = "10.78.0.5"
CLIENT, SERVER = "10.77.0.1", "10.77.0.2"
CAUSES = ("no_listener", "rp_filter", "policy_drop")
# the exported counter of each cause: (metric, labels)
METRICS = {"no_listener": ("nptrace_resets_total", {"cause": "no_listener", "direction": "sent"}),
           "rp_filter": ("nptrace_drops_total", {"cause": "rp_filter"}),
           "policy_drop": ("nptrace_drops_total", {"cause": "policy_drop"})}
TRUTH_NAMES = {"no_listener": "TcpOutRsts", "rp_filter": "TcpExtIPReversePathFilter",
               "policy_drop": "DROP rule's counter"}


def sh(*argv: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def build(cli: str, srv: str) -> None:
    """The veth, rp_filter and NAT/filter rules in the (existing, empty) namespaces."""
    sh("ip", "link", "add", "xc0", "netns", cli, "type", "veth", "peer", "xs0", "netns", srv)
    sh("ip", "addr", "add", f"{CLIENT}/24", "dev", "xc0", ns=cli)
    sh("ip", "addr", "add", f"{SERVER}/24", "dev", "xs0", ns=srv)
    for ns, dev in ((cli, "xc0"), (srv, "xs0")):
        sh("ip", "link", "set", "lo", "up", ns=ns)
        sh("ip", "link", "set", dev, "up", ns=ns)
    # the server's route back to the spoofed source leaves by another interface: strict
    # rp_filter drops what arrives on xs0 from there
    sh("ip", "link", "add", "xd0", "type", "veth", "peer", "xd1", ns=srv)
    for dev in ("xd0", "xd1"):
        sh("ip", "link", "set", dev, "up", ns=srv)
    sh("ip", "route", "add", "10.78.0.0/24", "dev", "xd0", ns=srv)
    for k in ("all", "xs0"):
        sh("sysctl", "-qw", f"net.ipv4.conf.{k}.rp_filter=1", ns=srv)
    # rp_filter also refuses the ARP request of a spoofed source: a static neighbour
    mac = sh("cat", "/sys/class/net/xs0/address", ns=srv).stdout.strip()
    sh("ip", "neigh", "replace", SERVER, "lladdr", mac, "dev", "xc0", "nud", "permanent", ns=cli)
    # NodePort-like DNAT to the "pod" port, and a policy rule dropping the client there
    sh("iptables", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", str(NODEPORT),
       "-j", "DNAT", "--to-destination", f"{SERVER}:{POD_PORT}", ns=srv)
    sh("iptables", "-A", "INPUT", "-p", "tcp", "-s", CLIENT, "--dport", str(POD_PORT),
       "-j", "DROP", ns=srv)


def _nstat(ns: str) -> dict[str, int]:
    d = json.loads(sh("nstat", "-az", "--json", ns=ns).stdout)
    return {k: int(v) for k, v in next(iter(d.values())).items()}


def _rule_packets(ns: str) -> int:
    out = sh("iptables", "-L", "INPUT", "-v", "-x", "-n", ns=ns).stdout
    for line in out.splitlines():
        if "DROP" in line and f"dpt:{POD_PORT}" in line:
            return int(line.split()[0])
    raise RuntimeError(f"the DROP rule is not in the server's INPUT chain: {out[-300:]}")


def snapshot(srv: str) -> dict[str, int]:
    """The truth counters now: per cause, a count that only grows."""
    st = _nstat(srv)
    return {"no_listener": st["TcpOutRsts"], "rp_filter": st["TcpExtIPReversePathFilter"],
            "policy_drop": _rule_packets(srv)}


def truth(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {c: after[c] - before[c] for c in CAUSES}


def flood(cli: str, secs: float) -> None:
    """The three hping3 floods at once from the client namespace, for `secs` seconds."""
    floods = [
        ["hping3", "-q", "-S", "--flood", "-p", str(CLOSED), SERVER],
        ["hping3", "-q", "-S", "--flood", "-a", SPOOF, "-p", "80", SERVER],
        ["hping3", "-q", "-S", "--flood", "-p", str(NODEPORT), SERVER],
    ]
    procs = [subprocess.Popen(["ip", "netns", "exec", cli, "timeout", "-s", "INT", f"{secs:g}"]
                              + f, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for f in floods]
    for p in procs:
        p.wait(timeout=secs + 20)


def scrape(port: int) -> dict[tuple, float]:
    """nptrace's metrics on loopback: {(name, sorted label pairs): value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(nptrace_\w+)(?:\{(.*)\})? ([0-9.e+]+)$', line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(samples: dict[tuple, float], name: str, **want: str) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name
               and all(dict(labels).get(k) == x for k, x in want.items()))


def settled(port: int, pause: float = 1.2) -> dict[tuple, float]:
    """The metrics once two reads `pause` seconds apart agree (the once-a-second count is done)."""
    import time
    m = scrape(port)
    while True:
        time.sleep(pause)
        m2 = scrape(port)
        if m2 == m:
            return m
        m = m2


def exported(samples: dict[tuple, float]) -> dict[str, float]:
    """Each cause's exported counter."""
    return {c: total(samples, name, **labels) for c, (name, labels) in METRICS.items()}


def line_sums(text: str) -> tuple[dict, dict]:
    """Per cause, from nptrace's --json lines: the summary lines' repeat (of the kind the truth
    counts), and the records of that kind the incident lines carry."""
    summary = {c: 0 for c in CAUSES}
    incidents = dict(summary)
    for x in text.splitlines():
        if not x.startswith("{"):
            continue
        d = json.loads(x)
        c = d.get("cause")
        if c not in summary:
            continue
        if d.get("summary"):
            if (c == "no_listener") == (d["kind"] == "rst") and \
                    (c != "no_listener" or d["direction"] == "sent"):
                summary[c] += d["repeat"]
        elif c == "no_listener":
            incidents[c] += sum(1 for e in d["evidence"] if e["hook"] == "tcp:tcp_send_reset")
        else:
            incidents[c] += sum(1 for e in d["evidence"] if e["hook"] == "skb:kfree_skb"
                                and e["what"] in ("IP_RPFILTER", "NETFILTER_DROP"))
    return summary, incidents
