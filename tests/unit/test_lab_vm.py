"""nptrace/lab/vm.py without root and without VMs: a lab VM's commands are the namespace lab's
host_steps (one source), with the NIC renaming, default-route and reset/prepare adaptations."""
import ipaddress
import json
import socket
import subprocess

import pytest
from click.testing import CliRunner

from nptrace.lab import hostplan, model, vm
from nptrace.lab.errors import LabError, UsageError

ALL_CASES = [(s.name, v) for s in model.load_scenarios() for v in (None, *s.variants)]
# Real names chosen so that a second renaming pass would show (node1 eth0->eth1->eth2).
NICS = {
    "client": {"eth0": "eth1", "eth1": "eth2"},
    "mbox": {"west": "ens7", "east": "ens8"},
    "node1": {"eth0": "eth1", "eth1": "eth2", "ul0": "eth3"},
    "node2": {"eth0": "eth1", "ul0": "eth2"},
}
PREFIX = "npt-"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setattr(vm, "MARKER", tmp_path / "no-marker")
    monkeypatch.setattr(vm, "STATE_DIR", tmp_path / "state")
    monkeypatch.delenv("NPT_LAB_PREFIX", raising=False)


# ---------------------------------------------------------------- an independent expectation

def _subnets(spec, ifaces_of):
    return {ipaddress.ip_interface(a).network for h, i in ifaces_of for a in spec.hosts[h]["ifaces"][i].get("addrs", [])}


def expected_role(spec, role, backend, nics, view=None):
    """host_steps of ``role``, renamed and with `default` split, written without vm.py's helpers."""
    src = view or spec
    lab = _subnets(spec, [m.split(":", 1) for ms in spec.networks.values() for m in ms])
    own = _subnets(src, [(role, i) for i in src.hosts[role]["ifaces"]])
    out = []
    for s in hostplan.host_steps(src, role, backend):
        if s.kind == "daemon":
            out.append(vm.Cmd(role, s.argv, daemon=f"nptrace-lab-{role}"))
            continue
        argvs = [list(s.argv)]
        if s.argv[:4] == ("ip", "route", "add", "default"):
            argvs = [["ip", "route", "add", str(n), *s.argv[4:]]
                     for n in sorted(lab - own, key=lambda n: int(n.network_address))]
        for a in argvs:
            if a[0] in ("ip", "ethtool"):
                a = [nics.get(x, x) for x in a]
            elif a[0] == "sysctl":
                a = [x if not x.startswith("net.ipv4.conf.") else
                     ".".join(nics.get(p, p) if i == 3 else p for i, p in enumerate(x.split(".")))
                     for x in a]
            out.append(vm.Cmd(role, tuple(a), vm.rename_text(s.input, nics) if s.input else s.input))
    return out


def expected_pod(spec, pod, backend):
    ns = PREFIX + pod
    out = []
    for s in hostplan.host_steps(spec, pod, backend):
        if s.kind == "daemon":
            if not spec.hosts[pod].get("gone"):
                out.append(vm.Cmd(pod, s.argv, daemon=f"nptrace-lab-{pod}", netns=ns))
            continue
        argv = ["ip", "-n", ns, *s.argv[1:]] if s.argv[0] == "ip" else ["ip", "netns", "exec", ns, *s.argv]
        out.append(vm.Cmd(pod, tuple(argv), s.input))
    return out


@pytest.mark.parametrize("name,variant", ALL_CASES)
def test_vm_commands_are_the_namespace_labs_host_steps(name, variant, tmp_path):
    spec = model.compile_spec(name, variant)
    for backend in spec.backends:
        for role, nics in NICS.items():
            cmds = vm.role_commands(spec, role, backend, nics, prefix=PREFIX, state_dir=tmp_path)
            sections = [c.section for c in cmds]
            assert sections[0] == "reset" and "prepare" in sections
            assert [c for c in cmds if c.section == role] == expected_role(spec, role, backend, nics)
            for pod in spec.pods(role):
                assert [c for c in cmds if c.section == pod] == expected_pod(spec, pod, backend)
            gone = [(f"veth{p.replace('-', '')}", PREFIX + p) for p in spec.pods(role) if spec.hosts[p].get("gone")]
            # the pod's veth before its namespace: the kernel tears a deleted one down later
            assert [c.argv[-1] for c in cmds if c.section == "finish"] == [x for g in gone for x in g]
            # Reset may fail (nothing to undo); nothing else may.
            assert all(c.check == (c.section != "reset") for c in cmds)


