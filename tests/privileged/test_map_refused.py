"""A BPF map the kernel will not create ends `nptrace run` in one line naming the flag that
sized it, exit 2: the event ring of the largest --ring-pages (1 GiB) in a memory cgroup
smaller than that (BPF maps are charged to the memory cgroup since Linux 5.11)."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.privileged
LIMIT = 900 << 20        # room for the compile, not for a 1 GiB ring


def _memory_cgroup() -> Path | None:
    """This process's memory cgroup directory (v2 unified, or v1's memory controller)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, ctrls, path = line.split(":", 2)
        if ctrls == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            if "memory" in Path("/sys/fs/cgroup/cgroup.controllers").read_text().split():
                return Path("/sys/fs/cgroup") / path.lstrip("/")
        if "memory" in ctrls.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return None


@pytest.fixture
def small_cgroup():
    base = _memory_cgroup()
    if base is None or not base.is_dir():
        pytest.skip("no memory cgroup to confine the run in")
    cg = base / f"npt-maptest-{uuid.uuid4().hex[:8]}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e.strerror}")
    limit = cg / ("memory.max" if (cg / "memory.max").exists() else "memory.limit_in_bytes")
    limit.write_text(str(LIMIT))
    try:
        yield cg
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                import time
                time.sleep(0.1)


def test_a_ring_the_kernel_will_not_create_is_one_line_naming_ring_pages(small_cgroup):
    code = (f"import os; open({str(small_cgroup / 'cgroup.procs')!r}, 'w').write(str(os.getpid()));"
            "from nptrace.cli import main; main(['run', '--ring-pages', '262144', '--duration', '1'])")
    p = subprocess.run(["timeout", "300", sys.executable, "-c", code], capture_output=True,
                       text=True, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert len(errors) == 1, p.stderr[-2000:]
    assert "BPF map events" in errors[0] and "lower --ring-pages" in errors[0], errors[0]
