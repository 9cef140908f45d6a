"""The schema of every session record: one checker per record kind and per Context lookup,
applied where records leave the reader (format.read_header, format.read_session), so replay,
report, merge, events.decode, the classifier and the formatters see only these types.

A checker takes a decoded msgpack value and returns it (normalised: tuples for fixed-length
keys) or raises Invalid naming the field. Unknown keys of a record are dropped (a newer writer
may add some); missing optional ones are absent. Checkers recurse only as deep as the schema,
and `show` prints a bad value bounded in depth and length, so a value nested a thousand levels
deep is refused in one line, never by RecursionError.
"""
from __future__ import annotations

import reprlib

from nptrace import events as ev
from nptrace.config import MAX_SNAPLEN

class Invalid(ValueError):
    pass


_I64, _U64 = (-(1 << 63), (1 << 63) - 1), (0, (1 << 64) - 1)
MAX_TEXT = 4096           # a name, a rule's text; nothing we write is longer
MAX_ITEMS = 1 << 20       # rows of a table in one record (a header with every name of a node)
MAX_BYTES = 1 << 16       # an event's raw record (216 bytes today) or a packet's


def Int(lo: int = _I64[0], hi: int = _U64[1]):
    def check(v, where):
        if type(v) is not int or not lo <= v <= hi:
            raise Invalid(f"{where}: {show(v)} is not an integer in [{lo}, {hi}]")
        return v
    return check


def Str(max_len: int = MAX_TEXT):
    def check(v, where):
        if type(v) is not str or len(v) > max_len:
            raise Invalid(f"{where}: {show(v)} is not a string of at most {max_len} characters")
        return v
    return check


def Bytes(max_len: int):
    def check(v, where):
        if type(v) is not bytes or len(v) > max_len:
            raise Invalid(f"{where}: {show(v)} is not bytes (at most {max_len})")
        return v
    return check


def _bool(v, where):
    if type(v) is not bool:
        raise Invalid(f"{where}: {show(v)} is not true/false")
    return v


def Opt(inner):
    return lambda v, where: None if v is None else inner(v, where)


def OneOf(*inner):
    def check(v, where):
        for c in inner:
            try:
                return c(v, where)
            except Invalid:
                continue
        raise Invalid(f"{where}: {show(v)} has the wrong type")
    return check


def Tuple(*items):
    def check(v, where):
        if type(v) not in (list, tuple) or len(v) != len(items):
            raise Invalid(f"{where}: {show(v)} is not a list of {len(items)}")
        return [c(x, f"{where}[{i}]") for i, (c, x) in enumerate(zip(items, v))]
    return check


def ListOf(item, max_len: int = MAX_ITEMS):
    def check(v, where):
        if type(v) is not list or len(v) > max_len:
            raise Invalid(f"{where}: {show(v)} is not a list (at most {max_len})")
        return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return check


def MapOf(key, value, max_len: int = MAX_ITEMS):
    def check(v, where):
        if type(v) is not dict or len(v) > max_len:
            raise Invalid(f"{where}: {show(v)} is not a map (at most {max_len})")
        return {key(k, f"{where} key"): value(x, f"{where}[{show(k)}]") for k, x in v.items()}
    return check


def Record(required: dict, optional: dict | None = None):
    optional = optional or {}

    def check(v, where):
        if type(v) is not dict:
            raise Invalid(f"{where}: {show(v)} is not a map")
        out = {}
        for k, c in required.items():
            if k not in v:
                raise Invalid(f"{where}: {k} is missing")
            out[k] = c(v[k], f"{where}.{k}")
        for k, c in optional.items():
            if k in v:
                out[k] = c(v[k], f"{where}.{k}")
        return out
    return check


