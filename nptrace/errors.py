"""Typed errors. The CLI maps each to one line on stderr and exit code 2 (cli.py, one place)."""
from __future__ import annotations


class NptraceError(Exception):
    """Expected failure: the message says what failed, the likely cause and what to do."""


class LoadError(NptraceError):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


class InterfaceError(NptraceError):
    pass


class LockError(NptraceError):
    pass


PRIVILEGE_HINT = "needs root or CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN: run with sudo"


class FeatureMissing(NptraceError):
    """A kernel feature is absent. Message format of cilium/ebpf internal/feature.go."""

    def __init__(self, name: str, min_kernel: str | None, hint: str = ""):
        need = f">= {min_kernel}" if min_kernel else "kernel support"
        super().__init__(f"{name} not supported (requires {need})" + (f": {hint}" if hint else ""))
        self.name, self.min_kernel, self.hint = name, min_kernel, hint


class PrivilegeError(NptraceError):
    def __init__(self, message: str = PRIVILEGE_HINT):
        super().__init__(message)
