"""Each lab scenario, on the real kernel, shows its client-visible symptom. The yardstick
(test_attribution.py) checks it in every case it runs (tests/privileged/symptoms.py); here,
without any tracer, the lab cases it does not run, and the lab's own life cycle.

Root only (network namespaces, iptables/nft inside them). Every namespace carries a prefix
unique to this run and is removed even when a test fails.
"""
import collections
import json
import os
import shutil
from pathlib import Path

import pytest

from nptrace import lab
from nptrace.lab import netns
from nptrace.lab.errors import NotRunnable
from nptrace.lab.scorecard import cases
from symptoms import check_symptom  # noqa: E402

pytestmark = pytest.mark.privileged

PREFIX = f"npt-t{os.getpid()}-"
NFT_REQUIRED = ("etp-local-no-endpoint", "no-endpoints", "missing-snat", "no-listener")
# each scenario on its first backend (iptables, but ipvs for the ipvs- scenarios)
CASES = [(s.name, s.backends[0], v) for s in lab.scenarios() for v in (None, *s.variants)]
CASES += [(s.name, "nft", None) for s in lab.scenarios() if "nft" in s.backends]
CASES += [("etp-local-no-endpoint", "nft", "reject"), ("no-listener", "iptables-legacy", None)]
assert all((n, "nft", None) in CASES for n in NFT_REQUIRED)
YARDSTICK = {(sc.name, b, v) for sc, b, v in cases(lab.scenarios())}
CASES = [c for c in CASES if c not in YARDSTICK]


def _ours():
    return sorted(n for n in netns.existing_namespaces() if n.startswith(PREFIX))


@pytest.fixture(scope="module", autouse=True)
def lab_env(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) to create network namespaces")
    missing = [t for t in ("ip", "iptables-restore", "iptables-legacy-restore", "nft", "sysctl") if not shutil.which(t)]
    if missing:
        pytest.skip(f"missing tools: {', '.join(missing)}")
    yield
    lab.down_all(prefix=PREFIX)
    assert _ours() == []


@pytest.mark.parametrize("name,backend,variant", CASES,
                         ids=[f"{n}-{b}" + (f"-{v}" if v else "") for n, b, v in CASES])
def test_symptom(name, backend, variant):
    try:
        info = lab.up(name, backend=backend, prefix=PREFIX, variant=variant)
    except NotRunnable as e:     # this kernel lacks what the backend needs (IPVS): said, skipped
        pytest.skip(str(e))
    try:
        assert info.watch and all(w.startswith(PREFIX) and "/" in w for w in info.watch)
        attempts = lab.trigger(name, count=50, prefix=PREFIX)
        view = lab.lb_view(name, prefix=PREFIX)
    finally:
        lab.down(name, prefix=PREFIX)
    assert _ours() == []
    assert len(attempts) == 50
    check_symptom(name, attempts, view)


def test_attempts_carry_ports_and_timing():
    lab.up("no-listener", prefix=PREFIX)
    try:
        attempts = lab.trigger("no-listener", count=20, prefix=PREFIX)
    finally:
        lab.down("no-listener", prefix=PREFIX)
    assert len({a.sport for a in attempts}) == 20
    assert all(a.src == "192.168.10.100" and a.dst == "192.168.10.11" and a.dport == 30080 for a in attempts)
    assert all(a.outcome == "refused" and a.error == "ECONNREFUSED" and 0 < a.elapsed < 1 for a in attempts)


def test_down_all_recovers_after_a_crash():
    lab.up("app-reset", prefix=PREFIX)
    st = netns.load_state(PREFIX)
    pids = st["pids"]
    assert pids and all(Path(f"/proc/{p}").exists() for p in pids)
    netns.drop_state(PREFIX)  # the process that ran `up` died and its state is gone
    with pytest.raises(lab.LabError, match="down --all"):
        lab.up("app-reset", prefix=PREFIX)
    removed = lab.down_all(prefix=PREFIX)
    assert f"{PREFIX}client" in removed and _ours() == []
    assert not any(Path(f"/proc/{p}").exists() and b"server.py" in Path(f"/proc/{p}/cmdline").read_bytes()
                   for p in pids)


def test_down_all_leaves_other_prefixes_unless_told():
    """Another user's lab (another prefix) survives `lab down --all`; --every-prefix takes it."""
    from click.testing import CliRunner
    from nptrace.lab.cli import lab as group
    other = f"npt-o{os.getpid()}-"
    lab.up("app-reset", prefix=PREFIX)
    lab.up("app-reset", prefix=other)
    try:
        out = CliRunner().invoke(group, ["--prefix", PREFIX, "down", "--all"])
        assert out.exit_code == 0, out.output
        left = sorted(n for n in netns.existing_namespaces() if n.startswith(other))
        assert _ours() == [] and f"{other}client" in left, left
        out = CliRunner().invoke(group, ["down", "--all", "--every-prefix"])
        assert out.exit_code == 0 and other in out.output, out.output
        assert not [n for n in netns.existing_namespaces() if n.startswith(other)]
    finally:
        lab.down_all(prefix=other)


