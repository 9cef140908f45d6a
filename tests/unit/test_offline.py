"""replay / report / merge over recorded sessions (no root, no bcc): replay prints what the
live run printed; problems are one line on stderr with the right exit code."""
import json
import os

import pytest
from click.testing import CliRunner

from nptrace import events as ev
from nptrace.sessions.commands import merge_command, replay_command, report_command
from nptrace.sessions.merge import merge
from nptrace.sessions.replay import Replay, replay
from nptrace.sessions.report import report
from nptrace.classify import Classifier, Context
from nptrace.reasons import ReasonTable
from nptrace.sessions.header import make_header, session_files
from nptrace.sessions.reader import read_session
from nptrace.sessions.writer import SessionWriter
from nptrace.sinks.jsonl import verdict_dict
from nptrace.sinks.recorder import Recorder

E0 = 1_700_000_000 * 10**9        # wall-clock ns of the scenario's start
HOST_NS = 4026531840
DROPS = ReasonTable({3: "SKB_DROP_REASON_NO_SOCKET", 12: "SKB_DROP_REASON_NETFILTER_DROP",
                     16: "SKB_DROP_REASON_IP_RPFILTER"}, "SKB_DROP_REASON_")
RSTS = ReasonTable({0: "SK_RST_REASON_NOT_SPECIFIED", 1: "SK_RST_REASON_NO_SOCKET"}, "SK_RST_REASON_")
SVC = {("10.0.0.2", 30080): "default/web:http", ("10.244.2.5", 8080): "default/web:http"}


def rp_drop(ts, sport=5000, ifindex=3):
    return ev.encode(ts_ns=ts, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16,
                     ifindex=ifindex, netns=HOST_NS, saddr="192.168.2.10", sport=sport,
                     daddr="10.0.0.2", dport=30080, l4proto=6, tcpflags=ev.TCP_SYN)


def rst_recv(ts, sport=5000, ifindex=3):
    return ev.encode(ts_ns=ts, type=ev.EvType.RST_RECV, hook=ev.Hook.TCP_RECV_RST,
                     ifindex=ifindex, netns=HOST_NS, saddr="10.0.0.2", sport=30080,
                     daddr="192.168.2.10", dport=sport, flags=ev.F_HAS_SOCK, tcpflags=ev.TCP_RST)


def pod_no_listener(ts):
    """Node B: the pod's kernel resets the SNATed connection (nothing listens on 8080)."""
    return ev.encode(ts_ns=ts, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST, reason=1,
                     ifindex=5, netns=HOST_NS, saddr="10.244.2.5", sport=8080,
                     daddr="10.0.0.2", dport=40001, tcpflags=ev.TCP_RST | ev.TCP_ACK,
                     aux=ev.TCP_SYN)   # the packet it answered


def nodeport_wire_rst(ts):
    """Node A: that reset arrives back from node B, before conntrack un-NATs it."""
    return ev.encode(ts_ns=ts, type=ev.EvType.WIRE_RST, hook=ev.Hook.TC_INGRESS, ifindex=3,
                     netns=HOST_NS, saddr="10.244.2.5", sport=8080, daddr="10.0.0.2",
                     dport=40001, tcpflags=ev.TCP_RST | ev.TCP_ACK, flags=ev.F_HAS_CT,
                     ct_osrc="192.0.2.10", ct_osport=50000, ct_odst="10.0.0.2", ct_odport=30080,
                     ct_rsrc="10.244.2.5", ct_rsport=8080, ct_rdst="10.0.0.2", ct_rdport=40001,
                     ct_status=ev.IPS_DST_NAT | ev.IPS_SRC_NAT)


