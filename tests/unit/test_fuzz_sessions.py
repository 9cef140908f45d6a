"""Hostile session files never crash and never hang `replay`, `report` or `merge`.

A seeded mutation fuzzer (pure Python, deterministic: a failure names its seed and replays
with NPTRACE_FUZZ_SEED). It starts from a real session written by the live pipeline (every
record kind, the Context's lookups recorded) and damages it at three levels:

  bytes     flips, cuts, zeroed and duplicated spans, inserted fake frame headers
  frames    a well-framed record (right magic, length and crc) whose msgpack payload has a
            field of the wrong type, a huge int, nested garbage, a missing or extra key
  files     FIFOs, /dev/zero, directories of mixed files, 1 MiB of fake frame headers

and cases made from the schema's own tables (sessions/schema.py LOOKUPS, SCHEMAS, HEADER):
every place of every lookup's key and answer, of every record kind and of the header, given
every wrong type (int, negative and huge ints, float, list, map, bytes, a string with control
characters or past its bound, None, bool, deep nesting), so a lookup or record kind added to a
table is fuzzed with no case written for it. And, crafted: values nested a thousand levels
deep, packet records whose lengths overflow, frames built to make msgpack allocate far more
than their bytes, and summary records, each through every output form.

Every run must end with exit 0 (warnings allowed), or exit 2 with ONE error line; never a
traceback, never past the time limit, and nothing but printable text on a terminal. Runs in
a process of their own also keep their peak RSS within RSS_MULTIPLE times the input's size
plus RSS_SLACK_MB over an intact session's.

`make test` runs a fixed few hundred cases (a few seconds) and every place of the tables once;
`make fuzz` sets NPTRACE_FUZZ_SECONDS and runs every place with every wrong type, then new
seeds for that long.
"""
from __future__ import annotations

import os
import random
import signal
import stat
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import msgpack
import pytest
from click.testing import CliRunner

from nptrace import events as ev
from nptrace.classify import Classifier, Context
from nptrace.reasons import ReasonTable
from nptrace.sessions import format as S
from nptrace.sessions.schema import LOOKUPS, show
from nptrace.sessions.commands import merge_command, replay_command, report_command
from nptrace.sinks.jsonl import JsonLines
from nptrace.sinks.recorder import Recorder

E0 = 1_700_000_000 * 10**9
HOST_NS = 4026531840
DROPS = ReasonTable({3: "SKB_DROP_REASON_NO_SOCKET", 12: "SKB_DROP_REASON_NETFILTER_DROP",
                     16: "SKB_DROP_REASON_IP_RPFILTER"}, "SKB_DROP_REASON_")
RSTS = ReasonTable({0: "SK_RST_REASON_NOT_SPECIFIED", 1: "SK_RST_REASON_NO_SOCKET"},
                   "SK_RST_REASON_")
CASES = int(os.environ.get("NPTRACE_FUZZ_CASES", "240"))
SECONDS = float(os.environ.get("NPTRACE_FUZZ_SECONDS", "0"))
SEED = os.environ.get("NPTRACE_FUZZ_SEED")
CASE_TIMEOUT_S = 10


# --- the seed: a session as the live pipeline writes it ----------------------------------

def seed_events():
    t = 1_000_000
    out = []
    for i in range(4):
        out.append(ev.encode(ts_ns=t + i * 10**6, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB,
                             reason=16, ifindex=3, netns=HOST_NS, saddr=f"192.168.2.{10 + i}",
                             sport=5000 + i, daddr="10.0.0.2", dport=30080, l4proto=6,
                             tcpflags=ev.TCP_SYN))
    out.append(ev.encode(ts_ns=t + 5 * 10**6, type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST,
                         ifindex=3, netns=HOST_NS, saddr="10.0.0.2", sport=30080,
                         daddr="192.168.2.10", dport=5000, flags=ev.F_HAS_SOCK,
                         tcpflags=ev.TCP_RST))
    out.append(ev.encode(ts_ns=t + 6 * 10**6, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB,
                         reason=12, ifindex=5, netns=HOST_NS, saddr="192.168.2.50", sport=6000,
                         daddr="10.244.2.5", dport=8080, l4proto=6, tcpflags=ev.TCP_SYN))
    out.append(ev.encode(ts_ns=t + 62 * 10**9, type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_INGRESS,
                         ifindex=3, netns=HOST_NS, saddr="10.244.2.5", sport=8080,
                         daddr="10.0.0.2", dport=40001, tcpflags=ev.TCP_RST | ev.TCP_ACK,
                         flags=ev.F_HAS_CT, ct_osrc="192.0.2.10", ct_osport=50000,
                         ct_odst="10.0.0.2", ct_odport=30080, ct_rsrc="10.244.2.5",
                         ct_rsport=8080, ct_rdst="10.0.0.2", ct_rdport=40001,
                         ct_status=ev.IPS_DST_NAT | ev.IPS_SRC_NAT))
    out.append(ev.encode(ts_ns=t + 63 * 10**9, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST,
                         reason=1, ifindex=5, netns=HOST_NS, saddr="10.244.2.5", sport=8080,
                         daddr="10.0.0.9", dport=40002, tcpflags=ev.TCP_RST | ev.TCP_ACK,
                         aux=ev.TCP_SYN))
    return out


def _summary_rows():
    from nptrace.classify.keylabel import KeyLabel
    from nptrace.sinks.exact import SummaryRow
    return [SummaryRow(KeyLabel("drop", "rp_filter", None, "eth1", "default/web:http",
                                "skb:kfree_skb", "IP_RPFILTER"), 5000, 10**9, 2 * 10**9),
            SummaryRow(KeyLabel("rst", "no_listener", "sent", None, None, "tcp:tcp_send_reset",
                                "NO_SOCKET"), 70, 10**9, 2 * 10**9)]


SUMMARY_ROWS = _summary_rows()
SEED_PACKET = bytes(12) + b"\x08\x00" + bytes.fromhex(
    "4500003c2be640003f0683aec0a80a64ac10150b83357580b055abe800000000a002faf08c5600000204")


