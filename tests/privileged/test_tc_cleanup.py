"""tc attachment lifecycle on real interfaces in namespaces made for the test (npt-tc<pid>-*):
only what we created is removed, on normal exit, on exception, and after a kill -9 (by the
next start, from the state file or from the filter names). Most cases are the clsact mode
(kernels before 6.6); the tcx ones are at the end: there the kernel unlinks a dead run's
programs itself."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nptrace.config import IfaceSpec
from nptrace.errors import InterfaceError

pytestmark = [pytest.mark.privileged,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # bcc 0.26 str args

ROOT = Path(__file__).resolve().parents[2]
PROG = "int npt_noop(struct __sk_buff *skb) { return -1; }"

# A run that attaches and is then killed with SIGKILL: nothing of ours runs after that.
DEAD_RUN = r"""
import sys
from bcc import BPF
from nptrace.kernel import tc
from nptrace.config import IfaceSpec
b = BPF(text=sys.argv[3], cflags=["-Wno-ignored-attributes"])
fd = b.load_func("npt_noop", BPF.SCHED_CLS).fd
att = tc.TcAttachments([IfaceSpec.parse(sys.argv[1])], fd, fd, state_dir=sys.argv[2],
                       mode=sys.argv[4] if len(sys.argv) > 4 else "clsact")
att.__enter__()
print("attached", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def ns(root_and_bcc):
    """A namespace with a veth pair (v0, v1) in it."""
    name = f"npt-tc{os.getpid()}-cl"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "v1"],
                       check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture(scope="module")
def fd(root_and_bcc):
    from bcc import BPF
    b = BPF(text=PROG, cflags=["-Wno-ignored-attributes"])
    yield b.load_func("npt_noop", BPF.SCHED_CLS).fd
    b.cleanup()


def tc_state(ns: str, dev: str) -> tuple[bool, list[str]]:
    """(clsact present, names of the bpf filters on ingress + egress)."""
    from nptrace.kernel import netlink
    with netlink.open_netns(ns) as r:
        idx = r.link(dev).ifindex
        names = [f.name for p in (netlink.PARENT_INGRESS, netlink.PARENT_EGRESS)
                 for f in r.filters(idx, p)]
        return r.has_clsact(idx), names


def ours(pid: int) -> list[str]:
    return [f"npt_{pid}_ing", f"npt_{pid}_egr"]


def test_normal_exit_and_exception_remove_everything(ns, fd, tmp_path):
    from nptrace.kernel import tc
    spec = [IfaceSpec(ns, "v0")]
    with tc.TcAttachments(spec, fd, fd, state_dir=tmp_path) as att:
        assert tc_state(ns, "v0") == (True, ours(os.getpid()))
        assert (tmp_path / f"tc-{os.getpid()}.json").exists()
        assert att.attached[0].clsact_created
    assert tc_state(ns, "v0") == (False, [])
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(RuntimeError):
        with tc.TcAttachments(spec, fd, fd, state_dir=tmp_path):
            raise RuntimeError("boom")
    assert tc_state(ns, "v0") == (False, [])
    assert list(tmp_path.iterdir()) == []


def test_foreign_qdisc_and_filter_are_kept(ns, fd, tmp_path):
    from nptrace.kernel import netlink, tc
    with netlink.open_netns(ns) as r:
        idx = r.link("v1").ifindex
        r.add_clsact(idx)
        r.add_bpf_filter(idx, netlink.PARENT_INGRESS, fd, "cni_prog")
    with tc.TcAttachments([IfaceSpec(ns, "v1")], fd, fd, state_dir=tmp_path) as att:
        assert not att.attached[0].clsact_created
        present, names = tc_state(ns, "v1")
        # ours first: the kernel gives a filter without a priority the one before the others
        assert present and names == [ours(os.getpid())[0], "cni_prog", ours(os.getpid())[1]]
    assert tc_state(ns, "v1") == (True, ["cni_prog"])


def test_unknown_interface_or_namespace_changes_nothing(ns, fd, tmp_path):
    from nptrace.kernel import tc
    with pytest.raises(InterfaceError, match="'nope0' not found"):
        with tc.TcAttachments([IfaceSpec(ns, "v0"), IfaceSpec(ns, "nope0")], fd, fd,
                              state_dir=tmp_path):
            pass
    assert tc_state(ns, "v0") == (False, [])
    with pytest.raises(InterfaceError, match="namespace 'npt-no-such-ns' not found"):
        with tc.TcAttachments([IfaceSpec("npt-no-such-ns", "v0")], fd, fd, state_dir=tmp_path):
            pass
    assert not Path("/run/netns/npt-no-such-ns").exists()   # pyroute2 must not create it


