"""The types of typed command-line values, shared by every command, so `run` and `dump-bpf`
(and the offline commands) refuse the same values with the same line.

click's own INT and FLOAT take what Python's int() and float() take: digits of any script
(int("١٢٣") is 123), and "nan" and "inf" for a number of seconds. These take ASCII digits
only and finite numbers, and keep the bounds where the value is parsed.
"""
from __future__ import annotations

import math

import click

from nptrace.config import SNAP_HEADERS, ConfigError, check_ring_pages, parse_metrics_addr


class Int(click.ParamType):
    """An integer in ASCII digits, within [lo, hi] (None: unbounded)."""
    name = "integer"

    def __init__(self, lo: int | None = None, hi: int | None = None):
        self.lo, self.hi = lo, hi

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        else:
            text = str(value)
            digits = text[1:] if text[:1] in "+-" else text
            if not (digits.isascii() and digits.isdigit()):
                self.fail(f"{text!r} is not an integer (ASCII digits)", param, ctx)
            n = int(text)
        if (self.lo is not None and n < self.lo) or (self.hi is not None and n > self.hi):
            self.fail(f"{n} is not in {self._range()}", param, ctx)
        return n

    def _range(self) -> str:
        if self.hi is None:
            return f"the range x>={self.lo}"
        return f"the range {self.lo if self.lo is not None else ''}<=x<={self.hi}"


class Seconds(click.ParamType):
    """A finite number of seconds (ASCII), above `above` or at least `least`."""
    name = "seconds"

    def __init__(self, above: float | None = None, least: float | None = None):
        self.above, self.least = above, least

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            x = float(value)
        else:
            text = str(value)
            try:
                x = float(text) if text.isascii() else math.nan
            except ValueError:
                x = math.nan
            if not math.isfinite(x):
                self.fail(f"{text!r} is not a finite number of seconds", param, ctx)
        if self.above is not None and not x > self.above:
            self.fail(f"{x:g} is not above {self.above:g}", param, ctx)
        if self.least is not None and not x >= self.least:
            self.fail(f"{x:g} is below {self.least:g}", param, ctx)
        return x


class Snaplen(Int):
    """--snaplen: `headers` (each packet's headers, no payload) or a number of bytes; the
    bounds are checked with the other packet options (cli.pcap_snaplen)."""
    name = "headers|BYTES"

    def __init__(self):
        super().__init__()

    def convert(self, value, param, ctx):
        if value == SNAP_HEADERS:
            return value
        return super().convert(value, param, ctx)


class RingPages(Int):
    """--ring-pages: config.check_ring_pages's bounds, said as a usage error of the flag."""

    def __init__(self):
        super().__init__(1)

    def convert(self, value, param, ctx):
        n = super().convert(value, param, ctx)
        try:
            return check_ring_pages(n)
        except ConfigError as e:
            self.fail(str(e).removeprefix(f"bad --ring-pages {n}: "), param, ctx)


class MetricsAddr(click.ParamType):
    """--metrics-addr [HOST:]PORT: a bare PORT binds 127.0.0.1; returns HOST:PORT."""
    name = "[HOST:]PORT"

    def convert(self, value, param, ctx):
        text = str(value)
        if ":" not in text:
            text = f"127.0.0.1:{text}"
        try:
            host, port = parse_metrics_addr(text)
        except ConfigError as e:
            self.fail(str(e), param, ctx)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