def test_every_scenario_keeps_the_vm_wiring():
    """The VMs' NICs come from the base topology: no scenario may add or move one."""
    base = model.load_topology()["networks"]
    for name, variant in ALL_CASES:
        assert model.compile_spec(name, variant).networks == base, (name, variant)


def test_k8s_profile_leaves_cluster_parts_to_the_cluster(tmp_path):
    spec = model.compile_spec("networkpolicy-drop")
    before = json.dumps(spec.hosts, sort_keys=True)
    cmds = vm.role_commands(spec, "node1", "iptables", NICS["node1"], profile="k8s", prefix=PREFIX,
                            state_dir=tmp_path)
    assert json.dumps(spec.hosts, sort_keys=True) == before   # the view is a copy
    text = "\n".join(c.shell() for c in cmds)
    for absent in ("cni0", "flannel.1", "veth", "iptables-restore", "KUBE-", "NETPOL", "netns add",
                   "nft flush", "conntrack -F", "systemd-run"):
        assert absent not in text, absent
    mine = [c for c in cmds if c.section == "node1"]
    assert mine == expected_role(spec, "node1", "iptables", NICS["node1"], view=vm.k8s_view(spec, "node1"))
    assert vm.Cmd("node1", ("ip", "addr", "add", "192.168.50.11/24", "dev", "eth3")) in mine
    assert vm.Cmd("node1", ("ip", "route", "add", "172.16.20.0/24", "via", "192.168.10.1")) in mine
    assert any(c.argv[0] == "sysctl" and "net.ipv4.conf.all.rp_filter=2" in c.argv for c in mine)
    # Client and mbox are not cluster members: the same commands in both profiles.
    for role in ("client", "mbox"):
        a = vm.role_commands(spec, role, "iptables", NICS[role], profile="k8s", state_dir=tmp_path)
        b = vm.role_commands(spec, role, "iptables", NICS[role], profile="netns", state_dir=tmp_path)
        assert a == b


def test_unknown_profile_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError):
        vm.role_commands(model.compile_spec("healthy"), "client", "iptables", {}, profile="k3s",
                         state_dir=tmp_path)


# ---------------------------------------------------------------- adaptations

def test_default_route_becomes_the_lab_subnets_not_attached():
    spec = model.compile_spec("healthy")
    assert vm.expand_default_route(["ip", "route", "add", "default", "via", "192.168.10.1"], spec, "node1") == [
        ["ip", "route", "add", "172.16.20.0/24", "via", "192.168.10.1"]]
    assert vm.expand_default_route(["ip", "route", "add", "0.0.0.0/0", "via", "192.168.10.1"], spec, "node2") == [
        ["ip", "route", "add", "172.16.20.0/24", "via", "192.168.10.1"],
        ["ip", "route", "add", "172.16.21.0/24", "via", "192.168.10.1"]]
    other = ["ip", "route", "add", "10.244.0.0/16", "via", "192.168.10.11"]
    assert vm.expand_default_route(other, spec, "client") == [other]


