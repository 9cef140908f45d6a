"""py-spy over a bench child process, and the reading of its raw output: where the time of a
Python loop goes, measured by sampling (no cProfile hooks on every call, which inflate the
many small functions of the classifier and the JSON sink more than the few big ones).

record() runs `py-spy record --format raw --nonblocking` around a command and never raises:
a missing or failing py-spy is {"error": why}, so the bench keeps going without it.
summarize() is pure (text in, dict out): tests/unit/test_pyspy.py covers it.

Caveats: --nonblocking reads the target's memory without pausing it, so the overhead stays
small but a few stacks are torn (py-spy counts them as errors); at a few hundred samples per
second a stage under ~1% is noise.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

STAGES = ("decode", "ring", "attribution", "json sink", "other")
# `name (path:line)`; the line is absent with --nolineno, the path is shortened to the
# package part (nptrace/events.py) unless --full-filenames
_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
_SAMPLES = re.compile(r"Samples: (\d+) Errors: (\d+)")


def default_pyspy() -> str | None:
    """The venv's py-spy (scripts/setup.sh installs it with the `bench` extra), else PATH's:
    under sudo PATH seldom holds the venv's bin."""
    venv = Path(sys.executable).parent / "py-spy"
    return str(venv) if os.access(venv, os.X_OK) else shutil.which("py-spy")


def record(argv: list[str], seconds_max: float, out_path: Path | str, rate: int = 250,
           pyspy: str | None = None) -> dict:
    """Sample `argv` until it exits (at most seconds_max, then it is killed) into out_path,
    py-spy's raw format. {"path", "seconds", "rate", "samples", "errors"} or {"error": why}."""
    exe = pyspy if pyspy is not None else default_pyspy()
    if not exe:
        return {"error": "py-spy not installed (pip install -e '.[bench]')"}
    out_path = Path(out_path)
    cmd = [exe, "record", "--format", "raw", "--rate", str(rate), "--nonblocking",
           "-o", str(out_path), "--", *argv]
    t0 = time.monotonic()
    try:
        # a session of its own: on timeout the profiled child goes with py-spy
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    except OSError as e:
        return {"error": f"cannot run {exe}: {e.strerror or e}"}
    try:
        out, _ = p.communicate(timeout=seconds_max)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return {"error": f"py-spy run did not finish in {seconds_max:g} s"}
    if p.returncode != 0 or not out_path.exists():
        last = [ln for ln in out.splitlines() if ln.strip()][-1:] or ["no output"]
        return {"error": f"py-spy exit {p.returncode}: {last[0].strip()[:160]}"}
    m = _SAMPLES.search(out)
    return {"path": str(out_path), "seconds": round(time.monotonic() - t0, 2), "rate": rate,
            "samples": int(m.group(1)) if m else None, "errors": int(m.group(2)) if m else None}


def parse(raw_text: str) -> list[tuple[list[tuple[str, str]], int]]:
    """[(frames outermost first as (function, file), count)] of collapsed stacks
    `frame;frame;...;frame COUNT`; lines that do not parse are skipped."""
    out = []
    for line in raw_text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = []
        for f in stack.split(";"):
            m = _FRAME.match(f)
            frames.append((m.group("fn"), m.group("file")) if m else (f, ""))
        out.append((frames, int(count)))
    return out


def _is(file: str, suffix: str) -> bool:
    return file == suffix or file.endswith("/" + suffix)


def stage_of(fn: str, file: str) -> str | None:
    """The pipeline stage a frame's code belongs to, None if none."""
    name = fn.rpartition(".")[2]          # py-spy names methods Class.method
    if _is(file, "nptrace/events.py") and name in ("decode_many", "from_tuple"):
        return "decode"
    if _is(file, "nptrace/kernel/ringbuf.py"):
        return "ring"
    if _is(file, "nptrace/classify.py") or "nptrace/classify/" in file:
        return "attribution"
    if _is(file, "nptrace/sinks/jsonl.py") or _is(file, "nptrace/sinks/collapse.py"):
        return "json sink"
    return None


def stack_stage(frames: list[tuple[str, str]]) -> str:
    """The stage of the innermost frame that has one: a classify.py helper called by the
    sink is attribution, a pipeline.py lambda called by the classifier too."""
    for fn, file in reversed(frames):
        stage = stage_of(fn, file)
        if stage:
            return stage
    return "other"


def summarize(raw_text: str, top: int = 15, within: str | None = None,
              skip: tuple[str, ...] = ()) -> dict:
    """Stage split and self time per function of py-spy raw output.

    Only samples with a frame of `within` (a function name) count, minus those with a frame
    named in `skip` below it; None counts every sample. Each counted sample goes to
    stack_stage(); its leaf frame gets the self time. Shares are of the counted samples."""
    total = kept = 0
    stages: Counter = Counter()
    selfs: Counter = Counter()
    for frames, n in parse(raw_text):
        total += n
        names = [fn.rpartition(".")[2] for fn, _ in frames]
        if within is not None:
            if within not in names:
                continue
            below = names[names.index(within) + 1:]
            if any(s in below for s in skip):
                continue
        kept += n
        stages[stack_stage(frames)] += n
        fn, file = frames[-1]
        selfs[f"{fn} ({file})"] += n
    share = (lambda c: round(c / kept, 4)) if kept else (lambda c: 0.0)
    return {"samples": kept, "total_samples": total,
            "stages": {s: share(stages[s]) for s in STAGES},
            "top": [{"function": f, "self_share": share(c)}
                    for f, c in selfs.most_common(top)]}


def stage_text(stages: dict[str, float]) -> str:
    """'attribution 61%, json sink 24%, ...': stages above 0.5%, largest first."""
    items = sorted(((v, k) for k, v in stages.items() if v >= 0.005), reverse=True)
    return ", ".join(f"{k} {v * 100:.0f}%" for v, k in items) or "no samples"
