"""What this kernel and this process can do, read from plain files (behind `nptrace doctor`).

Every check is a file read under `root`, so unit tests point `root` at a fixture tree
(tests/fixtures/features/<case>/) the way retis reads test_data/. The only things that are
not file reads are injected: `trials(kind)` loads a real BPF program (nptrace/kernel/loader.py owns
bcc), and tracefs is mounted only when asked and only on the real root.

Each probe has a name, a minimum kernel, a check, whether it is required and what is lost
without it. Required probes that fail make tracing impossible (`Features.tracing_possible`);
optional ones cost a cause or a view and are logged and skipped. The hook rows (one per
tracepoint and tracepoint field, and the kprobes / tc clsact / netfilter bpf facilities) are
derived from the hook table, nptrace/kernel/hooks.py; kernel/attach.py plan() turns this
module's answer into what `nptrace run` attaches, and `nptrace doctor` prints that plan.

The files read, and the readers, are nptrace/kernel/evidence.py's; this module turns their
answers into probe results.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

# The readers: kernel_version, tracepoint_fields, has_bpf_caps, read_text, parse_int and
# kernel_config stay importable from here (re-exported).
from nptrace.kernel.evidence import (  # noqa: F401
    TRACEFS_MOUNT, caps_detail, caps_ok, config_on, exists, find_ipvs, find_kprobes,
    find_netfilter_backend, find_tracefs, has_bpf_caps, kernel_config, kernel_version,
    module_evidence, parse_int, read_cap_eff, read_text, tracepoint_fields)

__all__ = [
    "FeatureMissing",
    "Features",
    "PrivilegeError",
    "Probe",
    "ProbeResult",
    "HOOK_ROWS",
    "PROBES",
    "TRACEPOINTS",
    "TrialResult",
    "has_bpf_caps",
    "kernel_version",
    "probe",
    "tracepoint_fields",
]

PRIVILEGE_HINT = "needs root or CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN: run with sudo"


from nptrace.errors import FeatureMissing, PrivilegeError  # noqa: E402,F401 (re-exported)
from nptrace.kernel import hooks  # noqa: E402


class TrialResult(NamedTuple):
    """What a trial load returns; nptrace.kernel.loader.TrialResult has the same two fields."""
    ok: bool
    error: str = ""


class _Trial(Protocol):
    ok: bool
    error: str


Trials = Callable[[str], _Trial]


@dataclass(frozen=True)
class Probe:
    name: str
    area: str
    min_kernel: str | None  # None: gated by config or privilege, not by version
    required: bool
    cost: str               # what is lost without it
    fail_reason: str = ""   # one-line reason for `nptrace doctor` when a required probe fails
    # Present on every kernel >= min_kernel (tracepoints and their fields, the ring buffer);
    # False where a config option or the kernel's policy decides (kprobes, fentry, clsact).
    by_version: bool = False


@dataclass(frozen=True)
class ProbeResult:
    name: str
    area: str
    present: bool | None    # None: could not tell (not tried, unreadable)
    status: str             # ok | warn | missing | fail | unknown
    detail: str
    min_kernel: str | None
    required: bool
    cost: str
    # A by-version probe on a kernel at or above min_kernel: missing anyway points at a broken
    # probe, so kernel-gated tests should fail rather than skip (cilium/ebpf checkVersion).
    expected: bool = False

    def to_dict(self) -> dict:
        return {"name": self.name, "area": self.area, "present": self.present,
                "status": self.status, "detail": self.detail, "min_kernel": self.min_kernel,
                "required": self.required, "cost": self.cost, "expected": self.expected}


# Tracepoints the probes use, with the kernel that added each: the hook table's.
TRACEPOINTS: dict[str, str] = {h.tracepoint: h.min_kernel for h in hooks.HOOKS
                               if h.kind == "tracepoint"}


def _tracepoint_rows():
    for h in hooks.HOOKS:
        if h.kind != "tracepoint":
            continue
        yield Probe(h.name, "tracepoints", h.min_kernel, h.required, h.cost, h.fail_reason,
                    by_version=True)
        for fld in (f for f in h.fields if f.row):
            yield Probe(fld.row, "tracepoints", fld.min_kernel, False, fld.cost, by_version=True)


def _facility(name: str) -> Probe:
    min_kernel, cost, by_version = hooks.FACILITIES[name]
    return Probe(name, "hooks", min_kernel, False, cost, by_version=by_version)


_P = Probe
PROBES: dict[str, Probe] = {p.name: p for p in (
    _P("capabilities", "privileges", None, True,
       "cannot load BPF programs or attach tc filters",
       "not root (" + PRIVILEGE_HINT + ")"),
    _P("bpf syscall", "kernel", "3.18", True,
       "no BPF at all", "no BPF: kernel built without CONFIG_BPF_SYSCALL"),
    _P("btf", "kernel", "5.4", True,
       "no struct offsets for this kernel: sk_buff/nf_conn fields cannot be read",
       "no BTF: /sys/kernel/btf/vmlinux missing (kernel needs CONFIG_DEBUG_INFO_BTF=y)"),
    _P("tracefs", "kernel", "4.1", True,
       "tracepoints cannot be attached",
       "no tracefs: " + TRACEFS_MOUNT),
    *_tracepoint_rows(),
    _facility("kprobes"),
    _P("fentry", "hooks", "5.5", False,
       "no fentry/fexit hooks: none are built, tracepoints are used instead"),
    # BPF_MAP_TYPE_RINGBUF carries every record (bpf/npt_common.h `events`); no perf buffer
    # variant is built.
    _P("ring buffer", "hooks", "5.8", False,
       "no fallback (no perf buffer variant is built): the programs cannot be loaded",
       by_version=True),
    _facility("tc clsact"),
    _P("tcx", "hooks", "6.6", False,
       "--iface programs are clsact filters: dearer dispatch, and a kill -9 leaves them on the "
       "device until the next start removes them"),
    _facility("netfilter bpf"),
    _P("netfilter backend", "netfilter", None, False,
       "no nf_tables or iptables: kube-proxy rules cannot be read"),
    _P("ipvs", "netfilter", None, False,
       "IPVS-mode kube-proxy traffic cannot be attributed (only matters in ipvs mode)"),
    _P("conntrack", "netfilter", None, False,
       "conntrack_invalid and snat cannot be named; DNAT'd tuples are not recovered"),
)}
del _P
# The rows derived from the hook table (what kernel/attach.py plans from).
HOOK_ROWS: tuple[str, ...] = hooks.probe_rows()
assert set(HOOK_ROWS) <= set(PROBES), set(HOOK_ROWS) - set(PROBES)


def _vt(version: str) -> tuple[int, int, int]:
    v = kernel_version(version)
    assert v is not None, version
    return v



# --- the result -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Features:
    root: Path
    kernel: str                           # osrelease, "" if unreadable
    version: tuple[int, int, int] | None
    tracefs: Path | None                  # under root; None when not mounted
    tracepoints: dict[str, bool]          # "skb/kfree_skb" -> present
    fields: dict[str, tuple[str, ...]]    # "skb/kfree_skb" -> field names (present ones)
    results: tuple[ProbeResult, ...]
    cap_eff: int | None = None
    config: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def result(self, name: str) -> ProbeResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def has(self, name: str) -> bool:
        return bool(self.result(name).present)

    def require(self, name: str) -> None:
        """Raise the typed error for a probe that did not pass (before a slow bcc compile)."""
        r = self.result(name)
        if r.present:
            return
        if name == "capabilities":
            raise PrivilegeError(f"{PRIVILEGE_HINT} ({caps_detail(self.cap_eff)})")
        raise FeatureMissing(r.name, r.min_kernel, r.detail)

    def tracepoint_fields(self, tp: str) -> tuple[str, ...]:
        return self.fields.get(tp, ())

    @property
    def available_tracepoints(self) -> set[str]:
        return {tp for tp, ok in self.tracepoints.items() if ok}

    @property
    def caps_ok(self) -> bool:
        return self.has("capabilities")

    @property
    def btf(self) -> bool:
        return self.has("btf")

    @property
    def kfree_skb_reason(self) -> bool:
        return self.has("skb:kfree_skb reason")

    @property
    def tcp_send_reset_reason(self) -> bool:
        return self.has("tcp:tcp_send_reset reason")

    @property
    def kprobes(self) -> bool:
        return self.has("kprobes")

    @property
    def fentry(self) -> bool | None:
        return self.result("fentry").present

    @property
    def ringbuf(self) -> bool:
        return self.has("ring buffer")

    @property
    def clsact(self) -> bool | None:
        return self.result("tc clsact").present

    @property
    def nf_prog(self) -> bool | None:
        return self.result("netfilter bpf").present

    @property
    def ipvs(self) -> bool:
        return self.has("ipvs")

    @property
    def conntrack(self) -> bool:
        return self.has("conntrack")

    @property
    def failures(self) -> tuple[ProbeResult, ...]:
        return tuple(r for r in self.results if r.status == "fail")

    @property
    def tracing_possible(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "tracefs": str(self.tracefs) if self.tracefs else None,
                "tracepoints": dict(self.tracepoints),
                "probes": [r.to_dict() for r in self.results]}


class _Builder:
    """Collects ProbeResults; turns (present, detail) into a status by the probe's spec."""

    def __init__(self, version: tuple[int, int, int] | None):
        self.version = version
        self.results: list[ProbeResult] = []

    def at_least(self, min_kernel: str) -> bool | None:
        return None if self.version is None else self.version >= _vt(min_kernel)

    def add(self, name: str, present: bool | None, detail: str, status: str | None = None):
        spec = PROBES[name]
        expected = bool(spec.by_version and spec.min_kernel and self.at_least(spec.min_kernel))
        if status is None:
            if present:
                status = "ok"
            elif present is None:
                status = "unknown"
            else:
                status = "fail" if spec.required else "missing"
        if present is False and spec.min_kernel and self.version is not None and not detail \
                and not self.at_least(spec.min_kernel):
            detail = f"kernel {_fmt(self.version)} < {spec.min_kernel}"
        self.results.append(ProbeResult(spec.name, spec.area, present, status, detail,
                                        spec.min_kernel, spec.required, spec.cost, expected))


