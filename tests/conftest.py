"""Test markers: privileged tests load BPF or build network namespaces. They run wherever the
process can (CI runs as root) and skip, with the reason printed, only where it cannot.

Under pytest-xdist (`make test`: -n 2) the privileged tests are one scope, run one after
another by one worker: they share the node's instance lock, its conntrack limits and its
tracepoints. The unit tests, which touch no kernel state, run on the other, with the few
privileged modules of BESIDE."""
import os

import pytest


def has_bpf_caps() -> bool:
    try:
        from nptrace.kernel.evidence import has_bpf_caps as probe
        return probe()
    except ImportError:
        return os.geteuid() == 0


# Privileged modules that start no traced run (no instance lock), bring up no lab and change
# nothing host-wide, each in namespaces of its own: they may run beside the others, on the
# worker of the unit tests.
BESIDE = ("/privileged/test_enrichment_compile.py", "/privileged/test_rules_source.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with every privileged test in one scope, so one worker runs
    them all, in order (but BESIDE's, a scope each). (xdist's own `loadgroup` marks do not
    take effect under this pytest: its workers never see the group in the node ids.)"""
    from xdist.scheduler import LoadScopeScheduling

    class PrivilegedTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::")[0]
            if module.endswith(BESIDE):
                return module
            return "privileged" if "/privileged/" in nodeid else nodeid
    return PrivilegedTogether(config, log)


def pytest_collection_modifyitems(config, items):
    reason = None if has_bpf_caps() else "needs root (CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN)"
    for item in items:
        if "/privileged/" in str(item.fspath):
            item.add_marker(pytest.mark.privileged)
        if reason and "privileged" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
