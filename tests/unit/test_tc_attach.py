"""nptrace.kernel.tc without root: attachment bookkeeping, state file and recovery, against a fake
netlink (FakeNet) and a fake /proc."""
from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field

import pytest

from nptrace.kernel import tc
from nptrace.config import Config, IfaceSpec
from nptrace.errors import InterfaceError

ING, EGR = tc.PARENT_INGRESS, tc.PARENT_EGRESS
ME = 4242


@dataclass
class Ref:
    ifindex: int
    parent: int
    prio: int
    handle: int
    protocol: int
    name: str

    def to_dict(self):
        return {"parent": self.parent, "prio": self.prio, "handle": self.handle,
                "protocol": self.protocol, "name": self.name}


@dataclass
class Link:
    name: str
    ifindex: int
    arphrd: int = 1


@dataclass
class Ns:
    inode: int
    links: dict[str, int]
    clsact: set = field(default_factory=set)
    filters: dict = field(default_factory=dict)     # (ifindex, parent) -> [Ref]


class FakeNet:
    """Namespaces by name (None = ours); log of every change; optional failure injection."""

    def __init__(self):
        self.ns: dict = {None: Ns(1000, {"eth0": 2, "br0": 3})}
        self.log: list[tuple] = []
        self.fail_on: tuple | None = None

    def add_ns(self, name, inode, links):
        self.ns[name] = Ns(inode, dict(links))

    def open(self, netns):
        if netns not in self.ns:
            raise InterfaceError(f"network namespace {netns!r} not found")
        return FakeRtnl(self, netns)

    def names(self, netns, ifindex):
        n = self.ns[netns]
        return [f.name for p in (ING, EGR) for f in n.filters.get((ifindex, p), [])]

    def add_foreign(self, netns, ifindex, parent, name, prio=1):
        n = self.ns[netns]
        n.clsact.add(ifindex)
        n.filters.setdefault((ifindex, parent), []).append(Ref(ifindex, parent, prio, 1, 3, name))


class FakeRtnl:
    def __init__(self, net: FakeNet, netns):
        self.net, self.netns = net, netns
        self.n = net.ns[netns]
        self.inode = self.n.inode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def _maybe_fail(self, *what):
        if self.net.fail_on == what:
            raise OSError(f"injected failure {what}")

    def link(self, name):
        if name not in self.n.links:
            raise InterfaceError(f"interface {name!r} not found")
        return Link(name, self.n.links[name], 65534 if name.startswith("wg") else 1)

    def link_by_index(self, idx):
        for name, i in self.n.links.items():
            if i == idx:
                return Link(name, i)
        return None

    def has_clsact(self, idx):
        return idx in self.n.clsact

    def add_clsact(self, idx):
        self._maybe_fail("add_clsact", self.netns, idx)
        self.n.clsact.add(idx)
        self.net.log.append(("add_clsact", self.netns, idx))

    def del_clsact(self, idx):
        self._maybe_fail("del_clsact", self.netns, idx)
        self.n.clsact.discard(idx)
        for p in (ING, EGR):
            self.n.filters.pop((idx, p), None)
        self.net.log.append(("del_clsact", self.netns, idx))

    def filters(self, idx, parent):
        return list(self.n.filters.get((idx, parent), []))

    def add_bpf_filter(self, idx, parent, fd, name):
        self._maybe_fail("add_filter", self.netns, idx, parent)
        assert idx in self.n.clsact
        lst = self.n.filters.setdefault((idx, parent), [])
        prio = min((f.prio for f in lst), default=0xC001) - 1
        ref = Ref(idx, parent, prio, 1, 3, name)
        lst.insert(0, ref)
        self.net.log.append(("add_filter", self.netns, idx, name))
        return ref

    def del_filter(self, ref):
        self._maybe_fail("del_filter", self.netns, ref.ifindex)
        lst = self.n.filters.get((ref.ifindex, ref.parent), [])
        for f in lst:
            if (f.prio, f.handle, f.name) == (ref.prio, ref.handle, ref.name):
                lst.remove(f)
                self.net.log.append(("del_filter", self.netns, ref.ifindex, ref.name))
                return True
        return False


