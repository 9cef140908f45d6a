"""The schema of every session record: one checker per record kind, and ONE table of what each
Context lookup a session can hold may hold (LOOKUPS), applied where records leave the reader
(format.read_header, format.read_session), so replay, report, merge, events.decode, the
classifier and the formatters see only these types.

A checker (Check) takes a decoded msgpack value and returns it (normalised: tuples for
fixed-length keys) or raises Invalid naming the field. Unknown keys of a record are dropped (a
newer writer may add some); missing optional ones are absent. Checkers recurse only as deep as
the schema, and `show` prints a bad value bounded in depth and length, so a value nested a
thousand levels deep is refused in one line, never by RecursionError.

LOOKUPS holds every lookup a session answers, whichever record carries it: lookup records and
the header's table of lookups, and for iface_name and service_of also the names and services
records and the header's ifnames and services, whose schemas are built from the table. A lookup
whose name is not in the table (a newer writer's) is skipped and counted (Unknown), never
handed on. Each checker also gives a valid `example()` and the checkers inside it (`parts()`),
so the fuzz suite (tests/unit/test_fuzz_sessions.py) makes its cases from these tables: a
lookup or record kind added here is fuzzed with no case written for it.
"""
from __future__ import annotations

import reprlib
from typing import NamedTuple

from nptrace import events as ev
from nptrace.config import MAX_SNAPLEN
from nptrace.sessions.lookups import IFACE, SERVICE


class Invalid(ValueError):
    pass


class Unknown(Exception):
    """A record kind or lookup this nptrace does not know (a newer writer's): skipped, counted."""


_I64, _U64 = (-(1 << 63), (1 << 63) - 1), (0, (1 << 64) - 1)
MAX_TEXT = 4096           # a name, a rule's text; nothing we write is longer
MAX_ITEMS = 1 << 20       # rows of a table in one record (a header with every name of a node)
MAX_BYTES = 1 << 16       # an event's raw record (216 bytes today) or a packet's


class Check:
    """check(value, where) -> the value, normalised, or Invalid naming `where`."""

    def __call__(self, v, where):
        raise NotImplementedError

    def example(self):
        """A value this checker accepts."""
        raise NotImplementedError

    def parts(self) -> dict:
        """{where in example(): the checker of that part}, for the parts a value has inside."""
        return {}


class Int(Check):
    def __init__(self, lo: int = _I64[0], hi: int = _U64[1]):
        self.lo, self.hi = lo, hi

    def __call__(self, v, where):
        if type(v) is not int or not self.lo <= v <= self.hi:
            raise Invalid(f"{where}: {show(v)} is not an integer in [{self.lo}, {self.hi}]")
        return v

    def example(self):
        return min(max(1, self.lo), self.hi)


class Str(Check):
    def __init__(self, max_len: int = MAX_TEXT):
        self.max_len = max_len

    def __call__(self, v, where):
        if type(v) is not str or len(v) > self.max_len:
            raise Invalid(f"{where}: {show(v)} is not a string of at most {self.max_len} "
                          "characters")
        return v

    def example(self):
        return "x"


class Bytes(Check):
    def __init__(self, max_len: int):
        self.max_len = max_len

    def __call__(self, v, where):
        if type(v) is not bytes or len(v) > self.max_len:
            raise Invalid(f"{where}: {show(v)} is not bytes (at most {self.max_len})")
        return v

    def example(self):
        return b""


class Bool(Check):
    def __call__(self, v, where):
        if type(v) is not bool:
            raise Invalid(f"{where}: {show(v)} is not true/false")
        return v

    def example(self):
        return False


class Opt(Check):
    """None or `inner` (its example and parts are inner's: None is the answer 'not known')."""

    def __init__(self, inner: Check):
        self.inner = inner

    def __call__(self, v, where):
        return None if v is None else self.inner(v, where)

    def example(self):
        return self.inner.example()

    def parts(self) -> dict:
        return self.inner.parts()


class OneOf(Check):
    def __init__(self, *inner: Check):
        self.inner = inner

    def __call__(self, v, where):
        for c in self.inner:
            try:
                return c(v, where)
            except Invalid:
                continue
        raise Invalid(f"{where}: {show(v)} has the wrong type")

    def example(self):
        return self.inner[0].example()


class Tuple(Check):
    def __init__(self, *items: Check):
        self.items = items

    def __call__(self, v, where):
        if type(v) not in (list, tuple) or len(v) != len(self.items):
            raise Invalid(f"{where}: {show(v)} is not a list of {len(self.items)}")
        return [c(x, f"{where}[{i}]") for i, (c, x) in enumerate(zip(self.items, v))]

    def example(self):
        return [c.example() for c in self.items]

    def parts(self) -> dict:
        return dict(enumerate(self.items))


class ListOf(Check):
    def __init__(self, item: Check, max_len: int = MAX_ITEMS):
        self.item, self.max_len = item, max_len

    def __call__(self, v, where):
        if type(v) is not list or len(v) > self.max_len:
            raise Invalid(f"{where}: {show(v)} is not a list (at most {self.max_len})")
        item = self.item
        return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]

    def example(self):
        return [self.item.example()]

    def parts(self) -> dict:
        return {0: self.item}


