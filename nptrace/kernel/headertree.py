"""Make the minimal kernel-header tree nptrace ships, so that nodes without headers (COS,
Bottlerocket, Talos, `ProtectKernelModules=yes`) still compile the probes.

Every struct offset the probes read comes from BTF (kernel/offsets.py); the headers serve only
bcc's own preamble: `-include include/linux/kconfig.h` and /virtual/include/bcc/helpers.h pull
in uapi/linux/bpf.h, linux/version.h, asm/page.h, the generated autoconf.h and asm-offsets.h
and about 140 more (measured with strace on this VM kind, with Debian's 6.12 headers), plus
the one header our sources name, uapi/linux/ptrace.h.

How: copy Debian's split headers (build/ with the generated files, source/ with the rest)
into ONE symlink-farm directory, because bcc 0.26's $BCC_KERNEL_SOURCE takes a single tree
and then uses the single-tree include flags (src/cc/frontends/clang/kbuild_helper.cc:
-Iarch/<arch>/include -Iarch/<arch>/include/generated -Iinclude ... -include
./include/linux/kconfig.h, relative to that directory); compile every nptrace program with
every switch on, and the `doctor` trial programs, under strace; copy exactly the files the
compile opened (dereferenced) into the output tree. The list is what the compiler read, not a
guess: a header our sources or bcc start to need shows up the next time the tree is made.

Where: at image build (deploy/Containerfile, against Debian's linux-headers-<arch>) and by
scripts/setup.sh, into /usr/share/nptrace/kheaders (kernel/headers.py SHIPPED). About 150
files, under 2 MB. The compile also creates the maps, which fails without CAP_BPF (as in an
image build): that is fine, the headers are read before; a compiler error is not.

    python -m nptrace.kernel.headertree OUT [--from /usr/src/linux-headers-X-amd64]

The pure parts (split-tree discovery, strace parsing) are unit-tested; generation is tested
by tests/privileged/test_no_node_headers.py, which hides /lib/modules and /usr/src.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# A clang diagnostic from the compile itself (file:line:col: error:), as opposed to bcc's
# "could not open bpf map: ..., error: Operation not permitted" from map creation.
_COMPILE_ERROR = re.compile(r":\d+:\d+: (?:fatal )?error:")
# openat(AT_FDCWD, "include/linux/kconfig.h", O_RDONLY|O_CLOEXEC) = 3
_OPENAT = re.compile(r'^(?:\[pid\s+\d+\]\s+|\d+\s+)?openat\((AT_FDCWD|\d+), "([^"]+)", [^)]*\)\s+=\s+(\d+)')


def split_trees(build: Path) -> list[Path]:
    """The directories that make up one kernel's headers, generated (build) first. Debian's
    linux-headers-X-<arch>/Makefile is one line, `include /usr/src/linux-headers-X-common/
    Makefile`: the common tree is the source half. A single tree is its own source."""
    build = Path(build)
    trees = [build]
    try:
        text = (build / "Makefile").read_text()
    except OSError:
        text = ""
    m = re.match(r"\s*include\s+(\S+)/Makefile\s*$", text)
    if m and Path(m.group(1)).is_dir() and Path(m.group(1)).resolve() != build.resolve():
        trees.append(Path(m.group(1)))
    else:
        src = build.parent / "source"
        if (build / "source").is_dir():
            trees.append(build / "source")
        elif src.is_dir() and src.resolve() != build.resolve():
            trees.append(src)
    return trees


def default_build(release: str | None = None) -> Path | None:
    """The node's build tree, else the newest Debian linux-headers-*-<arch> in /usr/src."""
    release = release or os.uname().release
    node = Path("/lib/modules") / release / "build"
    if (node / "include").is_dir():
        return node
    cands = [p for p in Path("/usr/src").glob("linux-headers-*")
             if (p / "include/generated").is_dir()]
    if not cands:
        return None

    def key(p: Path):
        return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", p.name)]
    return sorted(cands, key=key)[-1]


def merge(trees: list[Path], farm: Path) -> None:
    """One directory whose files are symlinks into the trees, the first tree winning."""
    for tree in trees:
        for dirpath, dirnames, filenames in os.walk(tree):
            rel = Path(dirpath).relative_to(tree)
            if rel.parts and rel.parts[0] in ("scripts", "tools", "Documentation"):
                dirnames[:] = []
                continue
            (farm / rel).mkdir(parents=True, exist_ok=True)
            for f in filenames:
                dst = farm / rel / f
                if not dst.exists() and not dst.is_symlink():
                    dst.symlink_to(Path(dirpath, f).resolve())


def opened_under(strace_text: str, top: Path) -> set[str]:
    """Paths relative to `top` that strace saw opened successfully (bcc chdirs into the
    tree and opens relative paths; clang opens absolute ones too)."""
    top = Path(os.path.normpath(top))
    out = set()
    for line in strace_text.splitlines():
        m = _OPENAT.match(line.strip())
        if not m or int(m.group(3)) < 0:
            continue
        p = Path(m.group(2))
        p = Path(os.path.normpath(p if p.is_absolute() else top / p))
        try:
            rel = p.relative_to(top)
        except ValueError:
            continue
        out.add(str(rel))
    return out


