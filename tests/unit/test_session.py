"""Session files: framing, torn tails, corruption, rotation, the size cap, modes (no root)."""
import errno
import os
import stat
import zlib

import pytest

from nptrace import events as ev
from nptrace.sessions import format as S
from nptrace.reasons import ReasonTable


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def raw(i=0, **kw):
    kw.setdefault("type", ev.EvType.RST_RECV)
    kw.setdefault("hook", ev.Hook.TCP_RECV_RST)
    return ev.encode(ts_ns=1_000 + i, saddr="10.0.0.1", sport=1000 + i, daddr="10.0.0.2",
                     dport=80, **kw)


def header(**kw):
    return S.make_header(epoch_offset_ns=1_700_000_000 * 10**9,
                         drops=ReasonTable({16: "SKB_DROP_REASON_IP_RPFILTER"}, "SKB_DROP_REASON_"),
                         resets=ReasonTable({1: "SK_RST_REASON_NO_SOCKET"}, "SK_RST_REASON_"),
                         features={"ringbuf": True}, ifnames={4026531840: {2: "eth0"}},
                         node="node-a", kernel="6.18.0", **kw)


def writer(d, clock=None, **kw):
    kw.setdefault("header", header())
    logs = []
    w = S.SessionWriter(d, clock=clock or Clock(), log=logs.append, **kw)
    w.logs = logs
    return w


def records(path):
    headers, recs, problems = S.read_session(path)
    return headers, list(recs), problems


def test_roundtrip_header_and_every_record_kind(tmp_path):
    d = tmp_path / "rec"
    w = writer(d)
    w.write_event(raw(1))
    w.write_names({4026531840: {3: "eth1"}})
    w.write_services([("10.0.0.2", 30080, "default/web:http")])
    w.write_counters({(1, 1, 16, 2, 4026531840): 5}, {"emitted": 4, "lost": 1, "filtered": 0}, ts_ns=77)
    w.write_event(raw(2) + b"\0" * 8)       # perf samples come padded: stored as the record
    w.close()
    headers, recs, problems = records(d)
    assert problems == []
    [h] = headers
    assert h["node"] == "node-a" and h["kernel"] == "6.18.0" and h["abi"] == ev.ABI_VERSION
    assert h["drop_reasons"] == {16: "IP_RPFILTER"} and h["rst_reasons"] == {1: "NO_SOCKET"}
    assert h["ifnames"] == {4026531840: {2: "eth0"}} and h["features"] == {"ringbuf": True}
    assert h["epoch_offset_ns"] == 1_700_000_000 * 10**9 and h["part"] == 0 and h["run_id"]
    assert [r.kind for r in recs] == ["event", "names", "services", "counters", "event"]
    e0 = recs[0].data
    assert e0 == {"abi": ev.ABI_VERSION, "type": int(ev.EvType.RST_RECV), "raw": raw(1)}
    assert len(recs[4].data["raw"]) == ev.SIZE
    assert recs[1].data["ifnames"] == {4026531840: {3: "eth1"}}
    assert recs[2].data["services"] == [["10.0.0.2", 30080, "default/web:http"]]
    assert recs[3].data == {"ts_ns": 77, "counts": [[1, 1, 16, 2, 4026531840, 5]],
                            "stats": {"emitted": 4, "lost": 1, "filtered": 0}}


def test_modes_file_0600_created_dir_0700(tmp_path):
    old = os.umask(0)
    try:
        d = tmp_path / "rec"
        w = writer(d)
        w.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    [f] = S.session_files(d)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600


def test_existing_directory_of_ours_is_tightened_to_0700(tmp_path):
    """A 0755 directory of ours, as the kubelet creates a hostPath, is tightened (the files hold
    client addresses); a shared one (/tmp) is refused."""
    tmp_path.chmod(0o755)
    w = writer(tmp_path)
    w.close()
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in S.session_files(tmp_path))