def live(d, raws, *, node="node-a", mono0=0, ifnames=None, services=None, rename_at=None,
         counters=None, **wkw):
    """The live pipeline as tracer.py wires it: recorder.on_raw before classifier.feed, the
    Context's lookups wrapped by the recorder. Returns the JSON lines the live run printed."""
    offset = E0 - mono0
    w = SessionWriter(d, header=make_header(epoch_offset_ns=offset, drops=DROPS, resets=RSTS,
                                            node=node, kernel="6.18.0"), **wkw)
    rec = Recorder(w, counters=counters)
    names = dict(ifnames or {3: "eth1", 5: "eth0"})
    svc = dict(SVC if services is None else services)
    ctx = Context(drop_name=DROPS.name, rst_name=RSTS.name,
                  iface_name=rec.iface_name(lambda ns, i: names.get(i)),
                  service_of=rec.service_of(lambda a, p: svc.get((a, p))))
    c = Classifier(ctx)
    out = []
    for i, raw in enumerate(raws):
        if rename_at is not None and i == rename_at:
            names[3] = "eth1-renamed"
        rec.on_raw(raw)
        for v in c.feed(ev.decode(raw)):
            out.append({"node": node, **verdict_dict(v, offset)})   # live lines name the node
        rec.tick()
    for v in c.flush():
        out.append({"node": node, **verdict_dict(v, offset)})
    rec.close()
    return out


def scenario_a(mono0=0):
    t = mono0
    return [rp_drop(t + 1_000_000), rst_recv(t + 2_000_000),
            rp_drop(t + 61 * 10**9, sport=5001), nodeport_wire_rst(t + 62 * 10**9)]


def roundtrip(v):
    return json.loads(json.dumps(v))


def test_replay_equals_live_with_names_services_and_rotation(tmp_path):
    raws = scenario_a() + [rp_drop(70 * 10**9 + i, sport=6000 + i) for i in range(60)]
    want = live(tmp_path / "a", raws, rename_at=40, max_file_bytes=4096 * 2)
    assert len(session_files(tmp_path / "a")) > 1            # rotation happened mid-run
    assert want[0]["iface"] == "eth1" and want[0]["service"] == "default/web:http"
    assert want[-1]["iface"] == "eth1-renamed"
    problems = []
    got = [{"node": it.node, **verdict_dict(it.verdict, it.header["epoch_offset_ns"])}
           for it in Replay(tmp_path / "a").items()]
    assert problems == []
    assert roundtrip(got) == roundtrip(want)
    assert [v.cause for v in replay(tmp_path / "a")] == [d["cause"] for d in want]


def test_received_reset_inherits_the_drop_cause_in_replay(tmp_path):
    out = live(tmp_path / "a", scenario_a())
    assert [d["cause"] for d in out[:2]] == ["rp_filter", "rp_filter"]
    got = [v.cause for v in replay(tmp_path / "a")]
    assert got[:2] == ["rp_filter", "rp_filter"]


def test_each_daemon_start_is_a_run_of_its_own(tmp_path):
    d = tmp_path / "a"
    live(d, [rp_drop(1_000)])
    live(d, [rst_recv(2_000)])                   # restarted daemon: no memory of the drop
    causes = [v.cause for v in replay(d)]
    assert causes == ["rp_filter", "peer_reset"]


def verdict_lines(r) -> list[str]:
    """stdout of --json without its loss lines ({"kind":"loss",...})."""
    return [x for x in r.stdout.splitlines() if '"kind":"loss"' not in x]


def invoke(cmd, args):
    return CliRunner().invoke(cmd, [str(a) for a in args])


def test_replay_command_json_is_the_live_json(tmp_path):
    want = live(tmp_path / "a", scenario_a())
    r = invoke(replay_command, [tmp_path / "a", "--json"])
    assert r.exit_code == 0, r.output
    got = [json.loads(x) for x in r.stdout.splitlines()]
    assert got == roundtrip(want)
    assert r.stderr == ""


def test_replay_command_text(tmp_path):
    live(tmp_path / "a", scenario_a())
    r = invoke(replay_command, [tmp_path / "a"])
    assert r.exit_code == 0
    assert "rp_filter" in r.stdout and "hint:" in r.stdout and "svc=default/web:http" in r.stdout
    assert "summary" in r.stderr


