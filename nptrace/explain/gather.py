"""Read what `explain` needs from the node, in its network namespace: addresses, rp_filter and
conntrack sysctls, `ip route get` for the SYN (with its ingress interface) and for the reply,
the netfilter rules (node/rules_source.py), the local pods (the namespaces at the other end of
the node's veths) with their listening sockets, and one probe connection from the node to each
endpoint (`probe=False` skips it); the namespace's conntrack table (count, limit, `conntrack -S`
counters) and checksum-error counters, read before the probes and again at the end, so that
what moved while explain ran is known.

Needs root (reading rules and entering namespaces). Each step is one `ip`/`ss` call or a short
thread in the namespace (kernel/nsenter.py); a probe costs at most PROBE_TIMEOUT_S twice.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from nptrace.errors import NptraceError
from nptrace.kernel import nsenter
from nptrace.node.knowledge import conntrack_stat, read_conntrack
from nptrace.services.model import fmt_ep, split_hostport

from .facts import Facts, Route

PROBE_TIMEOUT_S = 1.0
PROBE_PAYLOAD = b"HEAD / HTTP/1.0\r\n\r\n"
_NETNS_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SYSCTLS = ("nf_conntrack_tcp_timeout_established", "nf_conntrack_tcp_loose",
            "nf_conntrack_tcp_be_liberal")


class ExplainError(NptraceError):
    pass


def _ip(netns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ExplainError(f"cannot run {' '.join(argv)}: {e}: install iproute2") from None
    if check and r.returncode != 0:
        raise ExplainError(f"{' '.join(argv)} failed: {r.stderr.strip() or r.returncode}")
    return r


def _exec(netns: str | None, argv: list[str]) -> str:
    full = (["ip", "netns", "exec", netns] if netns else []) + argv
    try:
        r = subprocess.run(full, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout


def route_get(netns: str | None, dst: str, src: str | None = None, iif: str | None = None) -> Route:
    args = ["route", "get", dst] + (["from", src] if src else []) + (["iif", iif] if iif else [])
    cmd = "ip " + " ".join(args)
    r = _ip(netns, "-j", *args, check=False)
    if r.returncode != 0:
        return Route(cmd, type="error", error=(r.stderr.strip().splitlines() or ["failed"])[-1]
                     .replace("RTNETLINK answers: ", ""))
    try:
        d = json.loads(r.stdout)[0]
    except (ValueError, IndexError, KeyError):
        return Route(cmd, type="error", error="unreadable answer")
    return Route(cmd, dev=d.get("dev"), via=d.get("gateway"), type=d.get("type", "unicast"))


def addresses(netns: str | None) -> dict:
    out: dict = {}
    for link in json.loads(_ip(netns, "-j", "addr").stdout or "[]"):
        out[link["ifname"]] = [a["local"] for a in link.get("addr_info", []) if "local" in a]
    return out


def sysctls(netns: str | None, ifaces) -> tuple[dict, dict]:
    paths = ["/proc/sys/net/ipv4/conf/all/rp_filter"] + \
        [f"/proc/sys/net/ipv4/conf/{i}/rp_filter" for i in ifaces] + \
        [f"/proc/sys/net/netfilter/{k}" for k in _SYSCTLS]
    text = _exec(netns, ["grep", "-H", ".", *paths])
    rp, ct = {}, {}
    for line in text.splitlines():
        path, _, value = line.partition(":")
        if not value.strip().lstrip("-").isdigit():
            continue
        parts = path.split("/")
        if parts[-1] == "rp_filter":
            rp[parts[-2]] = int(value)
        else:
            ct[parts[-1]] = int(value)
    return rp, ct


def local_pods(netns: str | None) -> dict:
    """Pods of this node: the named namespaces at the far end of its veths, with their
    addresses and TCP listening ports."""
    ids = _ip(netns, "netns", "list-id", check=False).stdout
    names = re.findall(r"nsid \d+ \(iproute2 netns name: (\S+)\)", ids)
    pods: dict = {}
    for name in names:
        if name == netns:
            continue
        try:
            addrs = addresses(name)
        except ExplainError:
            continue
        listen = sorted({int(m) for m in re.findall(r"\S+:(\d+)\s+\S+:\*",
                                                       _exec(name, ["ss", "-Htln"]))})
        for ifname, lst in addrs.items():
            if ifname == "lo":
                continue
            for a in lst:
                pods[a] = {"netns": name, "listen": listen}
    return pods


MAX_INFLIGHT = 256
_CT_STATE = re.compile(r"^[A-Z][A-Z_]{3,}$")     # ESTABLISHED, TIME_WAIT, SYN_SENT, ...


def parse_conntrack(text: str, client: str, dst: str, port: int) -> list[dict]:
    """The client's TCP entries to dst:port from /proc/net/nf_conntrack or `conntrack -L`
    text: the original direction's src/dst/sport/dport first, the reply's second."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if "tcp" not in f[:4]:
            continue
        kv: dict[str, list[str]] = {}
        for x in f:
            k, eq, v = x.partition("=")
            if eq:
                kv.setdefault(k, []).append(v)
        try:
            (osrc, rsrc), (odst, rdst) = kv["src"][:2], kv["dst"][:2]
            (osp, rsp), (odp, rdp) = [int(x) for x in kv["sport"][:2]], [int(x) for x in kv["dport"][:2]]
        except (KeyError, ValueError):
            continue
        if osrc != client or odst != dst or odp != port:
            continue
        state = next((x for x in f[:6] if _CT_STATE.match(x)), "")
        out.append({"sport": osp, "state": state, "ep": fmt_ep(rsrc, rsp),
                    "peer": fmt_ep(rdst, rdp), "socket": None})
        if len(out) >= MAX_INFLIGHT:
            break
    return out


