"""nptrace.kernel.nfhook without root: what a bad namespace says before any bpf() call."""
from __future__ import annotations

import errno

import pytest

from nptrace.kernel import nfhook


def test_unknown_namespace_is_a_clear_error():
    with pytest.raises(nfhook.NfHookError, match="cannot enter network namespace "
                                                 "'npt-no-such-ns'") as e:
        nfhook.link_create(0, nfhook.HookPoint(nfhook.NFPROTO_IPV4, *nfhook.AFTER_SNAT),
                           "npt-no-such-ns")
    assert e.value.errno == errno.ENOENT
