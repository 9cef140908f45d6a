"""`explain --confirm SECONDS`: trace the client's next connections with the real tracer
(host filter = the client's address, tc on the ingress interface) and count the causes of the
incidents seen, with the first hint of each (the interface a bad checksum came in by, the
table's numbers), to print beside the prediction. Needs what `nptrace run` needs."""
from __future__ import annotations

from collections import Counter

from nptrace.classify.verdict import RANK
from nptrace.config import Config, IfaceSpec, parse_hosts


class _Count:
    """A sink that only counts incident causes and keeps each cause's first hint."""

    def __init__(self):
        self.causes: Counter = Counter()
        self.hints: dict[str, str] = {}

    def write(self, v) -> None:
        cause = getattr(v, "cause", None)
        if cause:
            self.causes[cause] += 1
            self.hints.setdefault(cause, getattr(v, "hint", ""))

    def close(self) -> None:
        pass


def observe(facts, seconds: float, ready_file: str | None = None) -> dict:
    from nptrace.daemon.tracer import Tracer, log
    ifaces = (IfaceSpec(facts.netns, facts.iif),) if facts.iif else ()
    cfg = Config(ifaces=ifaces, hosts=parse_hosts([facts.client]))
    sink = _Count()
    tracer = Tracer(cfg, [sink], ready_file=ready_file)
    tracer.status_every = 0
    try:
        tracer.start()
        log(f"confirm: tracing connections of {facts.client} for {seconds:g} s; connect now")
        tracer.run(seconds)
    finally:
        tracer.stop()
    causes = dict(sink.causes)
    best = min(causes, key=lambda c: RANK.get(c, 99)) if causes else None
    return {"seconds": seconds, "causes": causes, "cause": best,
            "hint": sink.hints.get(best) if best else None}