def test_cli_round_trip():
    from click.testing import CliRunner
    from nptrace.lab.cli import lab as group
    r = CliRunner()
    out = r.invoke(group, ["--prefix", PREFIX, "up", "app-reset"])
    try:
        assert out.exit_code == 0, out.output
        assert f"ip netns exec {PREFIX}client bash" in out.output
        again = r.invoke(group, ["--prefix", PREFIX, "up", "healthy"])
        assert again.exit_code == 1 and "already up" in again.output
        st = r.invoke(group, ["--prefix", PREFIX, "status"])
        assert "app-reset is up" in st.output and "3/3 servers alive" in st.output
        tr = r.invoke(group, ["--prefix", PREFIX, "trigger", "app-reset", "--count", "10", "--json"])
        rows = [json.loads(x) for x in tr.output.splitlines()]
        assert len(rows) == 10 and {x["outcome"] for x in rows} == {"reset"}
        wrong = r.invoke(group, ["--prefix", PREFIX, "trigger", "healthy"])
        assert wrong.exit_code == 1 and "not up" in wrong.output
    finally:
        down = r.invoke(group, ["--prefix", PREFIX, "down", "app-reset"])
    assert down.exit_code == 0 and _ours() == []


def test_failed_up_leaves_nothing(monkeypatch):
    from nptrace.lab import hostplan, runner
    planned = hostplan.host_steps

    def broken(spec, host, backend, real=False):
        steps = planned(spec, host, backend, real)
        if host == "node2":  # after node1 and the fabric exist
            steps.append(hostplan.Step("run", ("ip", "route", "add", "10.99.0.0/16", "via", "203.0.113.77")))
        return steps
    monkeypatch.setattr(runner, "host_steps", broken)
    with pytest.raises(lab.LabError, match="failed"):
        lab.up("healthy", prefix=PREFIX)
    assert _ours() == [] and netns.load_state(PREFIX) is None


CTMAX = Path("/proc/sys/net/netfilter/nf_conntrack_max")


def test_host_wide_limit_is_held_while_up_and_always_put_back(monkeypatch):
    """conntrack-table-full lowers the host-wide nf_conntrack_max (read-only in a namespace)
    while it is up: node1's table is at the limit, no other lab comes up meanwhile, and the old
    value is back after down, and after an up interrupted (Ctrl-C) once the limit was set."""
    if not CTMAX.exists():
        pytest.skip("no nf_conntrack in this kernel")
    saved = CTMAX.read_text()
    try:
        lab.up("conntrack-table-full", prefix=PREFIX)
    except lab.LabError as e:   # HostBusy: the machine's own table is too full to lower it
        pytest.skip(str(e))
    try:
        assert CTMAX.read_text().strip() == "256"
        count = netns.sh(["ip", "netns", "exec", f"{PREFIX}node1", "cat",
                          "/proc/sys/net/netfilter/nf_conntrack_count"]).stdout
        assert int(count) >= 256
        with pytest.raises(lab.LabError, match="holds host-wide sysctls"):
            lab.up("healthy", prefix=PREFIX[:-1] + "b-")
    finally:
        lab.down("conntrack-table-full", prefix=PREFIX)
    assert CTMAX.read_text() == saved and _ours() == []

    real = netns.set_host_wide

    def then_ctrl_c(*a, **kw):
        real(*a, **kw)
        assert CTMAX.read_text().strip() == "256"
        raise KeyboardInterrupt
    monkeypatch.setattr(netns, "set_host_wide", then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        lab.up("conntrack-table-full", prefix=PREFIX)
    assert CTMAX.read_text() == saved and _ours() == [] and netns.load_state(PREFIX) is None


def test_gone_pod_stays_gone_while_the_kernel_still_holds_its_namespace(monkeypatch):
    """A deleted namespace lives on until the kernel's cleanup work runs (seconds, when earlier
    labs' namespaces queue before it), still answering on its address: a SYN to the gone pod
    got a RST (refused) instead of the timeout. Holding the namespace open stands in for that
    delay; the pod's veth is deleted first, so nothing answers."""
    held = []
    real = netns.delete_namespaces

    def delayed(names, pids=()):
        held.extend(os.open(f"/run/netns/{n}", os.O_RDONLY) for n in names
                    if Path(f"/run/netns/{n}").exists())
        real(names, pids)
    monkeypatch.setattr(netns, "delete_namespaces", delayed)
    lab.up("stale-endpoint", backend="nft", prefix=PREFIX)
    try:
        attempts = lab.trigger("stale-endpoint", count=5, prefix=PREFIX)
    finally:
        lab.down("stale-endpoint", prefix=PREFIX)
        for fd in held:
            os.close(fd)
    assert held and collections.Counter(a.outcome for a in attempts) == {"timeout": 5}