def stat_line(pid, start):
    # /proc/PID/stat: the start time is field 22; the comm may contain spaces and ')'
    rest = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 10
    return f"{pid} (py thon) x) " + " ".join(rest)


def alive(proc, pid, start=77):
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(stat_line(pid, start))


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    alive(root, ME)
    return root


@pytest.fixture
def net():
    n = FakeNet()
    n.add_ns("pod", 2000, {"eth0": 2, "lo": 1, "wg0": 3})
    return n


def manager(net, proc, tmp_path, *specs, pid=ME):
    return tc.TcAttachments([IfaceSpec.parse(s) for s in specs], 10, 11,
                            state_dir=tmp_path / "state", open_netns=net.open, proc=proc,
                            pid=pid)


def state_file(tmp_path, pid=ME):
    return tmp_path / "state" / f"tc-{pid}.json"


def test_filter_names_carry_the_pid():
    assert tc.filter_name(12, ING) == "npt_12_ing"
    assert tc.filter_name(12, EGR) == "npt_12_egr"
    assert tc.filter_owner("npt_12_egr") == 12
    for other in ("npt_x_ing", "npt_12_foo", "cilium-lxc", "npt_12_ing_extra", ""):
        assert tc.filter_owner(other) is None


def test_attach_and_exit_remove_in_reverse_order(net, proc, tmp_path):
    with manager(net, proc, tmp_path, "eth0", "pod/eth0") as att:
        assert net.names(None, 2) == ["npt_4242_ing", "npt_4242_egr"]
        assert net.names("pod", 2) == ["npt_4242_ing", "npt_4242_egr"]
        st = json.loads(state_file(tmp_path).read_text())
        assert st["pid"] == ME and st["start"] == 77
        assert [(e["netns"], e["ifname"], e["netns_inode"], e["clsact_created"])
                for e in st["entries"]] == [(None, "eth0", 1000, True), ("pod", "eth0", 2000, True)]
        assert [f["name"] for f in st["entries"][1]["filters"]] == ["npt_4242_ing", "npt_4242_egr"]
        assert [(a.netns, a.ifindex) for a in att.attached] == [(None, 2), ("pod", 2)]
        adds = list(net.log)
    assert adds == [("add_clsact", None, 2), ("add_filter", None, 2, "npt_4242_ing"),
                    ("add_filter", None, 2, "npt_4242_egr"), ("add_clsact", "pod", 2),
                    ("add_filter", "pod", 2, "npt_4242_ing"),
                    ("add_filter", "pod", 2, "npt_4242_egr")]
    assert net.log[len(adds):] == [("del_filter", "pod", 2, "npt_4242_egr"),
                                   ("del_filter", "pod", 2, "npt_4242_ing"),
                                   ("del_clsact", "pod", 2),
                                   ("del_filter", None, 2, "npt_4242_egr"),
                                   ("del_filter", None, 2, "npt_4242_ing"),
                                   ("del_clsact", None, 2)]
    assert not state_file(tmp_path).exists()
    assert net.ns[None].clsact == set() and net.ns["pod"].clsact == set()


def test_exception_inside_the_block_still_cleans(net, proc, tmp_path):
    with pytest.raises(KeyError):
        with manager(net, proc, tmp_path, "eth0"):
            raise KeyError("boom")
    assert net.names(None, 2) == [] and net.ns[None].clsact == set()
    assert not state_file(tmp_path).exists()


def test_failure_while_attaching_undoes_the_rest(net, proc, tmp_path):
    net.fail_on = ("add_filter", "pod", 2, EGR)
    with pytest.raises(OSError, match="injected"):
        with manager(net, proc, tmp_path, "eth0", "pod/eth0"):
            pytest.fail("must not run")
    assert net.ns[None].clsact == set() and net.ns["pod"].clsact == set()
    assert net.names("pod", 2) == []
    assert not state_file(tmp_path).exists()


@pytest.mark.parametrize("spec, msg", [("pod/wlan0", "'wlan0' not found"),
                                       ("nosuch/eth0", "'nosuch' not found")])
