"""node/xtables.py's UAPI layouts against this kernel's BTF (struct ipt_getinfo, ipt_get_entries,
ipt_entry, ip6t_entry): the offsets it walks the rule blob with must be the kernel's."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nptrace.node import xtables

BTF = Path("/sys/kernel/btf/vmlinux")


@pytest.fixture(scope="module")
def structs():
    if not BTF.exists() or not shutil.which("bpftool"):
        pytest.skip("needs the kernel's BTF (/sys/kernel/btf/vmlinux) and bpftool")
    raw = subprocess.run(["bpftool", "btf", "dump", "file", str(BTF), "format", "raw"],
                         capture_output=True, text=True, check=True).stdout
    out, cur = {}, None
    for line in raw.splitlines():
        m = re.match(r"\[\d+\] STRUCT '(\w+)' size=(\d+)", line)
        if m:
            cur = out.setdefault(m.group(1), {"sizeof": int(m.group(2))})
            continue
        m = re.match(r"\s+'(\w+)' type_id=\d+ bits_offset=(\d+)", line)
        if m and cur is not None:
            cur[m.group(1)] = int(m.group(2)) // 8
        elif not line.startswith(("\t", " ")):
            cur = None
    return out


def test_the_layouts_are_the_kernels(structs):
    info = structs["ipt_getinfo"]
    assert info["sizeof"] == xtables.GETINFO_SIZE
    assert info["size"] == xtables.GETINFO_SIZE - 4          # the blob's size, read last
    assert structs["ipt_get_entries"]["size"] == xtables.NAME_LEN
    assert structs["ipt_get_entries"]["entrytable"] == xtables.ENTRIES_HEADER
    for family, struct_name in (("ip", "ipt_entry"), ("ip6", "ip6t_entry")):
        _, _, _, next_at, counters_at = xtables.FAMILIES[family]
        assert structs[struct_name]["next_offset"] == next_at, struct_name
        assert structs[struct_name]["counters"] == counters_at, struct_name
