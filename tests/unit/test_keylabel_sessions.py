"""Over every recorded lab session (tests/fixtures/sessions/<scenario>/, one small `nptrace run
--record` per scenario of nptrace/lab/data/scenarios): for each incident, the label of its
primary event's cause key (classify/keylabel.py, with the flow fact the kernel would add:
the incident's first causal record) is the classifier's label of the flow. Pure: replay's
recorded lookups answer the labeler's questions (a key keeps what the rules ask about).

One assumption is the test's: a key keeps no client port, so a netfilter verdict on a packet
headed to the client (a reply conntrack marked INVALID) is asked about with dport 0; replay
answers only the exact questions the live run asked, so such a question gets the recorded
answer for the same packet with any port: netfilter rules that match on the client's port
are not told apart (a bounded key cannot keep it)."""
import dataclasses
from pathlib import Path

import pytest

from nptrace.classify.keylabel import KeyLabeler
from nptrace.kernel.causekeys import encode_key, fact_of, key_hash, key_of, server_ends
from nptrace.sessions.reader import read_session
from nptrace.sessions.replay import Replay

SESSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "sessions"
CAUSAL = {1, 2, 4, 7, 8}       # npt_common.h npt_causal_type
SCENARIOS = sorted(p.name for p in SESSIONS.iterdir()) if SESSIONS.is_dir() else []


def key_with_fact(v, ctx):
    """The primary's key as the kernel counts it: with the flow fact of the incident's first
    causal record (the root an earlier incident named comes first in v.labeled)."""
    ordered = sorted(v.labeled, key=lambda l: l.ev.ts_ns)
    first = next((l.ev for l in ordered if int(l.ev.type) in CAUSAL
                  and l.cause is not None), None)
    e = v.event
    if first is None or first is e:
        return None, key_of(e, ctx.drop_name)
    ends = server_ends(first)
    fk = key_of(first, ctx.drop_name)
    return fk, key_of(e, ctx.drop_name, fact_of(first),
                      client_is_src=(e.saddr, e.sport) not in ends,
                      prior_late=e.ts_ns - first.ts_ns > 1_000_000_000,
                      prior_key=key_hash(encode_key(fk)))


def any_port_nf_rule(path: Path, ctx):
    """ctx.nf_rule, and for a question with dport 0 the recorded answer of any port."""
    _, recs, _ = read_session([path])
    table = {}
    for rec in recs:
        if rec.kind == "lookup" and rec.data["name"] == "nf_rule":
            k = tuple(rec.data["key"])
            table.setdefault(k[:3] + k[4:5] + k[6:], rec.data["value"])
    exact = ctx.nf_rule

    def nf_rule(*a):
        got = exact(*a)
        if got is None and a[3] == 0:        # dport, and oport when it is the same port
            got = table.get(tuple(a[:3]) + tuple(a[4:5]) + tuple(a[6:]))
        return got
    return dataclasses.replace(ctx, nf_rule=nf_rule)


@pytest.mark.skipif(not SCENARIOS, reason="no recorded sessions under tests/fixtures/sessions")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_key_label_is_the_classifier_label(scenario):
    r = Replay([SESSIONS / scenario])
    labelers: dict = {}
    n, wrong = 0, []
    for it in r.items():
        v = it.verdict
        lab = labelers.get(id(v.ctx))
        if lab is None:
            lab = labelers[id(v.ctx)] = KeyLabeler(any_port_nf_rule(SESSIONS / scenario, v.ctx))
        own = next((l for l in v.labeled if l.ev is v.event), None)
        prior, fact_key = key_with_fact(v, v.ctx)
        lab.register([prior, fact_key])          # the kernel map holds the prior's key too
        keys = [fact_key]
        if own is not None and own.cause == v.cause:    # named by itself, not by a root
            keys.append(key_of(v.event, v.ctx.drop_name))
        for k in keys:
            got = lab.label(k)
            if got is None or (got.cause, got.kind, got.direction) != \
                    (v.cause, v.kind, v.direction):
                wrong.append((v.cause, v.kind, v.direction, v.hook, v.reason, got, k))
        n += 1
    if not n:
        assert "healthy" in scenario, f"{scenario}: the session has no incidents"
        return
    assert not wrong, f"{scenario}: {len(wrong)} keys of {n} incidents labeled otherwise: " \
        f"{wrong[:3]}"
