"""Run a command under deploy/nptrace.service's own sandbox, where PID 1 is not systemd.

The directives are read from the unit file; each is applied the way systemd.exec(5) says, in
a private mount namespace (`unshare -m --propagation private`):
  ProtectSystem=strict    / read-only, except ReadWritePaths=, StateDirectory= (/var/lib/X),
                          CacheDirectory= (/var/cache/X) and RuntimeDirectory= (/run/X),
                          bound onto themselves first
  PrivateTmp=yes          fresh tmpfs on /tmp and /var/tmp
  ProtectHome=yes         empty read-only tmpfs on /home and /root
  ProtectKernelModules    empty read-only tmpfs on /usr/lib/modules (when set)
  ProtectKernelLogs=yes   /dev/null over /proc/kmsg
  ProtectControlGroups    /sys/fs/cgroup read-only
  CapabilityBoundingSet=  setpriv --bounding-set (and --inh-caps, --ambient-caps cleared)
  NoNewPrivileges=yes     setpriv --no-new-privs
  UMask=, Environment=    umask, env
  Type=notify             NOTIFY_SOCKET (a datagram socket this module reads), WATCHDOG_USEC
                          from WatchdogSec=
Directives with no emulation here are listed in `skipped` (with why), never silently dropped.
Where systemd is PID 1, `systemd_run_argv` gives the `systemd-run --wait -p ...` line instead.

    unit = Unit.parse(Path("deploy/nptrace.service"))
    with Sandbox(unit, state_dir=tmp) as sb:       # sb.notify collects READY=1/WATCHDOG=1
        proc = sb.popen(["nptrace", "run", ...])
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Directives that change nothing a single start can observe here, with the reason.
NOT_EMULATED = {
    "ExecReload": "SIGHUP is sent by the test itself",
    "Restart": "decided by should_restart()", "RestartSec": "decided by should_restart()",
    "RestartPreventExitStatus": "decided by should_restart()",
    "TimeoutStopSec": "the test waits for the stop", "TimeoutStartSec": "the test waits for READY=1",
    "NotifyAccess": "only the main process is started", "LimitMEMLOCK":
    "raising it needs CAP_SYS_RESOURCE (not in this VM's bounding set); Linux 5.11+ charges "
    "BPF memory to the cgroup instead", "MemoryMax": "no cgroup manager", "Nice": "scheduling only",
    "PrivateDevices": "device nodes: nptrace opens none", "ProtectClock": "nptrace sets no clock",
    "ProtectHostname": "nptrace sets no hostname", "RestrictAddressFamilies": "needs seccomp-bpf",
    "RestrictNamespaces": "needs seccomp-bpf", "RestrictRealtime": "needs seccomp-bpf",
    "RestrictSUIDSGID": "needs seccomp-bpf", "LockPersonality": "needs seccomp-bpf",
    "SystemCallArchitectures": "needs seccomp-bpf", "SystemCallFilter": "needs seccomp-bpf",
    "StateDirectoryMode": "applied with StateDirectory", "RuntimeDirectoryMode":
    "applied with RuntimeDirectory", "RuntimeDirectoryPreserve": "the directory is kept",
    "CacheDirectoryMode": "applied with CacheDirectory",
    "TasksMax": "no cgroup manager (the pids controller)",
    "IPAddressAllow": "systemd's cgroup BPF firewall: systemd as the cgroup manager, cgroup v2",
    "IPAddressDeny": "systemd's cgroup BPF firewall: systemd as the cgroup manager, cgroup v2",
    "Description": "", "After": "", "Wants": "", "WantedBy": "",
}
HANDLED = {"Type", "ExecStart", "ProtectSystem", "ReadWritePaths", "StateDirectory", "CacheDirectory",
           "RuntimeDirectory", "PrivateTmp", "ProtectHome", "ProtectKernelModules",
           "ProtectKernelLogs", "ProtectControlGroups", "CapabilityBoundingSet",
           "NoNewPrivileges", "UMask", "Environment", "WatchdogSec"}


def pid1_is_systemd() -> bool:
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


def seconds(v: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|min)?", v.strip())
    if not m:
        raise ValueError(f"time span {v!r} not understood")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, "min": 60, None: 1}[m.group(2)]


@dataclass
class Unit:
    values: dict[str, list[str]]

    @classmethod
    def parse(cls, path: Path) -> "Unit":
        values: dict[str, list[str]] = {}
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";", "[")):
                continue
            k, v = line.split("=", 1)
            values.setdefault(k.strip(), []).append(v.strip())
        return cls(values)

    def get(self, key: str, default: str | None = None) -> str | None:
        v = self.values.get(key)
        return v[-1] if v else default

    def words(self, key: str) -> list[str]:
        return [w for v in self.values.get(key, []) for w in shlex.split(v)]

    def yes(self, key: str) -> bool:
        return (self.get(key) or "no").lower() in ("yes", "true", "1", "on", "strict", "full")

    def exec_start(self) -> list[str]:
        return shlex.split(self.get("ExecStart") or "")

    def should_restart(self, returncode: int) -> bool:
        """Restart=on-failure with RestartPreventExitStatus=: what systemd does after an exit
        (negative returncode: killed by that signal)."""
        if self.get("Restart", "no") != "on-failure":
            return self.get("Restart") in ("always", "on-abnormal") and returncode < 0
        if returncode == 0:
            return False
        prevent = set(self.words("RestartPreventExitStatus"))
        return str(returncode) not in prevent

    def skipped(self) -> dict[str, str]:
        unknown = set(self.values) - HANDLED - set(NOT_EMULATED)
        if unknown:
            raise ValueError(f"unit directives with no emulation decided: {sorted(unknown)}")
        return {k: NOT_EMULATED[k] for k in self.values if k in NOT_EMULATED}

    def writable_paths(self) -> list[str]:
        out = [p.lstrip("-") for p in self.words("ReadWritePaths")]
        out += [f"/var/lib/{d}" for d in self.words("StateDirectory")]
        out += [f"/var/cache/{d}" for d in self.words("CacheDirectory")]
        out += [f"/run/{d}" for d in self.words("RuntimeDirectory")]
        return list(dict.fromkeys(out))

    def bounding_set(self) -> str | None:
        caps = self.words("CapabilityBoundingSet")
        if not caps:
            return None
        return "-all," + ",".join("+" + c.lower().removeprefix("cap_") for c in caps)

    def mount_script(self, binds: dict[str, str]) -> str:
        """The sh commands that build the unit's file-system view in a fresh mount namespace.
        `binds` moves a writable path's host side (e.g. the state directory into a test dir)."""
        sh = ["set -e", "mount --make-rprivate /"]
        bases = {"StateDirectory": "/var/lib", "CacheDirectory": "/var/cache",
                 "RuntimeDirectory": "/run"}
        for key, base in bases.items():
            mode_key = key + "Mode"
            for d in self.words(key):
                p = f"{base}/{d}"
                src = binds.get(p, p)
                mode = self.get(mode_key, "0755")
                sh.append(f"mkdir -p {shlex.quote(src)} && chmod {mode} {shlex.quote(src)}")
        for p in self.writable_paths():
            src = binds.get(p, p)
            sh.append(f"mkdir -p {shlex.quote(p)}; mount --bind {shlex.quote(src)} {shlex.quote(p)}")
        if self.yes("PrivateTmp"):
            # nptrace itself must stay reachable when its checkout or venv is under /tmp (a
            # CI clone): set it aside, mount the fresh /tmp, and bind it back where it was
            keep = _under_tmp()
            for i, k in enumerate(keep):
                sh += [f"mkdir -p /run/npt-keep{i}", f"mount --bind {shlex.quote(k)} /run/npt-keep{i}"]
            sh += ["mount -t tmpfs -o mode=1777 tmpfs /tmp", "mount -t tmpfs -o mode=1777 tmpfs /var/tmp"]
            for i, k in enumerate(keep):
                sh += [f"mkdir -p {shlex.quote(k)}", f"mount --bind /run/npt-keep{i} {shlex.quote(k)}"]
        if self.yes("ProtectHome"):
            sh += [f"[ ! -d {d} ] || mount -t tmpfs -o ro,mode=0755 tmpfs {d}" for d in ("/home", "/root")]
        if self.yes("ProtectKernelModules"):
            sh.append("mount -t tmpfs -o ro,mode=0755 tmpfs /usr/lib/modules")
        if self.yes("ProtectKernelLogs"):
            sh.append("[ ! -e /proc/kmsg ] || mount --bind /dev/null /proc/kmsg")
        if self.yes("ProtectControlGroups"):
            sh.append("for m in $(awk '$3 ~ /^cgroup/ {print $2}' /proc/self/mounts); do "
                      "mount -o remount,bind,ro \"$m\" || true; done")
        if (self.get("ProtectSystem") or "no") == "strict":
            # the whole tree read-only; the writable binds above are mounts of their own and
            # stay writable; API file systems (/proc, /sys, /dev) are not touched by strict
            sh.append("mount -o remount,bind,ro /")
            for p in self.writable_paths():
                sh.append(f"mount -o remount,bind,rw {shlex.quote(p)}")
        return "\n".join(sh)


