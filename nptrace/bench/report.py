"""The benchmark report: rows, verdicts, the printed table, its Markdown twin and the JSON
document, plus the parsers for what the measured tools print. Pure: no I/O beyond the
string or bytes handed in, so tests/unit/test_bench_report.py covers all of it."""
from __future__ import annotations

import json
import math
import re
import statistics
import struct
from dataclasses import asdict, dataclass, field

MET, MISSED, INFO, ERROR = "met", "missed", "-", "error"
SCHEMA = 1
SECTIONS = ("tc_cost", "auto_ifaces", "throughput", "connrate", "reset_storm", "pipeline",
            "startup", "soak")


@dataclass
class Row:
    """One line of the table. `nptrace` and `baseline` are display strings; the numbers
    behind them (value, base_value, ratio) go to the JSON. met: True/False, None = info."""
    section: str
    metric: str
    nptrace: str
    baseline: str = ""
    ratio_target: str = ""
    met: bool | None = None
    value: float | None = None
    base_value: float | None = None
    ratio: float | None = None
    target: str = ""
    error: str = ""

    @property
    def verdict(self) -> str:
        if self.error:
            return ERROR
        if self.met is None:
            return INFO
        return MET if self.met else MISSED


@dataclass
class Section:
    name: str
    rows: list[Row] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0


# --- numbers -------------------------------------------------------------------------------
def spread(samples) -> dict:
    """median, min, max, quartiles and count of a list of numbers (empty: count 0 only)."""
    xs = sorted(float(x) for x in samples if x is not None and not math.isnan(float(x)))
    if not xs:
        return {"n": 0}
    if len(xs) >= 2:
        q = statistics.quantiles(xs, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = xs[0]
    return {"n": len(xs), "median": statistics.median(xs), "min": xs[0], "max": xs[-1],
            "p25": p25, "p75": p75}


def paired_ratios(with_tool, without) -> list[float]:
    """Ratio of each run with the tool to its neighbour run without (same pair index)."""
    return [a / b for a, b in zip(with_tool, without) if b]


def per_100k(cpu_s: float, count: int) -> float | None:
    return cpu_s / count * 100_000 if count else None


def si(x: float | None, unit: str = "", digits: int = 3) -> str:
    """1234567 -> '1.23M'; None -> 'n/a'."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    ax = abs(x)
    for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if ax >= div:
            return f"{x / div:.{digits}g}{suf}{unit}"
    return f"{x:.{digits}g}{unit}"


def pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x * 100:.{digits}f}%"


# --- rendering -----------------------------------------------------------------------------
COLUMNS = ("metric", "nptrace", "baseline", "ratio/target", "verdict")


def _cells(r: Row) -> tuple[str, ...]:
    return (r.metric, r.nptrace, r.baseline, r.ratio_target, r.verdict if not r.error
            else f"error: {r.error}")


def render_table(rows: list[Row]) -> str:
    """Fixed-width text table, one section after another."""
    body = [_cells(r) for r in rows]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(COLUMNS)]
    widths[-1] = min(widths[-1], 60)
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)), line]
    last = None
    for r, cells in zip(rows, body):
        if last is not None and r.section != last:
            out.append("")
        last = r.section
        out.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(out)


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(rows: list[Row]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append("| " + " | ".join(_md(c) for c in _cells(r)) + " |")
    return "\n".join(out)


def summary(rows: list[Row]) -> dict:
    counts = {MET: 0, MISSED: 0, ERROR: 0, INFO: 0}
    for r in rows:
        counts[r.verdict] += 1
    return counts


def document(sections: list[Section], meta: dict) -> dict:
    """The JSON saved beside the table: every section, its rows and its raw data."""
    rows = [r for s in sections for r in s.rows]
    return {
        "schema": SCHEMA,
        "meta": meta,
        "summary": summary(rows),
        "sections": {s.name: {"rows": [dict(asdict(r), verdict=r.verdict) for r in s.rows],
                              "data": s.data, "error": s.error, "seconds": round(s.seconds, 2)}
                     for s in sections},
    }


def dumps(doc: dict) -> str:
    return json.dumps(doc, indent=1, sort_keys=False, default=_json_default)


def _json_default(o):
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


# --- parsers for what the measured tools print --------------------------------------------
_STOPPED = re.compile(r"stopped: (\d+) events decoded, (\d+) lost")
_ATTACHED = re.compile(r"attached .* in ([0-9.]+) ?s\b")
_TCPDUMP = re.compile(r"(\d+) packets? (captured|received by filter|dropped by kernel)")
_BCC_LOST = re.compile(r"[Pp]ossibly lost (\d+) samples")
_SAMPLED = re.compile(r"(\d+) events over --max-rate were counted")


def parse_stopped(stderr: str) -> tuple[int, int] | None:
    """(decoded, lost) from nptrace's last `stopped: N events decoded, M lost` line."""
    m = None
    for m in _STOPPED.finditer(stderr):
        pass
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_sampled(stderr: str) -> int:
    """Records nptrace's in-kernel rate limit (--max-rate) counted but did not send."""
    m = _SAMPLED.search(stderr)
    return int(m.group(1)) if m else 0


def parse_attached(stderr: str) -> float | None:
    """nptrace's own start-up time from `attached ... in X s`."""
    m = _ATTACHED.search(stderr)
    return float(m.group(1)) if m else None


def parse_tcpdump(stderr: str) -> dict[str, int]:
    """tcpdump's exit statistics: captured, received by filter, dropped by kernel."""
    out = {}
    for n, what in _TCPDUMP.findall(stderr):
        out[{"captured": "captured", "received by filter": "received",
             "dropped by kernel": "dropped"}[what]] = int(n)
    return out


def parse_bcc_lost(text: str) -> int:
    """Sum of bcc's perf-buffer `Possibly lost N samples` lines."""
    return sum(int(n) for n in _BCC_LOST.findall(text))


def count_bcc_events(stdout: str, header_prefix: str = "PID") -> int:
    """Event lines of a bcc tool: non-empty lines that are not its header or a warning."""
    n = 0
    for line in stdout.splitlines():
        s = line.strip()
        if not s or s.startswith(header_prefix) or s.startswith(("WARNING", "Possibly lost")):
            continue
        n += 1
    return n


def pcap_count(data: bytes) -> int:
    """Records in a classic pcap file (either byte order, µs or ns magic); a record cut
    short at the end (tcpdump killed mid-write) is not counted."""
    if len(data) < 24:
        return 0
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        order = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        order = ">"
    else:
        raise ValueError("not a pcap file")
    rec = struct.Struct(order + "IIII")
    off, n = 24, 0
    while off + 16 <= len(data):
        _s, _u, incl, _orig = rec.unpack_from(data, off)
        off += 16 + incl
        if off > len(data):
            break
        n += 1
    return n


def proc_cpu_ticks(stat: str) -> int:
    """utime + stime + cutime + cstime (clock ticks) from a /proc/<pid>/stat line."""
    f = stat.rpartition(")")[2].split()
    return int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])


