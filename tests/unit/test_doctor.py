"""nptrace doctor: node checks, report, rendering, exit codes and the click command (no root)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from nptrace import doctor
from nptrace.kernel import features
from nptrace.node import checks as node

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "features"
ROUTE_HDR = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"


def write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def node_tree(root: Path, all_rp: int, ifaces: dict[str, int], routes: list[tuple[str, str, str]],
              devtypes: dict[str, str] | None = None, conntrack: tuple[int, int] = (10, 1000)) -> Path:
    """ifaces: name -> rp_filter; routes: (iface, dest hex, mask hex)."""
    write(root, "proc/sys/net/ipv4/conf/all/rp_filter", f"{all_rp}\n")
    write(root, "proc/sys/net/ipv4/conf/default/rp_filter", f"{all_rp}\n")
    for name, rp in {"lo": 0, **ifaces}.items():
        write(root, f"proc/sys/net/ipv4/conf/{name}/rp_filter", f"{rp}\n")
        write(root, f"sys/class/net/{name}/type", "772\n" if name == "lo" else "1\n")
        dev = (devtypes or {}).get(name)
        write(root, f"sys/class/net/{name}/uevent",
              (f"DEVTYPE={dev}\n" if dev else "") + f"INTERFACE={name}\n")
    write(root, "proc/net/route", ROUTE_HDR + "".join(
        f"{i}\t{d}\t00000000\t0001\t0\t0\t0\t{m}\t0\t0\t0\n" for i, d, m in routes))
    write(root, "proc/sys/net/netfilter/nf_conntrack_count", f"{conntrack[0]}\n")
    write(root, "proc/sys/net/netfilter/nf_conntrack_max", f"{conntrack[1]}\n")
    return root


DEFAULT = "00000000"


# --- node checks ---------------------------------------------------------------------------

def test_strict_rp_filter_on_multihomed_node_warns_with_remedy(tmp_path):
    root = node_tree(tmp_path, 1, {"eth0": 1, "eth1": 1},
                     [("eth0", DEFAULT, DEFAULT), ("eth0", "000A0A0A", "00FFFFFF"),
                      ("eth1", "0014A8C0", "00FFFFFF")])
    checks = node.check(root, detect_backend=None)
    assert checks.multi_homed
    rp = checks.finding("rp_filter")
    assert rp.status == "warn"
    assert "eth0, eth1" in rp.detail and "multi-homed" in rp.detail
    assert rp.remedy.startswith(
        "sysctl -w net.ipv4.conf.eth0.rp_filter=2 net.ipv4.conf.eth1.rp_filter=2")
    assert "loose" in rp.remedy and "IP_RPFILTER" in rp.remedy    # the reason travels with it


def test_effective_rp_filter_is_max_of_all_and_iface(tmp_path):
    # all=1 makes eth1 strict although its own value is 0.
    root = node_tree(tmp_path / "a", 1, {"eth0": 2, "eth1": 0},
                     [("eth0", DEFAULT, DEFAULT), ("eth1", "0014A8C0", "00FFFFFF")])
    checks = node.check(root, detect_backend=None)
    eff = {i.name: i.effective for i in checks.interfaces}
    assert eff == {"lo": 1, "eth0": 2, "eth1": 1}
    rp = checks.finding("rp_filter")
    assert rp.status == "warn" and "net.ipv4.conf.eth1.rp_filter=2" in rp.remedy
    assert "conf.eth0." not in rp.remedy
    # all=2 (loose) wins over an interface's 1.
    root = node_tree(tmp_path / "b", 2, {"eth0": 1, "eth1": 1},
                     [("eth0", DEFAULT, DEFAULT), ("eth1", "0014A8C0", "00FFFFFF")])
    assert node.check(root, detect_backend=None).finding("rp_filter").status == "ok"


def test_strict_on_single_homed_node_is_fine(tmp_path):
    root = node_tree(tmp_path, 1, {"eth0": 0, "ifb0": 1},
                     [("eth0", DEFAULT, DEFAULT), ("eth0", "000200C0", "00FFFFFF")])
    checks = node.check(root, detect_backend=None)
    assert not checks.multi_homed
    rp = checks.finding("rp_filter")
    assert rp.status == "ok" and "single-homed" in rp.detail and not rp.remedy


def test_strict_with_overlay_warns_and_quotes_dotted_names(tmp_path):
    root = node_tree(tmp_path, 0, {"eth0": 1, "flannel.1": 1},
                     [("eth0", DEFAULT, DEFAULT), ("flannel.1", "0001F40A", "00FFFFFF")],
                     devtypes={"flannel.1": "vxlan"})
    checks = node.check(root, detect_backend=None)
    assert checks.overlays == ("flannel.1",) and not checks.multi_homed
    rp = checks.finding("rp_filter")
    assert rp.status == "warn" and "overlay" in rp.detail
    # procps sysctl reads '/' as the '.' inside an interface name.
    assert "net.ipv4.conf.flannel/1.rp_filter=2" in rp.remedy


def test_vxlan_found_by_devtype_not_name(tmp_path):
    root = node_tree(tmp_path, 1, {"eth0": 1, "tun-x": 0}, [("eth0", DEFAULT, DEFAULT)],
                     devtypes={"tun-x": "vxlan"})
    checks = node.check(root, detect_backend=None)
    assert {i.name: i.kind for i in checks.interfaces}["tun-x"] == "overlay"
    assert checks.finding("rp_filter").status == "warn"


def test_two_default_routes_make_a_node_multihomed(tmp_path):
    root = node_tree(tmp_path, 0, {"eth0": 0, "eth1": 0},
                     [("eth0", DEFAULT, DEFAULT), ("eth1", DEFAULT, DEFAULT)])
    checks = node.check(root, detect_backend=None)
    assert checks.multi_homed and checks.finding("rp_filter").status == "ok"


def test_rp_filter_off_everywhere_is_ok(tmp_path):
    root = node_tree(tmp_path, 0, {"eth0": 0}, [("eth0", DEFAULT, DEFAULT)])
    assert node.check(root, detect_backend=None).finding("rp_filter").status == "ok"


@pytest.mark.parametrize("count,cmax,status", [(900, 1000, "warn"), (800, 1000, "ok"), (0, 1000, "ok")])
def test_conntrack_usage(tmp_path, count, cmax, status):
    root = node_tree(tmp_path, 0, {"eth0": 0}, [("eth0", DEFAULT, DEFAULT)], conntrack=(count, cmax))
    f = node.check(root, detect_backend=None).finding("conntrack usage")
    assert f.status == status
    if status == "warn":
        assert "90%" in f.detail and f.remedy == "sysctl -w net.netfilter.nf_conntrack_max=2000"


@pytest.mark.parametrize("backend,status,text", [
    ("nft", "ok", "kube-proxy nftables mode"),
    ("iptables-legacy", "ok", "legacy backend"),
    ("none", "missing", "no kube-proxy rules"),
])
def test_kube_proxy_backend(tmp_path, backend, status, text):
    root = node_tree(tmp_path, 0, {"eth0": 0}, [("eth0", DEFAULT, DEFAULT)])
    seen = []
    checks = node.check(root, detect_backend=lambda ns: seen.append(ns) or backend)
    assert seen == [None] and checks.kube_proxy == backend
    f = checks.finding("kube-proxy rules")
    assert f.status == status and text in f.detail


def test_kube_proxy_detection_errors_become_unknown(tmp_path):
    root = node_tree(tmp_path, 0, {"eth0": 0}, [("eth0", DEFAULT, DEFAULT)])

    def broken(ns):
        raise PermissionError("iptables-save: Permission denied")
    checks = node.check(root, detect_backend=broken)
    assert checks.kube_proxy == "unknown"
    assert "Permission denied" in checks.finding("kube-proxy rules").detail


def test_fixture_root_never_runs_the_real_rule_reader():
    checks = node.check(FIXTURES / "kprobes-ipvs")
    assert checks.kube_proxy == "unknown" and checks.ipvs_services == 2
    assert "ipvs mode" in checks.finding("kube-proxy rules").detail


def test_node_checks_round_trip_through_json():
    checks = node.check(FIXTURES / "kprobes-ipvs")
    again = node.NodeChecks.from_dict(json.loads(json.dumps(checks.to_dict())))
    assert again == checks


def test_netns_only_on_real_root():
    with pytest.raises(node.NodeError):
        node.check(FIXTURES / "linux-6.18", netns="npt-x")


# --- report and rendering ------------------------------------------------------------------

def report_for(case: str) -> doctor.Report:
    root = FIXTURES / case
    return doctor.build_report(features.probe(root), node.check(root))


def test_report_ok_on_6_18():
    rep = report_for("linux-6.18")
    assert rep.ok and doctor.exit_code(rep) == 0 and rep.reason == ""
    assert len(rep.rows) == len(features.PROBES) + 3
    kprobes = next(r for r in rep.rows if r.check == "kprobes")
    assert kprobes.status == "missing" and kprobes.cost    # cost shown for what is missing
    btf = next(r for r in rep.rows if r.check == "btf")
    assert btf.status == "ok" and btf.cost == ""


def test_report_fails_with_one_line_reason():
    rep = report_for("empty")
    assert not rep.ok and doctor.exit_code(rep) == 1
    assert "\n" not in rep.reason
    assert rep.reason.startswith("tracing is not possible: not root")
    for part in ("no BPF", "no BTF", "no tracefs"):
        assert part in rep.reason


def test_render_aligns_columns():
    rep = report_for("kprobes-ipvs")
    text = doctor.render(rep)
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("AREA"))
    col = {name: lines[header].index(name) for name in ("CHECK", "STATUS", "DETAIL", "COST")}
    rows = lines[header + 1: header + 1 + len(rep.rows)]
    for ln, row in zip(rows, rep.rows):
        assert ln[col["CHECK"]:].startswith(row.check)
        assert ln[col["STATUS"]:].startswith(row.status)
        assert ln[col["DETAIL"]:].startswith(row.detail)
    assert "remedies:" in text and "net.ipv4.conf.eth0.rp_filter=2" in text
    assert lines[-1].startswith("result: tracing is possible (2 warn")
    assert "\x1b[" not in text


def test_render_color_only_when_asked():
    rep = report_for("linux-6.18")
    assert "\x1b[" in doctor.render(rep, color=True)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", doctor.render(rep, color=True))
    assert plain == doctor.render(rep, color=False)


def test_report_to_dict():
    d = report_for("empty").to_dict()
    json.dumps(d)
    assert d["ok"] is False and d["exit_code"] == 1 and d["reason"]
    assert {"area", "check", "status", "detail", "cost", "remedy"} == set(d["rows"][0])
    assert {r["status"] for r in d["rows"]} <= set(doctor.STATUSES)


# --- the click command ---------------------------------------------------------------------

@pytest.fixture
def no_trials(monkeypatch):
    def refuse():
        raise AssertionError("trial loader used with a fixture root")
    monkeypatch.setattr(doctor, "_trial_function", refuse)


def invoke(*args):
    return CliRunner().invoke(doctor.doctor_command, list(args))


def test_cli_ok_on_fixture(no_trials):
    r = invoke("--root", str(FIXTURES / "linux-6.18"))
    assert r.exit_code == 0, r.output
    assert "AREA" in r.stdout and "result: tracing is possible" in r.stdout
    assert r.stderr == ""


def test_cli_json(no_trials):
    r = invoke("--root", str(FIXTURES / "kprobes-ipvs"), "--json")
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    assert d["ok"] is True and d["kernel"] == "5.15.0-91-generic"
    rp = next(x for x in d["rows"] if x["check"] == "rp_filter")
    assert rp["status"] == "warn" and "rp_filter=2" in rp["remedy"]


def test_cli_not_root_exits_nonzero_with_one_line_reason(tmp_path, no_trials):
    root = tmp_path / "nonroot"
    shutil.copytree(FIXTURES / "linux-6.18", root)
    status = root / "proc/self/status"
    status.write_text(re.sub(r"CapEff:\t\w+", "CapEff:\t0000000000000000", status.read_text()))
    r = invoke("--root", str(root))
    assert r.exit_code == 1
    err = r.stderr.strip().splitlines()
    assert len(err) == 1
    assert err[0] == ("nptrace doctor: tracing is not possible: not root (needs root or "
                      "CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN: run with sudo)")
    assert "Traceback" not in r.output
    r = invoke("--root", str(root), "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["ok"] is False


def test_cli_bad_root_is_a_usage_error(tmp_path):
    r = invoke("--root", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_cli_netns_with_fixture_root_is_one_line_error(no_trials):
    r = invoke("--root", str(FIXTURES / "linux-6.18"), "--netns", "npt-x")
    assert r.exit_code == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "netns" in r.stderr


def test_headers_row_fails_the_report_when_there_are_none(tmp_path):
    from nptrace.kernel import headers
    fx = features.probe(FIXTURES / "linux-6.18")
    none = headers.find("6.18.0", root=tmp_path, env={}, shipped=tmp_path / "none")
    rep = doctor.build_report(fx, header_source=none)
    row = [r for r in rep.rows if r.check == "headers"][0]
    assert row.status == "fail" and not rep.ok and "no kernel headers" in rep.reason
    shipped = headers.HeaderSource("shipped", "/usr/share/nptrace/kheaders", "minimal tree")
    rep = doctor.build_report(fx, header_source=shipped)
    assert [r.status for r in rep.rows if r.check == "headers"] == ["ok"]
    assert rep.ok == doctor.build_report(fx).ok


# --- the hot path compiled by Cython from its own sources (setup.py, nptrace/compiled.py) ----

def hot_row(state):
    rep = doctor.build_report(features.probe(FIXTURES / "linux-6.18"), hot_path=state)
    return rep, [r for r in rep.rows if r.check == "hot path"]


def test_hot_path_compiled_is_one_ok_row():
    rep, rows = hot_row("compiled")
    assert [(r.area, r.status, r.detail, r.cost, r.remedy) for r in rows] == [
        ("nptrace", "ok", "compiled (events, classify.correlate, classify.flowkey, "
         "classify.incident, classify.rules, sinks.jsonl)", "", "")]
    assert doctor.hot_path_line("compiled") is None      # run says nothing


def test_hot_path_forced_pure_warns_and_does_not_fail():
    state = "python: nptrace.events: NPTRACE_PURE=1 (and 3 more)"
    rep, [row] = hot_row(state)
    assert row.status == "warn" and row.detail == state and "slowly" in row.cost
    assert row.remedy == "unset NPTRACE_PURE"
    assert rep.ok == doctor.build_report(features.probe(FIXTURES / "linux-6.18")).ok
    assert "hot path: unset NPTRACE_PURE" in doctor.render(rep)
    line = doctor.hot_path_line(state)
    assert line.startswith(f"hot path: {state}; ") and "unset NPTRACE_PURE" in line


def test_hot_path_not_compiled_names_the_remedy():
    state = "python: nptrace.events: not compiled (make setup compiles it with Cython)"
    rep, [row] = hot_row(state)
    assert row.status == "warn" and "make setup" in row.remedy and "python3-dev" in row.remedy
    assert "make setup" in doctor.hot_path_line(state)


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """A package `fakepkg` whose module `hot` has a source and an extension file beside it,
    listed among the compiled modules."""
    import importlib.machinery
    from nptrace import compiled
    (tmp_path / "fakepkg").mkdir()
    src = tmp_path / "fakepkg" / "hot.py"
    src.write_text("X = 1\n")
    ext = tmp_path / "fakepkg" / ("hot" + importlib.machinery.EXTENSION_SUFFIXES[0])
    ext.write_bytes(b"")
    monkeypatch.setattr(compiled, "MODULES", compiled.MODULES + ("fakepkg.hot",))
    monkeypatch.delenv("NPTRACE_PURE", raising=False)
    return compiled, src, ext


def test_the_compiled_form_is_taken_only_while_newer_than_its_source(fake_module):
    """A `git pull` without `make setup` leaves an extension older than its source: the source
    runs (never yesterday's rules), and doctor says which module and why."""
    import os
    compiled, src, ext = fake_module
    path = [str(src.parent)]
    os.utime(src, (1000, 1000))
    os.utime(ext, (2000, 2000))
    assert compiled.Finder().find_spec("fakepkg.hot", path).origin == str(ext)
    assert compiled.STATE["fakepkg.hot"] == "compiled"
    os.utime(src, (3000, 3000))
    assert compiled.Finder().find_spec("fakepkg.hot", path).origin == str(src)
    assert compiled.STATE["fakepkg.hot"] == \
        "python: its source is newer than its compiled form (run make setup)"
    ext.unlink()
    assert compiled.Finder().find_spec("fakepkg.hot", path).origin == str(src)
    assert "not compiled" in compiled.STATE["fakepkg.hot"]
    assert compiled.Finder().find_spec("fakepkg.other", path) is None   # not ours to find


def test_pure_env_runs_the_source(fake_module, monkeypatch):
    import os
    compiled, src, ext = fake_module
    os.utime(src, (1000, 1000))
    monkeypatch.setenv("NPTRACE_PURE", "1")
    assert compiled.Finder().find_spec("fakepkg.hot", [str(src.parent)]).origin == str(src)
    assert compiled.STATE["fakepkg.hot"] == "python: NPTRACE_PURE=1"


def test_hot_path_of_a_process_with_nptrace_pure():
    """In a process of its own: every module then runs from its source, and hot_path says so."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "from nptrace import compiled; "
                          "from nptrace.sinks import jsonl; print(compiled.hot_path()); "
                          "print(jsonl.__file__)"],
                         env={**__import__("os").environ, "NPTRACE_PURE": "1"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "python: nptrace.events: NPTRACE_PURE=1 (and 5 more)"
    assert out[1].endswith("jsonl.py")


def test_cli_has_the_hot_path_row(no_trials):
    r = invoke("--root", str(FIXTURES / "linux-6.18"), "--json")
    rows = [x for x in json.loads(r.stdout)["rows"] if x["check"] == "hot path"]
    assert len(rows) == 1 and rows[0]["status"] in ("ok", "warn")
    assert (rows[0]["status"] == "ok") == (doctor.hot_path() == "compiled")


def test_plan_load_row_and_its_failure_make_the_verdict():
    """doctor compiles and loads the plan `run` would use (attach.trial): a plan that does not
    load makes tracing impossible, with the first compiler or verifier error as the reason."""
    feats = features.probe(FIXTURES / "linux-6.18")
    seen = []

    def good(plan):
        seen.append(plan)
        return True, "compiled and loaded 5 tracepoint and 0 kprobe programs in 1.0 s"
    r = doctor.build_report(feats, plan_load=good)
    assert r.ok and seen and seen[0].tracepoints
    row = next(x for x in r.rows if x.check == "plan load")
    assert row.status == "ok" and "compiled and loaded" in row.detail
    bad = doctor.build_report(feats, plan_load=lambda p: (
        False, "BPF compile/load failed: error: no member named 'reason' in 'struct "
               "tracepoint__tcp__tcp_send_reset'"))
    assert not bad.ok and doctor.exit_code(bad) == 1
    assert "plan `run` would use does not load" in bad.reason and "no member named" in bad.reason
    assert next(x for x in bad.rows if x.check == "plan load").status == "fail"
