"""Errors of the repro lab. The CLI turns them into one-line messages."""


class LabError(Exception):
    """A lab operation failed; the message says what and what to do."""


class UsageError(LabError):
    """The caller asked for something that does not exist (unknown scenario, backend, variant)."""


class NotRoot(LabError):
    """Namespaces and rules need CAP_SYS_ADMIN and CAP_NET_ADMIN."""


class NotUp(LabError):
    """The scenario is not up under this prefix."""


class HostBusy(LabError):
    """A scenario that changes a host-wide setting cannot come up safely now (the machine's own
    use of it, or another lab holding it)."""


class NotRunnable(LabError):
    """This machine cannot run the scenario at all (its kernel lacks what the scenario's
    backend needs): the yardstick reports it in one line and skips it, not a failure."""