def test_renaming_is_one_pass_and_only_touches_interface_names():
    nics = {"eth0": "eth1", "eth1": "eth2"}
    assert vm.rename_argv(["ip", "addr", "add", "10.0.0.1/24", "dev", "eth0"], nics)[-1] == "eth1"
    assert vm.rename_argv(["ip", "link", "set", "eth1", "up"], nics)[3] == "eth2"
    assert vm.rename_argv(["sysctl", "-w", "net.ipv4.conf.eth1.rp_filter=2", "net.ipv4.conf.all.rp_filter=1"],
                          nics) == ["sysctl", "-w", "net.ipv4.conf.eth2.rp_filter=2", "net.ipv4.conf.all.rp_filter=1"]
    assert vm.rename_argv(["iptables", "-A", "FORWARD", "-i", "eth0", "-m", "comment", "--comment", "eth0"],
                          nics) == ["iptables", "-A", "FORWARD", "-i", "eth1", "-m", "comment", "--comment", "eth0"]
    assert vm.rename_argv(["nft", "-f", "-"], nics) == ["nft", "-f", "-"]
    ipt = '-A FORWARD ! -i eth0 -o eth1 -j DROP\n-A X --in-interface eth1 -m comment --comment "eth0 x" -j ACCEPT\n'
    assert vm.rename_text(ipt, nics) == ('-A FORWARD ! -i eth1 -o eth2 -j DROP\n'
                                         '-A X --in-interface eth2 -m comment --comment "eth0 x" -j ACCEPT\n')
    nft = 'iifname "eth0" oifname != eth1 counter drop comment "eth0"'
    assert vm.rename_text(nft, nics) == 'iifname "eth1" oifname != eth2 counter drop comment "eth0"'
    assert vm.rename_text("", nics) == "" and vm.rename_text("-i eth9", nics) == "-i eth9"


def test_reset_and_prepare(tmp_path):
    spec = model.compile_spec("healthy")
    cmds = vm.reset_cmds(spec, "node1", NICS["node1"], "netns", PREFIX, tmp_path)
    text = [c.shell() for c in cmds]
    assert text[0] == "systemctl stop 'nptrace-lab-*' || true"
    for want in ("ip netns del npt-web-0 || true", "ip link del cni0 || true", "ip link del flannel.1 || true",
                 "ip addr flush dev eth3 || true", "nft flush ruleset || true", "conntrack -F || true",
                 "ethtool -K eth3 tx on || true"):
        assert want in text
    assert not any("sysctl" in t for t in text)          # no baseline yet
    (tmp_path / "sysctl-baseline.json").write_text(json.dumps({"net.ipv4.ip_forward": "0"}))
    cmds = vm.reset_cmds(spec, "node1", NICS["node1"], "netns", PREFIX, tmp_path)
    assert "sysctl -q -w net.ipv4.ip_forward=0 || true" in [c.shell() for c in cmds]
    prep = vm.prepare_cmds(spec, "node2", NICS["node2"], "netns", PREFIX)
    assert "net.ipv4.conf.eth2.rp_filter=0" in prep[0].argv and "net.ipv6.conf.eth1.disable_ipv6=1" in prep[0].argv
    assert vm.Cmd("prepare", ("ip", "link", "add", "vethweb1", "type", "veth", "peer", "name", "eth0",
                              "netns", "npt-web-1")) in prep
    assert len(vm.prepare_cmds(spec, "node2", NICS["node2"], "k8s", PREFIX)) == 1


def test_cmd_shell_forms():
    c = vm.Cmd("node1", ("nft", "-f", "-"), "table ip t {}\n")
    assert c.shell() == "nft -f - <<'NPTRACE_EOF'\ntable ip t {}\nNPTRACE_EOF"
    r = vm.Cmd("reset", ("nft", "-f", "-"), "flush ruleset", check=False)
    assert r.shell() == "nft -f - <<'NPTRACE_EOF' || true\nflush ruleset\nNPTRACE_EOF"
    d = vm.Cmd("web-0", ("/py", "/s.py", "--name", "web-0", "--listen", "8080:echo", "--listen", "32080:hc:a/b:1"),
               daemon="nptrace-lab-web-0", netns="npt-web-0")
    assert d.full_argv()[:6] == ["systemd-run", "--unit=nptrace-lab-web-0", "--collect", "--quiet", "--", "ip"]
    assert d.ports() == [8080, 32080]


