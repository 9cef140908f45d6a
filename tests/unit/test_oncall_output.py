"""The output vocabulary of every command: -o text|json|table (--json its alias),
RFC 3339 ms UTC times (--local), [v6]:port, -n, `report -o json` with every number the text
prints; bad values are one line and exit 2."""
import io
import json
import re
import socket

import pytest
from click.testing import CliRunner

from nptrace import cli
from nptrace import events as ev
from nptrace.classify import Classifier, Context
from nptrace.sessions.commands import merge_command, replay_command, report_command
from nptrace.sinks.console import Console
from nptrace.sinks.jsonl import dumps, verdict_dict, verdict_line

from test_offline import DROPS, HOST_NS, RSTS, live, pod_no_listener, scenario_a

TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}(Z|[+-]\d\d:\d\d)")


def invoke(cmd, args):
    return CliRunner().invoke(cmd, [str(a) for a in args])


def counted(tmp_path):
    counts = ({(1, 1, 16, 3, HOST_NS): 9, (3, 3, 0, 3, HOST_NS): 2},
              {"emitted": 10, "lost": 1, "filtered": 4})
    live(tmp_path / "a", scenario_a(), counters=lambda: counts)
    live(tmp_path / "b", [pod_no_listener(61_500_000_000)], node="node-b")
    return [tmp_path / "a", tmp_path / "b"]


def _strings_and_numbers(x, strs, nums):
    if isinstance(x, dict):
        for k, y in x.items():
            strs.add(str(k))
            _strings_and_numbers(y, strs, nums)
    elif isinstance(x, list):
        for y in x:
            _strings_and_numbers(y, strs, nums)
    elif isinstance(x, bool) or x is None:
        pass
    elif isinstance(x, (int, float)):
        nums.add(x)
    else:
        strs.add(str(x))


def test_report_json_has_every_number_the_text_prints(tmp_path):
    paths = counted(tmp_path)
    text = invoke(report_command, paths)
    js = invoke(report_command, [*paths, "-o", "json"])
    assert text.exit_code == 0 and js.exit_code == 0, js.output
    d = json.loads(js.stdout)
    strs, nums = set(), set()
    _strings_and_numbers(d, strs, nums)
    # the numbers of the text outside the strings the JSON holds whole (times, flows, names)
    rest = text.stdout
    for s in sorted(strs, key=len, reverse=True):
        if len(s) > 2 and re.search(r"\d", s):
            rest = rest.replace(s, " ")
    found = [int(n) for n in re.findall(r"(?<![\w.:/-])\d+(?![\w.:/-])", rest)]
    assert found, rest
    missing = [n for n in found if n not in nums]
    assert not missing, (missing, rest)
    # and the report's sections are there by name
    for key in ("by_cause", "by_service", "by_interface", "by_node", "top_flows", "timeline",
                "kernel", "warnings", "problems"):
        assert key in d
    assert d["kernel"]["ring"] == {"emitted": 10, "lost": 1, "filtered": 4}
    assert d["by_node"] == {"node-a": 3, "node-b": 1}
    assert TS.fullmatch(d["timeline"]["rows"][0]["time"])
    assert invoke(report_command, [*paths, "--json"]).stdout == js.stdout   # the alias


def test_report_times_are_rfc3339_ms_utc_or_local(tmp_path, monkeypatch):
    paths = counted(tmp_path)
    out = invoke(report_command, paths).stdout
    assert "events 2023-11-14T22:13:20.001Z .. " in out
    assert "timeline (per minute, UTC)" in out and "2023-11-14T22:13:00.000Z" in out
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    import time
    time.tzset()
    try:
        out = invoke(report_command, [*paths, "--local"]).stdout
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert "events 2023-11-15T03:43:20.001+05:30" in out and "local)" in out


def test_replay_text_times_are_utc_ms(tmp_path):
    live(tmp_path / "a", scenario_a())
    out = invoke(replay_command, [tmp_path / "a"]).stdout
    first = out.splitlines()[0]
    assert first.startswith("2023-11-14T22:13:20.001Z rp_filter"), first


def test_replay_and_merge_tables(tmp_path):
    paths = counted(tmp_path)
    r = invoke(replay_command, [paths[0], "-o", "table"])
    assert r.exit_code == 0, r.output
    head, *rows = r.stdout.splitlines()
    assert head.split() == ["TIME", "NODE", "CAUSE", "WHAT", "FLOW", "IFACE", "SERVICE"]
    assert len(rows) == 3
    assert TS.match(rows[0]) and "node-a" in rows[0] and "rp_filter" in rows[0]
    assert "192.168.2.10:5000 -> 10.0.0.2:30080" in rows[0] and "default/web:http" in rows[0]
    col = head.index("CAUSE")
    assert all(row[col:].startswith(("rp_filter", "no_listener", "snat", "proxy", "peer_reset"))
               for row in rows), rows
    m = invoke(merge_command, [*paths, "-o", "table"])
    assert m.exit_code == 0, m.output
    lines = m.stdout.splitlines()
    assert lines[0].split()[:3] == ["TIME", "NODE", "STORY"]
    assert sum(1 for x in lines if "node-b" in x and "no_listener" in x) >= 1


