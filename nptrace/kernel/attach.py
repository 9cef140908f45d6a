"""What `nptrace run` compiles and attaches on this kernel, and the doing of it.

plan(features, cfg) is pure: from features.probe() and the hook table (kernel/hooks.py) it
decides which tracepoints are compiled in, whether the kprobe enrichment, the tc programs and
the netfilter-hook program are on, with one line per choice. `nptrace run` (tracer.py) logs
those lines once and attaches what the plan says; `nptrace doctor` prints its hook rows from
the same plan and `nptrace dump-bpf` prints the same cflags, so the three cannot disagree.

The rest compiles (through loader.py, the only bcc importer), attaches and falls back at run
time, where only a real load tells: tc programs the verifier refuses are rebuilt without kernel
sk_buff reads, a netfilter program the kernel refuses is skipped, kprobe groups try their
alternatives. An optional hook that cannot run is logged and skipped; a required one stops
the run before the slow compile (Plan.require).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from nptrace.config import Config
from nptrace.errors import FeatureMissing, LoadError
from nptrace.kernel import hooks, loader

__all__ = ["Choice", "Plan", "all_cflags", "attach_kprobes", "attach_netfilter", "attach_tc",
           "kernel_flags", "load", "nf_cflags", "nf_namespaces", "plan", "reason_cflags",
           "tc_cflags", "trial"]

Log = Callable[[str], None]

NF_HOOK = hooks.by_name("netfilter:post_routing")
TC_HOOKS = tuple(h for h in hooks.HOOKS if h.kind == "tc")
KPROBE_HOOKS = tuple(h for h in hooks.HOOKS if h.kind == "kprobe")


@dataclass(frozen=True)
class Choice:
    hook: str       # a hook name, or several of one kind ("tc:ingress, tc:egress")
    row: str        # the features row it was decided from
    on: bool
    why: str

    @property
    def line(self) -> str:
        return f"{self.hook}: {'on' if self.on else 'off'} ({self.why})"


@dataclass(frozen=True)
class Plan:
    cfg: Config                      # effective: kprobes set where the kernel has them
    tracepoints: frozenset[str]      # "cat/name" compiled in
    kprobes: bool
    tc: bool
    nf_hook: bool
    choices: tuple[Choice, ...]
    missing: tuple[tuple[hooks.Hook, str], ...] = ()   # required hooks that cannot run, why
    # each compiled tracepoint's format-file fields, for the field gates (kernel/cflags.py);
    # None where tracefs was not read (dump-bpf without root: the newest layout)
    fields: dict[str, tuple[str, ...]] | None = None
    kprobe_groups: tuple[str, ...] = ()   # the kprobe groups attached (hooks.py order)

    def require(self) -> None:
        """FeatureMissing for a required hook this kernel lacks (before the slow compile)."""
        for h, why in self.missing:
            raise FeatureMissing(f"{h.kind} {h.name}", h.min_kernel, why)

    @property
    def lost_causes(self) -> tuple[str, ...]:
        """Causes this kernel cannot give at all: their tracepoint field is missing and no
        other hook names them (hooks.Field.lost). A scenario of such a cause is not
        attributable here; it must not be mislabeled either."""
        if self.fields is None:
            return ()
        return tuple(dict.fromkeys(
            c for h in hooks.HOOKS if h.tracepoint in self.fields for f in h.fields
            if f.name not in self.fields[h.tracepoint] for c in f.lost))

    def lines(self) -> list[str]:
        lost = self.lost_causes
        return [c.line for c in self.choices] + (
            [f"causes this kernel cannot give: {', '.join(lost)} (see doctor)"] if lost else [])

    def decision(self, row: str) -> str:
        """What `run` does about a features hook row, as doctor shows it ("" for a field row)."""
        said = [c for c in self.choices if c.row == row]
        parts = []
        for c in said:
            state = "on" if c.on else (c.why if c.why.startswith("only ") else "off")
            parts.append(f"run: {state}" if c.hook == row else f"run: {c.hook} {state}")
        return "; ".join(parts)

    def detail(self, result) -> str:
        """A features ProbeResult's detail with the plan's decision after it (doctor)."""
        d = self.decision(result.name)
        return f"{result.detail}; {d}" if result.detail and d else (result.detail or d)


def _result(features, name: str):
    try:
        return features.result(name)
    except KeyError:
        return None


def plan(features, cfg: Config, *, assume_unknown: bool = False) -> Plan:
    """Which hooks to compile and attach. `assume_unknown`: hooks whose presence cannot be
    told (tracefs not readable: not root) count as present (dump-bpf without root)."""
    choices: list[Choice] = []
    missing: list[tuple[hooks.Hook, str]] = []
    tracefs = features.tracefs is not None
    tps: set[str] = set()
    for h in hooks.HOOKS:
        if h.kind != "tracepoint":
            continue
        r = _result(features, h.probe)
        tp = h.tracepoint
        wanted = cfg.tracepoints is None or tp in cfg.tracepoints
        present = features.tracepoints.get(tp, False) if tracefs else (True if assume_unknown else None)
        if not wanted:
            choices.append(Choice(h.name, h.probe, False, "not asked for"))
            continue
        if present:
            tps.add(tp)
            choices.append(Choice(h.name, h.probe, True, f"{h.bpf_file}, -D{h.gate}=1"))
            continue
        why = (r.detail if r is not None and r.detail else "absent") if present is False \
            else "cannot tell: tracefs not readable"
        if h.required:
            missing.append((h, why))
            choices.append(Choice(h.name, h.probe, False, f"{why}; required, fallback: "
                                                         f"{h.fallback}"))
        else:
            choices.append(Choice(h.name, h.probe, False, f"{why}; lost: {h.cost}"))

    fields = {tp: features.tracepoint_fields(tp) for tp in sorted(tps)} if tracefs else None

    # kprobe enrichment: wherever the kernel has kprobes (or the config asks for it); a group
    # whose events a tracepoint field's kernel already gives (`unless`) stays off
    kp = _result(features, "kprobes")
    kprobes = bool(cfg.kprobes or (kp is not None and kp.present))
    groups = tuple(h.group for h in KPROBE_HOOKS if not _redundant(h, fields)) if kprobes else ()
    if kprobes:
        skipped = [f"{h.group} (not needed: {h.unless.replace('/', ':')})"
                   for h in KPROBE_HOOKS if h.group not in groups]
        choices.append(Choice("kprobe:*", "kprobes", True, f"kprobes.bpf.c, -DNPT_WITH_KPROBES=1; "
                              f"groups {', '.join(groups)}"
                              + (f"; off: {', '.join(skipped)}" if skipped else "")))
    else:
        choices.append(Choice("kprobe:*", "kprobes", False,
                              kp.detail if kp is not None and kp.detail else "no kprobes"))

    # tc: on --iface's devices, or on those the automatic choice finds at start and follows
    # (node/ifchoice.py); tcx links or clsact filters are tc.py's choice at attach time
    tc_names = "tc:" + "/".join(h.name.split(":", 1)[1] for h in TC_HOOKS)   # tc:ingress/egress
    clsact = _result(features, "tc clsact")
    tc = bool(cfg.ifaces) or cfg.iface_auto
    if cfg.iface_auto and not cfg.ifaces and clsact is not None and clsact.present is False:
        tc = False
        cfg = dataclasses.replace(cfg, iface_auto=False)
        choices.append(Choice(tc_names, "tc clsact", False,
                              f"automatic interface choice off: {clsact.detail or 'no clsact'}"))
    elif tc:
        tcx = _result(features, "tcx")
        mode = cfg.tc_mode
        if mode == "auto":
            mode += ": tcx links" if tcx is not None and tcx.present else ": clsact filters"
        where = (f"--iface {', '.join(map(str, cfg.ifaces))}" if cfg.ifaces else
                 "the node's devices, chosen at start and followed")
        choices.append(Choice(tc_names, "tc clsact", True, f"{where}; tc mode {mode}"))
    else:
        choices.append(Choice(tc_names, "tc clsact", False,
                              "--iface none: no tc programs on any interface"))

    # the netfilter-hook view of NATed SYNs (Linux 6.4+)
    nf = _result(features, NF_HOOK.probe)
    if not cfg.nf_hook:
        nf_hook, why = False, "turned off in the configuration"
    elif nf is not None and nf.present is False:
        nf_hook, why = False, f"{nf.detail or 'absent'}; fallback: {NF_HOOK.fallback}"
    else:
        nf_hook, why = True, f"{NF_HOOK.bpf_file}, linked at ipv4 and ipv6 POST_ROUTING@101 in " + \
            ", ".join(ns or "the namespace nptrace runs in" for ns in nf_namespaces(cfg))
    choices.append(Choice(NF_HOOK.name, NF_HOOK.probe, nf_hook, why))

    eff = dataclasses.replace(cfg, kprobes=True) if kprobes and not cfg.kprobes else cfg
    return Plan(eff, frozenset(tps), kprobes, tc, nf_hook, tuple(choices), tuple(missing),
                fields, groups)


def _redundant(h: hooks.Hook, fields) -> bool:
    """A kprobe group made redundant by a tracepoint field this kernel has (unknown fields:
    the newest kernel, where it is)."""
    if not h.unless:
        return False
    tp, _, name = h.unless.partition(":")
    return fields is None or name in fields.get(tp, ())


# --- compile ---------------------------------------------------------------------------------
def nf_namespaces(cfg: Config) -> list[str | None]:
    """Where NAT happens: the namespaces of the watched interfaces, else the host."""
    spaces = {s.netns for s in cfg.ifaces}
    return sorted(spaces, key=lambda n: n or "") or [None]


def _nf_points():
    from nptrace.kernel import nfhook
    return (nfhook.AFTER_SNAT,)    # just after SNAT, where both NAT tuples are final


def nf_cflags(p: Plan, kbtf, log: Log) -> list[str]:
    """-D switches of the netfilter-hook program, [] when the plan has it off or BTF lacks
    what it reads (then it is off, said once)."""
    if not p.nf_hook:
        return []
    from nptrace.kernel import nfhook
    try:
        return nfhook.cflags(kbtf, points=_nf_points())
    except Exception as e:
        log(f"netfilter-hook view off: {e}")
        return []


def kernel_flags(p: Plan, kbtf, drops, rsts, log: Log) -> list[str]:
    """The -D switches that come from this kernel, not the configuration: BTF offsets, the
    netfilter-hook program's, the reasonless drops' call sites and the reason values."""
    from nptrace.kernel import kallsyms, offsets
    flags = offsets.cflags(kbtf) + nf_cflags(p, kbtf, log)
    neigh = kallsyms.neigh_cflags(drops)
    if not neigh:
        log("IPv6 neighbour failures stay unnamed: /proc/kallsyms shows no addresses "
            "(needs CAP_SYSLOG) or the kernel lacks NEIGH_FAILED")
    return flags + neigh + reason_cflags(p, drops, rsts)


def trial(p: Plan, log: Log = lambda _: None) -> tuple[bool, str]:
    """Compile and load the very programs `run` would for this plan (tracepoints attached for
    the moment of the trial, kprobes verified without attaching): (ok, one line). What
    `nptrace doctor` reports, so that it never calls tracing possible where `run` then fails."""
    import time

    from nptrace import reasons
    from nptrace.kernel import btf
    t0 = time.monotonic()
    try:
        kbtf = btf.default()
        drops, rsts = reasons.load_tables(kbtf)
        probes = load(p, kernel_flags(p, kbtf, drops, rsts, log), drops, log)
    except (LoadError, btf.BtfError, OSError) as e:
        return False, _first_error(e)
    try:
        progs = sorted({prog for h in KPROBE_HOOKS if h.group in p.kprobe_groups
                        for prog in h.programs})
        n = loader.verify_kprobes(probes.bpf, progs) if p.kprobes else 0
    except LoadError as e:
        return False, _first_error(e)
    finally:
        probes.close()
    how = "compiled" if probes.origin == "compiled" else "took from the object cache"
    return True, (f"{how} and loaded {len(p.tracepoints)} tracepoint and {n} kprobe "
                  f"programs in {time.monotonic() - t0:.1f} s")


def _first_error(e: Exception) -> str:
    """The error and the first compiler/verifier `error:` line of its log, on one line."""
    tail = getattr(e, "log_tail", "") or ""
    first = next((ln.strip() for ln in tail.splitlines() if "error" in ln.lower()), "")
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"{msg}: {first}" if first and first not in msg else msg


def reason_cflags(p: Plan, drops, rsts) -> list[str]:
    """The reason values the programs set themselves (nptrace/reasons.py bpf_flags) and, where
    kfree_skb has no reason field, the call sites that name a drop (kernel/kallsyms.py)."""
    from nptrace import reasons
    from nptrace.kernel import kallsyms
    kfree_reason = p.fields is None or "reason" in p.fields.get("skb/kfree_skb", ())
    flags = reasons.bpf_flags(drops, rsts, kfree_reason)
    return flags if kfree_reason else flags + kallsyms.drop_site_cflags()


def tc_cflags(p: Plan, kskb: bool = True) -> list[str]:
    if not p.tc:
        return []
    try:
        from nptrace.kernel.tc import tc_cflags as flags
    except ImportError:
        return []
    out = flags(p.cfg)
    if not kskb:
        out = [f for f in out if not f.startswith("-DNPT_TC_KSKB=")] + ["-DNPT_TC_KSKB=0"]
    return out


def all_cflags(p: Plan, kernel_flags: list[str]) -> list[str]:
    """Every cflag of the one bcc object (`nptrace dump-bpf` prints these). kernel_flags: BTF
    offsets (offsets.cflags) and nf_cflags."""
    return loader.all_cflags(p.cfg, p.tracepoints, kernel_flags + tc_cflags(p), p.fields)


def load(p: Plan, kernel_flags: list[str], drops, log: Log = lambda _: None, *,
         kskb: bool = True) -> loader.Probes:
    """Compile (or take from the object cache) and load the planned programs as one
    object; what the cache had to say is logged."""
    probes = loader.Probes(p.cfg, kernel_flags + tc_cflags(p, kskb), drops, p.tracepoints,
                           p.fields)
    for note in probes.notes:
        log(note)
    return probes


# --- attach, fall back -----------------------------------------------------------------------
def attach_tc(p: Plan, probes, kernel_flags: list[str], drops, log: Log):
    """(probes, tc attachments). Where the verifier refuses the tc programs, rebuild without
    kernel sk_buff reads and try once more; the first probes are closed then."""
    from nptrace.kernel import tc
    try:
        return probes, tc.attach(probes, p.cfg)
    except LoadError as e:
        # Reading the kernel sk_buff behind a tc context (netns, conntrack) needs
        # CAP_PERFMON's probe_read in tc programs; where the verifier refuses it,
        # fall back to the attach-time netns map and no conntrack on tc events.
        log(f"tc programs refused ({str(e).splitlines()[0]}); retrying without kernel sk_buff reads "
            "(tc events carry no conntrack tuples)")
        probes.close()
    probes = load(p, kernel_flags, drops, log, kskb=False)
    try:
        return probes, tc.attach(probes, p.cfg)
    except BaseException:
        probes.close()
        raise


def attach_netfilter(p: Plan, probes, log: Log):
    """Link the netfilter-hook program in every NAT namespace; its NfHookLinks, or None."""
    if not any(f.startswith("-DNPT_WITH_NF_HOOK=1") for f in probes.cflags):
        return None
    from nptrace.kernel import nfhook
    links = None
    try:
        fd = loader.load_netfilter_prog(probes.bpf)
        links = nfhook.NfHookLinks(fd)
        for ns in nf_namespaces(p.cfg):
            links.attach(ns, points=_nf_points())
        try:   # and IPv6's (dual-stack NAT: ip6tables / nft ip6 tables); the same program
            for ns in nf_namespaces(p.cfg):
                links.attach(ns, points=_nf_points(), pf=nfhook.NFPROTO_IPV6)
        except Exception as e:
            log(f"netfilter-hook view of IPv6 not attached ({str(e).splitlines()[0]}): IPv6 NAT "
                "tuples come from tracepoints and tc egress only")
        probes.attached.append("netfilter:post_routing@101")
        return links
    except Exception as e:
        # Linux < 6.4 or CONFIG_NETFILTER_BPF_LINK off: NAT tuples still come from
        # conntrack at the tracepoints and tc egress, only later in a flow.
        log(f"netfilter-hook view not attached ({str(e).splitlines()[0]}): NAT "
            "tuples come from tracepoints and tc egress only")
        if links is not None:
            links.close()
        return None


def attach_kprobes(p: Plan, probes, log: Log) -> None:
    """Attach the enrichment kprobe groups the plan has on; a group none of whose
    alternatives attaches is logged and skipped."""
    if not p.cfg.kprobes:
        return
    got = loader.attach_kprobes(probes.bpf, {g: hooks.KPROBE_GROUPS[g] for g in p.kprobe_groups})
    for group, what in got.items():
        if what.startswith("skipped"):
            log(f"kprobe {group} {what}")
        else:
            probes.attached.append(f"kprobe:{what}")