# ---------------------------------------------------------------- plan and NICs

def test_plan_has_one_vm_per_host_and_one_nic_per_network_member():
    topo = model.load_topology()
    plan = vm.vagrant_plan()
    assert [v["name"] for v in plan["vms"]] == ["mbox", "node1", "node2", "client"]
    members = {f"{v['name']}:{n['lab']}": n["network"] for v in plan["vms"] for n in v["nics"]}
    assert members == {m: net for net, ms in topo["networks"].items() for m in ms}
    macs = [n["mac"] for v in plan["vms"] for n in v["nics"]]
    assert len(set(macs)) == len(macs) and all(int(m.split(":")[0], 16) & 2 for m in macs)  # locally administered
    node1 = vm.plan_vm(plan, "node1")
    assert node1["primary_ip"] == "192.168.10.11" and node1["overlay_nic"] == "ul0" and node1["pods"] == ["web-0"]
    with pytest.raises(UsageError, match="not a lab VM"):
        vm.plan_vm(plan, "web-0")


def _sysfs(tmp_path, devs):
    root = tmp_path / "net"
    for name, mac in devs.items():
        (root / name).mkdir(parents=True)
        (root / name / "address").write_text(mac + "\n")
    return root


def test_nics_are_found_by_mac(tmp_path):
    node1 = vm.plan_vm(vm.vagrant_plan(), "node1")
    macs = [n["mac"] for n in node1["nics"]]
    root = _sysfs(tmp_path, {"eth0": "52:54:00:00:00:01", "eth1": macs[0].upper(), "eth3": macs[2]})
    found, missing = vm.nic_map(node1, vm.read_macs(root))
    assert found == {"eth0": "eth1", "ul0": "eth3"} and missing == ["eth1"]
    found, missing = vm.nic_map(node1, vm.read_macs(root), {"eth1": "ens9"})
    assert found == {"eth0": "eth1", "eth1": "ens9", "ul0": "eth3"} and missing == []
    with pytest.raises(UsageError):
        vm.nic_map(node1, {}, {"west": "eth1"})
    with pytest.raises(UsageError):
        vm.parse_nic_overrides(["eth0"])
    assert vm.read_macs(tmp_path / "absent") == {}


def test_marker(tmp_path):
    p = tmp_path / "m"
    assert vm.read_marker(p) is None
    p.write_text("# comment\nrole = node2\nprofile=k8s\n")
    assert vm.read_marker(p) == {"role": "node2", "profile": "k8s"}


# ---------------------------------------------------------------- the commands

def _invoke(args):
    return CliRunner().invoke(vm.main_group, args)


def test_dry_run_prints_a_script_without_marker_or_root():
    r = _invoke(["apply-role", "rp-filter-asymmetric", "--role", "node1", "--dry-run",
                 "--nic", "eth0=eth1", "--nic", "eth1=eth2", "--nic", "ul0=eth3"])
    assert r.exit_code == 0, r.output
    out = r.output
    assert out.startswith("# nptrace lab apply-role rp-filter-asymmetric --role node1")
    assert "# --- reset" in out and "# --- prepare" in out and "# --- node1" in out and "# --- web-0" in out
    assert "ip addr add 172.16.21.11/24 dev eth2\n" in out
    assert "sysctl -q -w net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=1\n" in out
    assert "iptables-restore -w --noflush <<'NPTRACE_EOF'\n*filter\n" in out
    assert "ip netns exec npt-web-0" in out and "--listen 8080:echo" in out


def test_dry_run_names_nics_it_cannot_find(tmp_path, monkeypatch):
    r = _invoke(["apply-role", "healthy", "--role", "client", "--dry-run"])
    assert r.exit_code == 0
    assert "# eth0: no interface with this MAC here; shown under its lab name" in r.output


