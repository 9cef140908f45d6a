"""The kernel's cause keys on real resets (bpf/npt_common.h npt_count_cause): 50 refused
connects in a namespace of the test's own. Each kind of record is one key whatever the
client port; the later records of a connection carry its first causal record, whose own key
they name by a hash user space computes alike (causekeys.key_hash); the labeler gives them all
the classifier's cause."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.privileged

from loopback import CLOSED_PORT, GENERATOR, TRACEPOINTS, loopback_netns  # noqa: E402


@pytest.fixture
def netns():
    with loopback_netns("npt-ck") as ns:
        yield ns


def test_refused_connects_are_three_keys_labeled_no_listener(netns):
    from nptrace import reasons
    from nptrace.classify import Context
    from nptrace.classify.keylabel import KeyLabeler
    from nptrace.classify.verdict import WEAK_DROPS
    from nptrace.config import Config
    from nptrace.kernel import btf, causekeys, offsets
    from nptrace.kernel.loader import Probes

    ns, inode = netns
    n = 50
    b = btf.default()
    drops, resets = reasons.load_tables(b)
    probes = Probes(Config(), offsets.cflags(b), drops, TRACEPOINTS)
    try:
        probes.mark_weak_drops(WEAK_DROPS)
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", GENERATOR, str(n),
                            str(CLOSED_PORT)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and int(r.stdout) == n, r.stderr
        got = probes.cause_counts()
        raw = dict(probes._cause_raw)
    finally:
        probes.close()
    mine = {k: v for k, v in got.items() if k is not None and k.netns == inode}
    by_type: dict[int, int] = {}
    for k, (counted, sent) in mine.items():
        by_type[k.type] = by_type.get(k.type, 0) + counted
        assert sent == counted                     # no --max-rate: every record sent
        assert 0 in (k.sport, k.dport)             # the client port is never in a key
    assert by_type.get(2) == n and by_type.get(3) == n, by_type     # RST_SENT, RST_RECV
    assert len([k for k in mine if k.type in (2, 3)]) <= 4, list(mine)
    hashes = {causekeys.key_hash(b): k for k, b in raw.items()}
    priors = [k for k in mine if k.prior_type]
    assert priors, list(mine)
    for k in priors:
        assert k.prior_key in hashes, (k, sorted(hashes))
        assert hashes[k.prior_key].netns == inode and not hashes[k.prior_key].prior_type
    ctx = Context(drop_name=drops.name, rst_name=resets.name)
    lab = KeyLabeler(ctx)
    lab.register(list(got))
    causes = {k.type: lab.label(k) for k in mine}
    assert causes[2].cause == "no_listener" and causes[2].direction == "sent"
    assert causes[3].cause == "no_listener" and causes[3].direction == "received"
    print("\n" + "\n".join(f"{k.type} {k.hook} {k.reason} {k.saddr}:{k.sport} > {k.daddr}:"
                           f"{k.dport} prior {k.prior_type}/{k.prior_reason} {v} -> "
                           f"{causes[k.type].cause if causes[k.type] else None}"
                           for k, v in mine.items()))
