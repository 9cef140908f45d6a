"""One output vocabulary for every command that prints events or reports: timestamps as
RFC 3339 with milliseconds, in UTC unless --local; endpoints as addr:port, IPv6 as
[addr]:port; -o text|json|table. Pure helpers; the sinks and commands call them."""
from __future__ import annotations

import time

OUTPUTS = ("text", "json", "table")


def ts(epoch_ns: int, local: bool = False) -> str:
    """2026-01-01T10:40:00.250Z (UTC) or 2026-01-01T11:40:00.250+01:00 (--local)."""
    s, ns = divmod(int(epoch_ns), 10**9)
    ms = f"{ns // 1_000_000:03d}"
    if not local:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s)) + f".{ms}Z"
    t = time.localtime(s)
    off = t.tm_gmtoff or 0
    sign = "+" if off >= 0 else "-"
    hh, mm = divmod(abs(off) // 60, 60)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{ms}{sign}{hh:02d}:{mm:02d}"


def endpoint(addr: str, port: int | None) -> str:
    """10.0.0.1:80, [fd00::10]:5000; no port (0/None): the address alone."""
    if not port:
        return addr
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def output_mode(output: str | None, as_json: bool) -> str:
    """-o's value, with --json as an alias of -o json."""
    if as_json:
        if output not in (None, "json"):
            from nptrace.errors import NptraceError
            raise NptraceError(f"--json conflicts with -o {output}")
        return "json"
    return output or "text"


def table(rows: list[dict], cols: list[str]) -> str:
    """Aligned columns with a header line (-o table)."""
    cells = [[str(r.get(c, "") if r.get(c) is not None else "-") for c in cols] for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.ljust(w) for x, w in zip(xs, widths)).rstrip()
    return "\n".join([line([c.upper() for c in cols])] + [line(x) for x in cells])
