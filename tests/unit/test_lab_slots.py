"""A lab's address plan moved to a slot (nptrace/lab/slots.py): labs up at once under one
tracer must share no address, and everything derived from the data moves with it."""
import dataclasses
import re

import pytest

from nptrace import lab
from nptrace.lab import model, slots
from nptrace.lab.errors import UsageError
from nptrace.lab.scorecard import cases

ADDR = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b|\bfd[0-9a-f]{2}:[0-9a-f:]*", re.I)
# not the lab's own: loopback, multicast, the default route
SHARED = ("127.", "0.0.0.0", "224.", "255.")


@pytest.mark.parametrize("text,slot,want", [
    ("10.244.0.10", 1, "10.245.0.10"),
    ("10.96.0.80/32", 2, "10.98.0.80/32"),
    ("172.16.21.11/24", 3, "172.19.21.11/24"),
    ("192.168.10.11", 1, "192.168.11.11"),
    ("via 192.168.50.12 dev ul0", 7, "via 192.168.57.12 dev ul0"),
    ("fd00:244::a", 1, "fd01:244::a"),
    ("[fd00:10::64]:30080", 5, "[fd05:10::64]:30080"),
    ("! -s 10.244.0.0/16 -j MASQUERADE", 4, "! -s 10.248.0.0/16 -j MASQUERADE"),
    ("192.168.0.0/16", 3, "192.168.0.0/16"),        # covers every slot: stays
    ("10.0.0.0/8", 3, "10.0.0.0/8"),
    ("127.0.0.1 224.0.0.106 0.0.0.0/0", 3, "127.0.0.1 224.0.0.106 0.0.0.0/0"),
    ("net.ipv4.conf.all.rp_filter=2 0e:6e:70:74:00:01", 3,
     "net.ipv4.conf.all.rp_filter=2 0e:6e:70:74:00:01"),
    ("10.244.0.10", 0, "10.244.0.10"),
])
def test_an_address_moves_by_its_slot(text, slot, want):
    assert slots.move_text(text, slot) == want


def test_data_moves_in_keys_and_values_and_keeps_other_types():
    got = slots.move({"map": {"10.244.0.0/16": "fd00:244::/112"}, "n": 3, "ok": True,
                      "l": ["192.168.10.1/24", 1.5]}, 2)
    assert got == {"map": {"10.246.0.0/16": "fd02:244::/112"}, "n": 3, "ok": True,
                   "l": ["192.168.12.1/24", 1.5]}


def test_a_slot_out_of_range_or_past_its_octet_is_refused():
    with pytest.raises(UsageError):
        slots.check(slots.SLOTS)
    with pytest.raises(UsageError):
        slots.move_text("172.31.0.1", 1)      # past 172.16.0.0/12


def _addresses(spec) -> set[str]:
    out: set[str] = set()

    def walk(o):
        if dataclasses.is_dataclass(o):
            o = dataclasses.asdict(o)
        if isinstance(o, dict):
            for k, v in o.items():
                walk(k)
                walk(v)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for v in o:
                walk(v)
        elif isinstance(o, str):
            out.update(a for a in ADDR.findall(o) if not a.startswith(SHARED))
    walk(spec)
    return out


@pytest.mark.parametrize("sc,backend,variant", [pytest.param(*c, id=f"{c[0].name}/{c[2]}@{c[1]}")
                                                for c in cases(lab.scenarios()) if c[1] == c[0].backends[0]])
def test_labs_in_two_slots_share_no_address(sc, backend, variant):
    a = model.compile_spec(sc.name, variant)
    b = model.compile_spec(sc.name, variant, slot=3)
    assert b.slot == 3 and _addresses(a)
    assert not _addresses(a) & _addresses(b)
    # the same lab otherwise: hosts, interfaces, services by name, steps by kind
    assert a.hosts.keys() == b.hosts.keys() and a.networks == b.networks
    assert [s.name for s in a.services] == [s.name for s in b.services]
    assert [st["kind"] for st in a.steps] == [st["kind"] for st in b.steps]
    assert [slots.move_text(w, 3) for w in a.hint] == list(b.hint)


def test_scale_services_move_too():
    a = model.compile_spec("rollout-in-flight", "at-once-scale")
    b = model.compile_spec("rollout-in-flight", "at-once-scale", slot=1)
    assert len(a.services) == len(b.services) > 2000
    assert not {e.ip for s in a.services for e in s.endpoints} & \
        {e.ip for s in b.services for e in s.endpoints}
    assert not {s.cluster_ip for s in a.services} & {s.cluster_ip for s in b.services}


def test_every_case_has_a_place_in_the_last_slot():
    for sc, _, variant in cases(lab.scenarios()):
        assert model.compile_spec(sc.name, variant, slot=slots.SLOTS - 1).slot == slots.SLOTS - 1