def _dead_run(ns: str, state_dir: Path, mode: str = "clsact") -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-W", "ignore", "-c", DEAD_RUN, f"{ns}/v0",
                          str(state_dir), PROG, mode], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        line = p.stdout.readline().strip()
        assert line == "attached", line
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    return p.pid


@pytest.mark.parametrize("lose_state_file", [False, True], ids=["state-file", "names-only"])
def test_next_start_removes_what_a_killed_run_left(ns, fd, tmp_path, lose_state_file):
    from nptrace.kernel import tc
    dead = _dead_run(ns, tmp_path)
    assert tc_state(ns, "v0") == (True, ours(dead))
    state = tmp_path / f"tc-{dead}.json"
    assert state.exists()
    if lose_state_file:
        state.unlink()
    with tc.TcAttachments([IfaceSpec(ns, "v0")], fd, fd, state_dir=tmp_path) as att:
        want = [f"v0: filter {n}" for n in ours(dead)] + ([] if lose_state_file else
                                                          ["v0: clsact"])
        assert sorted(att.recovered) == sorted(want)
        assert tc_state(ns, "v0") == (True, ours(os.getpid()))
        assert not state.exists()
    # the dead run's qdisc: removed by the recovery (state file); left in place when only
    # the names were left, since then nobody knows who made it
    assert tc_state(ns, "v0") == (lose_state_file, [])


# --- tcx (Linux 6.6+) ----------------------------------------------------------------------
def _ifindex(ns: str, dev: str) -> int:
    return int(subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/ifindex"],
                              capture_output=True, text=True, check=True).stdout)


def _need_tcx(ns: str, fd: int) -> None:
    from nptrace.kernel import tcx
    from nptrace.kernel.nsenter import path_of
    try:
        os.close(tcx.link_create(fd, _ifindex(ns, "v1"), True, path_of(ns)))
    except OSError as e:
        if e.errno in tcx.NOT_SUPPORTED:
            pytest.skip(f"kernel without tcx links (Linux < 6.6): {e}")
        raise


def tcx_progs(ns: str, dev: str) -> tuple[list[int], list[int]]:
    """(ingress, egress) program ids linked with tcx on dev, in run order."""
    from nptrace.kernel import tcx
    from nptrace.kernel.nsenter import path_of
    idx = _ifindex(ns, dev)
    return (tcx.prog_ids(idx, True, path_of(ns)), tcx.prog_ids(idx, False, path_of(ns)))


def _prog_id(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("prog_id:"):
            return int(line.split()[1])
    raise AssertionError("no prog_id in fdinfo")


def test_tcx_links_first_and_unlinks_on_exit(ns, fd, tmp_path):
    from nptrace.kernel import tc, tcx
    from nptrace.kernel.nsenter import path_of
    _need_tcx(ns, fd)
    pid_ = _prog_id(fd)
    # a CNI's program already linked on v0's ingress: ours must run before it
    idx = _ifindex(ns, "v0")
    from bcc import BPF
    cni = BPF(text="int cni(struct __sk_buff *skb) { return -1; }",
              cflags=["-Wno-ignored-attributes"])
    cni_fd = cni.load_func("cni", BPF.SCHED_CLS).fd
    cni_link = tcx.link_create(cni_fd, idx, True, path_of(ns))
    try:
        cni_id = _prog_id(cni_fd)
        with tc.TcAttachments([IfaceSpec(ns, "v0")], fd, fd, state_dir=tmp_path,
                              mode="auto") as att:
            assert att.mode == "tcx" and att.attached == []
            assert tcx_progs(ns, "v0") == ([pid_, cni_id], [pid_])
            assert tc_state(ns, "v0") == (False, [])     # no qdisc, no filter
            assert list(tmp_path.iterdir()) == []         # nothing for a next start to undo
        assert tcx_progs(ns, "v0") == ([cni_id], [])     # the CNI's link stays
    finally:
        os.close(cni_link)
        cni.cleanup()


def test_tcx_links_of_a_killed_run_are_gone_with_it(ns, fd, tmp_path):
    _need_tcx(ns, fd)
    _dead_run(ns, tmp_path, mode="tcx")
    # the kernel released the links with the process's fds: nothing left, no state file
    assert tcx_progs(ns, "v0") == ([], [])
    assert tc_state(ns, "v0") == (False, [])
    assert list(tmp_path.iterdir()) == []
