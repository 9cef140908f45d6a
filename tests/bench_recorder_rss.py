"""RSS of the --record path under a scanner: N distinct client tuples, each making the
Context lookups the live classifier makes (nat_peer for every event, route_iface for every
new source, nf_rule for every new client of a rejecting rule), recorded by the Recorder.

    PYTHONPATH=. python tests/bench_recorder_rss.py [N] [--rev REV]

`--rev REV` runs the recorder and session format of a commit (git show REV:...) instead of
the work tree, for the before/after figure: 21405f6 is the last one with unbounded tables.
Not a test: a measurement. Measured (500k tuples, Python 3.11):
21405f6 +67/+138/+177/+259/+300 MB at 100k..500k, 24 s; bounded +5..+7 MB, flat, 7 s.
"""
from __future__ import annotations

import gc
import importlib.util
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def load_rev(rev: str):
    """nptrace.sessions.format and nptrace.sinks.recorder as of commit `rev`."""
    mods = {}
    for name, path in (("nptrace.sessions.format", "nptrace/sessions/format.py"),
                       ("nptrace.sinks.recorder", "nptrace/sinks/recorder.py")):
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                             capture_output=True, text=True, check=True).stdout
        m = types.ModuleType(name)
        m.__file__ = str(ROOT / path)
        sys.modules[name] = m
        exec(compile(src, path, "exec"), m.__dict__)
        mods[name] = m
    return mods["nptrace.sessions.format"], mods["nptrace.sinks.recorder"]


def main() -> None:
    n = int(next((a for a in sys.argv[1:] if a.isdigit()), "500000"))
    rev = sys.argv[sys.argv.index("--rev") + 1] if "--rev" in sys.argv else None
    impl = rev or "worktree"
    if rev:
        S, R = load_rev(rev)
    else:
        from nptrace.sessions import format as S
        from nptrace.sinks import recorder as R
    from nptrace import events as ev
    d = Path(tempfile.mkdtemp()) / "rec"
    w = S.SessionWriter(d, max_file_bytes=64 << 20, max_total_bytes=256 << 20,
                        header=S.make_header(epoch_offset_ns=0, node="n", kernel="k"),
                        log=lambda m: None)
    rec = R.Recorder(w)
    nat_peer = rec.lookup("nat_peer", lambda *a: None)
    route = rec.lookup("route_iface", lambda ns, a: "eth0")
    rule = {"tag": "other", "where": "filter/INPUT rule 3", "text": "-p tcp -j REJECT",
            "service": None, "to_pod": False, "source": "ruleset", "note": "not traced"}
    nf_rule = rec.lookup("nf_rule", lambda *a: rule)
    raw = ev.encode(ts_ns=1, type=ev.EvType.DROP, hook=ev.Hook.KFREE_SKB, reason=12,
                    saddr="10.0.0.1", sport=1, daddr="10.0.0.2", dport=80)
    gc.collect()
    base = rss_mb()
    t0 = time.monotonic()
    marks = []
    for i in range(n):
        a = f"100.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
        port = 1024 + i % 60000
        rec.on_raw(raw)
        nat_peer(a, port, "10.0.0.2", 30080)
        nat_peer("10.0.0.2", 30080, a, port)
        route(4026531840, a)
        nf_rule(4026531840, a, "10.0.0.2", 30080, "10.0.0.2", 30080, True, False)
        if (i + 1) % (n // 5) == 0:
            gc.collect()
            marks.append(f"{(i + 1) // 1000}k: +{rss_mb() - base:.0f} MB")
    rec.close()
    gc.collect()
    print(f"impl={impl} tuples={n} {time.monotonic() - t0:.1f}s  " + ", ".join(marks)
          + f"  (base RSS {base:.0f} MB)")


if __name__ == "__main__":
    main()
