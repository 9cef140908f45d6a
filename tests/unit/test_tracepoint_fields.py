"""Every tracepoint field a program in bpf/tracepoints.bpf.c reads is listed in the hook table
(kernel/hooks.py) with its kernels, and a field some kernels lack is read only under its gate:
bcc builds `args` from the running kernel's format file, so an ungated read of a missing field
is a compile error that stops `nptrace run` (6.1's tcp_send_reset has no `reason`, 5.10's
kfree_skb none either). Held against the format files of real kernels
(tests/fixtures/tracepoints/<release>/), and, for the gates, against the plan that
attach.plan() makes there. No root, no bcc."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from nptrace.config import Config
from nptrace.kernel import features, hooks
from nptrace.kernel.cflags import build_cflags

BPF = Path(__file__).resolve().parents[2] / "bpf" / "tracepoints.bpf.c"
KERNELS = Path(__file__).resolve().parent.parent / "fixtures" / "tracepoints"
RELEASES = sorted(p.name for p in KERNELS.iterdir() if p.is_dir())
TP_HOOKS = [h for h in hooks.HOOKS if h.kind == "tracepoint"]


def _macro_fields(text: str) -> dict[str, set[str]]:
    """Function-like macros of the file whose body reads (args)->field: name -> fields."""
    out = {}
    for m in re.finditer(r"^#define (NPT_\w+)\(([^)]*)\)((?:.*\\\n)*.*)$", text, re.M):
        got = set(re.findall(r"\(args\)->(\w+)", m.group(3)))
        if got:
            out[m.group(1)] = got
    return out


def field_reads(text: str = None) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """"cat:event" -> [(field, the #if conditions around the read)] for each program."""
    text = BPF.read_text() if text is None else text
    macros = _macro_fields(text)
    out: dict[str, list] = {}
    stack: list[str] = []
    current = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#if"):
            stack.append(s)
            continue
        if s.startswith("#else"):
            stack[-1] = "!(" + stack[-1] + ")"
            continue
        if s.startswith("#endif"):
            stack.pop()
            continue
        m = re.match(r"TRACEPOINT_PROBE\((\w+),\s*(\w+)\)", s)
        if m:
            current = f"{m.group(1)}:{m.group(2)}"
            out[current] = []
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        conds = tuple(stack)
        for fld in re.findall(r"\bargs->(\w+)", line):
            out[current].append((fld, conds))
        for name, flds in macros.items():
            if re.search(rf"\b{name}\(", line):
                out[current] += [(f, conds) for f in sorted(flds)]
    return out


def test_every_program_is_parsed():
    assert set(field_reads()) == {h.name for h in TP_HOOKS}
    assert all(field_reads()[h.name] for h in TP_HOOKS)


@pytest.mark.parametrize("hook", TP_HOOKS, ids=lambda h: h.name)
def test_every_field_read_is_listed_and_optional_ones_are_gated(hook):
    optional = {f.name: f for f in hook.fields}
    for fld, conds in field_reads()[hook.name]:
        assert fld in hook.reads or fld in optional, \
            f"{hook.name} reads {fld!r}: list it in hooks.py (reads, or a Field with its kernel)"
        if fld in optional:
            f = optional[fld]
            # a gate of this field, or of one that comes and goes with it (one layout)
            gates = {hook.field_gate(o) for o in hook.fields
                     if (o.min_kernel, o.until) == (f.min_kernel, f.until)}
            assert any(g in c and not c.startswith("!") for c in conds for g in gates), \
                f"{hook.name} reads {fld!r} outside #if {hook.field_gate(f)}"


def test_no_unused_reads_are_claimed():
    reads = field_reads()
    for h in TP_HOOKS:
        used = {f for f, _ in reads[h.name]}
        assert set(h.reads) <= used, (h.name, set(h.reads) - used)


@pytest.mark.parametrize("release", RELEASES)
def test_base_reads_exist_on_every_real_kernel_with_the_tracepoint(release):
    for h in TP_HOOKS:
        fields = features.tracepoint_fields(KERNELS / release, h.tracepoint)
        if not fields:
            assert h.name != "skb:kfree_skb", release
            continue
        assert set(h.reads) <= set(fields), (release, h.name, set(h.reads) - set(fields))


@pytest.mark.parametrize("release", RELEASES)
def test_field_gates_follow_the_kernels_format(release):
    """build_cflags turns on exactly the gated fields that kernel's format has, and a field's
    min_kernel / until agree with where it is found."""
    root = KERNELS / release
    fields = {h.tracepoint: features.tracepoint_fields(root, h.tracepoint) for h in TP_HOOKS}
    have = {tp for tp, f in fields.items() if f}
    flags = build_cflags(Config(), have, [], {tp: f for tp, f in fields.items() if f})
    version = features.kernel_version(release)
    for h in TP_HOOKS:
        for f in h.fields:
            present = f.name in fields[h.tracepoint]
            assert f"-D{h.field_gate(f)}={int(present)}" in flags
            if not fields[h.tracepoint]:
                continue
            expect = version >= features.kernel_version(f.min_kernel) and \
                (not f.until or version < features.kernel_version(f.until))
            assert present == expect, (release, h.name, f.name)


def test_newest_layout_when_the_format_was_not_read():
    flags = build_cflags(Config())
    assert "-DNPT_TPF_KFREE_SKB_REASON=1" in flags
    assert "-DNPT_TPF_TCP_SEND_RESET_SADDR_V6=0" in flags