def test_no_names(tmp_path):
    live(tmp_path / "a", scenario_a())
    for args in ([], ["-o", "table"]):
        out = invoke(replay_command, [tmp_path / "a", "-n", *args]).stdout
        assert "default/web" not in out and "eth1" not in out, out
        assert "ifindex 3" in out
    rows = [json.loads(x) for x in invoke(replay_command, [tmp_path / "a", "-n", "-o", "json"]).stdout.splitlines()]
    assert all(d["service"] is None and d["iface"] is None and d["ifindex"] for d in rows)
    assert all(x["iface"] is None for d in rows for x in d["evidence"])
    assert not any("eth1" in d["hint"] for d in rows), [d["hint"] for d in rows]
    rep = invoke(report_command, [tmp_path / "a", "-n"]).stdout
    assert "default/web" not in rep and "eth1" not in rep and "ifindex 3" in rep
    m = invoke(merge_command, [tmp_path / "a", "-n"]).stdout
    assert "default/web" not in m and "eth1" not in m


def _v6_incident():
    raw = ev.encode(ts_ns=1_000_000, type=ev.EvType.RST_SENT, hook=ev.Hook.TCP_SEND_RST,
                    reason=1, ifindex=3, netns=HOST_NS, saddr="fd00::10", sport=5000,
                    daddr="fd00::1", dport=40001, family=socket.AF_INET6,
                    tcpflags=ev.TCP_RST | ev.TCP_ACK, aux=ev.TCP_SYN)
    c = Classifier(Context(drop_name=DROPS.name, rst_name=RSTS.name,
                           iface_name=lambda ns, i: "eth1"))
    out = list(c.feed(ev.decode(raw))) + list(c.flush())
    assert len(out) == 1
    return out[0]


def test_ipv6_endpoints_in_brackets_everywhere():
    v = _v6_incident()
    assert v.cause == "no_listener" and "[fd00::10]:5000" in v.hint
    line = verdict_line(v, 0)
    assert line == dumps(verdict_dict(v, 0))
    d = json.loads(line)
    assert d["saddr"] == "fd00::10" and d["sport"] == 5000     # separate fields unchanged
    assert d["evidence"][0]["detail"] == "[fd00::10]:5000 > [fd00::1]:40001"
    buf = io.StringIO()
    Console(0, buf).write(v)
    assert "[fd00::10]:5000 -> [fd00::1]:40001" in buf.getvalue()
    assert TS.match(buf.getvalue())


def test_ipv4_json_lines_unchanged_by_the_v6_path(tmp_path):
    want = live(tmp_path / "a", scenario_a())
    assert all("[" not in x["detail"] for d in want for x in d["evidence"])


@pytest.mark.parametrize("argv", [
    ["replay", "X", "-o", "yaml"], ["report", "X", "-o", "table"], ["merge", "X", "-o", "csv"],
    ["replay", "X", "--json", "-o", "table"], ["merge", "X", "--json", "-o", "text"],
    ["report", "X", "--json", "-o", "text"], ["run", "-o", "yaml"],
    ["run", "--json", "-o", "text"], ["run", "--json", "-o", "table"], ["run", "-o", "tables"],
    ["replay", "X", "-w", "/nonexistent/dir/x.pcapng"], ["replay", "X", "-w", "X"],
])
def test_bad_output_options_are_one_line_exit_2(argv, tmp_path, capsys):
    live(tmp_path / "a", scenario_a())
    argv = [str(tmp_path / "a") if a == "X" else a for a in argv]
    with pytest.raises(SystemExit) as ex:
        cli.main(argv)
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("nptrace: error: ")


def test_run_table_rows_stream_under_one_header():
    from nptrace.sinks.collapse import StormCollapse
    from nptrace.sinks.console import LiveTable
    v = _v6_incident()
    buf = io.StringIO()
    t = LiveTable(0, buf)
    t.write(v)
    t.write(v)
    head, *rows = buf.getvalue().splitlines()     # streamed: there before close()
    assert head.split() == ["TIME", "CAUSE", "WHAT", "IFACE", "SERVICE", "N", "FLOW"]
    assert len(rows) == 2 and TS.match(rows[0])
    cells = rows[0].split()
    assert cells[1:6] == ["no_listener", "rst/sent", "eth1", "-", "1"], cells
    assert rows[0].endswith("[fd00::10]:5000 -> [fd00::1]:40001")
    for col in ("CAUSE", "WHAT", "IFACE", "N", "FLOW"):      # fixed width: columns line up
        assert rows[0][head.index(col)] != " " and rows[0][head.index(col) - 1] == " ", col
    assert "no_listener" in t.summary()
    # a storm's collapsed rows: one row with N = how many
    buf = io.StringIO()
    t = LiveTable(0, buf, collapse=StormCollapse(burst=1))
    for _ in range(4):
        t.write(v)
    t.close()
    rows = buf.getvalue().splitlines()[1:]
    assert [r.split()[5] for r in rows] == ["1", "3"], rows


def test_run_table_summary_rows():
    from nptrace.classify.keylabel import KeyLabel
    from nptrace.sinks.console import LiveTable
    from nptrace.sinks.exact import SummaryRow
    buf = io.StringIO()
    lab = KeyLabel("rst", "no_listener", "sent", "eth1", "default/web:http", "tcp_send_reset", "x")
    LiveTable(0, buf).write_summary([SummaryRow(lab, 7, 0, 10**9)])
    row = buf.getvalue().splitlines()[1]
    assert row.split()[1:6] == ["no_listener", "rst/sent", "eth1", "default/web:http", "7"]
    assert "counted in the kernel" in row
    Console(0, io.StringIO()).write_summary([SummaryRow(lab, 7, 0, 10**9)])   # text too
