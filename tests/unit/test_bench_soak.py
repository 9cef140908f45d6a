"""The soak's fd verdict (bench/soak.py _figures): fds saw-tooth with the tracer's prune
period, so growth is the peak of the run's last two periods against the warm-up's last two.
A leak fails it; the saw-tooth and one sample's spike do not."""
from types import SimpleNamespace

from nptrace.bench import soak

RUN = SimpleNamespace(decoded=1, lost=0, killed=False)
CHURN = SimpleNamespace(created=75, deleted=72, errors=0)


def _samples(fds_at):
    return [{"t": t, "rss": 100 << 20, "fds": fds_at(t)} for t in range(0, 76, 2)]


def _fds(fds_at) -> dict:
    return soak._figures(_samples(fds_at), 25.0, 75, 3000, 225000, CHURN, 30, 0, RUN)


def saw(t):
    return 46 + int(t) % 10     # 46..55 over each 10 s prune period


def test_a_saw_tooth_is_flat():
    d = _fds(saw)
    assert d["fds_ok"] and d["fds_warm"] == d["fds_late"] == 54


def test_one_spike_mid_run_is_not_growth():
    d = _fds(lambda t: 60 if t == 40 else saw(t))
    assert d["fds_ok"] and d["fds_max_after"] == 60


def test_a_leak_of_one_fd_every_5_s_fails():
    d = _fds(lambda t: saw(t) + int(t) // 5)
    assert not d["fds_ok"] and d["fds_late"] - d["fds_warm"] > soak.FD_SLACK


def test_the_row_names_the_windows():
    d = _fds(saw)
    d.update(secs=75, rate=3000)
    row = [r for r in soak.rows(d) if "open fds" in r.metric][0]
    assert "last 20 s" in row.metric and row.met is True