def test_unknown_interface_or_netns_changes_nothing(net, proc, tmp_path, spec, msg):
    with pytest.raises(InterfaceError, match=msg):
        with manager(net, proc, tmp_path, "eth0", spec):
            pass
    assert net.log == []
    assert not (tmp_path / "state").exists()


def test_l3_devices_are_refused(net, proc, tmp_path):
    with pytest.raises(InterfaceError, match="pod/wg0: link type 65534 has no Ethernet header"):
        with manager(net, proc, tmp_path, "eth0", "pod/wg0"):
            pass
    assert net.log == []


def test_duplicate_specs(net, proc, tmp_path):
    net.add_ns("/proc/1/ns/net", 1000, {"eth0": 2})   # the same namespace, by path
    with manager(net, proc, tmp_path, "eth0", "eth0") as att:   # repeated: once
        assert len(att.attached) == 1
    with pytest.raises(InterfaceError, match="same interface"):
        with manager(net, proc, tmp_path, "eth0", "/proc/1/ns/net/eth0"):
            pass


def test_existing_clsact_and_foreign_filters_are_kept(net, proc, tmp_path):
    net.add_foreign(None, 2, ING, "cilium_lxc")
    with manager(net, proc, tmp_path, "eth0") as att:
        assert not att.attached[0].clsact_created
        assert net.names(None, 2) == ["npt_4242_ing", "cilium_lxc", "npt_4242_egr"]
    assert net.names(None, 2) == ["cilium_lxc"] and 2 in net.ns[None].clsact


def test_created_clsact_is_kept_if_someone_else_added_a_filter(net, proc, tmp_path):
    with manager(net, proc, tmp_path, "eth0"):
        net.add_foreign(None, 2, EGR, "late_comer", prio=5)
    assert net.names(None, 2) == ["late_comer"] and 2 in net.ns[None].clsact


def _dead_run(net, proc, tmp_path, pid=999, specs=("eth0", "pod/eth0")):
    """Attach as `pid`, then vanish without cleanup (what kill -9 leaves)."""
    alive(proc, pid, start=5)
    m = manager(net, proc, tmp_path, *specs, pid=pid)
    m.__enter__()
    (proc / str(pid) / "stat").unlink()
    (proc / str(pid)).rmdir()
    return m


def test_next_start_recovers_from_the_state_file(net, proc, tmp_path):
    _dead_run(net, proc, tmp_path)
    net.add_foreign("pod", 2, ING, "keep_me", prio=9)
    assert state_file(tmp_path, 999).exists()
    with manager(net, proc, tmp_path, "br0") as att:
        assert sorted(att.recovered) == sorted([
            "eth0: filter npt_999_ing", "eth0: filter npt_999_egr", "eth0: clsact",
            "eth0: filter npt_999_ing", "eth0: filter npt_999_egr"])
        assert not state_file(tmp_path, 999).exists()
    assert net.names(None, 2) == [] and 2 not in net.ns[None].clsact
    assert net.names("pod", 2) == ["keep_me"] and 2 in net.ns["pod"].clsact


def test_live_runs_are_left_alone(net, proc, tmp_path):
    alive(proc, 555, start=9)
    other = manager(net, proc, tmp_path, "pod/eth0", pid=555)
    other.__enter__()
    with manager(net, proc, tmp_path, "eth0") as att:
        assert att.recovered == []
        assert net.names("pod", 2) == ["npt_555_ing", "npt_555_egr"]
    assert state_file(tmp_path, 555).exists()
    other.__exit__(None, None, None)
    assert net.names("pod", 2) == []


def test_reused_pid_counts_as_dead(net, proc, tmp_path):
    _dead_run(net, proc, tmp_path, specs=("pod/eth0",))
    alive(proc, 999, start=6)      # a different process got the pid
    assert tc.recover(tmp_path / "state", net.open, proc=proc)
    assert net.names("pod", 2) == []


