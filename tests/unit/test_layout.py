"""The Python mirrors in nptrace/events.py, nptrace/kernel/natpeers.py (the NAT map),
nptrace/kernel/causekeys.py (the cause keys) and
the stat names of nptrace/kernel/loader.py must equal bpf/nptrace_events.h, checked by clang."""
import ctypes as ct
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nptrace import events
from nptrace.kernel import causekeys, loader, natpeers

BPF_DIR = Path(__file__).resolve().parents[2] / "bpf"
LAYOUTS = {**events.LAYOUTS, **natpeers.LAYOUTS, **causekeys.LAYOUTS}
PRELUDE = """
typedef unsigned char __u8; typedef unsigned short __u16;
typedef unsigned int __u32; typedef unsigned long long __u64;
#include <stddef.h>
#include "nptrace_events.h"
"""


def static_asserts(cname, py):
    yield f'_Static_assert(sizeof(struct {cname}) == {ct.sizeof(py)}, "{cname} size");'
    for name, *_ in py._fields_:
        f = getattr(py, name)
        yield f'_Static_assert(offsetof(struct {cname}, {name}) == {f.offset}, "{name} offset");'
        yield f'_Static_assert(sizeof(((struct {cname} *)0)->{name}) == {f.size}, "{name} size");'


@pytest.mark.parametrize("cname", sorted(LAYOUTS))
def test_layout_matches_header(cname, tmp_path):
    clang = shutil.which("clang")
    if not clang:
        pytest.skip("clang not installed (scripts/setup.sh installs it)")
    src = tmp_path / "layout.c"
    src.write_text(PRELUDE + "\n".join(static_asserts(cname, LAYOUTS[cname])) + "\n")
    r = subprocess.run([clang, "-target", "bpf", "-fsyntax-only", f"-I{BPF_DIR}", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("cname", sorted(LAYOUTS))
def test_no_implicit_padding(cname):
    py = LAYOUTS[cname]
    assert sum(getattr(py, n).size for n, *_ in py._fields_) == ct.sizeof(py)


def test_struct_format_equals_ctypes():
    assert events.RECORD.size == ct.sizeof(events.RawEvent)
    assert events.COUNT_KEY.size == ct.sizeof(events.RawCountKey)
    assert natpeers.NAT_KEY.size == ct.sizeof(natpeers.NatKey)
    assert causekeys.CAUSE_KEY.size == ct.sizeof(causekeys.RawCauseKey)


def test_abi_version_matches_header():
    text = (BPF_DIR / "nptrace_events.h").read_text()
    assert f"#define NPT_ABI_VERSION {events.ABI_VERSION}\n" in text


def test_enums_match_header():
    text = (BPF_DIR / "nptrace_events.h").read_text()
    for prefix, enum in (("NPT_T_", events.EvType), ("NPT_H_", events.Hook), ("NPT_D_", events.Dir),
                         ("NPT_KF_", events.KFunc), ("NPT_S_", loader.Stat)):
        for member in enum:
            m = re.search(rf"\b{prefix}{member.name}\s*=\s*(\d+)", text)
            assert m and int(m.group(1)) == member.value, f"{prefix}{member.name}"


def test_stat_names_cover_header():
    """Every counter the kernel keeps has a name in Probes.stats() (NPT_S_MAX is the size)."""
    text = (BPF_DIR / "nptrace_events.h").read_text()
    body = re.search(r"enum npt_stat \{(.*?)\};", text, re.S).group(1)
    names = set(re.findall(r"\bNPT_S_(\w+)\s*=", body)) - {"MAX"}
    assert names == {s.name for s in loader.Stat}
    size = int(re.search(r"\bNPT_S_MAX\s*=\s*(\d+)", body).group(1))
    assert max(loader.Stat) < size


def test_cause_key_round_trip():
    k = causekeys.CauseKey(type=1, hook=1, reason=12, netns=4026531840, ifindex=3, dir=0,
                           saddr="10.0.0.1", sport=0, daddr="10.0.0.2", dport=80, family=2,
                           flags=1, tcpflags=2, ct_bits=2, odst="10.96.0.10", oport=443,
                           prior_type=2, prior_hook=2, prior_reason=3)
    raw = causekeys.encode_key(k)
    assert len(raw) == ct.sizeof(causekeys.RawCauseKey)
    c = causekeys.RawCauseKey.from_buffer_copy(raw)
    assert (c.reason, c.dport, c.oport, c.type, c.prior_type, c.prior_hook, c.ct_bits) == \
        (12, 80, 443, 1, 2, 2, 2)
    assert causekeys.decode_key(raw) == k
