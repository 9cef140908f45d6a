"""Read the live netfilter rules of a network namespace for nptrace.services.

Runs the node's own dump tools: ``nft -a list table ...``, ``iptables-nft-save`` /
``ip6tables-nft-save`` and ``iptables-legacy-save`` / ``ip6tables-legacy-save``, inside a named
namespace through ``ip netns exec NAME`` (``netns=None`` is the caller's own namespace). It only
reads; it never changes a rule.

Measured here (Debian 12, nftables 1.0.6, iptables 1.8.9, 2 vCPUs) with 10,000 Services in the
kube-proxy fixture pattern: ``iptables-nft-save`` 2.0 s, ``iptables-legacy-save`` 0.4 s,
``nft -a list ruleset`` of kube-proxy's nft table 5.2 s, and ``nft list ruleset`` of the same
iptables-nft ruleset 11.8 s. Hence:
  * native nft tables are listed one by one, leaving out the tables iptables-nft owns
    (``filter``/``nat``/``mangle``/``raw``/``security`` in ``ip``/``ip6``), which are read with
    ``iptables-nft-save`` instead;
  * change detection does not re-dump: :func:`nft_generation` asks the kernel for the nf_tables
    generation id (NFT_MSG_GETGEN over netlink, about a millisecond), which moves on every
    committed nft or iptables-nft transaction and not on counter updates. iptables-legacy has no
    generation, so its dump is hashed with counters removed.

What a namespace holds is its pod's to write: a table name is passed to nft only when nft reads
it as one identifier (nft_name; others are counted and said once, REFUSED), and every tool's
output is read up to MAX_OUTPUT bytes (run_bounded), its text decoded whatever the bytes.
"""

from __future__ import annotations

import hashlib
import os
import re
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from nptrace.kernel.nsenter import path_of, run_in
from nptrace.node.nlmsg import (NFGENMSG_LEN, NLM_F_DUMP, NLM_F_REQUEST, NLMSG, NLMSG_DONE, NLMSG_ERROR, attrs,
                                error_of, messages, request)
from nptrace.services import ServiceMap, ipvs, merge, parse_iptables_save, parse_nft

__all__ = [
    "BACKENDS",
    "RulesDump",
    "RulesSourceError",
    "ServiceMapCache",
    "detect_backend",
    "dump_digest",
    "fingerprint",
    "legacy_digest",
    "load_service_map",
    "nft_generation",
    "nft_name",
    "parse_dump",
    "read_all",
    "read_rules",
]

BACKENDS = ("nft", "iptables-nft", "iptables-legacy", "none")
# tables iptables-nft / ip6tables-nft create in the ip / ip6 families
_XT_TABLES = frozenset({"filter", "nat", "mangle", "raw", "security"})
_TIMEOUT = 60.0
_NETNS_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,254}$")
# What one tool may print before it is killed and the read fails: every dump is read whole
# into memory (bytes, then text: twice this at the peak), and a namespace's rules are the
# pod's to make. The kube-proxy fixture pattern at 10,002 Services (tests/unit/test_services.py
# synth_*) is 13 MiB as iptables-save prints it and 12 MiB as nft commands: this leaves five
# times that, within the 768 MiB the shipped unit and DaemonSet allow.
MAX_OUTPUT = 64 << 20
MAX_STDERR = 64 << 10       # only its first line is said


# An nft identifier as nft's scanner reads one (scanner.l: `string`): a letter, '_' or '.',
# then letters, digits and '/', '-', '_', '.'; at most NFT_NAME_MAXLEN - 1 bytes. Table and
# chain names come from the kernel, where any bytes but NUL are allowed (`nft add table
# 'x; flush ruleset'` works), and nft joins its arguments into one line and parses it: a name
# that is not an identifier could be read as more commands (`;`, a newline, `include "..."`).
# Such names are refused, not quoted (nft's quoting cannot hold every byte). The one check of
# a name before it is an nft argument: rules dumps here, trace lookups (nftrace_live.py).
_NFT_IDENT = re.compile(r"[A-Za-z_.][A-Za-z0-9/_.\-]{0,254}\Z")