def _fmt(v: tuple[int, int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def _run_trial(trials: Trials | None, kind: str) -> tuple[bool | None, str]:
    """(True/False, error) from a real load; (None, why) when no trial could be made."""
    if trials is None:
        return None, "not tried"
    try:
        r = trials(kind)
    except Exception as e:  # a trial must never take the probe down
        return False, f"trial load raised {type(e).__name__}: {e}"
    error = (getattr(r, "error", "") or "").strip()
    # bcc says "Need super-user privileges to run" for any EPERM, even as root; the rest of
    # the message has the kernel's answer.
    error = error.removeprefix("Need super-user privileges to run: ")
    if not getattr(r, "ok", False) and error.startswith("unknown trial"):
        return None, "not tried (the loader has no such trial)"
    return bool(r.ok), error.splitlines()[0] if error else ""


def probe(root: Path = Path("/"), trials: Trials | None = None,
          mount_tracefs: bool = False) -> Features:
    """Probe the kernel under `root`. `trials(kind)` (kinds: fentry, clsact, nf_prog) does real
    loads; without it those probes fall back to file evidence or report "not tried"."""
    root = Path(root)
    release = (read_text(root / "proc/sys/kernel/osrelease") or "").strip()
    version = kernel_version(release)
    cfg = kernel_config(root, release)
    b = _Builder(version)
    ver = f"kernel {_fmt(version)}" if version else "kernel version unknown"

    # Capabilities, checked before anything slow (STYLE.md §5).
    cap_eff = read_cap_eff(root)
    b.add("capabilities", caps_ok(cap_eff, version), caps_detail(cap_eff))

    # unprivileged_bpf_disabled exists only when the bpf() syscall is built in (4.4+).
    if exists(root / "proc/sys/kernel/unprivileged_bpf_disabled"):
        b.add("bpf syscall", True, "/proc/sys/kernel/unprivileged_bpf_disabled")
    else:
        on = config_on(cfg, "CONFIG_BPF_SYSCALL")
        b.add("bpf syscall", bool(on),
              "CONFIG_BPF_SYSCALL=y" if on else "no /proc/sys/kernel/unprivileged_bpf_disabled")

    vmlinux = root / "sys/kernel/btf/vmlinux"
    has_btf = bool(exists(vmlinux))
    b.add("btf", has_btf, "/sys/kernel/btf/vmlinux" if has_btf else
          "no /sys/kernel/btf/vmlinux (kernel needs CONFIG_DEBUG_INFO_BTF=y)")

    tracefs, where = find_tracefs(root, mount_tracefs)
    readable = tracefs is not None and bool(exists(tracefs / "events"))
    b.add("tracefs", True if readable else (None if tracefs else False), where)

    # Tracepoints: the format file exists exactly when the event does.
    tracepoints: dict[str, bool] = {}
    fields: dict[str, tuple[str, ...]] = {}
    for tp in TRACEPOINTS:
        tracepoints[tp] = bool(readable and exists(tracefs / "events" / tp / "format"))
        if tracepoints[tp]:
            fields[tp] = tracepoint_fields(tracefs, tp)

    kprobes, kdetail = find_kprobes(root, tracefs if readable else None, cfg)

    unseen = "tracefs not readable" if tracefs is not None else "no tracefs"

    def tp_row(tp: str, name: str):
        # No tracepoint falls back to a kprobe: bcc tools/tcpdrop.py's kprobe tcp_drop (before
        # kfree_skb had a reason, 5.17) is not built here (kernel/hooks.py says "none").
        if not readable:
            b.add(name, None, unseen)
            return
        if tracepoints[tp]:
            b.add(name, True, "")
            return
        b.add(name, False, _missing_detail(b, name, f"no events/{tp}"))

    def field_row(tp: str, name: str, fld: str):
        if not readable:
            b.add(name, None, unseen)
        elif not tracepoints[tp]:
            b.add(name, False, f"no {tp.replace('/', ':')} tracepoint")
        elif fld in fields[tp]:
            b.add(name, True, f"field {fld!r}")
        else:
            b.add(name, False, _missing_detail(b, name, f"no {fld!r} field in its format"))

    for h in hooks.HOOKS:              # the hook table's order: PROBES' order
        if h.kind == "tracepoint":
            tp_row(h.tracepoint, h.name)
            for fld in (f for f in h.fields if f.row):   # kfree_skb reason: c504e5c2f964, 5.17
                field_row(h.tracepoint, fld.row, fld.name)

    b.add("kprobes", kprobes, kdetail)

    # fentry needs BTF and a trampoline (5.5), and even then a kernel may refuse it (this
    # project's 6.18 VM returns EPERM): only a real load tells.
    if b.at_least("5.5") is False:
        b.add("fentry", False, "")
    elif not has_btf:
        b.add("fentry", False, "needs BTF")
    else:
        ok, err = _run_trial(trials, "fentry")
        b.add("fentry", ok, "trial load ok" if ok else
              (f"trial load failed: {err}" if ok is False and err else err))

    b.add("ring buffer", *_ringbuf(root, b, has_btf))

    clsact, where = module_evidence(root, release, "sch_ingress")   # clsact lives in sch_ingress.c
    if not clsact:
        on = config_on(cfg, "CONFIG_NET_SCH_INGRESS")
        clsact, where = (on, "CONFIG_NET_SCH_INGRESS") if on is not None else (clsact, where)
    if b.at_least("4.5") is False:
        b.add("tc clsact", False, "")
    else:
        ok, err = _run_trial(trials, "clsact") if clsact is not False else (False, "")
        if ok is None:
            b.add("tc clsact", clsact, f"sch_ingress {where}" if clsact else
                  "no evidence of sch_ingress (module list and kernel config unreadable)")
        else:
            b.add("tc clsact", ok, "trial attach ok" if ok else
                  (err or "sch_ingress not built (CONFIG_NET_SCH_INGRESS)"))

    # tcx links (BPF_TCX_INGRESS/EGRESS): 6.6 (commit e420bed02507), under CONFIG_NET_XGRESS.
    # No trial here: `nptrace run` tries the link itself and falls back to clsact (tc.py).
    on = config_on(cfg, "CONFIG_NET_XGRESS")
    if b.at_least("6.6") is False:
        b.add("tcx", False, "")
    elif on is not None:
        b.add("tcx", on, "CONFIG_NET_XGRESS=y" if on else "CONFIG_NET_XGRESS is not set")
    else:
        b.add("tcx", b.at_least("6.6"), ver)

    # BPF_PROG_TYPE_NETFILTER and its link: 6.4 (commit fd9c663b9ad6), CONFIG_NETFILTER_BPF_LINK.
    if b.at_least("6.4") is False:
        b.add("netfilter bpf", False, "")
    elif config_on(cfg, "CONFIG_NETFILTER_BPF_LINK") is False:
        b.add("netfilter bpf", False, "CONFIG_NETFILTER_BPF_LINK is not set")
    else:
        ok, err = _run_trial(trials, "nf_prog")
        if ok is None and version is None:
            b.add("netfilter bpf", None, "kernel version unknown; not tried")
        elif ok is None:
            b.add("netfilter bpf", True, f"{ver} >= 6.4 (not trial-loaded)")
        else:
            b.add("netfilter bpf", ok, "trial load ok" if ok else err)

    b.add("netfilter backend", *find_netfilter_backend(root, release, cfg))
    b.add("ipvs", *find_ipvs(root, release, cfg))

    count = parse_int(read_text(root / "proc/sys/net/netfilter/nf_conntrack_count"))
    cmax = parse_int(read_text(root / "proc/sys/net/netfilter/nf_conntrack_max"))
    if count is not None and cmax is not None:
        b.add("conntrack", True, f"{count}/{cmax} entries")
    else:
        b.add("conntrack", False, "no /proc/sys/net/netfilter/nf_conntrack_{count,max}")

    return Features(root=root, kernel=release, version=version,
                    tracefs=tracefs if readable else None, tracepoints=tracepoints,
                    fields=fields, results=tuple(b.results), cap_eff=cap_eff, config=cfg)


def _missing_detail(b: _Builder, name: str, what: str) -> str:
    spec = PROBES[name]
    if b.version is None or not spec.min_kernel:
        return what
    if b.at_least(spec.min_kernel):
        if not spec.by_version:
            return what
        return f"{what}; unexpected on kernel {_fmt(b.version)} (>= {spec.min_kernel})"
    return f"{what} (kernel {_fmt(b.version)} < {spec.min_kernel})"


def _ringbuf(root: Path, b: _Builder, has_btf: bool) -> tuple[bool, str]:
    # BPF_MAP_TYPE_RINGBUF: 5.8 (commit 457f44363a88). bcc tools/f2fsslower.py asks BTF for
    # struct bpf_ringbuf instead of trusting the version, which distribution backports break.
    by_version = b.at_least("5.8")
    if has_btf:
        try:
            from nptrace.kernel import btf as _btf
            kernel = _btf.default() if root == Path("/") else _btf.load(root / "sys/kernel/btf/vmlinux")
            if kernel.has("bpf_ringbuf"):
                return True, "BTF has struct bpf_ringbuf"
            if by_version is not None:
                return False, "BTF has no struct bpf_ringbuf"
        except Exception:  # unreadable or not real BTF (fixtures): fall back to the version
            pass
    if by_version is None:
        return False, "kernel version unknown"
    if by_version:
        return True, f"kernel {_fmt(b.version)} >= 5.8"
    return False, ""