def _plain(v, where, depth: int = 0):
    """A msgpack value of bounded depth and size (features: shown, never computed with)."""
    if v is None or type(v) in (bool, int, float):
        return v
    if type(v) in (str, bytes):
        if len(v) > MAX_TEXT:
            raise Invalid(f"{where}: too long")
        return v
    if depth < 4 and type(v) is list and len(v) <= 256:
        return [_plain(x, where, depth + 1) for x in v]
    if depth < 4 and type(v) is dict and len(v) <= 256:
        return {_plain(k, where, 9): _plain(x, where, depth + 1) for k, x in v.items()}
    raise Invalid(f"{where}: {show(v)} is too deep or too big")


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
IFNAMES = MapOf(NETNS, MapOf(U32, Opt(NAME)))
SERVICES = ListOf(Tuple(ADDR, PORT, Opt(NAME)))
_NF_RULE_KNOWN = Record({}, {"tag": Opt(NAME), "where": Opt(NAME), "text": Opt(NAME),
                             "service": Opt(NAME), "to_pod": Opt(_bool), "source": Opt(NAME),
                             "note": Opt(NAME), "hook": Opt(NAME)})
_SCALAR = OneOf(Opt(NAME), _bool, Int())


def NF_RULE(v, where):
    """knowledge.nf_rule's answer: the fields the classifier reads typed, others scalars."""
    out = MapOf(Str(64), _SCALAR, 64)(v, where)
    out.update(_NF_RULE_KNOWN(v, where))
    return out


# (key, value) of each Context lookup the recorder records, as Context calls and answers it:
# the one list of recorded lookups (tracer.py records these, replay.py answers them).
LOOKUPS = {
    "endpoint_of": (Tuple(ADDR, PORT), Opt(NAME)),
    "etp_local": (Tuple(ADDR, PORT), Opt(Record({"service": NAME}, {"no_local": ListOf(NAME, 64)}))),
    "route_iface": (Tuple(NETNS, ADDR), Opt(NAME)),
    "iface_peer": (Tuple(NETNS, U32), Opt(NAME)),
    "peer_tx_csum": (Tuple(NETNS, U32), Opt(_bool)),
    "nat_peer": (Tuple(ADDR, PORT, ADDR, PORT), Opt(Tuple(ADDR, PORT, ADDR, PORT))),
    "nf_rule": (Tuple(NETNS, ADDR, ADDR, PORT, ADDR, PORT, _bool, _bool), Opt(NF_RULE)),
    "pod_of": (Tuple(ADDR), Opt(NAME)),
    "pod_of_netns": (Tuple(NETNS), Opt(NAME)),
}


def lookup_row(name: str, key, value, where: str) -> tuple[tuple, object]:
    """A lookup's (key, value) checked against its schema; an unknown lookup name (a newer
    writer's) keeps plain scalars, and no reader of ours asks it."""
    kc, vc = LOOKUPS.get(name, (ListOf(_SCALAR, 16), _plain))
    return tuple(kc(key, f"{where} key")), vc(value, f"{where} value")


def _lookup_tables(v, where):
    tables = MapOf(Str(64), ListOf(Tuple(_any, _any)), 64)(v, where)
    return {name: [lookup_row(name, k, x, f"{where}.{name}") for k, x in rows]
            for name, rows in tables.items()}


def _any(v, where):
    return v


HEADER = Record(
    {"format": Str(64), "format_version": Int(0, 1 << 16)},
    {"nptrace": Str(64), "abi": U16, "record_size": U32, "node": NAME, "kernel": NAME,
     "features": MapOf(Str(256), _plain, 256), "epoch_offset_ns": NS,
     "drop_reasons": MapOf(U32, Str(256)), "rst_reasons": MapOf(U32, Str(256)),
     "ifnames": IFNAMES, "services": SERVICES, "lookups": _lookup_tables, "start_ns": NS,
     "run_id": Str(64), "part": Int(0, 1 << 31), "run_start_ns": NS,
     "lookup_cache": Int(1, 1 << 24), "stop_record": _bool})
SCHEMAS = {
    "event": Record({"raw": Bytes(MAX_BYTES)}, {"abi": U16, "type": U16}),
    "packet": Record({"raw": Bytes(ev.PACKET.size + MAX_SNAPLEN)}),
    "names": Record({"ifnames": IFNAMES}),
    "services": Record({"services": SERVICES}),
    "lookup": Record({"name": Str(64), "key": _any, "value": _any}),
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
    """The record normalised by its kind's schema; Invalid if it does not fit. KeyError for
    a kind this nptrace does not know."""
    out = SCHEMAS[kind](rec, kind)
    if kind == "lookup":
        out["key"], out["value"] = lookup_row(out["name"], out["key"], out["value"], "lookup")
    return out


def check_header(rec: dict) -> dict:
    return HEADER(rec, "header")