def nft_name(name: str) -> str | None:
    """`name` if nft reads it as one identifier, else None."""
    return name if isinstance(name, str) and _NFT_IDENT.match(name) else None


class RefusedNames:
    """Tables left out of a rules dump because their names are not nft identifiers (nft_name):
    `count` of distinct (namespace, family, name), each said once through `log`. A pod must
    not hide a table from the rules view by its name unnoticed; the tracer counts these as
    the user-space loss `rules_bad_names`."""

    MAX_SEEN = 4096

    def __init__(self, log=None):
        self.log = log or (lambda msg: print(f"nptrace: {msg}", file=sys.stderr))
        self.count = 0
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()

    def refuse(self, netns: str | None, family: str, name: str) -> None:
        key = (netns, family, name)
        with self._lock:
            if key in self._seen:
                return
            self.count += 1
            if len(self._seen) >= self.MAX_SEEN:
                return               # counted, no longer said: a flood of names is not a flood of lines
            self._seen.add(key)
        where = "the host namespace" if netns is None else f"netns {netns}"
        self.log(f"warning: nf_tables table {family} {name[:80]!r}{'...' if len(name) > 80 else ''}"
                 f" in {where} not listed: its name is not an nft identifier, so it cannot be "
                 "passed to nft safely; its rules are missing from the rules view")


REFUSED = RefusedNames()


class RulesSourceError(Exception):
    """Reading rules failed; the message is one line saying what and what to do."""


@dataclass(frozen=True)
class RulesDump:
    """One dump: ``text`` as the tool printed it, the ``backend`` it came from, ``digest``
    (sha256 of the text without counters and timestamps), and the nf_tables ``generation`` it
    was read at (None for iptables-legacy or when unknown)."""

    text: str
    backend: str
    digest: str
    generation: int | None = None
    netns: str | None = None


# --------------------------------------------------------------------------------------------
# running the tools


def _check_netns(netns: str | None) -> None:
    if netns is None:
        return
    if not _NETNS_RE.match(netns):
        raise RulesSourceError(f"invalid network namespace name {netns!r}")
    if not os.path.exists(f"/run/netns/{netns}"):
        raise RulesSourceError(f"network namespace {netns!r} not found (see `ip netns list`)")


def run_in_netns(netns: str | None, argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    tool = argv[0]
    if shutil.which(tool) is None:
        raise RulesSourceError(f"{tool} not found: install the Debian package "
                               f"{'nftables' if tool == 'nft' else 'iptables'}")
    if netns is not None:
        if shutil.which("ip") is None:
            raise RulesSourceError("ip not found: install the Debian package iproute2")
        argv = ["ip", "netns", "exec", netns, *argv]
    try:
        r = run_bounded(argv, _TIMEOUT, MAX_OUTPUT)
    except subprocess.TimeoutExpired:
        raise RulesSourceError(f"{' '.join(argv)} took more than {_TIMEOUT:.0f} s") from None
    except OutputTooLarge:
        raise RulesSourceError(f"{tool}{' in netns ' + netns if netns else ''} printed more "
                               f"than {MAX_OUTPUT >> 20} MiB: not read (nptrace's bound on a "
                               "namespace's rules)") from None
    except OSError as e:
        raise RulesSourceError(f"cannot run {tool}: {e.strerror}") from None
    if check and r.returncode != 0:
        raise RulesSourceError(_failure(tool, netns, r.stderr))
    return r


class OutputTooLarge(Exception):
    """A child printed more than its bound; it was killed."""


def run_bounded(argv: list[str], timeout: float, limit: int,
                err_limit: int = MAX_STDERR) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True, timeout=timeout) that reads at
    most `limit` bytes of stdout (past it: the child is killed, OutputTooLarge) and keeps the
    first `err_limit` bytes of stderr. Text is UTF-8, undecodable bytes replaced (a rule's
    comment is the pod's to write). TimeoutExpired and OSError as subprocess raises them."""
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(p.stdout, selectors.EVENT_READ, (out, limit))
            sel.register(p.stderr, selectors.EVENT_READ, (err, err_limit))
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(argv, timeout)
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf, cap = key.data
                    if len(buf) + len(chunk) > cap:
                        if buf is out:
                            raise OutputTooLarge(f"{argv[0]} printed more than {cap} bytes")
                        chunk = chunk[:max(cap - len(buf), 0)]    # stderr: its start is enough
                    buf += chunk
        p.wait(max(deadline - time.monotonic(), 0.01))
    except BaseException:
        p.kill()
        p.wait()
        raise
    finally:
        p.stdout.close()
        p.stderr.close()
    return subprocess.CompletedProcess(argv, p.returncode, out.decode("utf-8", "replace"),
                                       err.decode("utf-8", "replace"))


def _failure(tool: str, netns: str | None, stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("# Warning")]
    first = lines[0] if lines else "no error text"
    where = f" in netns {netns}" if netns else ""
    if "ermission denied" in first or "Operation not permitted" in first:
        return f"{tool}{where}: {first}: reading netfilter rules needs root (CAP_NET_ADMIN)"
    return f"{tool} failed{where}: {first}"


_NFT_FAMILIES = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}


