"""Which kernel headers bcc's compile will use, said once at start and by `doctor`.

bcc 0.26 (src/cc/frontends/clang/loader.cc) looks, in order, at $BCC_KERNEL_SOURCE, then
/lib/modules/$(uname -r)/build (with .../source beside it on split trees such as Debian's),
then /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS), which it unpacks to /tmp. Nothing of the
headers' struct layouts is used by nptrace: every offset comes from BTF (kernel/offsets.py);
the compile needs them only for bcc's own helpers (helpers.h pulls in uapi/linux/bpf.h,
linux/version.h, asm/page.h and about 140 more, measured with strace on this VM kind) and
uapi/linux/ptrace.h.

Pure: reads the file system under `root` and the environment it is given; imports without bcc.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The minimal header tree made at image build (deploy/Containerfile) or by scripts/setup.sh
# with `python -m nptrace.kernel.headertree` (kernel/headertree.py): about 150 files.
SHIPPED = Path(os.environ.get("NPTRACE_KHEADERS", "/usr/share/nptrace/kheaders"))


@dataclass(frozen=True)
class HeaderSource:
    kind: str      # env | node | kheaders | shipped | none
    path: str
    detail: str

    def line(self) -> str:
        return f"kernel headers: {self.kind} ({self.detail})"


def find(release: str | None = None, root: Path = Path("/"), env=os.environ,
         shipped: Path = SHIPPED) -> HeaderSource:
    release = release or os.uname().release
    if env.get("BCC_KERNEL_SOURCE"):
        p = env["BCC_KERNEL_SOURCE"]
        return HeaderSource("env", p, f"BCC_KERNEL_SOURCE={p}")
    build = root / "lib/modules" / release / "build"
    try:
        if (build / "include").is_dir():
            target = os.path.realpath(build)
            return HeaderSource("node", str(build), f"{build} -> {target}")
    except OSError:     # ProtectKernelModules=yes makes the directory inaccessible
        pass
    ik = root / "sys/kernel/kheaders.tar.xz"
    if ik.exists():
        return HeaderSource("kheaders", str(ik), f"{ik} (CONFIG_IKHEADERS), unpacked by bcc")
    if (shipped / "include/linux/kconfig.h").is_file():    # what bcc 0.26 checks for
        return HeaderSource("shipped", str(shipped), f"nptrace's minimal tree {shipped}")
    return HeaderSource("none", "", f"no {build}, no {ik}: install the kernel headers package "
                        f"for {release} (Debian: linux-headers-{release}), or make nptrace's "
                        f"own tree: python -m nptrace.kernel.headertree {shipped}")


def select(source: HeaderSource, env=os.environ) -> None:
    """Point bcc at the shipped tree when that is what `find` chose (bcc reads the variable
    at compile time, in libbcc)."""
    if source.kind == "shipped":
        env["BCC_KERNEL_SOURCE"] = source.path