def _established(ns: str) -> set[tuple[str, str]]:
    """(local, peer) of the namespace's established TCP sockets (`ss -Htn`)."""
    pairs = set()
    for line in _exec(ns, ["ss", "-Htn", "state", "established"]).splitlines():
        f = line.split()
        if len(f) >= 4:
            pairs.add((f[-2].replace("[", "").replace("]", ""),
                       f[-1].replace("[", "").replace("]", "")))
    return pairs


def inflight(netns: str | None, client: str, dst: str, port: int, pods: dict) -> list[dict]:
    """The client's open connections to dst:port (ESTABLISHED in the node's conntrack), and
    whether the local pod each is DNATed to still holds its socket."""
    text = _exec(netns, ["cat", "/proc/net/nf_conntrack"]) or \
        _exec(netns, ["conntrack", "-L", "-p", "tcp"])
    flows = [x for x in parse_conntrack(text, client, dst, port) if x["state"] == "ESTABLISHED"]
    socks: dict[str, set] = {}
    for x in flows:
        host, _p = split_hostport(x["ep"])
        pod = pods.get(host)
        if pod is None:
            continue
        if pod["netns"] not in socks:
            socks[pod["netns"]] = _established(pod["netns"])
        plain = lambda ep: ep.replace("[", "").replace("]", "")
        x["socket"] = (plain(x["ep"]), plain(x["peer"])) in socks[pod["netns"]]
    return flows


CT_STATS = ("insert_failed", "early_drop")      # `conntrack -S` columns beside drop
CSUM_ERRORS = ("TcpInCsumErrors", "UdpInCsumErrors")
MOVING = ("drop", *CT_STATS, *CSUM_ERRORS)      # the counters whose increase is kept


def csum_errors(snmp: str) -> dict:
    """TcpInCsumErrors and UdpInCsumErrors from /proc/net/snmp text: a header line and a value
    line a protocol ("Tcp: ... InCsumErrors" / "Tcp: ... 3")."""
    lines = [ln.split() for ln in snmp.splitlines()]
    out = {}
    for head, vals in zip(lines[::2], lines[1::2]):
        name = f"{head[0].rstrip(':')}InCsumErrors" if head else ""
        if name in CSUM_ERRORS and "InCsumErrors" in head and len(vals) == len(head):
            out[name] = int(vals[head.index("InCsumErrors")])
    return out


def _read_counters() -> dict:
    """counters() in the calling thread's namespace (/proc/thread-self/net: the thread's, not
    the process's)."""
    out: dict = {}
    ct = read_conntrack()
    if ct is not None:
        out["nf_conntrack_count"], out["nf_conntrack_max"], out["drop"] = ct
        stat = conntrack_stat("/proc/thread-self/net/stat/nf_conntrack") or {}
        out.update({k: stat[k] for k in CT_STATS if k in stat})
    try:
        with open("/proc/thread-self/net/snmp") as f:
            out.update(csum_errors(f.read()))
    except OSError:
        pass
    return out


def counters(netns: str | None) -> dict:
    """The namespace's conntrack table (count, limit: host-wide, read-only in a child namespace)
    and conntrack's and the stack's drop counters, read by one short thread in it."""
    try:
        return nsenter.run_in(nsenter.path_of(netns), _read_counters, "npt-explain")
    except OSError:
        return {}