def _tables_here() -> list[tuple[str, str]]:
    """(family, name) of this thread's namespace's nf_tables tables, by a netlink dump
    (NFT_MSG_GETTABLE): milliseconds, where `nft list tables` reads the whole ruleset first
    (a quarter of a second for 2,000 Services)."""
    tables, done = [], False
    with _nft_ask(_NFT_MSG_GETTABLE, NLM_F_DUMP) as s:
        while not done:
            data = s.recv(65536)
            for mtype, start, end in messages(data):
                if mtype == NLMSG_ERROR:
                    raise error_of(data, start)
                if mtype == NLMSG_DONE:
                    done = True
                    break
                if mtype != (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWTABLE:
                    continue
                family = _NFT_FAMILIES.get(data[start + NLMSG.size])
                for atype, payload in attrs(data, start + NLMSG.size + NFGENMSG_LEN, end):
                    if atype == _NFTA_TABLE_NAME and family:   # any bytes: checked at use
                        tables.append((family, payload.split(b"\0", 1)[0].decode(errors="replace")))
    return tables


def _nft_tables(netns: str | None) -> list[tuple[str, str]]:
    """(family, name) of every nf_tables table, iptables-nft's included; [] without nft."""
    if shutil.which("nft") is None:
        return []
    try:
        return in_netns(netns, _tables_here)
    except OSError:
        pass     # cannot enter the namespace or ask there: nft, from a process inside it
    out = run_in_netns(netns, ["nft", "list", "tables"]).stdout
    tables = []
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0] == "table":     # a name with a space too: checked at use
            tables.append((parts[1], parts[2]))
    return tables


def is_xt(family: str, name: str) -> bool:
    return family in ("ip", "ip6") and name in _XT_TABLES


def _legacy_names_here() -> str:
    names = ""
    for proc in ("ip_tables_names", "ip6_tables_names"):
        try:  # thread-self: the netns of this thread, which in_netns may have moved
            with open(f"/proc/thread-self/net/{proc}") as f:
                names += f.read()
        except OSError:
            pass  # x_tables modules not loaded: no legacy tables anywhere
    return names


def _legacy_present(netns: str | None) -> bool:
    """Does the namespace hold legacy (x_tables) tables? Reading /proc loads no module."""
    try:
        return bool(in_netns(netns, _legacy_names_here).strip())
    except OSError:
        # cannot enter the namespace from here (no CAP_SYS_ADMIN): ask a process inside it
        r = run_in_netns(netns, ["cat", "/proc/net/ip_tables_names", "/proc/net/ip6_tables_names"], check=False)
        return bool(r.stdout.strip())


