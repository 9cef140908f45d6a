"""Files nptrace writes as root never follow what another user planted:
--pcap through a symbolic link or onto someone else's file is refused with one line and exit
2; a session directory of another user's is refused; the size cap deletes only files that
start with a session header, never a foreign file or a link named like ours. Root: the
"other user" is nobody (65534), whose files these tests create with chown."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nptrace import events as ev
from nptrace.sessions import format as S

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files of another uid)")


def _nptrace(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["timeout", "60", sys.executable, "-c",
                           "import sys; from nptrace.cli import main; main(sys.argv[1:])", *args],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _session(d: Path) -> None:
    w = S.SessionWriter(d, header=S.make_header(epoch_offset_ns=0, node="n", kernel="k"),
                        log=lambda m: None)
    w.write_event(ev.encode(ts_ns=1, type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST,
                            saddr="10.0.0.1", sport=1, daddr="10.0.0.2", dport=2))
    w.close()


@pytest.fixture
def shared(tmp_path):
    """A /tmp-like directory: world-writable and sticky."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    tmp_path.chmod(0o755)
    return d


def test_pcap_through_a_planted_symlink_is_refused(tmp_path, shared):
    _session(tmp_path / "rec")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = shared / "out.pcapng"
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    p = _nptrace("replay", str(tmp_path / "rec"), "--json", "--pcap", str(link))
    assert p.returncode == 2, p.stderr
    [line] = p.stderr.strip().splitlines()
    assert line.startswith("nptrace: error: ") and "out.pcapng" in line, line
    assert victim.read_text() == "precious\n"


def test_pcap_onto_another_users_file_is_refused(tmp_path, shared):
    _session(tmp_path / "rec")
    theirs = shared / "out.pcapng"
    theirs.write_text("theirs\n")
    os.chown(theirs, NOBODY, NOBODY)
    theirs.chmod(0o644)
    p = _nptrace("replay", str(tmp_path / "rec"), "--json", "--pcap", str(theirs))
    assert p.returncode == 2, p.stderr
    [line] = p.stderr.strip().splitlines()
    assert "belongs to uid 65534" in line
    assert theirs.read_text() == "theirs\n"


def test_pcap_of_our_own_file_is_written(tmp_path):
    _session(tmp_path / "rec")
    out = tmp_path / "out.pcapng"
    out.write_text("old\n")
    p = _nptrace("replay", str(tmp_path / "rec"), "--json", "--pcap", str(out))
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:4] == b"\x0a\x0d\x0d\x0a"


def test_session_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(S.SessionError, match="owned by uid 65534"):
        S.SessionWriter(d, log=lambda m: None)
    assert os.listdir(d) == []


def test_session_directory_planted_as_a_link_is_refused(tmp_path, shared):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = shared / "rec"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(S.SessionError, match="symbolic link"):
        S.SessionWriter(link, log=lambda m: None)
    assert os.listdir(target) == []


def test_size_cap_deletes_only_what_nptrace_wrote(tmp_path):
    d = tmp_path / "rec"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 2000)
    old = "nptrace-20000101T000000Z-"       # sorts before every file the writer makes
    foreign = d / f"{old}aaaaaaaaaaaa-00000.nps"
    foreign.write_bytes(b"not a session" * 1000)
    theirs = d / f"{old}bbbbbbbbbbbb-00000.nps"
    theirs.write_bytes(b"x" * 9000)
    os.chown(theirs, NOBODY, NOBODY)
    link = d / f"{old}cccccccccccc-00000.nps"
    link.symlink_to(victim)
    w = S.SessionWriter(d, max_file_bytes=8192, max_total_bytes=8192 * 3, log=lambda m: None)
    for i in range(600):
        w.write_event(ev.encode(ts_ns=i, type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST,
                                saddr="10.0.0.1", sport=i, daddr="10.0.0.2", dport=2))
    w.close()
    assert w.deleted                                  # the cap did delete (its own files)
    assert foreign.exists() and theirs.exists() and link.is_symlink()
    assert victim.read_bytes() == b"precious" * 2000
    assert all(p.name.startswith("nptrace-") and p not in (foreign, theirs, link)
               for p in w.deleted)