def test_recovery_skips_recreated_namespaces_and_renamed_links(net, proc, tmp_path):
    _dead_run(net, proc, tmp_path)
    net.ns["pod"].inode = 2001                       # deleted and created again
    net.ns[None].links = {"eth9": 2}                 # ifindex 2 is now another device
    assert tc.recover(tmp_path / "state", net.open, proc=proc) == []
    assert not state_file(tmp_path, 999).exists()


def test_recovery_when_the_namespace_is_gone(net, proc, tmp_path):
    _dead_run(net, proc, tmp_path, specs=("pod/eth0",))
    del net.ns["pod"]
    assert tc.recover(tmp_path / "state", net.open, proc=proc) == []
    assert not state_file(tmp_path, 999).exists()


def test_unreadable_and_foreign_files_in_state_dir(net, proc, tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    (d / "tc-123.json").write_text("{not json")
    (d / "notes.txt").write_text("keep")
    assert tc.recover(d, net.open, proc=proc) == []
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


def test_filters_of_dead_pids_are_swept_without_a_state_file(net, proc, tmp_path):
    alive(proc, 555)
    net.add_foreign(None, 2, ING, "npt_999_ing")      # dead pid, state file lost
    net.add_foreign(None, 2, EGR, "npt_4242_egr")     # our own pid: a previous life
    net.add_foreign(None, 2, EGR, "npt_555_egr")      # a live nptrace
    net.add_foreign(None, 2, EGR, "other")
    with manager(net, proc, tmp_path, "eth0") as att:
        assert sorted(att.recovered) == ["eth0: filter npt_4242_egr", "eth0: filter npt_999_ing"]
    assert net.names(None, 2) == ["npt_555_egr", "other"]


def test_failed_cleanup_stays_in_the_state_file(net, proc, tmp_path):
    m = manager(net, proc, tmp_path, "eth0", "pod/eth0")
    m.__enter__()
    net.fail_on = ("del_filter", "pod", 2)
    m.__exit__(None, None, None)
    st = json.loads(state_file(tmp_path).read_text())
    assert [(e["netns"], e["ifname"]) for e in st["entries"]] == [("pod", "eth0")]
    assert net.names(None, 2) == []
    net.fail_on = None
    # the next run (a new pid, after this one exited) finishes the job
    (proc / str(ME) / "stat").unlink()
    alive(proc, ME + 1)
    with manager(net, proc, tmp_path, "eth0", pid=ME + 1) as att:
        assert "eth0: clsact" in att.recovered
    assert net.names("pod", 2) == [] and net.ns["pod"].clsact == set()


# --- configuration ---------------------------------------------------------------------
class FakeTable(dict):
    class Key(int):
        pass

    class Leaf:
        def __init__(self, v=0):
            self.value = v
            self.ifindex = 0
            self.netns = 0
            self.flags = 0


class FakeProbes:
    def __init__(self):
        self.maps = {"vxlan_ports": FakeTable(), "tc_ifaces": FakeTable()}

    def map(self, name):
        return self.maps[name]

    def tc_program_fds(self):
        return 7, 8


def test_cflags():
    assert tc.tc_cflags(Config()) == ["-DNPT_TC_KSKB=1", "-DNPT_TC_VXLAN=1"]
    assert "-DNPT_TC_VXLAN=0" in tc.tc_cflags(Config(vxlan_ports=()))


def test_configure_fills_vxlan_ports():
    p = FakeProbes()
    tc.configure(p, Config(vxlan_ports=(4789, 8472)))
    assert sorted(p.maps["vxlan_ports"]) == [4789, 8472]
    with pytest.raises(InterfaceError, match="bad VXLAN port 0"):
        tc.configure(p, Config(vxlan_ports=(0,)))


def test_iface_map_marks_an_ifindex_of_two_namespaces_ambiguous():
    from types import SimpleNamespace as A
    p = FakeProbes()
    fill = tc.iface_map_filler(p)
    fill(A(ifindex=2, netns_inode=2000))
    fill(A(ifindex=3, netns_inode=2000))
    fill(A(ifindex=2, netns_inode=2000))      # attached again in the same namespace
    m = p.maps["tc_ifaces"]
    assert (m[2].netns, m[2].flags, m[3].flags) == (2000, 0, 0)
    fill(A(ifindex=2, netns_inode=3000))      # another namespace's device, same ifindex
    assert m[2].flags == tc.TC_IF_AMBIGUOUS
    fill(A(ifindex=2, netns_inode=2000))      # stays ambiguous: both may still be watched
    assert m[2].flags == tc.TC_IF_AMBIGUOUS and m[3].flags == 0


def test_iface_map_marks_a_slot_two_ifindexes_share_ambiguous():
    from types import SimpleNamespace as A
    p = FakeProbes()
    fill = tc.iface_map_filler(p)
    fill(A(ifindex=3, netns_inode=2000))
    fill(A(ifindex=3 + tc.TC_IF_SLOTS, netns_inode=2000))   # the same slot, another device
    m = p.maps["tc_ifaces"]
    assert list(m) == [3]
    # the programs find the slot not theirs (ifindex) or ambiguous: both read the sk_buff
    assert (m[3].ifindex, m[3].flags) == (3 + tc.TC_IF_SLOTS, tc.TC_IF_AMBIGUOUS)


def test_iface_map_constants_are_the_programs():
    import re
    from pathlib import Path
    src = (Path(tc.__file__).parents[2] / "bpf" / "tc.bpf.c").read_text()
    slots = int(re.search(r"#define NPT_TC_IF_SLOTS (\d+)", src).group(1))
    amb = int(re.search(r"#define NPT_TC_IF_AMBIGUOUS (0x[0-9a-f]+)", src).group(1), 16)
    assert (slots, amb) == (tc.TC_IF_SLOTS, tc.TC_IF_AMBIGUOUS)
    assert slots & (slots - 1) == 0        # the programs take the slot with a mask


def test_attach_helper_fills_the_iface_map(net, proc, tmp_path):
    p = FakeProbes()
    cfg = Config(ifaces=(IfaceSpec("pod", "eth0"),), tc_mode="clsact")
    att = tc.attach(p, cfg, state_dir=tmp_path / "state", open_netns=net.open, proc=proc,
                    pid=ME)
    assert att.fds == {ING: 7, EGR: 8}
    assert net.names("pod", 2) == ["npt_4242_ing", "npt_4242_egr"]
    assert {k: v.netns for k, v in p.maps["tc_ifaces"].items()} == {2: 2000}
    with att:                       # already attached: entering again adds nothing
        assert net.names("pod", 2) == ["npt_4242_ing", "npt_4242_egr"]
    assert net.names("pod", 2) == []
    att.close()                     # idempotent
    assert sorted(p.maps["vxlan_ports"]) == [4789, 8472]


def test_prog_stats_parses_fdinfo(tmp_path):
    (tmp_path / "fdinfo").mkdir()
    (tmp_path / "fdinfo" / "5").write_text(
        "pos:\t0\nflags:\t02000002\nprog_type:\t3\nprog_tag:\tabc\nmemlock:\t4096\n"
        "prog_id:\t77\nrun_time_ns:\t123456\nrun_cnt:\t1000\nrecursion_misses:\t0\n"
        "verified_insns:\t99\n")
    assert tc.prog_stats(5, tmp_path) == (1000, 123456)


def test_state_file_with_our_pid_from_an_earlier_life(net, proc, tmp_path):
    earlier = manager(net, proc, tmp_path, "pod/eth0")
    earlier.__enter__()
    d = tmp_path / "state"
    assert tc.recover(d, net.open, proc=proc) == []            # same pid and start: alive
    st = json.loads(state_file(tmp_path).read_text())
    st["start"] = 1                                              # same pid, another process
    state_file(tmp_path).write_text(json.dumps(st))
    assert len(tc.recover(d, net.open, proc=proc)) == 3
    assert net.names("pod", 2) == [] and not state_file(tmp_path).exists()


# --- tcx links (Linux 6.6+); the kernel side is tests/privileged/test_tc_cleanup.py ---------
class FakeTcx:
    """link_tcx stand-in: hands out real fds (pipe ends) so closing them can be checked, or
    fails with a given errno."""

    def __init__(self, errno_=None):
        self.errno, self.calls, self.fds = errno_, [], []

    def __call__(self, prog_fd, ifindex, ingress, netns_path):
        self.calls.append((prog_fd, ifindex, ingress, netns_path))
        if self.errno is not None:
            raise OSError(self.errno, os.strerror(self.errno))
        r, w = os.pipe()
        os.close(w)
        self.fds.append(r)
        return r


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_auto_links_with_tcx_and_leaves_nothing_to_recover(net, proc, tmp_path):
    link = FakeTcx()
    seen = []
    att = tc.TcAttachments([IfaceSpec.parse("pod/eth0")], 10, 11, state_dir=tmp_path / "state",
                           open_netns=net.open, proc=proc, pid=ME, mode="auto",
                           link_tcx=link, on_attach=seen.append)
    with att:
        assert att.mode == "tcx"
        assert link.calls == [(10, 2, True, "/run/netns/pod"), (11, 2, False, "/run/netns/pod")]
        assert net.names("pod", 2) == [] and not any(e[0] == "add_clsact" for e in net.log)
        assert not state_file(tmp_path).exists()      # a dead run's links die with it
        assert [(a.netns, a.ifindex, a.netns_inode) for a in seen] == [("pod", 2, 2000)]
        assert all(fd_open(fd) for fd in link.fds)
    assert not any(fd_open(fd) for fd in link.fds)     # closing the fds unlinks
    assert att.links == []


@pytest.mark.parametrize("err", [errno.EINVAL, errno.EOPNOTSUPP])
def test_auto_falls_back_to_clsact_without_tcx(net, proc, tmp_path, err):
    link = FakeTcx(err)
    with tc.TcAttachments([IfaceSpec.parse("pod/eth0"), IfaceSpec.parse("eth0")], 10, 11,
                          state_dir=tmp_path / "state", open_netns=net.open, proc=proc, pid=ME,
                          mode="auto", link_tcx=link) as att:
        assert att.mode == "clsact"
        assert len(link.calls) == 1                   # asked once, not per interface
        assert net.names("pod", 2) == ["npt_4242_ing", "npt_4242_egr"]
        assert net.names(None, 2) == ["npt_4242_ing", "npt_4242_egr"]
    assert net.names("pod", 2) == []


def test_tcx_failures_that_clsact_would_not_fix_are_errors(net, proc, tmp_path):
    with pytest.raises(InterfaceError, match="--iface pod/eth0: Operation not permitted"):
        with tc.TcAttachments([IfaceSpec.parse("pod/eth0")], 10, 11,
                              state_dir=tmp_path / "state", open_netns=net.open, proc=proc,
                              pid=ME, mode="auto", link_tcx=FakeTcx(errno.EPERM)):
            pass
    # --tc-mode tcx on a kernel without tcx: said, not silently replaced by clsact
    with pytest.raises(InterfaceError, match="Invalid argument"):
        with tc.TcAttachments([IfaceSpec.parse("pod/eth0")], 10, 11,
                              state_dir=tmp_path / "state", open_netns=net.open, proc=proc,
                              pid=ME, mode="tcx", link_tcx=FakeTcx(errno.EINVAL)):
            pass
    assert net.names("pod", 2) == [] and not any(e[0] == "add_clsact" for e in net.log)


def test_second_interface_failing_closes_the_first_ones_links(net, proc, tmp_path):
    link = FakeTcx()
    att = tc.TcAttachments([IfaceSpec.parse("eth0"), IfaceSpec.parse("pod/eth0")], 10, 11,
                           state_dir=tmp_path / "state", open_netns=net.open, proc=proc, pid=ME,
                           mode="tcx", link_tcx=link)
    real = link.__call__

    def fail_in_pod(prog_fd, ifindex, ingress, path):
        if path is not None:
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        return real(prog_fd, ifindex, ingress, path)
    att.link_tcx = fail_in_pod
    with pytest.raises(InterfaceError, match="No such device"):
        att.__enter__()
    assert len(link.fds) == 2 and not any(fd_open(fd) for fd in link.fds)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="tc mode 'tc'"):
        tc.TcAttachments([], 1, 2, mode="tc")