def moved(first: dict, last: dict, seconds: float) -> dict:
    """Each MOVING counter's increase from one reading to the next."""
    return {"seconds": round(seconds, 2),
            **{k: last[k] - first[k] for k in MOVING if k in first and k in last}}


def _probe_one(ep: str) -> dict:
    host, port = split_hostport(ep)
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(PROBE_TIMEOUT_S)
    try:
        try:
            s.connect((host, port))
        except socket.timeout:
            return {"outcome": "timeout", "error": f"no answer in {PROBE_TIMEOUT_S:g} s"}
        except OSError as e:
            name = {111: "refused", 113: "unreachable", 101: "unreachable",
                    104: "reset"}.get(e.errno, "error")
            return {"outcome": name, "error": os.strerror(e.errno) if e.errno else str(e)}
        try:
            s.sendall(PROBE_PAYLOAD)
            data = s.recv(64)
            return {"outcome": "ok" if data else "connected", "error": ""}
        except socket.timeout:
            return {"outcome": "connected", "error": ""}
        except (ConnectionResetError, BrokenPipeError) as e:
            return {"outcome": "reset", "error": os.strerror(e.errno)}
    finally:
        s.close()


def probe(netns: str | None, endpoints) -> dict:
    path = nsenter.path_of(netns)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(endpoints)))) as pool:
        futs = {ep: pool.submit(nsenter.run_in, path, lambda ep=ep: _probe_one(ep))
                for ep in endpoints}
    out = {}
    for ep, f in futs.items():
        try:
            out[ep] = f.result()
        except OSError as e:
            out[ep] = {"outcome": "error", "error": str(e)}
    return out


def rules(netns: str | None) -> list:
    from nptrace.node.rules_source import RulesSourceError, read_all
    try:
        return [(d.backend, d.text) for d in read_all(netns)]
    except RulesSourceError as e:
        raise ExplainError(f"cannot read the netfilter rules: {e}") from None


def check_netns(netns: str | None) -> None:
    if netns is None:
        return
    if not _NETNS_RE.match(netns) or netns in (".", ".."):
        raise ExplainError(f"bad network namespace name {netns!r}")
    if not os.path.exists(f"/run/netns/{netns}"):
        raise ExplainError(f"no network namespace {netns!r} (see `ip netns list`)")


def gather(client: str, dst: str, port: int, *, netns: str | None = None, iif: str | None = None,
           do_probe: bool = True) -> Facts:
    """The Facts for client -> dst:port as the node in `netns` sees it."""
    from .predict import service_map
    check_netns(netns)
    if shutil.which("ip") is None:
        raise ExplainError("ip not found: install the Debian package iproute2")
    if os.geteuid() != 0:
        raise ExplainError("explain reads netfilter rules and enters namespaces: run as root")
    addrs = addresses(netns)
    if iif is not None and iif not in addrs:
        raise ExplainError(f"no interface {iif!r} in {'netns ' + netns if netns else 'this namespace'} "
                           f"(interfaces: {', '.join(sorted(addrs))})")
    back = route_get(netns, client)
    source = "given"
    if iif is None:
        owner = [i for i, lst in addrs.items() if dst in lst and i != "lo"]
        if owner:
            iif, source = owner[0], "address"
        elif back.ok and back.dev:
            iif, source = back.dev, "route"
    t0 = time.monotonic()
    first = counters(netns)            # before the probes: they add conntrack entries
    rp, ct = sysctls(netns, [i for i in addrs if i != "lo"])
    facts = Facts(client=client, dst=dst, port=port, netns=netns, iif=iif, iif_source=source,
                  addrs=addrs, rp_filter=rp, route_to_client=back, sysctl=ct,
                  rules=rules(netns), local_pods=local_pods(netns), counters=first)
    smap = service_map(facts)
    svc = smap.lookup(dst, port)
    eps = list(svc.endpoints) if svc is not None else []
    for ep in eps:
        hp = split_hostport(ep)
        if hp:
            facts.syn_routes[hp[0]] = route_get(netns, hp[0], client, iif)
    if do_probe and eps:
        facts.probes = probe(netns, eps)
    facts.inflight = inflight(netns, client, dst, port, facts.local_pods)
    facts.moved = moved(first, counters(netns), time.monotonic() - t0)
    return facts


__all__ = ["ExplainError", "counters", "fmt_ep", "gather", "moved", "route_get"]
