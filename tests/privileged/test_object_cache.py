"""The compiled-object cache for real (kernel/objcache.py, kernel/bpfobject.py): the first
start compiles and writes the object, the next loads it without compiling, and the object
loaded from the cache counts and records real resets as the compiled one does. A damaged
entry or one another user could have written is not loaded: the start compiles and says why.
`nptrace run` names where its object came from."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from nptrace.kernel import objcache
from nptrace.kernel import ringbuf as rb

from loopback import CLOSED_PORT, GENERATOR, TRACEPOINTS, loopback_netns  # noqa: E402

pytestmark = pytest.mark.privileged


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv(objcache.ENV, str(d))
    return d


def _probes():
    from nptrace import reasons
    from nptrace.config import Config
    from nptrace.kernel import btf, offsets
    from nptrace.kernel.loader import Probes
    b = btf.default()
    drops, _ = reasons.load_tables(b)
    return Probes(Config(), offsets.cflags(b), drops, TRACEPOINTS)


def _resets_seen(probes, ns: str, inode: int, n: int = 50) -> tuple[int, int]:
    """(RST_SENT counted in the namespace, records read from the ring) for n refused connects."""
    from nptrace import events as ev
    with rb.RingReader(probes.ring_map_fd()) as reader:
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", GENERATOR, str(n),
                            str(CLOSED_PORT)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and int(r.stdout) == n, r.stderr
        counted, records, deadline = 0, 0, time.monotonic() + 10
        while time.monotonic() < deadline:
            records += sum(1 for t in reader.read_batch()
                           if ev.from_tuple(t).netns == inode)
            counted = sum(c for (typ, _h, _r, _i, netns), c in probes.counts().items()
                          if netns == inode and typ == ev.EvType.RST_SENT)
            if counted >= n and records >= 2 * n:
                break
            time.sleep(0.05)
    return counted, records


def test_second_load_comes_from_the_cache_and_traces_alike(cache):
    with loopback_netns("npt-oc") as (ns, inode):
        first = _probes()
        try:
            assert first.origin == "compiled" and first.notes == []
            entries = list(cache.glob("*" + objcache.SUFFIX))
            assert len(entries) == 1
            assert oct(cache.stat().st_mode & 0o777) == "0o700"
            assert entries[0].stat().st_mode & 0o077 == 0
            compiled = _resets_seen(first, ns, inode)
        finally:
            first.close()
        t0 = time.monotonic()
        second = _probes()
        took = time.monotonic() - t0
        try:
            assert second.origin == "cache", second.notes
            assert second.attached == first.attached
            cached = _resets_seen(second, ns, inode)
        finally:
            second.close()
    # every reset counted, and each connect's two records (sent, received) in the ring, both ways
    assert compiled[0] == cached[0] == 50, (compiled, cached)
    assert compiled[1] >= 100 and cached[1] >= 100, (compiled, cached)
    print(f"\nload from the cache: {took:.2f} s")


def test_damaged_or_foreign_entries_are_compiled_again(cache):
    _probes().close()
    [entry] = cache.glob("*" + objcache.SUFFIX)
    entry.write_bytes(entry.read_bytes()[:-40])          # cut short
    p = _probes()
    try:
        assert p.origin == "compiled"
        assert any("unusable" in n and "digest" in n for n in p.notes), p.notes
    finally:
        p.close()
    assert _probes_origin() == "cache"                  # written again, whole
    os.chmod(entry, 0o666)
    p = _probes()
    try:
        assert p.origin == "compiled"
        assert any("writable by group or others" in n for n in p.notes), p.notes
    finally:
        p.close()


def _probes_origin() -> str:
    p = _probes()
    try:
        return p.origin
    finally:
        p.close()


def test_run_says_where_its_object_came_from(cache, tmp_path):
    env = dict(os.environ, **{objcache.ENV: str(cache)})
    origins = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "nptrace.cli", "run", "--json",
                            "--duration", "0.2"], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-800:]
        line = next(ln for ln in r.stderr.splitlines() if "attached " in ln)
        origins.append(line.split("(BPF object ", 1)[1].split(";", 1)[0])
    assert origins == ["compiled", "cache"]
    env[objcache.ENV] = "off"
    r = subprocess.run([sys.executable, "-m", "nptrace.cli", "run", "--json", "--duration",
                        "0.2"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "(BPF object compiled;" in r.stderr, r.stderr[-800:]


def test_a_refused_program_shows_the_verifiers_log():
    """bpfobject.load_program: the verifier's words reach fd 2 (where the callers capture
    them, as they do bcc's) and the error names the program, as bcc's load_func does."""
    import struct

    from nptrace.kernel import bpfobject
    from nptrace.kernel.compilelog import capture_stderr
    exit_only = struct.pack("<BBhi", 0x95, 0, 0, 0)     # r0 never set
    with capture_stderr() as log:
        with pytest.raises(Exception, match=r"Failed to load BPF program b'npt_bad'"):
            bpfobject.load_program("npt_bad", 5, exit_only, b"GPL", 0)   # a tracepoint program
    assert "R0 !read_ok" in log["text"], log["text"]
