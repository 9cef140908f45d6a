"""Fixtures of the privileged tests (root, BPF, network namespaces)."""
import pytest

from loopback import need_root_and_bcc


@pytest.fixture(scope="session")
def root_and_bcc():
    """Skip, with the reason, where BPF cannot be loaded (not root, bcc not importable)."""
    need_root_and_bcc()
