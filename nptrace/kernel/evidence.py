"""The file evidence nptrace/kernel/features.py probes from: plain reads under `root`.

Every reader here is a file read under `root` (only find_tracefs may run `mount`, and only on
the real root), so unit tests point `root` at a fixture tree (tests/fixtures/features/<case>/).
features.py decides what each answer means for a probe; this module only reads.

Evidence used, besides the paths named per probe: the kernel config (/proc/config.gz, or
/boot/config-<release>), and module lists (/proc/modules, /sys/module/<m>,
/lib/modules/<release>/modules.builtin and modules.dep). A kernel built without module support
has no /proc/modules, so built-in code without parameters (sch_ingress, nf_tables) is visible
only in the config.
"""
from __future__ import annotations

import gzip
import re
import subprocess
from pathlib import Path

__all__ = [
    "TRACEFS_MOUNT",
    "caps_detail",
    "caps_ok",
    "config_on",
    "exists",
    "find_ipvs",
    "find_kprobes",
    "find_netfilter_backend",
    "find_tracefs",
    "has_bpf_caps",
    "kernel_config",
    "kernel_version",
    "module_evidence",
    "parse_int",
    "read_cap_eff",
    "read_text",
    "tracepoint_fields",
]

# uapi/linux/capability.h. CAP_PERFMON and CAP_BPF exist from 5.8 (commit a17b53c4a4b5).
CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 12, 21, 38, 39
_CAP_NAMES = {CAP_NET_ADMIN: "CAP_NET_ADMIN", CAP_SYS_ADMIN: "CAP_SYS_ADMIN",
              CAP_PERFMON: "CAP_PERFMON", CAP_BPF: "CAP_BPF"}

TRACEFS_MOUNT = "mount -t tracefs nodev /sys/kernel/tracing"


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except (OSError, ValueError):
        return None


def exists(path: Path) -> bool | None:
    """None when a parent is unreadable (tracefs is mode 0700: non-root cannot look)."""
    try:
        path.stat()
    except PermissionError:
        return None
    except (OSError, ValueError):
        return False
    return True


