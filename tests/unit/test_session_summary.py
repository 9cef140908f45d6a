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
