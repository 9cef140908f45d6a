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


try:  # features.py owns the probe errors; re-exported so callers have one place to import
    from nptrace.features import FeatureMissing, PrivilegeError  # noqa: F401
except ImportError:  # pragma: no cover - only while features.py is absent
    class FeatureMissing(NptraceError):
        def __init__(self, name: str, min_kernel: str):
            super().__init__(f"{name} not supported (requires >= {min_kernel})")
            self.name, self.min_kernel = name, min_kernel

    class PrivilegeError(NptraceError):
        pass