def proc_rss_bytes(status: str) -> int | None:
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) * 1024 if m else None


def snmp_counter(snmp: str, proto: str, name: str) -> int:
    """A counter from /proc/net/snmp text (the counters `nstat` shows, e.g. Tcp OutRsts)."""
    lines = [ln.split() for ln in snmp.splitlines() if ln.startswith(proto + ":")]
    for hdr, vals in zip(lines[::2], lines[1::2]):
        if name in hdr:
            return int(vals[hdr.index(name)])
    raise KeyError(f"{proto} {name} not in /proc/net/snmp")


def iperf3_bps(doc: dict) -> float:
    """Receiver-side bits/s of an `iperf3 -J` run."""
    end = doc.get("end", {})
    for key in ("sum_received", "sum"):
        if key in end:
            return float(end[key]["bits_per_second"])
    raise KeyError("iperf3 JSON has no end.sum_received")


def bpf_prog_fdinfo(text: str) -> dict[str, int]:
    """prog_type, prog_id, run_time_ns, run_cnt from /proc/<pid>/fdinfo/<fd> of a prog fd."""
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("prog_type", "prog_id", "run_time_ns", "run_cnt"):
            out[k] = int(v.strip())
    return out


def tc_filter_progs(tc_json: list) -> dict[str, int]:
    """{bpf filter name: prog id} from `tc -j filter show dev X ingress|egress`."""
    out = {}
    for f in tc_json:
        opt = f.get("options") or {}
        prog = opt.get("prog") or {}
        if "bpf_name" in opt and "id" in prog:
            out[opt["bpf_name"]] = int(prog["id"])
    return out


def count_port_lines(lines, port: int) -> int:
    """JSON lines (bytes) of nptrace whose own tuple has `port` on either side: one line per
    labeled incident, so per reset when every reset is a flow of its own."""
    a, b = f'"sport":{port},'.encode(), f'"dport":{port},'.encode()
    return sum(1 for ln in lines if a in ln or b in ln)


_PROM = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def prom_samples(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample in Prometheus text exposition format."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM.match(line)
        if m:
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def prom_sum(samples, name: str, **contains: str) -> float | None:
    """Sum of the samples of `name` whose labels contain each given substring; None if the
    metric is absent."""
    vals = [v for n, labels, v in samples if n == name
            and all(s in labels.get(k, "") for k, s in contains.items())]
    return sum(vals) if vals else None
