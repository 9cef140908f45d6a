"""Fixtures of the privileged tests (root, BPF, network namespaces)."""
import pytest

from loopback import need_root_and_bcc


@pytest.fixture(scope="session")
def root_and_bcc():
    """Skip, with the reason, where BPF cannot be loaded (not root, bcc not importable)."""
    need_root_and_bcc()


@pytest.fixture(scope="session")
def shipped_headers():
    """nptrace's minimal kernel-header tree where the unit and the tracer look for it
    (kernel/headers.py SHIPPED, made by scripts/setup.sh); made here when it is missing."""
    import subprocess
    import sys

    from nptrace.kernel import headers, headertree
    need_root_and_bcc()
    if not (headers.SHIPPED / "include/linux/kconfig.h").is_file():
        if headertree.default_build() is None:
            pytest.skip("no kernel headers on this machine to make the minimal tree from")
        r = subprocess.run([sys.executable, "-m", "nptrace.kernel.headertree", str(headers.SHIPPED)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return headers.SHIPPED
