"""Bad session files through the real entry point (`nptrace replay` / `report`, no root): one
line on stderr, the right exit code, and every intact record still labeled.

A crash (kill -9, power loss) leaves a torn tail: a warning and exit 0. Bytes flipped in the
middle, or a file that is not a session at all, are errors (exit 2), but only after every
readable record was printed: nothing recorded is lost to the error."""
import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from nptrace import cli
from nptrace import events as ev
from nptrace.sessions import format as S
from nptrace.reasons import ReasonTable

E0 = 1_700_000_000 * 10**9
NETNS = 4026531840
N = 8                       # incidents in the crafted session, one event each
RSTS = ReasonTable({1: "SK_RST_REASON_NO_SOCKET"}, "SK_RST_REASON_")


def rst_no_socket(i: int) -> bytes:
    """The pod's kernel answering a SYN on a port nothing listens on: one `no_listener`
    incident per event (2 s apart, longer than the classifier's 1 s hold)."""
    return ev.encode(ts_ns=(i + 1) * 2 * 10**9, type=ev.EvType.RST_SENT,
                     hook=ev.Hook.TCP_SEND_RST, reason=1, ifindex=2, netns=NETNS,
                     saddr="10.244.0.10", sport=8080, daddr="10.244.0.1", dport=40000 + i,
                     tcpflags=ev.TCP_RST | ev.TCP_ACK, aux=ev.TCP_SYN)


def make_session(d: Path, n: int = N) -> Path:
    """One session file of `n` incidents; returns its path."""
    hdr = S.make_header(epoch_offset_ns=E0, resets=RSTS, ifnames={NETNS: {2: "eth0"}},
                        node="node-a", kernel="6.18.0")
    w = S.SessionWriter(d, header=hdr, log=lambda _m: None)
    for i in range(n):
        w.write_event(rst_no_socket(i))
    w.close()
    [f] = S.session_files(d)
    return f


def event_offsets(f: Path) -> list[int]:
    _, recs, problems = S.read_session(f)
    offs = [r.offset for r in recs if r.kind == "event"]
    assert problems == []
    return offs


def events_end(f: Path) -> int:
    """Where the records after the last event begin (a clean stop writes a stop record last):
    what a crash right after that event leaves as the file's size."""
    last = event_offsets(f)[-1]
    _magic, length, _crc = S.FRAME.unpack_from(f.read_bytes(), last)
    return last + S.FRAME.size + length


def nptrace(capsys, *args) -> tuple[int, str, str]:
    """`nptrace ARGS` in this process, through cli.main exactly as the console script runs."""
    with pytest.raises(SystemExit) as ex:
        cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    code = ex.value.code
    return (0 if code is None else code), out, err


def ports(out: str) -> list[int]:
    """The incidents' ports; loss lines ({"kind": "loss"}: records may be missing) left out."""
    lines = [json.loads(line) for line in out.splitlines()]
    return [d["dport"] for d in lines if d.get("kind") != "loss"]