class MapOf(Check):
    def __init__(self, key: Check, value: Check, max_len: int = MAX_ITEMS):
        self.key, self.value, self.max_len = key, value, max_len

    def __call__(self, v, where):
        if type(v) is not dict or len(v) > self.max_len:
            raise Invalid(f"{where}: {show(v)} is not a map (at most {self.max_len})")
        key, value = self.key, self.value
        return {key(k, f"{where} key"): value(x, f"{where}[{show(k)}]") for k, x in v.items()}

    def example(self):
        return {self.key.example(): self.value.example()}

    def parts(self) -> dict:
        return {self.key.example(): self.value}


class Record(Check):
    def __init__(self, required: dict, optional: dict | None = None):
        self.required, self.optional = required, optional or {}

    def __call__(self, v, where):
        if type(v) is not dict:
            raise Invalid(f"{where}: {show(v)} is not a map")
        out = {}
        for k, c in self.required.items():
            if k not in v:
                raise Invalid(f"{where}: {k} is missing")
            out[k] = c(v[k], f"{where}.{k}")
        for k, c in self.optional.items():
            if k in v:
                out[k] = c(v[k], f"{where}.{k}")
        return out

    def example(self):
        return {k: c.example() for k, c in self.parts().items()}

    def parts(self) -> dict:
        return {**self.required, **self.optional}


class Open(Check):
    """A map of at most max_len fields: the known ones typed, any other `other` (a scalar);
    EXTRA stands for those in example() and parts()."""
    EXTRA = "extra"

    def __init__(self, known: Record, other: Check, max_len: int):
        self.known, self.rest = known, MapOf(Str(64), other, max_len)

    def __call__(self, v, where):
        out = self.rest(v, where)
        out.update(self.known(v, where))
        return out

    def example(self):
        return {**self.known.example(), self.EXTRA: self.rest.value.example()}

    def parts(self) -> dict:
        return {**self.known.parts(), self.EXTRA: self.rest.value}


class Plain(Check):
    """A msgpack value of bounded depth and size (features: shown, never computed with)."""

    def __call__(self, v, where, depth: int = 0):
        if v is None or type(v) in (bool, int, float):
            return v
        if type(v) in (str, bytes):
            if len(v) > MAX_TEXT:
                raise Invalid(f"{where}: too long")
            return v
        if depth < 4 and type(v) is list and len(v) <= 256:
            return [self(x, where, depth + 1) for x in v]
        if depth < 4 and type(v) is dict and len(v) <= 256:
            return {self(k, where, 9): self(x, where, depth + 1) for k, x in v.items()}
        raise Invalid(f"{where}: {show(v)} is too deep or too big")

    def example(self):
        return "x"


class Any(Check):
    """Anything: checked later by what it is (a lookup record's key and value: lookup_row)."""

    def __call__(self, v, where):
        return v

    def example(self):
        return None


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxtuple = 3, 4, 4, 4
_SHOW.maxstring = _SHOW.maxother = _SHOW.maxlong = 40


def show(v) -> str:
    """A bad value in an error line: at most 40 characters, and only three levels deep
    (repr() of a thousand nested lists ends in RecursionError)."""
    r = _SHOW.repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


U32, U16, PORT = Int(0, (1 << 32) - 1), Int(0, 0xFFFF), Int(0, 0xFFFF)
NETNS = Int(*_U64)
# Wall-clock and monotonic nanoseconds: inside +-146 years, so time.gmtime never overflows.
NS = Int(-(1 << 62), 1 << 62)
COUNT = Int(0, _U64[1])
ADDR = Str(64)
NAME = Str()
_SCALAR = OneOf(Opt(NAME), Bool(), Int())
# knowledge.nf_rule's answer: the fields the classifier reads typed, others scalars
NF_RULE = Open(Record({}, {"tag": Opt(NAME), "where": Opt(NAME), "text": Opt(NAME),
                           "service": Opt(NAME), "to_pod": Opt(Bool()), "source": Opt(NAME),
                           "note": Opt(NAME), "hook": Opt(NAME)}), _SCALAR, 64)


class Lookup(NamedTuple):
    key: Tuple          # the Context call's arguments
    value: Check        # its answer (None: not known)
    record: str = "lookup"   # the record kind the recorder writes answers in (sinks/recorder.py)