@dataclass
class Notifications:
    messages: list[tuple[float, str]] = field(default_factory=list)

    def has(self, field_: str) -> bool:
        return any(field_ in m.split("\n") for _, m in self.messages)

    def count(self, field_: str) -> int:
        return sum(field_ in m.split("\n") for _, m in self.messages)


class Sandbox:
    """The unit's environment for one process; a context manager owning the notify socket."""

    def __init__(self, unit: Unit, binds: dict[str, str] | None = None,
                 env: dict[str, str] | None = None):
        self.unit = unit
        self.binds = binds or {}
        self.extra_env = env or {}
        self.notify = Notifications()
        self._dir = tempfile.mkdtemp(prefix="npt-unit-")
        self._sock = None
        self._thread = None

    def __enter__(self) -> "Sandbox":
        if self.unit.get("Type") == "notify":
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.bind(os.path.join(self._dir, "notify"))
            self._sock.settimeout(0.2)
            self._thread = threading.Thread(target=self._listen, daemon=True)
            self._thread.start()
        return self

    def _listen(self) -> None:
        while self._sock is not None:
            try:
                msg = self._sock.recv(4096).decode(errors="replace")
            except socket.timeout:
                continue
            except OSError:
                return
            self.notify.messages.append((time.monotonic(), msg))

    def __exit__(self, *exc) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            s.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
        import shutil
        shutil.rmtree(self._dir, ignore_errors=True)

    def environment(self) -> dict[str, str]:
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "LANG": "C.UTF-8"}
        for v in self.unit.words("Environment"):
            k, _, val = v.partition("=")
            env[k] = val
        if self._sock is not None:
            env["NOTIFY_SOCKET"] = os.path.join(self._dir, "notify")
        wd = self.unit.get("WatchdogSec")
        if wd:
            env["WATCHDOG_USEC"] = str(int(seconds(wd) * 1e6))
        env.update(self.extra_env)
        return env

    def argv(self, command: list[str]) -> list[str]:
        """unshare + mounts + setpriv + umask, then the command."""
        priv = ["setpriv"]
        if self.unit.yes("NoNewPrivileges"):
            priv.append("--no-new-privs")
        bset = self.unit.bounding_set()
        if bset:
            priv += ["--bounding-set", bset, "--inh-caps", "-all", "--ambient-caps", "-all"]
        umask = self.unit.get("UMask", "0022")
        # the notify socket lives in /tmp on the host: PrivateTmp hides it, so it is bound in
        script = self.unit.mount_script(self.binds)
        if self._sock is not None:
            sock = self.environment()["NOTIFY_SOCKET"]
            script = (f"mkdir -p /run/npt-notify; mount -t tmpfs tmpfs /run/npt-notify; "
                      f": >/run/npt-notify/notify; mount --bind {shlex.quote(sock)} /run/npt-notify/notify\n"
                      + script)
        script += f"\numask {umask}\nexec {shlex.join(priv)} -- \"$@\""
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "unit-sandbox",
                *command]

    def popen(self, command: list[str], **kw) -> subprocess.Popen:
        env = self.environment()
        if self._sock is not None:
            env["NOTIFY_SOCKET"] = "/run/npt-notify/notify"
        return subprocess.Popen(self.argv(command), env=env, **kw)

    def wait_ready(self, proc: subprocess.Popen, timeout: float = 90) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.notify.has("READY=1"):
                return
            if proc.poll() is not None:
                raise RuntimeError(f"exited {proc.returncode} before READY=1")
            time.sleep(0.05)
        raise RuntimeError(f"no READY=1 in {timeout}s")


def systemd_run_argv(unit: Unit, command: list[str]) -> list[str]:
    """Where systemd is PID 1: the same directives as transient-unit properties."""
    argv = ["systemd-run", "--wait", "--collect", "--quiet", "--pipe"]
    for k, vs in unit.values.items():
        if k in ("ExecStart", "Description", "After", "Wants", "WantedBy", "ExecReload"):
            continue
        for v in vs:
            argv += ["-p", f"{k}={v}"]
    return argv + ["--", *command]


def _under_tmp() -> list[str]:
    """The project tree and the Python environment running it, where they lie under /tmp or
    /var/tmp (outermost only): what PrivateTmp would hide from the emulated unit."""
    import sys
    roots = sorted({str(Path(__file__).resolve().parents[2]), str(Path(sys.prefix).resolve())})
    tmp = [r for r in roots if r.startswith(("/tmp/", "/var/tmp/"))]
    return [r for r in tmp if not any(r != o and r.startswith(o + "/") for o in tmp)]