@pytest.mark.parametrize("args,code,text", [
    (["apply-role", "healthy", "--role", "node1"], 1, "not an nptrace lab VM"),
    (["apply-role", "healthy"], 2, "give --role"),
    (["apply-role", "no-such", "--role", "node1", "--dry-run"], 2, "unknown scenario 'no-such'"),
    (["apply-role", "healthy", "--role", "web-0", "--dry-run"], 2, "not a lab VM"),
    (["apply-role", "healthy", "--role", "node1", "--nic", "eth0", "--dry-run"], 2, "LAB=REAL"),
    (["apply-role", "networkpolicy-drop", "--role", "node1", "--backend", "nft", "--dry-run"], 2, "no nft form"),
    (["apply-role", "healthy", "--role", "node1", "--backend", "ipvs", "--dry-run"], 2, "ipvs"),
    (["apply-role", "no-listener", "--role", "node1", "--variant", "x", "--dry-run"], 2, "no variant"),
])
def test_bad_input_is_one_line(args, code, text, capsys):
    with pytest.raises(SystemExit) as e:
        vm.main(args)
    err = capsys.readouterr().err
    assert e.value.code == code
    assert err.startswith("nptrace: error:") and text in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def _marker(tmp_path, role="node1", profile="netns"):
    p = tmp_path / "marker"
    p.write_text(f"role={role}\nprofile={profile}\n")
    return p


def test_refuses_another_role_and_non_root_and_missing_nics(tmp_path, monkeypatch):
    m = _marker(tmp_path, "client")
    kw = dict(plan_path=None, net_dir=tmp_path / "none", marker_path=m, state_dir=tmp_path / "s", executor=list().append)
    with pytest.raises(LabError, match="this VM is 'client'"):
        vm._apply_role("healthy", "node1", "iptables", None, None, (), False, False, **kw)
    with pytest.raises(LabError, match=r"lab NIC\(s\) eth0, eth1 of client not found"):
        vm._apply_role("healthy", None, "iptables", None, None, (), False, False, **kw)
    monkeypatch.setattr(vm.os, "geteuid", lambda: 1000)
    with pytest.raises(LabError, match="as root"):
        vm._apply_role("healthy", None, "iptables", None, None, ("eth0=a", "eth1=b"), False, False, **kw)


def test_apply_runs_every_command_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vm.os, "geteuid", lambda: 0)
    ran = []
    m = _marker(tmp_path, "node1")
    pairs = ("eth0=eth1", "eth1=eth2", "ul0=eth3")
    vm._apply_role("etp-local-no-endpoint", None, "nft", None, None, pairs, False, False,
                   net_dir=tmp_path / "none", marker_path=m, state_dir=tmp_path / "s", executor=ran.append)
    spec = model.compile_spec("etp-local-no-endpoint")
    assert ran == vm.role_commands(spec, "node1", "nft", NICS["node1"], state_dir=tmp_path / "s")
    assert [c.daemon for c in ran if c.daemon] == ["nptrace-lab-node1", "nptrace-lab-web-0"]
    out = capsys.readouterr().out
    assert "node1: etp-local-no-endpoint applied (profile netns, backend nft)" in out
    assert "trace here: sudo nptrace run --iface eth1 --iface eth2 --iface eth3 --iface flannel.1 --iface cni0" in out
    applied = json.loads((tmp_path / "s" / "applied.json").read_text())
    assert applied["scenario"] == "etp-local-no-endpoint" and applied["role"] == "node1"
    # --force: a machine without the marker
    ran.clear()
    vm._apply_role("healthy", "client", "iptables", None, None, ("eth0=a", "eth1=b"), False, True,
                   net_dir=tmp_path / "none", marker_path=tmp_path / "absent", state_dir=tmp_path / "s",
                   executor=ran.append)
    assert vm.Cmd("client", ("ip", "addr", "add", "192.168.10.1/24", "dev", "a")) in ran