_RE_COUNTERS = re.compile(r"\[\d+:\d+\]")
_RE_NFT_COUNTER = re.compile(r"counter packets \d+ bytes \d+")
_RE_EXPIRES = re.compile(r" expires \S+?(?=[ ,}]|$)")
_RE_TIMESTAMP = re.compile(r"^# (?:Generated by|Completed on|Warning:).*$", re.M)


def dump_digest(text: str) -> str:
    """sha256 of a dump without packet counters, expiry timers and generated-on lines."""
    t = _RE_TIMESTAMP.sub("", text)
    t = _RE_COUNTERS.sub("[]", t)
    t = _RE_NFT_COUNTER.sub("counter", t)
    t = _RE_EXPIRES.sub("", t)
    return hashlib.sha256(t.encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# nf_tables generation id over netlink (no pyroute2: nptrace/kernel/netlink.py is its only importer)

_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_NFTABLES = 10
_NFT_MSG_NEWGEN = 15
_NFT_MSG_GETGEN = 16
_NFTA_GEN_ID = 1
_NFT_MSG_NEWTABLE, _NFT_MSG_GETTABLE = 0, 1
_NFTA_TABLE_NAME = 1


def _nft_ask(msg: int, flags: int = 0) -> socket.socket:
    """A NETLINK_NETFILTER socket of this thread's namespace that has sent nf_tables request
    `msg` (for every family), its replies to read."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
    try:
        s.settimeout(2.0)
        s.bind((0, 0))
        nfgen = struct.pack("=BBH", socket.AF_UNSPEC, 0, 0)  # nfgenmsg: family, version, res_id
        s.send(request((_NFNL_SUBSYS_NFTABLES << 8) | msg, NLM_F_REQUEST | flags,
                       int(time.time()) & 0xFFFFFFFF, nfgen))
    except OSError:
        s.close()
        raise
    return s


def _genid_here() -> int:
    with _nft_ask(_NFT_MSG_GETGEN) as s:
        data = s.recv(65536)
    for mtype, start, end in messages(data):
        if mtype == NLMSG_ERROR:
            raise error_of(data, start)
        if mtype != (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWGEN:
            raise OSError(0, f"unexpected netlink reply type {mtype}")
        for atype, payload in attrs(data, start + NLMSG.size + NFGENMSG_LEN, end):
            if atype == _NFTA_GEN_ID and len(payload) >= 4:
                return struct.unpack_from(">I", payload)[0]
        break
    raise OSError(0, "no NFTA_GEN_ID in the netlink reply")


def in_netns(netns: str | None, fn):
    """fn() run in the named namespace by a short-lived thread (nsenter.run_in); OSError when the
    namespace cannot be entered."""
    return run_in(path_of(netns), fn, f"npt-netns-{netns}")


def nft_generation(netns: str | None = None) -> int | None:
    """The nf_tables generation id of the namespace, or None when it cannot be read.

    It changes on every committed nft / iptables-nft transaction and not on counter updates, so
    an unchanged id means unchanged nft and iptables-nft rules.
    """
    _check_netns(netns)
    try:
        return in_netns(netns, _genid_here)
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# dumps


def detect_backend(netns: str | None = None) -> str:
    """Which kube-proxy backend programs the namespace: ``nft`` (table ``ip|ip6 kube-proxy``),
    ``iptables-nft`` (``KUBE-SERVICES`` in iptables-nft's tables), ``iptables-legacy``
    (``KUBE-SERVICES`` in legacy tables) or ``none``."""
    _check_netns(netns)
    tables = _nft_tables(netns)
    if ("ip", "kube-proxy") in tables or ("ip6", "kube-proxy") in tables:
        return "nft"
    if any(is_xt(f, n) for f, n in tables):
        for tool in ("iptables-nft", "ip6tables-nft"):
            if shutil.which(tool) is None:
                continue
            for table in ("nat", "filter"):
                if run_in_netns(netns, [tool, "-t", table, "-S", "KUBE-SERVICES"], check=False).returncode == 0:
                    return "iptables-nft"
    if _legacy_present(netns):
        for tool in ("iptables-legacy", "ip6tables-legacy"):
            if shutil.which(tool) is None:
                continue
            for table in ("nat", "filter"):
                if run_in_netns(netns, [tool, "-t", table, "-S", "KUBE-SERVICES"], check=False).returncode == 0:
                    return "iptables-legacy"
    return "none"


def _read_nft(netns: str | None, tables: list[tuple[str, str]]) -> str:
    """The native tables' listing: `list ruleset` when there is no iptables-nft table to
    leave out (no name on the command line), else `list table` one by one, each name checked
    (nft_name) and a refused one counted and said (REFUSED)."""
    native = [(f, n) for f, n in tables if not is_xt(f, n)]
    if not native:
        return ""
    if len(native) == len(tables):
        return run_in_netns(netns, ["nft", "-a", "list", "ruleset"]).stdout
    parts = []
    for f, n in native:
        if nft_name(n) is None or nft_name(f) is None:
            REFUSED.refuse(netns, f, n)
            continue
        parts.append(run_in_netns(netns, ["nft", "-a", "list", "table", f, n]).stdout)
    return "".join(parts)


def _read_xt(netns: str | None, tools: tuple[str, str], families: set[str] | None) -> str:
    parts = []
    for family, tool in zip(("ip", "ip6"), tools):
        if families is not None and family not in families:
            continue
        if family == "ip6" and shutil.which(tool) is None:
            continue  # an IPv4-only install; the IPv4 tool's absence is an error (_run says so)
        parts.append(run_in_netns(netns, [tool]).stdout)
    return "".join(parts)


def read_rules(netns: str | None = None, backend: str = "auto") -> RulesDump:
    """The rules of one backend (``auto``: :func:`detect_backend`).

    ``nft``: every native nft table (``nft -a list ...``, with rule handles), without the tables
    iptables-nft owns. ``iptables-nft`` / ``iptables-legacy``: IPv4 then IPv6 ``-save`` output.
    ``none``: empty text.
    """
    _check_netns(netns)
    if backend == "auto":
        backend = detect_backend(netns)
    if backend not in BACKENDS:
        raise RulesSourceError(f"unknown rules backend {backend!r} (choose from {', '.join(BACKENDS)}, auto)")
    gen = nft_generation(netns) if backend in ("nft", "iptables-nft") else None
    if backend == "nft":
        text = _read_nft(netns, _nft_tables(netns))
    elif backend == "iptables-nft":
        fams = {f for f, n in _nft_tables(netns) if is_xt(f, n)}
        text = _read_xt(netns, ("iptables-nft-save", "ip6tables-nft-save"), fams)
    elif backend == "iptables-legacy":
        text = _read_xt(netns, ("iptables-legacy-save", "ip6tables-legacy-save"), None)
    else:
        text = ""
    return RulesDump(text, backend, dump_digest(text), gen, netns)


def read_all(netns: str | None = None) -> list[RulesDump]:
    """Every backend that holds rules in the namespace, kube-proxy's or not (a CNI or firewall
    may drop with one backend while kube-proxy uses another)."""
    _check_netns(netns)
    tables = _nft_tables(netns)
    gen = nft_generation(netns) if tables else None
    dumps = []
    if any(not is_xt(f, n) for f, n in tables):
        text = _read_nft(netns, tables)
        dumps.append(RulesDump(text, "nft", dump_digest(text), gen, netns))
    fams = {f for f, n in tables if is_xt(f, n)}
    if fams and shutil.which("iptables-nft-save"):
        text = _read_xt(netns, ("iptables-nft-save", "ip6tables-nft-save"), fams)
        dumps.append(RulesDump(text, "iptables-nft", dump_digest(text), gen, netns))
    if _legacy_present(netns) and shutil.which("iptables-legacy-save"):
        text = _read_xt(netns, ("iptables-legacy-save", "ip6tables-legacy-save"), None)
        dumps.append(RulesDump(text, "iptables-legacy", dump_digest(text), None, netns))
    return dumps


def parse_dump(dump: RulesDump) -> ServiceMap:
    """The ServiceMap of one dump."""
    if dump.backend == "nft":
        return parse_nft(dump.text, backend="nft")
    if dump.backend in ("iptables-nft", "iptables-legacy"):
        return parse_iptables_save(dump.text, backend=dump.backend)
    return ServiceMap()


def load_service_map(netns: str | None = None) -> ServiceMap:
    """Services and drop rules from every backend present in the namespace, merged (with
    kube-proxy's IPVS state where the namespace has virtual servers)."""
    st = read_ipvs(netns)
    return merge(*(parse_dump(d) for d in read_all(netns)), *((ipvs.build_map(st),) if st else ()))


# --------------------------------------------------------------------------------------------
# IPVS (kube-proxy's ipvs mode): the kernel's table, kube-proxy's ipsets, the names beside them

IPVS_SYSCTLS = ("expire_nodest_conn", "conn_reuse_mode", "conntrack", "expire_quiescent_template")


def _ipvs_here() -> tuple[str, dict] | None:
    """The calling thread's namespace's /proc/net/ip_vs and net.ipv4.vs sysctls; None
    without IPVS (ip_vs not loaded: reading /proc loads no module)."""
    try:
        with open("/proc/thread-self/net/ip_vs") as f:
            text = f.read()
    except OSError:
        return None
    sysctl = {}
    for k in IPVS_SYSCTLS:
        try:
            with open(f"/proc/sys/net/ipv4/vs/{k}") as f:
                sysctl[k] = int(f.read())
        except (OSError, ValueError):
            pass
    return text, sysctl


def _ipvs_raw(netns: str | None) -> tuple[str, dict] | None:
    try:
        return in_netns(netns, _ipvs_here)
    except OSError:
        return None


# Where the virtual servers' names come from when no names table lies beside them: the
# Kubernetes API's Services (node/kubeapi.py PodWatch.service_names), set by the tracer when
# it watches the API. One process-wide source, as the API is one per node.
_api_names: Callable[[], str] | None = None


def set_api_names(source: Callable[[], str] | None) -> None:
    global _api_names
    _api_names = source


def ipvs_names(netns: str | None) -> tuple[str, str]:
    """(the names table's text, where it came from: "table" beside the namespace, "api" from
    the Kubernetes API's Services, "" none)."""
    try:
        return ipvs.names_path(netns).read_text(), "table"
    except OSError:
        pass
    text = _api_names() if _api_names is not None else ""
    return (text, "api") if text else ("", "")


def ipvs_digest(netns: str | None = None) -> str | None:
    """A digest of the namespace's virtual servers, real servers and weights (not their
    connection counters), IPVS sysctls and names table; None without virtual servers."""
    raw = _ipvs_raw(netns)
    servers = ipvs.parse_ipvs(raw[0]) if raw else []
    if not servers:
        return None
    reals = [(str(v), v.scheduler, [(str(r), r.weight) for r in v.reals]) for v in servers]
    names = ipvs_names(netns)
    return hashlib.sha256(repr((reals, sorted(raw[1].items()), names)).encode()).hexdigest()


def read_ipvs(netns: str | None = None) -> "ipvs.IpvsState | None":
    """The namespace's IPVS state (ipvs.IpvsState), None without virtual servers. The ipsets
    come from ``ipset save`` when the tool is installed (eTP=Local ports, local endpoints)."""
    raw = _ipvs_raw(netns)
    if raw is None or not ipvs.parse_ipvs(raw[0]):
        return None
    sets = ""
    if shutil.which("ipset"):
        try:
            sets = run_in_netns(netns, ["ipset", "save"], check=False).stdout
        except RulesSourceError:
            sets = ""
    names, source = ipvs_names(netns)
    return ipvs.state_of(raw[0], names_text=names, ipset_text=sets, sysctl=raw[1], names_from=source)


def local_addresses(netns: str | None = None) -> tuple[str, ...]:
    """The addresses configured in a namespace (``ip -o addr``), empty when unreadable."""
    cmd = (["ip", "-n", netns] if netns else ["ip"]) + ["-o", "addr", "show"]
    try:
        out = run_bounded(cmd, 5, MAX_OUTPUT).stdout
    except (OSError, subprocess.TimeoutExpired, OutputTooLarge):
        return ()
    addrs = []
    for line in out.splitlines():
        f = line.split()
        for fam in ("inet", "inet6"):
            if fam in f and f.index(fam) + 1 < len(f):
                addrs.append(f[f.index(fam) + 1].split("/")[0])
    return tuple(addrs)


def fingerprint(netns: str | None = None) -> tuple:
    """Cheap value that changes when the namespace's rules change (not on counter updates):
    the nf_tables generation id, plus a digest of the legacy dump when legacy tables exist,
    plus the IPVS digest where the namespace has virtual servers."""
    _check_netns(netns)
    fp = (nft_generation(netns), legacy_digest(netns))
    dig = ipvs_digest(netns)
    return fp if dig is None else (*fp, dig)


def legacy_digest(netns: str | None = None) -> str | None:
    """The digest of the namespace's legacy (x_tables) rules without counters; None without
    legacy tables. Asked of the kernel (node/xtables.py, a tenth of a millisecond for a few
    Services); where this process cannot enter the namespace or ask there, the digest of a
    dump instead (0.4 s for 10,000 Services, so callers then space their checks)."""
    _check_netns(netns)
    from nptrace.node import xtables
    try:
        return in_netns(netns, xtables.digest_here)
    except OSError:
        pass
    if _legacy_present(netns) and shutil.which("iptables-legacy-save"):
        return dump_digest(_read_xt(netns, ("iptables-legacy-save", "ip6tables-legacy-save"), None))
    return None


def legacy_info(netns: str | None = None) -> tuple:
    """The legacy tables' hooks, entry counts and sizes (node/xtables.py info_here), () without
    legacy tables; OSError where the kernel cannot be asked from here."""
    _check_netns(netns)
    from nptrace.node import xtables
    return in_netns(netns, xtables.info_here)


class ServiceMapCache:
    """A ServiceMap of one namespace that is re-read only when its rules changed.

    ``get()`` checks :func:`fingerprint` at most every ``min_interval`` seconds and re-dumps and
    re-parses only when it moved. When the generation id cannot be read (no CAP_SYS_ADMIN), the
    full dumps are hashed instead. ``clock`` is injectable for tests.
    """

    def __init__(self, netns: str | None = None, *, min_interval: float = 2.0, clock=time.monotonic):
        _check_netns(netns)
        self.netns = netns
        self.min_interval = min_interval
        self._clock = clock
        self._checked = float("-inf")
        self._fp: tuple | None = None
        self._map: ServiceMap | None = None
        self.reloads = 0
        self._lock = threading.Lock()

    def get(self) -> ServiceMap:
        with self._lock:
            now = self._clock()
            if self._map is not None and now - self._checked < self.min_interval:
                return self._map
            self._checked = now
            fp = fingerprint(self.netns)
            if self._map is not None and fp == self._fp and fp[0] is not None:
                return self._map
            dumps = read_all(self.netns)
            if fp[0] is None:  # no generation id: compare the dumps themselves
                fp = (None, tuple(d.digest for d in dumps))
                if self._map is not None and fp == self._fp:
                    return self._map
            st = read_ipvs(self.netns)
            self._map = merge(*(parse_dump(d) for d in dumps), *((ipvs.build_map(st),) if st else ()))
            self._fp = fp
            self.reloads += 1
            return self._map

    def invalidate(self) -> None:
        """Force the next get() to re-read."""
        with self._lock:
            self._fp = None
            self._checked = float("-inf")
