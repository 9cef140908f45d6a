"""The live run's summary rows (records counted under their cause, not sent) in session files:
recorded, read back by replay and report with the same numbers."""
import json

from click.testing import CliRunner

from nptrace.classify.keylabel import KeyLabel
from nptrace.sessions.replay import Replay
from nptrace.sessions.report import build_report
from nptrace.sinks.exact import SummaryRow

from test_session import raw, writer

ROWS = [SummaryRow(KeyLabel("rst", "no_listener", "sent", "eth0", None, "tcp:tcp_send_reset",
                            "NO_SOCKET"), 131_276, 1_000_000_000, 2_000_000_000),
        SummaryRow(KeyLabel("drop", "rp_filter", None, "eth0", "default/web:80",
                            "skb:kfree_skb", "IP_RPFILTER"), 222_246, 1_000_000_000,
                   2_000_000_000)]


def session(tmp_path):
    d = tmp_path / "rec"
    w = writer(d)
    w.write_event(raw(1))
    w.write_summary(ROWS)
    w.close()
    return d


def test_summary_rows_round_trip(tmp_path):
    r = Replay([session(tmp_path)])
    list(r.items())
    assert r.problems == []
    assert r.summaries == ROWS


def test_report_and_replay_show_the_live_numbers(tmp_path):
    d = session(tmp_path)
    r = Replay([d])
    text = build_report(r)
    assert "counted, not sent" in text and "131276" in text and "222246" in text
    from nptrace.sessions.commands import replay_command
    out = CliRunner().invoke(replay_command, [str(d), "--json"])
    assert out.exit_code == 0, out.output
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    summ = [x for x in lines if x.get("summary")]
    assert sorted((x["cause"], x["repeat"]) for x in summ) == \
        [("no_listener", 131_276), ("rp_filter", 222_246)]
    assert all(x["repeat_since"] < x["ts"] for x in summ)


# every output form of the offline commands over a session holding summary rows (a storm's
# session has them every second)
FORMS = [("replay", []), ("replay", ["-o", "text"]), ("replay", ["-o", "json"]),
         ("replay", ["-o", "table"]), ("replay", ["--collapse", "1"]),
         ("replay", ["-o", "table", "--collapse", "1"]), ("replay", ["-o", "json", "--collapse", "1"]),
         ("replay", ["-n", "-o", "table"]), ("replay", ["-w", "{tmp}/out.pcapng"]),
         ("report", []), ("report", ["-o", "json"]),
         ("merge", []), ("merge", ["-o", "json"]), ("merge", ["-o", "table"])]


def test_every_output_form_of_a_session_with_summary_rows(tmp_path):
    from nptrace.sessions.commands import merge_command, replay_command, report_command
    cmds = {"replay": replay_command, "report": report_command, "merge": merge_command}
    d = session(tmp_path)
    for name, extra in FORMS:
        args = [str(d), *(a.replace("{tmp}", str(tmp_path)) for a in extra)]
        r = CliRunner().invoke(cmds[name], args)
        assert r.exit_code == 0 and r.exception is None, (name, extra, r.output)
        if name != "merge":       # merge interleaves incidents; summary rows have none
            assert "131276" in r.stdout.replace("131_276", "131276") or \
                "131276" in r.stderr, (name, extra, r.output)


def test_replay_table_has_a_row_per_summary_row_with_its_count(tmp_path):
    from nptrace.sessions.commands import replay_command
    r = CliRunner().invoke(replay_command, [str(session(tmp_path)), "-o", "table"])
    assert r.exit_code == 0, r.output
    head, *rows = r.stdout.splitlines()
    assert head.split()[-1] == "REPEAT"
    counted = [x for x in rows if "counted in the kernel, not sent" in x]
    assert sorted(int(x.split()[-1]) for x in counted) == [131_276, 222_246]