def test_vm_nics_command(tmp_path, capsys):
    node2 = vm.plan_vm(vm.vagrant_plan(), "node2")
    root = _sysfs(tmp_path, {"enp0s8": node2["nics"][0]["mac"], "enp0s9": node2["nics"][1]["mac"]})
    vm._nics("node2", "ul0", False, net_dir=root)
    assert capsys.readouterr().out == "enp0s9\n"
    vm._nics("node2", None, True, net_dir=root)
    rows = json.loads(capsys.readouterr().out)["nics"]
    assert [(r["lab"], r["real"]) for r in rows] == [("eth0", "enp0s8"), ("ul0", "enp0s9")]
    with pytest.raises(UsageError):
        vm._nics("node2", "eth1", False, net_dir=root)
    with pytest.raises(LabError, match="no interface"):
        vm._nics("node2", "ul0", False, net_dir=tmp_path / "none")


def test_vm_trigger_groups_outcomes_like_lab_trigger(capsys):
    seen = []

    def probe(targets, timeout):
        seen.append(targets)
        if targets[0].get("read_all"):
            return [{"reply": "", "body": "HTTP/1.1 503 Service Unavailable\r\n\r\n{\"localEndpoints\": 0}",
                     "outcome": "ok"}]
        return [{"src": "192.168.10.100", "sport": 40000 + i, "dst": t["dst"], "dport": t["port"],
                 "outcome": "timeout", "error": "", "elapsed": 1.5, "phase": "connect", "reply": ""}
                for t in targets for i in range(t["count"])]

    vm._vm_trigger("etp-local-no-endpoint", None, 7, "client", False, probe=probe)
    out = capsys.readouterr().out
    assert "    7  192.168.10.11:30080  timeout" in out
    assert "7/7 attempts showed the expected symptom (timeout)" in out
    assert "health check 192.168.10.11:32080 -> HTTP 503 (expect 503)" in out
    assert seen[0][0]["src"] == "192.168.10.100" and seen[0][0]["count"] == 7
    with pytest.raises(UsageError, match="not from node1"):
        vm._vm_trigger("healthy", None, 3, "node1", False, probe=probe)


# ---------------------------------------------------------------- the executor (harmless commands only)

def test_executor_runs_checks_and_keeps_a_sysctl_baseline(tmp_path):
    ex = vm.HostExecutor(tmp_path)
    ex(vm.Cmd("x", ("true",)))
    ex(vm.Cmd("reset", ("false",), check=False))
    ex(vm.Cmd("reset", ("npt-no-such-binary",), check=False))
    with pytest.raises(LabError, match=r"\[x\] `false` failed"):
        ex(vm.Cmd("x", ("false",)))
    with pytest.raises(LabError, match="not installed"):
        ex(vm.Cmd("x", ("npt-no-such-binary",)))
    ex._note_baseline(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1", "net.npt.absent=1"])
    base = vm.read_baseline(tmp_path)
    assert list(base) == ["net.ipv4.ip_forward"]
    assert base["net.ipv4.ip_forward"] == open("/proc/sys/net/ipv4/ip_forward").read().strip()


def test_executor_waits_until_a_server_listens(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        vm.HostExecutor(tmp_path)._wait_listening(vm.Cmd("x", ("srv", "--listen", f"{port}:echo"), daemon="u"), 2.0)
        s.close()
        with pytest.raises(LabError, match="does not listen"):
            vm.HostExecutor(tmp_path)._wait_listening(
                vm.Cmd("x", ("srv", "--listen", f"{port}:echo"), daemon="u"), 0.3)
    finally:
        s.close()


@pytest.mark.parametrize("name,role", [("wrong-interface", "mbox"), ("networkpolicy-drop", "node1"),
                                       ("etp-local-no-endpoint", "node2"), ("healthy", "client")])
def test_dry_run_is_a_shell_script(name, role, tmp_path):
    cmds = vm.role_commands(model.compile_spec(name), role, "iptables", NICS[role], state_dir=tmp_path)
    script = tmp_path / "apply.sh"
    script.write_text("\n".join(c.shell() for c in cmds) + "\n")
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