# THE table: every Context lookup a session holds, as Context calls and answers it. The
# recorder records these (sinks/recorder.py, wired by daemon/tracer.py), the reader checks every
# answer against it wherever it is written, replay answers them (sessions/replay.py).
LOOKUPS: dict[str, Lookup] = {
    IFACE: Lookup(Tuple(NETNS, U32), Opt(NAME), "names"),
    SERVICE: Lookup(Tuple(ADDR, PORT), Opt(NAME), "services"),
    "endpoint_of": Lookup(Tuple(ADDR, PORT), Opt(NAME)),
    "removed_endpoint": Lookup(Tuple(ADDR, PORT), Opt(NAME)),
    "etp_local": Lookup(Tuple(ADDR, PORT),
                        Opt(Record({"service": NAME}, {"no_local": ListOf(NAME, 64)}))),
    "route_iface": Lookup(Tuple(NETNS, ADDR), Opt(NAME)),
    "iface_peer": Lookup(Tuple(NETNS, U32), Opt(NAME)),
    "peer_tx_csum": Lookup(Tuple(NETNS, U32), Opt(Bool())),
    "nat_peer": Lookup(Tuple(ADDR, PORT, ADDR, PORT), Opt(Tuple(ADDR, PORT, ADDR, PORT))),
    "nf_rule": Lookup(Tuple(NETNS, ADDR, ADDR, PORT, ADDR, PORT, Bool(), Bool()), Opt(NF_RULE)),
    "pod_of": Lookup(Tuple(ADDR), Opt(NAME)),
    "pod_of_netns": Lookup(Tuple(NETNS), Opt(NAME)),
}
# The records of their own for interface and Service names, from the table's rows.
_IF, _SVC = LOOKUPS[IFACE], LOOKUPS[SERVICE]
IFNAMES = MapOf(_IF.key.items[0], MapOf(_IF.key.items[1], _IF.value))
SERVICES = ListOf(Tuple(*_SVC.key.items, _SVC.value))


def lookup_row(name: str, key, value, where: str) -> tuple[tuple, object]:
    """A lookup's (key, value) checked against its row of LOOKUPS; Unknown for a name the
    table does not hold (no reader of ours asks it)."""
    lk = LOOKUPS.get(name)
    if lk is None:
        raise Unknown(f"lookup {name[:32]}")
    return tuple(lk.key(key, f"{where} key")), lk.value(value, f"{where} value")


class LookupRows(Check):
    """The header's tables of lookup answers, {name: [[key, value], ...]}: each row checked by
    its row of LOOKUPS; tables of names the table does not hold are left out (check_header
    counts them)."""
    _TABLES = MapOf(Str(64), ListOf(Tuple(Any(), Any())), 64)

    def __call__(self, v, where):
        return {name: [lookup_row(name, k, x, f"{where}.{name}") for k, x in rows]
                for name, rows in self._TABLES(v, where).items() if name in LOOKUPS}

    def example(self):
        return {}

    def parts(self) -> dict:
        return {name: ListOf(Tuple(lk.key, lk.value)) for name, lk in LOOKUPS.items()}


HEADER = Record(
    {"format": Str(64), "format_version": Int(0, 1 << 16)},
    {"nptrace": Str(64), "abi": U16, "record_size": U32, "node": NAME, "kernel": NAME,
     "features": MapOf(Str(256), Plain(), 256), "epoch_offset_ns": NS,
     "drop_reasons": MapOf(U32, Str(256)), "rst_reasons": MapOf(U32, Str(256)),
     "ifnames": IFNAMES, "services": SERVICES, "lookups": LookupRows(), "start_ns": NS,
     "run_id": Str(64), "part": Int(0, 1 << 31), "run_start_ns": NS,
     "lookup_cache": Int(1, 1 << 24), "stop_record": Bool()})
SCHEMAS = {
    "event": Record({"raw": Bytes(MAX_BYTES)}, {"abi": U16, "type": U16}),
    "packet": Record({"raw": Bytes(ev.PACKET.size + MAX_SNAPLEN)}),
    "names": Record({"ifnames": IFNAMES}),
    "services": Record({"services": SERVICES}),
    "lookup": Record({"name": Str(64), "key": Any(), "value": Any()}),   # then lookup_row
    "counters": Record({}, {"ts_ns": NS, "counts": ListOf(Tuple(U16, U16, U32, U32, NETNS, COUNT)),
                            "stats": MapOf(Str(64), COUNT, 64)}),
    "stop": Record({}, {"why": Str(16), "ts_ns": NS, "records": COUNT, "dropped": COUNT}),
    # records the kernel counted under a cause and did not send, as the live run labeled them
    # (sinks/exact.py SummaryRow: the summary lines of `run`)
    "summary": Record({"cause": NAME, "kind": Str(16), "repeat": COUNT},
                      {"ts_ns": NS, "since_ns": NS, "direction": Opt(Str(16)),
                       "hook": NAME, "reason": NAME, "service": Opt(NAME), "iface": Opt(NAME)}),
}


def check_record(kind: str, rec: dict) -> dict:
    """The record normalised by its kind's schema; Invalid if it does not fit, Unknown for a
    kind, or a lookup, this nptrace does not know."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise Unknown(kind[:32])
    out = schema(rec, kind)
    if kind == "lookup":
        out["key"], out["value"] = lookup_row(out["name"], out["key"], out["value"], "lookup")
    return out


def check_header(rec: dict) -> dict:
    """The header normalised by HEADER; "_unknown" counts the rows of lookup tables the table
    does not hold ({"lookup NAME": rows}), which are left out."""
    out = HEADER(rec, "header")
    tabs = rec.get("lookups")
    if type(tabs) is dict:
        unknown = {f"lookup {n[:32]}": len(rows) for n, rows in tabs.items() if n not in LOOKUPS}
        if unknown:
            out["_unknown"] = unknown
    return out