def test_shared_directory_is_refused_not_chmodded(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(S.SessionError, match="shared directory"):
        writer(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert os.listdir(shared) == []


def test_directory_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(S.SessionError, match="symbolic link"):
        writer(tmp_path / "link")
    assert os.listdir(tmp_path / "real") == []


def _stop_len(f) -> int:
    """Bytes of the stop record a clean close ends a file with."""
    data = f.read_bytes()
    off = 0
    while True:
        n = S.FRAME.size + S.FRAME.unpack_from(data, off)[1]
        if off + n == len(data):
            return n
        off += n


def _one_file(d):
    [f] = S.session_files(d)
    return f


@pytest.mark.parametrize("cut", [1, 7, 12, 100])
def test_torn_tail_loses_only_the_last_record(tmp_path, cut):
    w = writer(tmp_path)
    for i in range(5):
        w.write_event(raw(i))
    w.close()
    f = _one_file(tmp_path)
    size = f.stat().st_size - _stop_len(f)    # cut into the last event, behind the stop
    os.truncate(f, size - cut)
    _, recs, problems = records(f)
    assert [r.data["raw"] for r in recs] == [raw(i) for i in range(4)]
    [p] = problems
    frame_len = S.FRAME.size + len(S._pack({"rec": "event", "abi": 1, "type": 3, "raw": raw(4)}))
    assert p.kind == "torn_tail" and not p.serious
    assert p.offset == size - frame_len and p.dropped == frame_len - cut
    assert f"torn tail at byte {p.offset}: {p.dropped} bytes dropped" in str(p)


def test_zero_filled_tail_after_power_loss_is_a_torn_tail(tmp_path):
    w = writer(tmp_path)
    for i in range(3):
        w.write_event(raw(i))
    w.close()
    f = _one_file(tmp_path)
    size = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(b"\0" * 4096)
    _, recs, problems = records(f)
    assert len(recs) == 3
    assert [(p.kind, p.offset, p.dropped) for p in problems] == [("torn_tail", size, 4096)]


def test_corrupt_middle_is_serious_and_reading_resumes(tmp_path):
    w = writer(tmp_path)
    for i in range(5):
        w.write_event(raw(i))
    w.close()
    f = _one_file(tmp_path)
    _, recs, _ = records(f)
    target = recs[2].offset
    data = bytearray(f.read_bytes())
    data[target + S.FRAME.size + 20] ^= 0xFF         # a payload byte: the crc fails
    f.write_bytes(bytes(data))
    _, recs2, problems = records(f)
    assert [r.data["raw"] for r in recs2] == [raw(i) for i in (0, 1, 3, 4)]
    [p] = problems
    assert p.kind == "corrupt" and p.serious and p.offset == target
    assert f"corrupt record at byte {target}" in str(p)


def test_not_a_session(tmp_path):
    f = tmp_path / "x.nps"
    f.write_bytes(b"hello, this is not a session\n" * 10)
    with pytest.raises(S.SessionError, match="not an nptrace session file"):
        S.read_session(f)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(S.SessionError, match="not an nptrace session"):
        S.read_session(empty)
    # A frame with a valid crc but a foreign payload is not a session either.
    payload = b"\x93\x01\x02\x03"
    (tmp_path / "y").write_bytes(S.FRAME.pack(S.MAGIC, len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(S.SessionError, match="bad first record"):
        S.read_session(tmp_path / "y")
    with pytest.raises(S.SessionError, match="no such file"):
        S.read_session(tmp_path / "missing")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(S.SessionError, match="no session files"):
        S.read_session(tmp_path / "emptydir")


def test_stray_file_in_directory_is_a_problem_not_a_crash(tmp_path):
    w = writer(tmp_path)
    w.write_event(raw(1))
    w.close()
    (tmp_path / "nptrace-00000000T000000Z-bogus-00000.nps").write_bytes(b"garbage" * 10)
    headers, recs, problems = records(tmp_path)
    assert len(headers) == 1 and len(recs) == 1
    assert [p.kind for p in problems] == ["not_session"] and problems[0].serious


def test_newer_format_is_refused(tmp_path):
    w = writer(tmp_path, header=dict(header(), format_version=S.FORMAT_VERSION + 1))
    w.close()
    with pytest.raises(S.SessionError, match="newer than this nptrace reads"):
        S.read_session(_one_file(tmp_path))


def test_other_abi_is_reported(tmp_path):
    w = writer(tmp_path, header=dict(header(), abi=ev.ABI_VERSION + 1))
    w.write_event(raw(1))
    w.close()
    _, recs, problems = records(tmp_path)
    assert recs == [] and [p.kind for p in problems] == ["abi"]
    assert "ABI" in str(problems[0])


def test_rotation_by_size_keeps_every_record_in_order(tmp_path):
    w = writer(tmp_path, max_file_bytes=8192, max_total_bytes=1 << 30)
    for i in range(200):
        w.write_event(raw(i))
    w.close()
    files = S.session_files(tmp_path)
    assert len(files) > 5
    assert all(f.stat().st_size <= 8192 for f in files)
    headers, recs, problems = records(tmp_path)
    assert problems == [] and len(headers) == len(files)
    assert [h["part"] for h in headers] == list(range(len(files)))
    assert len({h["run_id"] for h in headers}) == 1
    assert [r.data["raw"] for r in recs] == [raw(i) for i in range(200)]


def test_rotated_headers_carry_cumulative_names(tmp_path):
    w = writer(tmp_path, max_file_bytes=8192)
    w.write_names({4026531840: {3: "eth1"}})
    w.write_services([("10.0.0.2", 30080, "default/web")])
    for i in range(100):
        w.write_event(raw(i))
    w.close()
    headers, _, _ = records(tmp_path)
    last = headers[-1]
    assert last["part"] > 0
    assert last["ifnames"] == {4026531840: {2: "eth0", 3: "eth1"}}
    assert last["services"] == [["10.0.0.2", 30080, "default/web"]]


def test_rotation_by_age_and_reopen(tmp_path):
    clock = Clock()
    w = writer(tmp_path, clock=clock, max_age_s=60)
    w.write_event(raw(1))
    clock.t += 30
    w.tick()
    assert len(S.session_files(tmp_path)) == 1
    clock.t += 31
    w.tick()
    assert len(S.session_files(tmp_path)) == 2
    w.reopen()                              # SIGHUP: only a flag until the next tick/write
    assert len(S.session_files(tmp_path)) == 2
    w.write_event(raw(2))
    assert len(S.session_files(tmp_path)) == 3
    w.close()
    _, recs, problems = records(tmp_path)
    assert problems == [] and len(recs) == 2


def test_total_cap_deletes_oldest_never_the_current(tmp_path):
    w = writer(tmp_path, max_file_bytes=8192, max_total_bytes=8192 * 3)
    for i in range(400):
        w.write_event(raw(i))
    files = S.session_files(tmp_path)
    assert sum(f.stat().st_size for f in files) <= 8192 * 3
    assert w.path in files and w.deleted
    assert all(p not in files for p in w.deleted)
    w.close()
    headers, recs, problems = records(tmp_path)
    assert problems == []
    # What is left is the newest records, contiguous, ending at the last one written.
    got = [ev.decode(r.data["raw"]).sport - 1000 for r in recs]
    assert got == list(range(got[0], 400)) and got[0] > 0
    assert headers[0]["part"] > 0


def test_flushed_within_the_interval_without_close(tmp_path):
    clock = Clock()
    w = writer(tmp_path, clock=clock)
    w.write_event(raw(1))
    _, recs, _ = records(tmp_path)
    assert recs == []                       # still buffered
    clock.t += S.FLUSH_INTERVAL_S
    w.tick()
    _, recs, problems = records(tmp_path)
    assert len(recs) == 1 and problems == []
    w.close()


def test_big_bursts_flush_by_size(tmp_path):
    w = writer(tmp_path)
    n = S.FLUSH_BYTES // 200 + 10
    for i in range(n):
        w.write_event(raw(i % 60000))
    _, recs, _ = records(tmp_path)
    assert len(recs) > 0
    w.close()


def test_write_error_pauses_then_resumes(tmp_path, monkeypatch):
    clock = Clock()
    w = writer(tmp_path, clock=clock)
    w.write_event(raw(1))
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    clock.t += 1
    w.write_event(raw(2))                   # due for a flush: fails, recording pauses
    assert w.fd is None and w.dropped == 2
    assert any("No space left on device" in m and "paused" in m for m in w.logs)
    w.write_event(raw(3))
    assert w.dropped == 3
    monkeypatch.setattr(os, "write", real_write)
    clock.t += S.RETRY_S
    w.write_event(raw(4))
    w.close()
    assert any("resumed" in m for m in w.logs)
    headers, recs, problems = records(tmp_path)
    assert [ev.decode(r.data["raw"]).sport for r in recs] == [1004]
    assert len(headers) == 2


@pytest.mark.parametrize("kw,msg", [
    (dict(max_file_bytes=100), "too small"),
    (dict(max_file_bytes=1 << 20, max_total_bytes=1 << 19), "below the file size"),
    (dict(max_age_s=0), "age limit"),
])
def test_bad_limits(tmp_path, kw, msg):
    with pytest.raises(S.SessionError, match=msg):
        writer(tmp_path, **kw)


def test_record_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(S.SessionError, match="not a directory"):
        writer(f)


def test_a_burst_is_written_whole(tmp_path):
    """A burst of records is on disk, in order, after close (its speed is a bench row)."""
    w = writer(tmp_path, max_file_bytes=64 << 20)
    n = 20000
    for i in range(n):
        w.write_event(raw(i % 1000))
    w.close()
    _, recs, problems = records(tmp_path)
    assert not problems and len(recs) == n