def write_seed(d: Path, node: str = "node-a") -> None:
    """The live pipeline as tracer.py wires it, every lookup recorded."""
    w = S.SessionWriter(d, header=S.make_header(epoch_offset_ns=E0, drops=DROPS, resets=RSTS,
                                                node=node, kernel="6.18.0",
                                                ifnames={HOST_NS: {2: "eth0"}}),
                        log=lambda m: None)
    counts = ({(1, 1, 16, 3, HOST_NS): 9}, {"emitted": 10, "lost": 1, "filtered": 0})
    rec = Recorder(w, counters=lambda: counts)
    names = {3: "eth1", 5: "cni0"}
    rule = {"tag": "other", "where": "filter/KUBE-FW rule 3", "text": "-j REJECT",
            "service": "default/web:http", "to_pod": True, "source": "ruleset", "note": "x"}
    ctx = Context(drop_name=DROPS.name, rst_name=RSTS.name,
                  iface_name=rec.iface_name(lambda ns, i: names.get(i)),
                  service_of=rec.service_of(lambda a, p: "default/web:http"
                                            if p in (30080, 8080) else None),
                  endpoint_of=rec.lookup("endpoint_of", lambda a, p: "default/web:http"
                                         if a.startswith("10.244.") else None),
                  nf_rule=rec.lookup("nf_rule", lambda *a: rule),
                  route_iface=rec.lookup("route_iface", lambda ns, a: "eth0"),
                  nat_peer=rec.lookup("nat_peer", lambda s, sp, d, dp:
                                      ["192.0.2.7", 1, "10.0.0.2", 2] if dp == 40002 else None))
    c = Classifier(ctx)
    sink = JsonLines(E0, open(os.devnull, "w"))
    for raw in seed_events():
        rec.on_raw(raw)
        e = ev.decode(raw)
        if e.type == ev.EvType.DROP:     # its packet bytes, as the ring gives them with -w
            rec.on_packet_raw(ev.encode_packet(SEED_PACKET, ts_ns=e.ts_ns, skb=e.skb,
                                               ifindex=e.ifindex, ev_type=e.type, hook=e.hook))
        for v in c.feed(ev.decode(raw)):
            sink.write(v)
        rec.snapshot_counters()
    for v in c.flush():
        sink.write(v)
    w.write_summary(SUMMARY_ROWS)
    rec.close()


def frames_of(data: bytes) -> list[tuple[int, int]]:
    """(offset, total length) of each frame of a well-formed file."""
    out, off = [], 0
    while off + S.FRAME.size <= len(data):
        _m, n, _c = S.FRAME.unpack_from(data, off)
        if off + S.FRAME.size + n > len(data):
            break
        out.append((off, S.FRAME.size + n))
        off += S.FRAME.size + n
    return out


# --- hostile values -------------------------------------------------------------------------

def hostile(rng: random.Random, depth: int = 0):
    pick = rng.randrange(22)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([-1, 0, 1, 2**31, 2**32, 2**63 - 1, -2**63, 2**64 - 1])
    if pick == 3:
        return rng.choice([float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 0.5])
    if pick == 4:
        return rng.choice(["", "x", "\x1b[2J\x1b]0;pwn\x07", "é" * 40, "\0\n\r\t",
                           "A" * 5000, "١٢٣", "-1", "None"])
    if pick == 5:
        return rng.choice([b"", b"\xff" * 7, bytes(216), rng.randbytes(216), b"\x00" * 300])
    if pick == 6 and depth < 4:
        return [hostile(rng, depth + 1) for _ in range(rng.randrange(5))]
    if pick == 7 and depth < 4:
        return {hostile_key(rng): hostile(rng, depth + 1) for _ in range(rng.randrange(5))}
    if pick == 8:
        return [[[[[[[[[[[]]]]]]]]]]]
    if pick == 9:
        return {"rec": "header"}
    if pick == 10:
        return list(range(rng.randrange(1, 5)))
    if pick == 11:
        return ["10.0.0.2", 30080, "default/web:http"]
    if pick == 12:
        return {HOST_NS: {3: hostile(rng, depth + 1)}}
    if pick == 13:
        return [[hostile(rng, depth + 1), hostile(rng, depth + 1)]]
    if pick == 14:
        return msgpack.ExtType(5, b"xx")
    if pick == 15:
        return {1: 2, "a": None}
    if pick == 16:
        return deep(rng.choice([50, 1000, 1020]))
    return rng.choice([0, "eth1", 3, "nptrace-session", 1, -5])


def deep(n: int, leaf=None):
    """A list nested n levels deep (msgpack unpacks up to about 1023)."""
    v = [] if leaf is None else leaf
    for _ in range(n):
        v = [v]
    return v


def hostile_key(rng: random.Random):
    return rng.choice([0, -1, 2**64 - 1, "x", "", "3", b"k", None, True, 1.5, "\x1b"])


def mutate_record(rng: random.Random, rec) -> object:
    """A damaged copy of one decoded record."""
    if not isinstance(rec, dict) or rng.random() < 0.05:
        return hostile(rng)
    rec = dict(rec)
    keys = list(rec)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(6)
        if op == 0 and keys:
            rec.pop(rng.choice(keys), None)
        elif op == 1:
            rec[hostile_key(rng)] = hostile(rng)
        elif op <= 3 and keys:
            k = rng.choice(keys)
            rec[k] = _mutate_inside(rng, rec.get(k))
        else:
            if keys:
                rec[rng.choice(keys)] = hostile(rng)
    return rec


def _mutate_inside(rng, v, depth=0):
    """Damage deep inside a value, keeping its outer shape (what passes a shallow check)."""
    if depth > 5 or rng.random() < 0.3:
        return hostile(rng)
    if isinstance(v, dict) and v:
        v = dict(v)
        k = rng.choice(list(v))
        if rng.random() < 0.3:
            v[hostile_key(rng)] = v.pop(k)
        else:
            v[k] = _mutate_inside(rng, v[k], depth + 1)
        return v
    if isinstance(v, list) and v:
        v = list(v)
        i = rng.randrange(len(v))
        v[i] = _mutate_inside(rng, v[i], depth + 1)
        return v
    if isinstance(v, bytes) and v:
        b = bytearray(v)
        b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    return hostile(rng)


def pack(obj) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return msgpack.packb(show(obj), use_bin_type=True)


