"""The py-spy runner and the reading of its raw output (nptrace/bench/pyspy.py): the stage
split, self time per leaf function, the samples left out of the split, and a missing py-spy
reported instead of raised. No py-spy needed."""
from __future__ import annotations

import sys

import pytest

from nptrace.bench import pipeline as pl
from nptrace.bench import pyspy

ROOT = "_run_module_as_main (<frozen runpy>:198);main (nptrace/bench/pipeline.py:248)"
LOOP = ROOT + ";run_pipeline (nptrace/bench/pipeline.py:165)"
# collapsed stacks as `py-spy record --format raw` writes them: 100 samples in all
RAW = "\n".join([
    # the loop: 40 attribution, 30 json sink, 10 decode, 5 other = 85 counted
    LOOP + ";Classifier.feed_many (nptrace/classify.py:344);_make_verdict (nptrace/classify.py:12) 30",
    # the Context's lambda, defined in pipeline.py, called by the classifier: attribution
    LOOP + ";Classifier._report (nptrace/classify.py:560);run_pipeline.<locals>.<lambda> "
           "(nptrace/bench/pipeline.py:150) 10",
    LOOP + ";JsonLines.write_many (nptrace/sinks/jsonl.py:170);verdict_line "
           "(nptrace/sinks/jsonl.py:139) 25",
    LOOP + ";JsonLines.write_many (nptrace/sinks/jsonl.py:170);StormCollapse.add "
           "(nptrace/sinks/collapse.py:80) 5",
    LOOP + ";decode_many (nptrace/events.py:320);from_tuple (nptrace/events.py:290) 6",
    LOOP + ";decode_many (nptrace/events.py:320) 4",
    LOOP + " 5",
    # the build and the imports under run_pipeline, start-up and teardown outside it: skipped
    ROOT + ";run_pipeline (nptrace/bench/pipeline.py:139);records (nptrace/bench/pipeline.py:70) 8",
    ROOT + ";run_pipeline (nptrace/bench/pipeline.py:131);_find_and_load "
           "(<frozen importlib._bootstrap>:1176);<module> (nptrace/classify.py:1) 2",
    ROOT + " 3",
    "_run_module_as_main (<frozen runpy>:198);<module> (nptrace/bench/pipeline.py:1) 2",
    "not a stack line",
    "",
])


def test_stage_split_over_the_loop_only():
    s = pyspy.summarize(RAW, within=pl.PYSPY_WITHIN, skip=pl.PYSPY_SKIP)
    assert s["total_samples"] == 100 and s["samples"] == 85
    assert s["stages"] == {"decode": round(10 / 85, 4), "ring": 0.0,
                           "attribution": round(40 / 85, 4), "json sink": round(30 / 85, 4),
                           "other": round(5 / 85, 4)}
    assert pyspy.stage_text(s["stages"]) == "attribution 47%, json sink 35%, decode 12%, other 6%"


def test_self_time_goes_to_the_leaf_function():
    s = pyspy.summarize(RAW, top=3, within=pl.PYSPY_WITHIN, skip=pl.PYSPY_SKIP)
    assert s["top"] == [
        {"function": "_make_verdict (nptrace/classify.py)", "self_share": round(30 / 85, 4)},
        {"function": "verdict_line (nptrace/sinks/jsonl.py)", "self_share": round(25 / 85, 4)},
        {"function": "run_pipeline.<locals>.<lambda> (nptrace/bench/pipeline.py)",
         "self_share": round(10 / 85, 4)},
    ]


def test_without_a_filter_every_sample_counts():
    s = pyspy.summarize(RAW)
    assert s["samples"] == s["total_samples"] == 100
    # the import of classify.py is attribution by file; the build, start-up: other
    assert s["stages"]["attribution"] == 0.42 and s["stages"]["other"] == 0.18


def test_stage_of_frames():
    assert pyspy.stage_of("Event.from_tuple", "nptrace/events.py") == "decode"
    assert pyspy.stage_of("decode", "nptrace/events.py") is None      # not the batch path
    assert pyspy.stage_of("RingReader.read_batch", "/x/nptrace/kernel/ringbuf.py") == "ring"
    assert pyspy.stage_of("x", "other/classify.py") is None
    assert pyspy.summarize("")["samples"] == 0
    assert pyspy.stage_text(pyspy.summarize("")["stages"]) == "no samples"


def test_record_reports_a_missing_pyspy(tmp_path):
    r = pyspy.record([sys.executable, "-c", "pass"], 5, tmp_path / "out.txt",
                     pyspy=str(tmp_path / "no-such-py-spy"))
    assert set(r) == {"error"} and "no-such-py-spy" in r["error"]


def test_record_reports_a_failing_pyspy(tmp_path):
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Error: Permission Denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    r = pyspy.record([sys.executable, "-c", "pass"], 5, tmp_path / "out.txt", pyspy=str(fake))
    assert r == {"error": "py-spy exit 1: Error: Permission Denied"}


def test_pipeline_row_says_why_pyspy_did_not_run():
    row = pl._pyspy_row({"error": "py-spy not installed"})
    assert row.nptrace == "not run: py-spy not installed" and row.verdict == "-"


@pytest.mark.skipif(pyspy.default_pyspy() is None, reason="py-spy not installed")
def test_record_samples_a_child(tmp_path):
    out = tmp_path / "raw.txt"
    r = pyspy.record([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<0.5: pass"],
                     30, out, rate=200)
    if "error" in r and "ermission" in r["error"]:
        pytest.skip(f"py-spy may not trace here: {r['error']}")
    assert "error" not in r, r
    assert pyspy.summarize(out.read_text())["samples"] > 10
