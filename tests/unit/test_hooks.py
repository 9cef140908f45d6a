"""The hook table (nptrace/kernel/hooks.py), the programs bpf/*.bpf.c define and the hook rows
features.probe() reports name the same hooks; attach.plan() decides from fixture trees
(tests/fixtures/features/<case>/) what `nptrace run` attaches. No root, no bcc."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from nptrace.config import Config, IfaceSpec
from nptrace.errors import FeatureMissing
from nptrace.kernel import attach, features, hooks
from nptrace.kernel.cflags import build_cflags

BPF_DIR = Path(__file__).resolve().parents[2] / "bpf"
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "features"


def bpf_programs() -> dict[str, set[str]]:
    """bpf file -> the programs it defines: bcc's tracepoint__<cat>__<event> for each
    TRACEPOINT_PROBE(cat, event), and every non-static `int npt_*(...)` entry function."""
    out = {}
    for path in sorted(BPF_DIR.glob("*.bpf.c")):
        text = path.read_text()
        progs = {f"tracepoint__{c}__{e}"
                 for c, e in re.findall(r"^TRACEPOINT_PROBE\((\w+),\s*(\w+)\)", text, re.M)}
        progs |= set(re.findall(r"^int (npt_\w+)\(", text, re.M))
        out[path.name] = progs
    return out


def test_table_names_every_program_in_the_bpf_sources():
    table: dict[str, set[str]] = {}
    for h in hooks.HOOKS:
        table.setdefault(h.bpf_file, set()).update(h.programs)
    assert table == {f: p for f, p in bpf_programs().items() if p}


def test_tracepoint_hooks_are_the_tracepoint_probes():
    text = (BPF_DIR / "tracepoints.bpf.c").read_text()
    probes = {f"{c}:{e}" for c, e in re.findall(r"^TRACEPOINT_PROBE\((\w+),\s*(\w+)\)", text, re.M)}
    assert probes == {h.name for h in hooks.HOOKS if h.kind == "tracepoint"}
    assert set(hooks.TRACEPOINTS) == {p.replace(":", "/") for p in probes}


def test_every_gate_is_tested_in_its_bpf_file():
    for h in hooks.HOOKS:
        text = (BPF_DIR / h.bpf_file).read_text()
        assert re.search(rf"^#if {h.gate}\b", text, re.M), (h.name, h.gate)


def test_features_hook_rows_are_the_tables():
    # every row the table derives is a features probe, reported once, and nothing else in
    # features is a tracepoint row (fib:fib_table_lookup had a row and no program)
    assert set(features.HOOK_ROWS) == {h.probe for h in hooks.HOOKS} | \
        {f.row for h in hooks.HOOKS for f in h.fields if f.row}
    feats = features.probe(FIXTURES / "linux-6.18")
    reported = [r.name for r in feats.results]
    for row in features.HOOK_ROWS:
        assert reported.count(row) == 1, row
    assert {r.name for r in feats.results if r.area == "tracepoints"} == \
        {r for r in features.HOOK_ROWS if ":" in r}
    assert set(features.TRACEPOINTS) == set(hooks.TRACEPOINTS)


def test_every_hook_says_kernel_cost_and_fallback():
    names = [h.name for h in hooks.HOOKS]
    assert len(names) == len(set(names))
    for h in hooks.HOOKS:
        assert features.kernel_version(h.min_kernel), h.name
        assert h.cost and h.fallback, h.name
        if h.required:
            assert h.fail_reason, h.name
    # no hook claims a fallback or cost that no code implements
    text = " ".join(f"{h.cost} {h.fallback}" for h in hooks.HOOKS)
    assert "tcp_drop" not in text and "perf buffer" not in text
    assert "perf buffer used" not in features.PROBES["ring buffer"].cost


def test_kprobe_groups_come_from_the_table():
    from nptrace.kernel import loader
    assert loader.KPROBE_GROUPS is hooks.KPROBE_GROUPS
    assert set(hooks.KPROBE_GROUPS) == {"nat", "rp_filter", "tcp_reset", "tcp_reset6",
                                        "reject_reset", "reject_reset6",
                                        "ipvs_in", "ipvs_out"}


def test_build_cflags_gates_are_the_tables():
    flags = build_cflags(Config())
    for tp, gate in hooks.TRACEPOINTS.items():
        assert f"-D{gate}=1" in flags
    flags = build_cflags(Config(tracepoints=("skb/kfree_skb",)))
    assert "-DNPT_TP_KFREE_SKB=1" in flags and "-DNPT_TP_ICMP_SEND=0" in flags


# --- attach.plan() against fixture trees ------------------------------------------------------

def plan_for(case, cfg=Config(), **kw):
    return attach.plan(features.probe(FIXTURES / case), cfg, **kw)


def choice(p: attach.Plan, hook: str) -> attach.Choice:
    return next(c for c in p.choices if c.hook == hook)


def test_plan_on_6_18_like_this_vm():
    p = plan_for("linux-6.18")
    assert p.tracepoints == frozenset(hooks.TRACEPOINTS)
    assert not p.kprobes and not p.cfg.kprobes and not choice(p, "kprobe:*").on
    assert p.nf_hook and choice(p, "netfilter:post_routing").on
    assert not p.tc and "--iface none" in choice(p, "tc:ingress/egress").why
    p.require()
    # one line per choice: each tracepoint, kprobes, tc, netfilter
    assert len(p.lines()) == len(hooks.TRACEPOINTS) + 3
    assert all("\n" not in line for line in p.lines())


def test_plan_on_5_4_skips_icmp_send_and_the_netfilter_program():
    p = plan_for("linux-5.4")
    assert "icmp/icmp_send" not in p.tracepoints and "skb/kfree_skb" in p.tracepoints
    c = choice(p, "icmp:icmp_send")
    assert not c.on and "5.4 < 6.10" in c.why and "lost:" in c.why
    assert not p.nf_hook and "5.4 < 6.4" in choice(p, "netfilter:post_routing").why
    assert p.kprobes and p.cfg.kprobes        # the kprobe PMU is there: enrichment on
    p.require()                               # optional losses only


def test_plan_kprobes_tc_and_no_netfilter_program():
    p = plan_for("kprobes-ipvs", Config(ifaces=(IfaceSpec.parse("eth0"),)))
    assert p.kprobes and p.tc and "tc mode auto" in choice(p, "tc:ingress/egress").why
    assert not p.nf_hook
    assert "5.15 < 6.4" in choice(p, "netfilter:post_routing").why


def test_plan_follows_the_config():
    p = plan_for("linux-6.18", Config(nf_hook=False, tracepoints=("skb/kfree_skb",)))
    assert p.tracepoints == {"skb/kfree_skb"} and not p.nf_hook
    assert choice(p, "tcp:tcp_send_reset").why == "not asked for"


def test_plan_without_the_required_hook_refuses_before_compiling(tmp_path):
    root = tmp_path / "k"
    shutil.copytree(FIXTURES / "kprobes-ipvs", root)
    shutil.rmtree(root / "sys/kernel/tracing/events/skb")
    p = attach.plan(features.probe(root), Config())
    with pytest.raises(FeatureMissing, match=r"tracepoint skb:kfree_skb not supported"):
        p.require()
    assert "fallback: none" in choice(p, "skb:kfree_skb").why


def test_plan_without_tracefs():
    p = plan_for("empty")
    assert not p.tracepoints
    with pytest.raises(FeatureMissing):
        p.require()
    # dump-bpf without root: what cannot be told counts as present
    assert plan_for("empty", assume_unknown=True).tracepoints == frozenset(hooks.TRACEPOINTS)


def test_doctor_hook_rows_come_from_the_plan():
    from nptrace import doctor
    feats = features.probe(FIXTURES / "linux-5.4")
    rows = {r.check: r for r in doctor.build_report(feats).rows}
    assert rows["skb:kfree_skb"].detail == "run: on"
    assert rows["icmp:icmp_send"].detail.endswith("run: off")
    assert rows["netfilter bpf"].detail.endswith("run: netfilter:post_routing off")
    assert rows["kprobes"].detail.endswith("run: kprobe:* on")
    assert "run:" not in rows["btf"].detail


def test_plan_names_the_causes_a_kernel_cannot_give():
    # before 5.17 kfree_skb has no reason: a bad checksum's drop looks like any other
    old = plan_for("linux-5.4")
    assert old.lost_causes == ("checksum",)
    assert "causes this kernel cannot give: checksum (see doctor)" in old.lines()[-1]
    assert plan_for("linux-6.18").lost_causes == ()
    assert not any("cannot give" in ln for ln in plan_for("linux-6.18").lines())