def parse_int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def kernel_version(release: str) -> tuple[int, int, int] | None:
    """'6.18.44-fc-v857' -> (6, 18, 44); '5.4.0-150-generic' -> (5, 4, 0)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", release.strip())
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def kernel_config(root: Path, release: str) -> dict[str, str]:
    """CONFIG_* -> 'y'/'m'/value/'n'; empty when the kernel publishes no config."""
    candidates = [root / "proc/config.gz"]
    if release:
        candidates.append(root / "boot" / f"config-{release}")
    for path in candidates:
        try:
            data = path.read_bytes()
            if path.suffix == ".gz":
                data = gzip.decompress(data)
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        cfg: dict[str, str] = {}
        for line in data.decode(errors="replace").splitlines():
            if line.startswith("CONFIG_"):
                key, _, value = line.partition("=")
                cfg[key] = value.strip('"')
            elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
                cfg[line[2:-len(" is not set")]] = "n"
        return cfg
    return {}


def config_on(cfg: dict[str, str], sym: str) -> bool | None:
    if not cfg:
        return None
    return cfg.get(sym, "n") in ("y", "m")


def module_evidence(root: Path, release: str, name: str) -> tuple[bool | None, str]:
    """Is module `name` loaded, built in or installed? (evidence, where it was seen)."""
    looked = False
    mods = read_text(root / "proc/modules")
    if mods is not None:
        looked = True
        if any(line.split(" ", 1)[0] == name for line in mods.splitlines()):
            return True, "loaded"
    if exists(root / "sys/module" / name):
        return True, f"/sys/module/{name}"
    if release:
        pattern = re.compile(rf"(^|/){re.escape(name)}\.ko(\.[a-z]+)?(:|$)", re.M)
        for fname, how in (("modules.builtin", "built in"), ("modules.dep", "module available")):
            text = read_text(root / "lib/modules" / release / fname)
            if text is not None:
                looked = True
                if pattern.search(text):
                    return True, how
    return (False if looked else None), ""


def read_cap_eff(root: Path) -> int | None:
    text = read_text(root / "proc/self/status")
    if text is None:
        return None
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", text, re.M)
    return int(m.group(1), 16) if m else None


def caps_ok(cap_eff: int | None, version: tuple[int, int, int] | None) -> bool:
    if cap_eff is None:
        return False
    if cap_eff >> CAP_SYS_ADMIN & 1:
        return True
    # Before 5.8 there is no CAP_BPF/CAP_PERFMON: only CAP_SYS_ADMIN loads tracing programs.
    if version is not None and version < (5, 8, 0):
        return False
    return all(cap_eff >> c & 1 for c in (CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN))


def has_bpf_caps(root: Path = Path("/")) -> bool:
    """CapEff of this process allows loading and attaching our programs."""
    root = Path(root)
    return caps_ok(read_cap_eff(root),
                   kernel_version(read_text(root / "proc/sys/kernel/osrelease") or ""))


def caps_detail(cap_eff: int | None) -> str:
    if cap_eff is None:
        return "CapEff unreadable in /proc/self/status"
    have = [n.removeprefix("CAP_") for c, n in sorted(_CAP_NAMES.items()) if cap_eff >> c & 1]
    return f"CapEff {cap_eff:#x}: " + (" ".join(have) if have else "none of SYS_ADMIN BPF PERFMON NET_ADMIN")


def tracepoint_fields(tracefs: Path, tp: str) -> tuple[str, ...]:
    """Field names of tracepoint 'cat/name' from its format file, without common_* fields."""
    text = read_text(Path(tracefs) / "events" / tp / "format")
    if text is None:
        return ()
    names = []
    for m in re.finditer(r"field:([^;]*);", text):
        decl = m.group(1).strip()
        name = re.sub(r"\[.*?\]", "", decl.split()[-1]) if decl else ""
        if name and not name.startswith("common_"):
            names.append(name)
    return tuple(names)


def find_tracefs(root: Path, mount: bool) -> tuple[Path | None, str]:
    # /sys/kernel/tracing since 4.1; older systems only have it inside debugfs (retis
    # core/inspect/kernel.rs looks in the same order).
    candidates = [root / "sys/kernel/tracing", root / "sys/kernel/debug/tracing"]
    unreadable = None
    for path in candidates:
        seen = exists(path / "events")
        if seen:
            return path, str(Path("/") / path.relative_to(root))
        if seen is None:
            unreadable = path
    if unreadable is not None:
        return unreadable, "unreadable (mode 0700: not root)"
    if mount and root == Path("/"):
        target = candidates[0]
        r = subprocess.run(["mount", "-t", "tracefs", "nodev", str(target)],
                           capture_output=True, text=True)
        if r.returncode == 0 and exists(target / "events"):
            return target, f"{target} (mounted by nptrace)"
        err = (r.stderr or r.stdout).strip().splitlines()
        return None, f"not mounted, and `{TRACEFS_MOUNT}` failed: {err[-1] if err else r.returncode}"
    return None, f"not mounted: {TRACEFS_MOUNT}"


def find_kprobes(root: Path, tracefs: Path | None, cfg: dict[str, str]) -> tuple[bool, str]:
    # The kprobe PMU (4.17) and kprobe_events (tracefs) exist only with CONFIG_KPROBES.
    if exists(root / "sys/bus/event_source/devices/kprobe"):
        return True, "/sys/bus/event_source/devices/kprobe"
    if tracefs is not None and exists(tracefs / "kprobe_events"):
        return True, "kprobe_events in tracefs"
    if config_on(cfg, "CONFIG_KPROBES"):
        return True, "CONFIG_KPROBES=y"
    if cfg:
        return False, "CONFIG_KPROBES is not set"
    return False, "no kprobe PMU and no kprobe_events"


def find_netfilter_backend(root: Path, release: str, cfg: dict[str, str]) -> tuple[bool | None, str]:
    nft, where = module_evidence(root, release, "nf_tables")
    if not nft:
        on = config_on(cfg, "CONFIG_NF_TABLES")
        if on is not None:
            nft, where = on, "CONFIG_NF_TABLES"
    names = read_text(root / "proc/net/ip_tables_names")
    legacy = names.split() if names else []
    # nftrace_live names the rule behind a drop with nf_tables tracing; legacy rules log TRACE
    # through nf_log instead, so with them the rule is named from iptables-save alone
    parts = [f"nf_tables ({where}; drops traced to their rule)" if nft else
             ("nf_tables unknown" if nft is None else "no nf_tables: rules named from dumps only")]
    if names is None and exists(root / "proc/net/ip_tables_names"):
        parts.append("legacy iptables unreadable (not root)")
    elif names is None:
        parts.append("no legacy iptables")
    else:
        parts.append("legacy iptables tables: " + (" ".join(legacy) if legacy else "none loaded"))
    present = bool(nft) or names is not None
    if not present and nft is None and exists(root / "proc/net/netfilter"):
        return None, "netfilter present; nf_tables unknown"
    return present, "; ".join(parts)


def find_ipvs(root: Path, release: str, cfg: dict[str, str]) -> tuple[bool, str]:
    table = read_text(root / "proc/net/ip_vs")
    if table is not None:
        services = sum(1 for line in table.splitlines() if line.startswith(("TCP ", "UDP ", "SCTP ")))
        return True, f"/proc/net/ip_vs: {services} virtual services"
    ok, where = module_evidence(root, release, "ip_vs")
    if ok:
        return True, f"ip_vs {where}"
    on = config_on(cfg, "CONFIG_IP_VS")
    if on:
        return True, "CONFIG_IP_VS"
    return False, "CONFIG_IP_VS is not set" if on is False else "no /proc/net/ip_vs, no ip_vs module"