def test_replay_torn_tail_prints_good_records_warns_exit_0(tmp_path):
    full = live(tmp_path / "a", scenario_a())
    [f] = session_files(tmp_path / "a")
    # The last record is the final counters snapshot; with no counters fn it is the last
    # event (an incident of its own), before the stop record a clean close writes. Cut into it.
    data = f.read_bytes()
    _, recs, _ = read_session(f)
    last = list(recs)[-1].offset
    os.truncate(f, last + (len(data) - last) // 3)
    r = invoke(replay_command, [f, "--json"])
    assert r.exit_code == 0
    assert len(verdict_lines(r)) == len(full) - 1
    assert [json.loads(x)["loss"] for x in r.stdout.splitlines() if '"kind":"loss"' in x] \
        == ["torn_tail"]
    [line] = r.stderr.splitlines()[-1:]
    assert line.startswith("nptrace: warning: ") and "torn tail at byte" in line
    assert "Traceback" not in r.output


def test_replay_corrupt_middle_prints_the_rest_and_exits_2(tmp_path):
    live(tmp_path / "a", scenario_a())
    [f] = session_files(tmp_path / "a")
    _, recs, _ = read_session(f)
    off = [x for x in recs if x.kind == "event"][1].offset
    data = bytearray(f.read_bytes())
    data[off + 30] ^= 0x55
    f.write_bytes(bytes(data))
    r = invoke(replay_command, [f, "--json"])
    assert r.exit_code == 2
    # the corrupt record was the received RST, which joined the first rp_filter incident
    assert len(verdict_lines(r)) == 3
    assert "corrupt record at byte" in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize("cmd", [replay_command, report_command,
                                 merge_command])
def test_not_a_session_is_one_line_exit_2(tmp_path, cmd):
    f = tmp_path / "notes.txt"
    f.write_text("not a session\n")
    r = invoke(cmd, [f])
    assert r.exit_code == 2
    assert r.stdout == ""
    assert "not an nptrace session file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = invoke(cmd, [tmp_path / "missing"])
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_replay_via_the_nptrace_entry_point(tmp_path):
    """Through a group and cli.main, as the lead registers it: `nptrace: error: ...`."""
    import click
    from nptrace import cli
    live(tmp_path / "a", scenario_a())
    f = tmp_path / "bad"
    f.write_text("x")
    group = click.Group(commands={"replay": replay_command})
    saved = cli.main_group
    cli.main_group = group
    try:
        with pytest.raises(SystemExit) as ex:
            cli.main(["replay", str(f)])
    finally:
        cli.main_group = saved
    assert ex.value.code == 2


def test_replay_writes_pcap(tmp_path):
    live(tmp_path / "a", scenario_a())
    out = tmp_path / "x.pcapng"
    r = invoke(replay_command, [tmp_path / "a", "--json", "--pcap", out])
    assert r.exit_code == 0
    assert out.read_bytes()[:4] == b"\x0a\x0d\x0d\x0a"
    assert oct(out.stat().st_mode & 0o777) == "0o600"


def test_report(tmp_path):
    counts = ({(1, 1, 16, 3, HOST_NS): 9, (3, 3, 0, 3, HOST_NS): 2},
              {"emitted": 10, "lost": 1, "filtered": 4})
    live(tmp_path / "a", scenario_a(), counters=lambda: counts)
    text = report(tmp_path / "a")
    assert "4 events replayed, 3 labeled" in text
    assert "rp_filter" in text and "default/web:http" in text and "eth1" in text
    assert "top flows" in text and "192.168.2.10:5000 -> 10.0.0.2:30080" in text
    assert "192.0.2.10:50000 -> 10.0.0.2:30080 -> 10.244.2.5:8080" in text
    assert "timeline (per minute, UTC)" in text
    assert "2023-11-14T22:13:00.000Z" in text and "2023-11-14T22:14:00.000Z" in text
    assert "DROP           skb:kfree_skb            IP_RPFILTER" in text
    assert "1 lost" in text and "WARNING: 1 event records were lost" in text
    r = invoke(report_command, [tmp_path / "a", "--top", "1"])
    assert r.exit_code == 0 and "top flows (1 of 3)" in r.stdout


def test_report_of_a_quiet_session(tmp_path):
    live(tmp_path / "a", [])
    text = report(tmp_path / "a")
    assert "no resets or drops recorded" in text and "kernel counts: none recorded" in text


def test_merge_interleaves_nodes_and_joins_the_crossing_flow(tmp_path):
    # Node A's monotonic clock started 500 s after node B's: only epoch time orders them.
    live(tmp_path / "a", scenario_a(mono0=10 * 10**9), node="node-a", mono0=10 * 10**9)
    live(tmp_path / "b", [pod_no_listener(900 * 10**9 + 61_500_000_000)], node="node-b",
         mono0=900 * 10**9)
    got = list(merge([tmp_path / "a", tmp_path / "b"]))
    # the first rp_filter drop and the reset the client received are one incident
    assert [m.node for m in got] == ["node-a", "node-a", "node-b", "node-a"]
    times = [m.item.epoch_ns for m in got]
    assert times == sorted(times)
    story = {m.verdict.event.type: m.story for m in got}
    assert story[ev.EvType.RST_SENT] == story[ev.EvType.WIRE_RST]        # one connection
    assert got[0].story != got[1].story != story[ev.EvType.RST_SENT]

    r = invoke(merge_command, [tmp_path / "a", tmp_path / "b"])
    assert r.exit_code == 0, r.output
    assert "stories across nodes (1)" in r.stdout
    assert "node-b -> node-a" in r.stdout and "no_listener" in r.stdout
    r = invoke(merge_command, [tmp_path / "a", tmp_path / "b", "--json"])
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert {x["node"] for x in rows} == {"node-a", "node-b"}
    assert rows[2]["story"] == rows[3]["story"] and rows[2]["cause"] == "no_listener"


def test_merge_window_keeps_reused_tuples_apart(tmp_path):
    live(tmp_path / "a", [rp_drop(0), rp_drop(100 * 10**9)])
    got = list(merge([tmp_path / "a"], window_s=30))
    assert got[0].story != got[1].story
    got = list(merge([tmp_path / "a"], window_s=1000))
    assert got[0].story == got[1].story


def test_replay_collapse_sums_to_every_incident(tmp_path):
    raws = [rp_drop(1_000_000 + i * 1000, sport=7000 + i) for i in range(50)]
    want = live(tmp_path / "a", raws)
    r = invoke(replay_command, [tmp_path / "a", "--json", "--collapse", "5"])
    assert r.exit_code == 0, r.output
    got = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(got) < len(want) and sum(d["repeat"] for d in got) == len(want)
    assert sum(d["events"] for d in got) == sum(d["events"] for d in want)
    assert any(d["repeat"] > 1 and "repeat_since" in d for d in got)
    plain = invoke(replay_command, [tmp_path / "a", "--json"])
    assert len(plain.stdout.splitlines()) == len(want)           # --json: off by default
    text = invoke(replay_command, [tmp_path / "a"])        # console: on by default
    assert "more rp_filter like this" in text.stdout


def test_storm_collapse_defaults():
    from nptrace.sinks.collapse import storm_collapse
    assert storm_collapse(None, True) is None and storm_collapse(0, False) is None
    assert storm_collapse(None, False).burst == 20 and storm_collapse(5, True).burst == 5


def _live_with_routes(d, raws, answer, **wkw):
    """live(), with route_iface recorded too (rp_filter hints name the route back)."""
    offset = E0
    w = SessionWriter(d, header=make_header(epoch_offset_ns=offset, drops=DROPS, resets=RSTS,
                                            node="node-a", kernel="6.18.0"), **wkw)
    rec = Recorder(w)
    clock = {"i": 0}
    ctx = Context(drop_name=DROPS.name, rst_name=RSTS.name,
                  iface_name=rec.iface_name(lambda ns, i: {3: "eth1"}.get(i)),
                  service_of=rec.service_of(lambda a, p: SVC.get((a, p))),
                  route_iface=rec.lookup("route_iface", lambda ns, a: answer(a, clock["i"])),
                  nat_peer=rec.lookup("nat_peer", lambda *a: None))
    c = Classifier(ctx)
    out = []
    for i, raw in enumerate(raws):
        clock["i"] = i
        rec.on_raw(raw)
        out += [verdict_dict(v, offset) for v in c.feed(ev.decode(raw))]
        rec.tick()
    out += [verdict_dict(v, offset) for v in c.flush()]
    rec.close()
    return out, w


def _scanner(n, sources):
    return [ev.encode(ts_ns=10**9 * i, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=16,
                      ifindex=3, netns=HOST_NS, saddr=f"192.168.{(i % sources) // 250}.{(i % sources) % 250 + 1}",
                      sport=10000 + i, daddr="10.0.0.2", dport=30080, l4proto=6,
                      tcpflags=ev.TCP_SYN) for i in range(n)]


@pytest.mark.parametrize("cap", [1, 3, 16])
def test_replay_equals_live_with_bounded_lookup_tables(tmp_path, cap):
    """The recorder keeps `cap` answers per lookup: sources come back after they were
    forgotten, with the same answer, another one, or None (the case a forgetful replay would
    get wrong); rotation replays each file from its header."""
    def answer(addr, i):
        last = int(addr.rsplit(".", 1)[1])
        if last % 5 == 0:
            return None
        if last % 7 == 0 and i > 150:
            return None if i % 2 else f"eth{i % 3}"     # changes, and goes away
        return f"eth{last % 3}"
    raws = _scanner(300, 40)
    want, w = _live_with_routes(tmp_path / "a", raws, answer, lookup_cache=cap,
                                max_file_bytes=4096 * 3)
    assert len(session_files(tmp_path / "a")) > 1
    assert w.known.size() <= 3 * (cap + 2)         # bounded, whatever came by
    got = [verdict_dict(it.verdict, it.header["epoch_offset_ns"])
           for it in Replay(tmp_path / "a").items()]
    assert roundtrip(got) == roundtrip(want)
    assert any("leaves by eth" in d["hint"] for d in want)
    assert any("leaves by" not in d["hint"] for d in want)
    # the newest file alone (older ones deleted) replays its own events alike
    newest = session_files(tmp_path / "a")[-1]
    alone = [verdict_dict(it.verdict, it.header["epoch_offset_ns"]) for it in Replay(newest).items()]
    tail = roundtrip(want)[-len(alone):] if alone else []
    assert roundtrip(alone)[1:] == tail[1:]


def test_none_answers_of_unknown_keys_cost_nothing(tmp_path):
    raws = _scanner(200, 200)
    _out, w = _live_with_routes(tmp_path / "a", raws, lambda a, i: None)
    kinds = [r.kind for r in read_session(tmp_path / "a")[1]]
    assert kinds.count("lookup") == 0 and kinds.count("event") == 200


def test_replay_json_has_a_loss_line_for_a_cut_session(tmp_path):
    live(tmp_path / "a", scenario_a())
    [f] = session_files(tmp_path / "a")
    _, recs, _ = read_session(f)
    cut = list(recs)[-1].offset           # exactly at a frame boundary: no torn tail
    os.truncate(f, cut)
    r = invoke(replay_command, [f, "--json"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    [loss] = [x for x in rows if x["kind"] == "loss"]
    assert loss["loss"] == "no_stop" and loss["path"] == str(f)
    assert "records may be missing" in r.stderr


def test_recorder_drops_are_shown_in_replay(tmp_path, monkeypatch):
    d = tmp_path / "a"
    w = SessionWriter(d, header=make_header(epoch_offset_ns=E0, drops=DROPS, resets=RSTS,
                                            node="n", kernel="k"), log=lambda m: None)
    w.write_event(rp_drop(1))
    w.dropped = 7                       # as _pause() counts records it could not write
    w.close()
    r = invoke(replay_command, [d, "--json"])
    assert r.exit_code == 0, r.output
    assert "dropped 7 records" in r.stderr
    [loss] = [json.loads(x) for x in r.stdout.splitlines() if '"loss"' in x]
    assert loss["loss"] == "recorder_dropped" and loss["records"] == 7