def offset_defines(text: str) -> list[str]:
    """-DNPT_OFF_x=0 for every offset macro the sources use: the values are the node's (from
    BTF at run time); the include set does not depend on them."""
    return [f"-D{n}=0" for n in sorted(set(re.findall(r"\bNPT_OFF_\w+", text)))]


def compile_everything() -> int:
    """Compile every nptrace program with every switch on, and doctor's trials. Run with
    BCC_KERNEL_SOURCE set (by generate(), under strace). 0 unless the compiler failed."""
    from nptrace.config import Config
    from nptrace.errors import LoadError
    from nptrace.kernel import loader
    from nptrace.kernel.cflags import build_cflags

    import ipaddress

    from nptrace.config import IfaceSpec, PortRange
    cfg = Config(ports=(PortRange.parse("1"),), hosts=(ipaddress.ip_network("10.0.0.0/8"),),
                 ifaces=(IfaceSpec.parse("lo"),), kprobes=True)
    text = loader.source_text()
    # bcc makes TRACEPOINT_PROBE's argument structs from tracefs format files, which an image
    # build has none of: there the tracepoint programs are left out. The header set is the
    # same either way (bcc's preamble; our programs include only uapi/linux/ptrace.h).
    from nptrace.kernel.evidence import tracepoint_fields
    from nptrace.kernel.features import TRACEPOINTS
    tracefs = next((Path(d) for d in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
                    if Path(d, "events/skb/kfree_skb/format").is_file()), None)
    use_tp = tracefs is not None and not os.environ.get("NPT_HEADERTREE_NO_TP")
    # the running kernel's tracepoints and fields (a 6.1 node has no icmp:icmp_send, and its
    # tcp_send_reset no `reason`): what `run` would compile there
    have = {tp for tp in TRACEPOINTS if use_tp and (tracefs / "events" / tp / "format").is_file()}
    fields = {tp: tracepoint_fields(tracefs, tp) for tp in have} if use_tp else None
    flags = build_cflags(cfg, have, offset_defines(text), fields)
    rc = 0
    try:
        b = loader.compile_families(loader.FAMILIES, flags)
        b.cleanup()
    except LoadError as e:
        detail = e.log_tail or str(e)
        if _COMPILE_ERROR.search(detail) or "Unable to find kernel headers" in detail:
            print(f"headertree: compile failed: {e}\n{detail}", file=sys.stderr)
            rc = 1
    for kind in ("tracepoint", "fentry"):
        loader.trial_load(kind)
    return rc


def generate(out: Path, build: Path | None = None, python: str = sys.executable) -> list[str]:
    """Write the minimal tree to `out` (replaced whole); the relative paths copied."""
    build = build or default_build()
    if build is None:
        raise SystemExit("headertree: no kernel headers to take from: install Debian's "
                         "linux-headers-$(dpkg --print-architecture)")
    if not shutil.which("strace"):
        raise SystemExit("headertree: strace is needed (apt-get install strace)")
    with tempfile.TemporaryDirectory(prefix="npt-kfarm.") as tmp:
        farm = Path(tmp, "tree")
        merge(split_trees(build), farm)
        log = Path(tmp, "strace.log")
        env = dict(os.environ, BCC_KERNEL_SOURCE=str(farm))
        env.pop("BCC_KERNEL_MODULES_SUFFIX", None)
        r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(log),
                            python, "-m", "nptrace.kernel.headertree", "--compile-only"],
                           env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"headertree: compiling against {build} failed:\n{r.stderr[-3000:]}")
        files = sorted(f for f in opened_under(log.read_text(), farm)
                       if (farm / f).is_file())
        if "include/linux/kconfig.h" not in files:
            raise SystemExit("headertree: the compile did not read include/linux/kconfig.h: "
                             f"bcc did not use {farm}\n{r.stderr[-2000:]}")
        staging = Path(str(out) + ".new")
        shutil.rmtree(staging, ignore_errors=True)
        for f in files:
            dst = staging / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(farm / f, dst)
        (staging / "SOURCE").write_text(
            f"nptrace minimal kernel headers: {len(files)} files copied from "
            f"{' + '.join(str(t.resolve()) for t in split_trees(build))}\n"
            "made by python -m nptrace.kernel.headertree (what bcc's compile opened)\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nptrace.kernel.headertree",
                                 description="make nptrace's minimal kernel-header tree")
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--from", dest="build", type=Path,
                    help="a kernel build tree (default: the node's, else the newest in /usr/src)")
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compile_only:
        return compile_everything()
    if a.out is None:
        ap.error("OUT is required")
    files = generate(a.out, a.build)
    size = sum((a.out / f).stat().st_size for f in files)
    print(f"headertree: {len(files)} files, {size // 1024} KiB in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