def one_error_line(err: str, needle: str) -> None:
    """The error is the last stderr line, the only `error:` one; no traceback anywhere."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    errors = [l for l in lines if l.startswith("nptrace: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert needle in errors[0], err


def test_intact_session_replays_every_incident_quietly(tmp_path, capsys):
    f = make_session(tmp_path / "rec")
    rc, out, err = nptrace(capsys, "replay", tmp_path / "rec", "--json")
    assert (rc, err) == (0, "")
    assert ports(out) == [40000 + i for i in range(N)]
    assert {json.loads(l)["cause"] for l in out.splitlines()} == {"no_listener"}
    rc, out, err = nptrace(capsys, "report", f)
    assert (rc, err) == (0, "") and f"{N} events replayed, {N} labeled" in out


# --- torn tails: what a crash leaves ---------------------------------------------------------

@pytest.mark.parametrize("where", ["last byte", "mid payload", "frame header only",
                                   "part of frame header", "zero-filled tail"])
def test_torn_tail_is_one_warning_exit_0_and_loses_only_the_last_record(tmp_path, capsys, where):
    f = make_session(tmp_path / "rec")
    last = event_offsets(f)[-1]
    size = events_end(f)
    if where == "zero-filled tail":       # ext4 extended the size, the data never landed
        with open(f, "ab") as fh:
            fh.write(b"\0" * 4096)
        want = N
    else:
        keep = {"last byte": size - 1, "mid payload": (last + S.FRAME.size + size) // 2,
                "frame header only": last + S.FRAME.size, "part of frame header": last + 5}[where]
        os.truncate(f, keep)
        want = N - 1
    rc, out, err = nptrace(capsys, "replay", f, "--json")
    assert rc == 0, err
    assert ports(out) == [40000 + i for i in range(want)]
    [line] = err.strip().splitlines()
    assert line.startswith("nptrace: warning: ") and "torn tail at byte" in line, err
    rc, out, err = nptrace(capsys, "report", tmp_path / "rec")
    assert rc == 0 and f"{want} events replayed" in out
    assert len(err.strip().splitlines()) == 1 and "torn tail" in err


def test_session_cut_inside_its_header_is_not_a_session(tmp_path, capsys):
    f = make_session(tmp_path / "rec")
    os.truncate(f, event_offsets(f)[0] - 3)
    for cmd in ("replay", "report"):
        rc, out, err = nptrace(capsys, cmd, f)
        assert (rc, out) == (2, "")
        one_error_line(err, "not an nptrace session file")


def test_crash_right_after_rotation_is_a_torn_tail(tmp_path, capsys):
    d = tmp_path / "rec"
    make_session(d)
    (d / "nptrace-29991231T235959Z-0000000000ff-00001.nps").write_bytes(b"")
    rc, out, err = nptrace(capsys, "replay", d, "--json")
    assert len(ports(out)) == N
    assert rc == 0 and err.startswith("nptrace: warning: "), err


# --- corruption in the middle: an error, after every readable record ------------------------

@pytest.mark.parametrize("where", ["payload", "crc", "length", "magic"])
def test_flipped_bytes_in_the_middle_exit_2_after_every_intact_record(tmp_path, capsys, where):
    f = make_session(tmp_path / "rec")
    k = N // 2
    off = event_offsets(f)[k]
    at = {"payload": off + S.FRAME.size + 40, "crc": off + 8, "length": off + 4,
          "magic": off}[where]
    data = bytearray(f.read_bytes())
    for i in range(at, at + 4):
        data[i] ^= 0xA5
    f.write_bytes(bytes(data))
    rc, out, err = nptrace(capsys, "replay", f, "--json")
    assert rc == 2
    # only the damaged record's incident is missing: reading resumed at the next frame
    assert ports(out) == [40000 + i for i in range(N) if i != k]
    one_error_line(err, "corrupt record at byte")
    assert len(err.strip().splitlines()) == 1
    rc, out, err = nptrace(capsys, "replay", f)           # text: the summary, then the error
    assert rc == 2 and out.count("no_listener") == N - 1
    one_error_line(err, "corrupt record at byte")
    rc, out, err = nptrace(capsys, "report", f)
    assert rc == 2 and f"{N - 1} events replayed" in out
    one_error_line(err, "corrupt record at byte")


def test_undecodable_event_record_is_an_error_after_the_rest(tmp_path, capsys):
    d = tmp_path / "rec"
    w = S.SessionWriter(d, header=S.make_header(epoch_offset_ns=E0, resets=RSTS),
                        log=lambda _m: None)
    w.write_event(rst_no_socket(0))
    w.write_event(b"\x01" * 40)                           # framed fine, too short to decode
    w.write_event(rst_no_socket(1))
    w.close()
    rc, out, err = nptrace(capsys, "replay", d, "--json")
    assert rc == 2 and ports(out) == [40000, 40001]
    one_error_line(err, "could not be decoded")


def test_directory_with_a_stray_damaged_file_still_replays_the_good_one(tmp_path, capsys):
    d = tmp_path / "rec"
    make_session(d)
    (d / "nptrace-20000101T000000Z-0000000000ff-00000.nps").write_bytes(os.urandom(300))
    rc, out, err = nptrace(capsys, "replay", d, "--json")
    assert rc == 2 and len(ports(out)) == N
    one_error_line(err, "not an nptrace session file")


# --- not a session at all -----------------------------------------------------------------

NOT_SESSIONS = {
    "text": b"hello, this is not a session\n",
    "random": bytes(range(256)) * 8,
    "empty": b"",
    "msgpack": msgpack.packb({"rec": "header", "format": "something-else"}),
    "bare magic": S.MAGIC,
    "foreign frame": S.frame(msgpack.packb({"rec": "header", "format": "other"})),
}


@pytest.mark.parametrize("cmd", ["replay", "report"])
@pytest.mark.parametrize("kind", sorted(NOT_SESSIONS))
def test_not_a_session_is_one_line_exit_2(tmp_path, capsys, cmd, kind):
    f = tmp_path / "x.nps"
    f.write_bytes(NOT_SESSIONS[kind])
    rc, out, err = nptrace(capsys, cmd, f)
    assert (rc, out) == (2, "")
    one_error_line(err, "not an nptrace session file")
    assert len(err.strip().splitlines()) == 1


def test_newer_session_format_is_refused(tmp_path, capsys):
    f = tmp_path / "new.nps"
    hdr = S.make_header(epoch_offset_ns=E0)
    hdr["format_version"] = S.FORMAT_VERSION + 1
    f.write_bytes(S.frame(msgpack.packb(hdr, use_bin_type=True)))
    rc, out, err = nptrace(capsys, "replay", f)
    assert (rc, out) == (2, "")
    one_error_line(err, "upgrade nptrace")


@pytest.mark.parametrize("args,needle", [
    (["replay", "{tmp}/missing"], "no such file or directory"),
    (["replay", "{tmp}"], "no session files"),
    (["report", "{tmp}"], "no session files"),
    (["replay"], "Missing argument"),
    (["replay", "{tmp}", "--no-such-option"], "No such option"),
    (["report", "{tmp}", "--top", "0"], "--top"),
    (["run", "--no-such-option"], "No such option"),
    (["run", "--record-max-file-mb", "0"], "--record-max-file-mb"),
    (["run", "--record-max-age", "-5"], "--record-max-age"),
    (["run", "--metrics-addr"], "--metrics-addr"),
])
def test_bad_arguments_are_one_line_exit_2(tmp_path, capsys, args, needle):
    rc, out, err = nptrace(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert (rc, out) == (2, "")
    one_error_line(err, needle)
    assert len(err.strip().splitlines()) == 1


def test_console_script_torn_tail_and_corruption(tmp_path):
    """The installed `nptrace` (or `python -m nptrace.cli`) in a process of its own."""
    f = make_session(tmp_path / "rec")
    os.truncate(f, events_end(f) - 3)
    cmd = [sys.executable, "-m", "nptrace.cli"]
    r = subprocess.run(cmd + ["replay", str(f), "--json"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and len(ports(r.stdout)) == N - 1
    assert r.stderr.startswith("nptrace: warning: ") and len(r.stderr.splitlines()) == 1
    r = subprocess.run(cmd + ["replay", str(tmp_path / "nope")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("nptrace: error: ") and len(r.stderr.splitlines()) == 1