def fake_frame(n: int, crc: int = 0) -> bytes:
    return S.FRAME.pack(S.MAGIC, n, crc)


def mutate_file(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return rng.randbytes(rng.randrange(64))
    fr = frames_of(data)
    op = rng.randrange(12)
    if op <= 4 and fr:
        # a well-framed hostile payload: the crc is right, so only the schema can refuse it
        i = 0 if op == 0 else rng.randrange(len(fr))
        off, n = fr[i]
        try:
            rec = msgpack.unpackb(data[off + S.FRAME.size:off + n], raw=False,
                                  strict_map_key=False)
        except Exception:    # an earlier mutation broke this frame
            rec = {"rec": "event"}
        payload = pack(mutate_record(rng, rec))
        return data[:off] + S.frame(payload) + data[off + n:]
    b = bytearray(data)
    if op == 5:
        for _ in range(rng.randrange(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 6:
        del b[rng.randrange(len(b)):]
    elif op == 7:
        at = rng.choice([o for o, _ in fr]) if fr else 0
        del b[at:]                                   # cut exactly at a frame boundary
    elif op == 8:
        at, n = rng.randrange(len(b)), rng.randrange(1, 600)
        b[at:at + n] = bytes(min(n, len(b) - at))
    elif op == 9:
        at = rng.randrange(len(b))
        b[at:at] = fake_frame(rng.choice([0, 1, 16, 2**31, S.MAX_PAYLOAD, 2**32 - 1])) \
            * rng.randrange(1, 50)
    elif op == 10 and fr:
        off, n = rng.choice(fr)
        b[off:off] = data[off:off + n]                # a duplicated frame
    else:
        at = rng.randrange(len(b))
        b[at:at] = rng.randbytes(rng.randrange(1, 200))
    return bytes(b)


# --- running and judging ----------------------------------------------------------------------

class Hang(Exception):
    pass


def _alarm(_sig, _frm):
    raise Hang()


PCAP_OUT = Path(__import__("tempfile").mkdtemp(prefix="npt-fuzz-")) / "out.pcapng"
COMMANDS = [(replay_command, []), (replay_command, ["--json"]), (replay_command, ["-o", "table"]),
            (replay_command, ["--collapse", "1"]), (report_command, []),
            (report_command, ["-o", "json"]), (merge_command, []), (merge_command, ["--json"]),
            (merge_command, ["-o", "table"]),
            (replay_command, ["-w", PCAP_OUT])]     # the recorded packet bytes (format 2)


def run(cmd, args, timeout=CASE_TIMEOUT_S):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return CliRunner().invoke(cmd, [str(a) for a in args])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _printable(text: str) -> bool:
    return all(c in "\n" or (c.isprintable()) for c in text)


def verdict_of(r) -> str | None:
    """None when the run kept the contract, else what broke it."""
    if isinstance(r.exception, Hang):
        return "hang"
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback
        tb = traceback.extract_tb(r.exc_info[2])[-1]
        return f"{type(r.exception).__name__} at {Path(tb.filename).name}:{tb.lineno}"
    if "Traceback" in r.output:
        return "traceback printed"
    if r.exit_code not in (0, 2):
        return f"exit {r.exit_code}"
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    if r.exit_code == 2 and len(errors) != 1:
        return f"exit 2 with {len(errors)} error lines"
    if r.exit_code == 0 and errors:
        return "exit 0 with an error line"
    if not _printable(r.stdout) or not _printable(r.stderr):
        return "control characters on the terminal"
    return None


def check_case(paths) -> list[str]:
    bad = []
    for cmd, extra in COMMANDS:
        why = verdict_of(run(cmd, [*paths, *extra]))
        if why is not None:
            bad.append(f"{cmd.name} {' '.join(extra)}: {why}".replace("  ", " "))
    return bad


@pytest.fixture(scope="module")
def seed_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("seed") / "rec"
    write_seed(d)
    return d


def _seed_file(seed_dir) -> tuple[Path, bytes]:
    [f] = S.session_files(seed_dir)
    return f, f.read_bytes()


def fuzz(seed_dir, tmp: Path, seeds) -> dict[str, list[int]]:
    f, data = _seed_file(seed_dir)
    failures: dict[str, list[int]] = {}
    for s in seeds:
        rng = random.Random(s)
        case = tmp / f"case-{s}"
        case.mkdir()
        out = case / f.name
        blob = data
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            blob = mutate_file(rng, blob)
        out.write_bytes(blob)
        if rng.random() < 0.2:   # a second, intact file beside it: a directory of mixed files
            (case / f.name.replace("-00000", "-00001")).write_bytes(data)
            target = [case]
        else:
            target = [out]
        for why in check_case(target):
            failures.setdefault(why, []).append(s)
        for p in case.iterdir():
            p.unlink()
        case.rmdir()
    return failures


def _report(failures) -> str:
    return "\n".join(f"{why}: seeds {seeds[:5]} ({len(seeds)} cases)"
                     for why, seeds in sorted(failures.items()))


def test_seed_session_replays_clean(seed_dir):
    assert check_case([seed_dir]) == []
    r = run(replay_command, [seed_dir, "--json"])
    assert r.exit_code == 0 and len(r.stdout.splitlines()) >= 4, r.output


def test_fuzz_deterministic_subset(seed_dir, tmp_path):
    """The fast subset `make test` runs: fixed seeds."""
    seeds = [int(SEED)] if SEED else range(CASES)
    failures = fuzz(seed_dir, tmp_path, seeds)
    assert not failures, _report(failures)


@pytest.mark.skipif(not SECONDS, reason="the long fuzz: make fuzz (NPTRACE_FUZZ_SECONDS)")
def test_fuzz_long(seed_dir, tmp_path):
    rng = random.Random()
    start = rng.randrange(10**6, 10**9)
    failures: dict = {}
    n = 0
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline:
        got = fuzz(seed_dir, tmp_path, range(start + n, start + n + 50))
        for k, v in got.items():
            failures.setdefault(k, []).extend(v)
        n += 50
    print(f"\nfuzzed {n} cases from seed {start}")
    assert not failures, _report(failures)


# --- crafted files ---------------------------------------------------------------------------

def _hdr_bytes(**kw) -> bytes:
    h = S.make_header(epoch_offset_ns=E0, node="n", kernel="k")
    h.update(kw)
    return S.frame(pack(h))


def test_fake_frame_headers_resync_in_linear_time(tmp_path, seed_dir):
    """1 MiB of fake frame headers (each claims a payload that is never there): the reader
    must skip it in linear time (it took 20 s, quadratic)."""
    _f, data = _seed_file(seed_dir)
    fr = frames_of(data)
    junk = fake_frame(S.MAX_PAYLOAD) * ((1 << 20) // S.FRAME.size)
    f = tmp_path / "nptrace-x.nps"
    f.write_bytes(data[:fr[1][0]] + junk + data[fr[1][0]:])
    t0 = time.monotonic()
    r = run(replay_command, [f, "--json"])
    assert time.monotonic() - t0 < 3, "resync is not linear"
    assert verdict_of(r) is None and r.exit_code == 2
    assert "corrupt" in r.stderr
    assert len(r.stdout.splitlines()) >= 4      # every record after the junk still replays


@pytest.mark.parametrize("cmd", [replay_command, report_command, merge_command])
def test_fifo_is_refused_not_waited_on(tmp_path, cmd):
    fifo = tmp_path / "nptrace-fifo.nps"
    os.mkfifo(fifo)
    r = run(cmd, [fifo], timeout=5)
    assert verdict_of(r) is None and r.exit_code == 2
    assert "not a regular file" in r.stderr
    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / "nptrace-20260101T000000Z-x-00000.nps")
    r = run(cmd, [d], timeout=5)
    assert verdict_of(r) is None and r.exit_code == 2


def test_dev_zero_is_refused(tmp_path):
    for cmd in (replay_command, report_command, merge_command):
        r = run(cmd, ["/dev/zero"], timeout=5)
        assert verdict_of(r) is None and r.exit_code == 2, r.output
        assert "not a regular file" in r.stderr


def test_fifo_through_the_entry_point_under_timeout(tmp_path):
    """Out of process, as a person runs it: one line, exit 2, well inside the timeout."""
    fifo = tmp_path / "s.nps"
    os.mkfifo(fifo)
    p = subprocess.run(["timeout", "20", sys.executable, "-c",
                        "import sys; from nptrace.cli import main; main(sys.argv[1:])",
                        "replay", str(fifo)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_cut_at_a_frame_boundary_says_records_may_be_missing(tmp_path, seed_dir):
    """A clean stop writes a stop record; a file that ends without one lost its tail even
    when the cut fell exactly between two frames."""
    _f, data = _seed_file(seed_dir)
    fr = frames_of(data)
    assert msgpack.unpackb(data[fr[-1][0] + S.FRAME.size:], raw=False)["rec"] == "stop"
    f = tmp_path / "nptrace-cut.nps"
    f.write_bytes(data[:fr[-3][0]])
    r = run(replay_command, [f, "--json"])
    assert r.exit_code == 0 and verdict_of(r) is None
    assert "no stop record" in r.stderr and "may be missing" in r.stderr
    assert '"kind":"loss"' in r.stdout


def test_well_framed_wrong_types_are_counted_not_fatal_to_the_rest(tmp_path, seed_dir):
    _f, data = _seed_file(seed_dir)
    fr = frames_of(data)
    off, n = fr[1]
    bad = S.frame(pack({"rec": "event", "abi": "x", "type": [], "raw": "not bytes"}))
    f = tmp_path / "nptrace-bad.nps"
    f.write_bytes(data[:off] + bad + data[off:])
    r = run(replay_command, [f, "--json"])
    assert verdict_of(r) is None and r.exit_code == 2
    assert "1 record" in r.stderr and "invalid" in r.stderr
    assert len([x for x in r.stdout.splitlines() if '"kind":"loss"' not in x]) >= 4


def test_hostile_header_fields_are_one_line(tmp_path):
    for i, kw in enumerate([dict(epoch_offset_ns="x"), dict(epoch_offset_ns=2**63 - 1),
                            dict(drop_reasons={"a": 1}), dict(ifnames=[1, 2]),
                            dict(services={"x": 1}), dict(node=["a"]), dict(run_id=5),
                            dict(part="0"), dict(lookups={"nf_rule": [[1, 2, 3]]}),
                            dict(abi="1"), dict(format_version="2"),
                            dict(format_version=2**63), dict(start_ns=-2**63)]):
        f = tmp_path / f"nptrace-h{i}.nps"
        f.write_bytes(_hdr_bytes(**kw) + S.frame(pack({"rec": "event", "abi": ev.ABI_VERSION,
                                                       "type": 1, "raw": seed_events()[0]})))
        for why in check_case([f]):
            pytest.fail(f"{kw}: {why}")


def test_escape_sequences_in_names_never_reach_the_terminal(tmp_path):
    d = tmp_path / "rec"
    w = S.SessionWriter(d, header=S.make_header(epoch_offset_ns=E0, drops=DROPS, resets=RSTS,
                                                node="n\x1b[31m", kernel="k"),
                        log=lambda m: None)
    rec = Recorder(w)
    ctx = Context(drop_name=DROPS.name, rst_name=RSTS.name,
                  iface_name=rec.iface_name(lambda ns, i: "eth\x1b]0;owned\x07"),
                  service_of=rec.service_of(lambda a, p: "ns/\x1b[2Jsvc:http"))
    c = Classifier(ctx)
    for raw in seed_events()[:2]:
        rec.on_raw(raw)
        list(c.feed(ev.decode(raw)))
    list(c.flush())
    rec.close()
    for cmd, extra in COMMANDS:
        r = run(cmd, [d, *extra])
        assert r.exit_code == 0, r.output
        assert "\x1b" not in r.stdout and "\x1b" not in r.stderr, (cmd.name, extra)
    r = run(replay_command, [d])
    assert "eth\\x1b]0;owned\\x07" in r.stdout


@pytest.mark.parametrize("claim", [0, 4096, 1 << 19, 1 << 20])
def test_crafted_fake_frames_that_fit_resync_in_linear_time(tmp_path, seed_dir, claim):
    """The worst case for a crc resync: every fake header claims a payload that fits, and
    the byte after it starts a msgpack map, so each one is a candidate worth checking."""
    _f, data = _seed_file(seed_dir)
    fr = frames_of(data)
    unit = fake_frame(claim) + b"\x85"
    junk = unit * ((1 << 20) // len(unit))
    f = tmp_path / "nptrace-x.nps"
    f.write_bytes(data[:fr[1][0]] + junk + data[fr[1][0]:] + bytes(2 << 20))
    t0 = time.monotonic()
    r = run(replay_command, [f, "--json"])
    assert time.monotonic() - t0 < 5, "resync is not linear"
    assert verdict_of(r) is None and r.exit_code == 2
    assert len(r.stderr.splitlines()) <= 4         # one line per kind of loss, not per frame


def test_damaged_packet_bytes_are_counted_not_fatal_to_the_rest(tmp_path, seed_dir):
    """A packet record whose cap_len says more than it holds, one cut short of its header,
    one of the wrong type, and garbage: counted as undecodable (exit 2, one line), the
    incidents and the other packets still written."""
    _f, data = _seed_file(seed_dir)
    fr = frames_of(data)
    off, _n = fr[2]
    good = ev.encode_packet(SEED_PACKET, ts_ns=1)
    bad = b"".join(S.frame(pack({"rec": "packet", "raw": raw})) for raw in (
        good[:-5], good[:ev.PACKET.size - 1], b"\x00" * 200, os.urandom(90)))
    f = tmp_path / "nptrace-bad.nps"
    f.write_bytes(data[:off] + bad + data[off:])
    out = tmp_path / "p.pcapng"
    r = run(replay_command, [f, "-w", out, "--json"])
    assert verdict_of(r) is None and r.exit_code == 2, r.output
    assert "4 records could not be decoded" in r.stderr and "packet:" in r.stderr, r.stderr
    assert len([x for x in r.stdout.splitlines() if '"kind":"loss"' not in x]) >= 4
    from test_pcapng import read_pcapng
    _ifaces, packets = read_pcapng(out)
    assert sum(1 for p in packets if p[2][14:] == SEED_PACKET[14:]) >= 4    # the real bytes


# --- lookup type confusion, depth, lengths, allocation bombs -----------------------------------

def _insert_after_header(data: bytes, *frames: bytes) -> bytes:
    end = frames_of(data)[0][1]
    return data[:end] + b"".join(frames) + data[end:]


# Cases made from the schema's tables (sessions/schema.py): every lookup of LOOKUPS, every
# record kind of SCHEMAS and every header field, each place in them (schema_paths) given every
# wrong type. Nothing here names a lookup or a field: one added to a table is fuzzed as it is.
WRONG_TYPES = {"int": 7, "negative int": -1, "huge int": 2**64 - 1, "float": 1.5,
               "list": ["eth0", 1], "map": {"service": "x", "a": 1}, "bytes": b"\xffeth0",
               "control str": "\x1b[2J\x1b]0;pwn\x07\x00", "None": None, "bool": True,
               "deep": deep(200), "long str": "x" * 5000}   # 1000 levels: a test of its own


class Case(NamedTuple):
    what: str               # "lookup NAME" (lookup records), "record KIND", "header"
    path: tuple             # where the wrong value is, in what that schema checks
    wrong: str              # a name of WRONG_TYPES
    records: tuple = ()     # records written before each of the seed's events and at its end
    header: tuple = ()      # or (the header written instead of the seed's,)

    def __str__(self) -> str:
        return f"{self.what} {'.'.join(map(str, self.path)) or '(whole)'} = {self.wrong}"

    __repr__ = __str__          # its values may be nested a thousand levels deep


def schema_paths(check, at=()):
    """Every place in a value of `check` where another value can go: the whole, then its parts."""
    yield at
    for k, part in check.parts().items():
        yield from schema_paths(part, at + (k,))


def put(v, check, path, new):
    """v with `new` at path; containers on the way that v lacks come from the schema's
    examples."""
    if not path:
        return new
    k, part = path[0], check.parts()[path[0]]
    base = check.example()
    if type(v) is not type(base) or (isinstance(v, list) and len(v) <= k):
        v = base
    out = dict(v) if isinstance(v, dict) else list(v)
    out[k] = put(v[k] if k in (v if isinstance(v, dict) else range(len(v))) else part.example(),
                 part, path[1:], new)
    return out


class Seed(NamedTuple):
    """What the fuzz starts from: the seed session's header and first record of each kind,
    each lookup's recorded answer and the keys its replay asks (so answers reach the
    classifier)."""
    data: bytes
    events: frozenset       # offsets of its event records
    header: dict
    first: dict
    answers: dict
    asked: dict


def seed_of(seed_dir) -> Seed:
    from nptrace.sessions.lookups import LookupTables
    from nptrace.sessions.replay import Replay
    _f, data = _seed_file(seed_dir)
    offsets = [o for o, _n in frames_of(data)]
    recs = [msgpack.unpackb(data[o + S.FRAME.size:o + n], raw=False, strict_map_key=False)
            for o, n in frames_of(data)]
    first, answers = {}, {}
    for r in recs[1:]:
        first.setdefault(r["rec"], {k: v for k, v in r.items() if k != "rec"})
        if r["rec"] == "lookup" and r["value"] is not None:
            answers.setdefault(r["name"], r["value"])
    asked: dict[str, list] = {}
    get = LookupTables.get

    def asking(self, name, key, default=None):
        if key not in asked.setdefault(name, []):
            asked[name].append(key)
        return get(self, name, key, default)
    LookupTables.get = asking
    try:
        list(Replay([seed_dir]).items())
    finally:
        LookupTables.get = get
    return Seed(data, frozenset(o for o, r in zip(offsets, recs) if r["rec"] == "event"),
                recs[0], first, answers, {n: [list(k) for k in ks] for n, ks in asked.items()})


def table_cases(seed: Seed, wrong_types=WRONG_TYPES):
    """Every case the tables make: (lookup, key or value place) x wrong type, (record kind,
    field) x wrong type, (header field, the header's lookup tables included) x wrong type."""
    from nptrace.sessions.schema import HEADER, LOOKUPS, SCHEMAS
    keys_of, answer_of = {}, {}
    for name, lk in sorted(LOOKUPS.items()):
        keys = keys_of[name] = seed.asked.get(name, [])[:4] or [lk.key.example()]
        answer = answer_of[name] = seed.answers.get(name) or lk.value.example()
        for path in schema_paths(lk.key):
            for w, wrong in wrong_types.items():
                yield Case(f"lookup {name}", ("key", *path), w, ({
                    "rec": "lookup", "name": name, "key": put(keys[0], lk.key, path, wrong),
                    "value": answer},))
        for path in schema_paths(lk.value):
            for w, wrong in wrong_types.items():
                bad = put(answer, lk.value, path, wrong)
                yield Case(f"lookup {name}", ("value", *path), w, tuple(
                    {"rec": "lookup", "name": name, "key": k, "value": bad} for k in keys))
    for kind, schema in sorted(SCHEMAS.items()):
        base = seed.first.get(kind) or schema.example()
        for path in schema_paths(schema):
            for w, wrong in wrong_types.items():
                rec = put(base, schema, path, wrong)
                yield Case(f"record {kind}", path, w,
                           ({"rec": kind, **rec} if isinstance(rec, dict) else rec,))
    header = {**seed.header, "lookups": {n: [[keys_of[n][0], answer_of[n]]] for n in keys_of}}
    for path in schema_paths(HEADER):
        for w, wrong in wrong_types.items():
            yield Case("header", path, w, header=(put(header, HEADER, path, wrong),))


def case_file(seed: Seed, case: Case, f: Path) -> Path:
    head_end = frames_of(seed.data)[0][1]
    if case.header:
        f.write_bytes(S.frame(pack(case.header[0])) + seed.data[head_end:])
    else:
        # before every event and at the end: replay classifies an event once the records up
        # to the next one are applied, so the case's answer is the last one it gets
        extra = b"".join(S.frame(pack(r)) for r in case.records)
        f.write_bytes(b"".join((extra if o in seed.events else b"") + seed.data[o:o + n]
                               for o, n in frames_of(seed.data)) + extra)
    return f


def schema_says(case: Case) -> str:
    """What the reader must make of the case's records (or header) as the file holds them, by
    the tables: "refused" (a header, or a frame that is no record within msgpack's limits),
    "invalid" (a record counted and skipped), "unknown" (a kind or lookup not in the tables),
    "kept"."""
    from nptrace.sessions.framing import Refused, unpack
    from nptrace.sessions.schema import Invalid, Unknown, check_header, check_record
    try:
        for r in case.header or case.records:
            r = unpack(pack(r))
            if r is None:
                return "refused"
            kind = r.pop("rec")
            if case.header:
                return "kept" if kind == "header" and check_header(r) else "refused"
            check_record(kind, r)
    except Refused:
        return "refused"
    except Invalid:
        return "refused" if case.header else "invalid"
    except Unknown:
        return "unknown"
    return "kept"


def check_table_case(seed: Seed, case: Case, tmp: Path) -> list[str]:
    """The contract of check_case, and what the tables say: a refused header is exit 2 for
    every command; an invalid record is counted as "invalid and skipped" (exit 2); one the
    tables keep is never called invalid."""
    f = case_file(seed, case, tmp / "nptrace-case.nps")
    says = schema_says(case)
    bad = []
    for cmd, extra in COMMANDS:
        r = run(cmd, [f, *extra])
        why = verdict_of(r)
        if why is None and says in ("refused", "invalid") and r.exit_code != 2:
            why = f"{says} by the schema, exit {r.exit_code}"
        if why is None and says == "invalid" and "and skipped" not in r.stderr:
            why = "invalid by the schema, not counted as invalid"
        if why is None and says == "kept" and "invalid and skipped" in r.stderr:
            why = "kept by the schema, counted invalid"
        if why is not None:
            bad.append(f"{case}: {cmd.name} {' '.join(map(str, extra))}: {why}")
    f.unlink()
    return bad


def quick_cases(cases) -> list[Case]:
    """`make test`'s share, deterministic: every place of every lookup, and each record kind's
    and the header's own fields, once, each with the next wrong type in turn (every place with
    every wrong type is make fuzz's, and the schema's own test)."""
    out, places = [], {}
    for c in cases:
        if not c.what.startswith("lookup ") and len(c.path) > 1:
            continue
        i = places.setdefault((c.what, c.path), len(places))
        if c.wrong == list(WRONG_TYPES)[i % len(WRONG_TYPES)]:
            out.append(c)
    return out


@pytest.fixture(scope="module")
def seed(seed_dir):
    return seed_of(seed_dir)


def test_every_table_place_of_every_wrong_type_is_refused_or_kept_typed(seed):
    """The whole product at the schema: each case is refused (Invalid) or unknown, or what is
    kept checks again to itself (nothing else raised, nothing half-normalised)."""
    from nptrace.sessions.schema import Invalid, Unknown, check_header, check_record
    n = 0
    for case in table_cases(seed):
        n += 1
        for r in case.header or case.records:
            if not isinstance(r, dict):
                continue
            try:
                out = check_header(dict(r)) if case.header else check_record(r["rec"], dict(r))
            except (Invalid, Unknown):
                continue
            again = check_header(out) if case.header else check_record(r["rec"], out)
            assert again == out, case
    assert n > 2000


def test_table_cases_through_every_command(seed, tmp_path):
    """`make test`'s share of the table cases through replay/report/merge (every form)."""
    cases = quick_cases(table_cases(seed))
    assert {c.what for c in cases} >= {f"lookup {n}" for n in LOOKUPS}
    assert {c.wrong for c in cases} == set(WRONG_TYPES)
    failures = [why for c in cases for why in check_table_case(seed, c, tmp_path)]
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} in all)"


@pytest.mark.skipif(not SECONDS, reason="the long fuzz: make fuzz (NPTRACE_FUZZ_SECONDS)")
def test_table_cases_long(seed, tmp_path):
    """`make fuzz`: every table case through every command, then random hostile values at
    random places of the tables until NPTRACE_FUZZ_SECONDS is spent."""
    deadline = time.monotonic() + SECONDS
    cases = list(table_cases(seed))
    failures = []
    for c in cases:
        failures += check_table_case(seed, c, tmp_path)
        if time.monotonic() > deadline:
            break
    rng = random.Random()
    start = rng.randrange(10**9)
    n = 0
    while time.monotonic() < deadline:
        r = random.Random(start + n)
        wild = {f"hostile {start + n}": hostile(r)}
        for c in r.sample(list(table_cases(seed, wild)), 20):
            failures += check_table_case(seed, c, tmp_path)
        n += 1
    print(f"\n{len(cases)} table cases, then {n} draws of 20 from seed {start}")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} in all)"


def test_a_lookup_added_to_the_table_is_fuzzed(seed, tmp_path, monkeypatch):
    """A lookup added to LOOKUPS, and nothing else: its records and its header table are
    checked against it and fuzzed at every place with every wrong type."""
    from nptrace.sessions import schema as sch
    dummy = sch.Lookup(sch.Tuple(sch.ADDR, sch.PORT),
                       sch.Opt(sch.Record({"name": sch.NAME}, {"hops": sch.ListOf(sch.U32, 8)})))
    valid = Case("lookup dummy_of", (), "valid", ({
        "rec": "lookup", "name": "dummy_of", "key": ["10.0.0.2", 80], "value": {"name": "a"}},))
    assert schema_says(valid) == "unknown"       # a newer writer's lookup, until it is in the table
    monkeypatch.setitem(sch.LOOKUPS, "dummy_of", dummy)
    assert schema_says(valid) == "kept"
    cases = [c for c in table_cases(seed) if "dummy_of" in c.what + str(c.path)]
    mine = [c for c in cases if c.what == "lookup dummy_of"]
    places = {("key",), ("key", 0), ("key", 1), ("value",), ("value", "name"), ("value", "hops"),
              ("value", "hops", 0)}
    assert {(c.path, c.wrong) for c in mine} == {(p, w) for p in places for w in WRONG_TYPES}
    assert {c.path[2:] for c in cases if c.what == "header"} >= {(), (0, 0, 1), (0, 1, "hops", 0)}
    said = [schema_says(c) for c in mine]
    assert "unknown" not in said and said.count("invalid") > len(mine) * 3 // 4, said
    failures = [why for c in quick_cases(cases) for why in check_table_case(seed, c, tmp_path)]
    assert not failures, "\n".join(failures[:20])
    r = run(replay_command, [case_file(seed, valid, tmp_path / "nptrace-v.nps")])
    assert r.exit_code == 0 and "invalid" not in r.stderr and "not know" not in r.stderr, r.output


def test_a_lookup_not_in_the_table_is_skipped_and_counted(seed, tmp_path):
    valid = {"rec": "lookup", "name": "dummy_of", "key": ["10.0.0.2", 80], "value": {"a": 1}}
    f = case_file(seed, Case("", (), "", (valid, valid)), tmp_path / "nptrace-u.nps")
    r = run(replay_command, [f])
    assert r.exit_code == 0 and "does not know: lookup dummy_of (" in r.stderr, r.stderr
    header = {**seed.header, "lookups": {"dummy_of": [[["10.0.0.2", 80], {"a": [1]}]]}}
    f = case_file(seed, Case("", (), "", header=(header,)), f)
    r = run(report_command, [f, "-o", "json"])
    assert r.exit_code == 0 and "lookup dummy_of (1)" in r.stderr, r.stderr


def test_every_answer_replay_gives_is_in_the_table():
    """The table holds every lookup the classifier's Context asks (the reason tables come
    from the header's own fields), so no answer reaches it unchecked."""
    from dataclasses import fields
    asked = {f.name for f in fields(Context) if "Callable" in str(f.type)}
    assert asked - {"drop_name", "rst_name", "at"} == set(LOOKUPS)


def test_recording_a_lookup_twice_records_it_once(tmp_path):
    """tracer.py wraps iface_name and service_of, then every lookup of the table: each is
    recorded once, in the record kind its row names."""
    w = S.SessionWriter(tmp_path / "r", header=S.make_header(epoch_offset_ns=E0),
                        log=lambda m: None)
    rec = Recorder(w)
    iface = rec.iface_name(lambda ns, i: "eth1")
    assert rec.lookup("iface_name", iface) is iface
    pod = rec.lookup("pod_of", lambda a: "ns/p")
    assert rec.lookup("pod_of", pod) is pod
    svc = rec.lookup("service_of", lambda a, p: "ns/s:http")
    iface(HOST_NS, 3), pod("10.0.0.1"), svc("10.0.0.2", 80)
    rec.close()
    kinds = [r.kind for r in S.read_session(tmp_path / "r")[1]]
    assert sorted(kinds) == ["lookup", "names", "services"], kinds


@pytest.mark.parametrize("where", ["event", "lookup value", "lookup key", "summary", "unknown",
                                   "header features", "nf_rule field"])
def test_a_thousand_levels_of_lists_are_one_line(tmp_path, seed_dir, where):
    _f, data = _seed_file(seed_dir)
    d = deep(1000)
    rec = {"event": {"rec": "event", "raw": d},
           "lookup value": {"rec": "lookup", "name": "pod_of", "key": ["10.0.0.2"], "value": d},
           "lookup key": {"rec": "lookup", "name": "nf_rule", "key": d, "value": None},
           "summary": {"rec": "summary", "cause": d, "kind": "rst", "repeat": 1},
           "unknown": {"rec": "newer", "x": d},
           "nf_rule field": {"rec": "lookup", "name": "nf_rule",
                             "key": LOOKUPS["nf_rule"].key.example(),
                             "value": {"tag": d}}}.get(where)
    f = tmp_path / "nptrace-deep.nps"
    if rec is None:
        head_end = frames_of(data)[0][1]
        h = msgpack.unpackb(data[S.FRAME.size:head_end], raw=False, strict_map_key=False)
        f.write_bytes(S.frame(pack({**h, "features": {"x": d}})) + data[head_end:])
    else:
        f.write_bytes(_insert_after_header(data, S.frame(pack(rec))))
    assert check_case([f]) == []
    # deeper than msgpack unpacks: the frame is refused by itself, named
    f.write_bytes(_insert_after_header(data, S.frame(b"\x82\xa3rec\xa5event\xa3raw"
                                                     + b"\x91" * 100_000 + b"\x90")))
    r = run(replay_command, [f, "--json"])
    assert verdict_of(r) is None and r.exit_code == 2 and "frame 1 at byte" in r.stderr


@pytest.mark.parametrize("orig_len", [0xFFFFFFFF, 0xFFFFFFF2, (1 << 24) + 1])
def test_a_packet_longer_than_any_skb_is_counted_not_an_overflow(tmp_path, seed_dir, orig_len):
    _f, data = _seed_file(seed_dir)
    e = ev.decode(seed_events()[0])
    raw = ev.encode_packet(SEED_PACKET, ts_ns=e.ts_ns, skb=e.skb, ifindex=e.ifindex,
                           ev_type=e.type, hook=e.hook, orig_len=orig_len)
    f = tmp_path / "nptrace-len.nps"
    f.write_bytes(_insert_after_header(data, S.frame(pack({"rec": "packet", "raw": raw}))))
    assert check_case([f]) == []
    r = run(replay_command, [f, "-w", tmp_path / "o.pcapng"])
    assert r.exit_code == 2 and "could not be decoded" in r.stderr and "bytes (at most" in r.stderr


# Frames built so that msgpack allocates far more than their bytes: before the limits, a
# 64 MiB frame of empty arrays took 5 GB. Python objects cost up to ~25 times the msgpack
# bytes they come from (a 2-character string: 3 bytes, 56 as an object plus its pointer),
# so that is the bound: RSS_MULTIPLE is generous over it, RSS_SLACK_MB covers the process.
RSS_MULTIPLE = 32
RSS_SLACK_MB = 100
BOMB_BYTES = int(os.environ.get("NPTRACE_FUZZ_BOMB_MB", "2")) << 20   # make fuzz: 64
_HEAD = b"\x82\xa3rec\xa5event\xa3raw"


def _arrays(elem: bytes, per: int = 1 << 16) -> bytes:
    """An array of arrays of `elem`, each under every per-container limit, BOMB_BYTES long."""
    inner = b"\xdd" + struct.pack(">I", per) + elem * per
    k = BOMB_BYTES // len(inner)
    return b"\xdd" + struct.pack(">I", k) + inner * k


def _bombs(header: dict) -> dict[str, tuple[bytes, bool]]:
    """name -> (payload, is a header)."""
    flat = BOMB_BYTES - 64
    rows = [[[f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"], f"ns/p{i}"]
            for i in range(min(BOMB_BYTES // 24, 1 << 20))]
    return {
        "one array of empty arrays": (_HEAD + b"\xdd" + struct.pack(">I", flat) + b"\x90" * flat,
                                      False),
        "arrays of empty arrays": (_HEAD + _arrays(b"\x90"), False),
        "arrays of empty maps": (_HEAD + _arrays(b"\x80"), False),
        "arrays of short strings": (_HEAD + _arrays(b"\xa2ab"), False),
        "arrays of nil triples": (_HEAD + _arrays(b"\x93\xc0\xc0\xc0"), False),
        "header lookups table of empty rows": (
            msgpack.packb({**header, "lookups": None}, use_bin_type=True)[:-1]
            + _arrays(b"\x92\x90\x90", 1 << 14), True),
        "header lookups table of answers": (
            msgpack.packb({**header, "lookups": {"pod_of": rows}}, use_bin_type=True), True),
    }


_RSS_RUN = ("import resource, sys\n"
            "from nptrace.cli import main\n"
            "try:\n"
            "    main(sys.argv[1:])\n"
            "finally:\n"
            "    print(f'rss_kb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}',"
            " file=sys.stderr)\n")


def run_measured(args) -> tuple[int, str, int]:
    """(exit code, stderr without the RSS line, peak RSS in bytes) of a CLI run in a process
    of its own."""
    p = subprocess.run(["timeout", "120", sys.executable, "-c", _RSS_RUN, *map(str, args)],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    lines = p.stderr.splitlines()
    rss = [int(x.split("=")[1]) for x in lines if x.startswith("rss_kb=")]
    assert rss, p.stderr
    return p.returncode, "\n".join(x for x in lines if not x.startswith("rss_kb=")), rss[-1] << 10


BOMB_COMMANDS = [["replay", "-o", "table"], ["report", "-o", "json"], ["merge", "-o", "json"]]


def test_allocation_bombs_are_bounded_by_their_size(tmp_path, seed_dir):
    f0, data = _seed_file(seed_dir)
    head_end = frames_of(data)[0][1]
    header = msgpack.unpackb(data[S.FRAME.size:head_end], raw=False, strict_map_key=False)
    _rc, _err, base = run_measured(["replay", "-o", "json", f0])
    over = []
    for name, (payload, is_header) in _bombs(header).items():
        f = tmp_path / "nptrace-bomb.nps"
        f.write_bytes(S.frame(payload) + data[head_end:] if is_header
                      else _insert_after_header(data, S.frame(payload)))
        size = f.stat().st_size
        for cmd in BOMB_COMMANDS:
            rc, err, rss = run_measured([*cmd, f])
            errors = [x for x in err.splitlines() if "error:" in x]
            assert rc in (0, 2) and "Traceback" not in err, (name, cmd, err)
            assert rc == 0 or len(errors) == 1, (name, cmd, err)
            if rss - base > RSS_MULTIPLE * size + (RSS_SLACK_MB << 20):
                over.append(f"{name} {' '.join(cmd)}: +{(rss - base) >> 20} MB for "
                            f"{size >> 20} MiB")
    assert not over, "\n".join(over)


def test_random_cases_stay_within_the_rss_bound(tmp_path, seed_dir):
    """A few of the seeded cases again, each in a process of its own."""
    f0, data = _seed_file(seed_dir)
    _rc, _err, base = run_measured(["replay", "-o", "json", f0])
    for s in range(4):
        rng = random.Random(s)
        blob = data
        for _ in range(rng.choice([1, 2, 3])):
            blob = mutate_file(rng, blob)
        f = tmp_path / f0.name
        f.write_bytes(blob)
        for cmd in (["replay", "-o", "table"], ["merge", "-o", "json"]):
            rc, err, rss = run_measured([*cmd, f])
            assert rc in (0, 2) and "Traceback" not in err, (s, cmd, err)
            assert rss - base < RSS_MULTIPLE * len(blob) + (RSS_SLACK_MB << 20), (s, cmd)
