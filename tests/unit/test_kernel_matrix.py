"""The kernel matrix's pure parts (nptrace/lab/kernels.py): where the kernels come from, how a
guest's run counts become kprobe groups, and the table and verdict the target prints. The
boots themselves run in `make test-kernels` (and their short form in .ci/run)."""
from __future__ import annotations

from pathlib import Path

from nptrace.lab import kernels


def test_debian_uri_is_the_machines_own_archive(tmp_path: Path):
    d = tmp_path / "etc/apt/sources.list.d"
    d.mkdir(parents=True)
    (d / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm\n")
    assert kernels.debian_uri(tmp_path) == "http://mirror.example/debian"
    (d / "debian.sources").unlink()
    (tmp_path / "etc/apt/sources.list").write_text(
        "deb [signed-by=/k.gpg] http://old.example/debian bullseye main\n")
    assert kernels.debian_uri(tmp_path) == "http://old.example/debian"


def test_kprobe_groups_fired_from_bpf_program_names():
    # bpftool shows the BTF function name, or the kernel's 15 characters without BTF; an
    # entry/return pair counts its calls once
    runs = {"npt_kp_fib_vali": 7, "npt_kp_tcp_rese": 3, "npt_kp_nat_mani": 0, "tracepoint__skb": 9}
    fired = kernels.kprobe_fired(runs)
    assert fired["rp_filter"] == 7 and fired["nat"] == 0
    assert fired["tcp_reset"] == 3 and fired["tcp_reset6"] == 3   # one program, two functions
    full = kernels.kprobe_fired({"npt_kp_fib_validate_entry": 7, "npt_kp_fib_validate_ret": 7,
                                 "npt_kp_ipvs_in_entry": 2})
    assert full["rp_filter"] == 7 and full["ipvs_in"] == 2 and full["nat"] == 0


def test_attached_groups_from_the_run_log():
    log = ("nptrace: plan: kprobe:*: on (kprobes.bpf.c, -DNPT_WITH_KPROBES=1; groups nat, "
           "rp_filter, ipvs_in; off: tcp_reset (not needed: tcp:tcp_send_reset:reason))\n"
           "nptrace: kprobe ipvs_in skipped: ip_vs_in_hook: no such function\n")
    assert kernels._attached(log) == (["nat", "rp_filter"], ["ipvs_in"])


def _result(hit=1.0, **kw):
    s = {"scenario": "no-listener", "expected": "no_listener", "hit": hit, "events": 10,
         "labels": {"no_listener": 10}, "attached": ["nat"], "fired": {"nat": 4}}
    s.update(kw)
    return {"kernel": "6.1.0-50-amd64", "accel": "TCG", "wall_s": 80.0,
            "doctor": {"ok": True, "reason": "", "rows": {"tcx": ["missing", ""]}},
            "scenarios": [s, {"scenario": "ipvs-no-endpoints", "expected": "no_endpoints",
                              "not_runnable": "no IPVS"}]}


def test_table_and_verdict():
    r = _result()
    md = kernels.table([r])
    assert "| 6.1.0-50-amd64 | TCG | 80 s | ok | tcx missing" in md
    assert "| no-listener | no_listener | 100.0% | 10 | nat | nat 4 |" in md
    assert "not runnable: no IPVS" in md
    assert kernels.failures([r]) == []
    bad = _result(hit=0.5, labels={"no_listener": 5, "peer_reset": 5})
    assert kernels.failures([bad]) == ["6.1.0-50-amd64 no-listener: 50.0% "
                                       "{'no_listener': 5, 'peer_reset': 5}"]
    assert kernels.failures([{"kernel": "5.10", "error": "guest did not finish"}]) == \
        ["5.10: guest did not finish"]
    down = _result()
    down["doctor"] = {"ok": False, "reason": "the plan does not load"}
    assert kernels.failures([down]) == ["6.1.0-50-amd64: doctor: the plan does not load"]


def test_vng_command_says_tcg_unless_kvm_works():
    k = kernels.Kernel("6.1", "bookworm", "6.1.0-50-amd64", Path("/k/vmlinuz"))
    cmd = kernels.vng_command(Path("/v/vng"), k, "true", Path("/out"), kvm=False)
    assert "--disable-kvm" in cmd and "--force-9p" in cmd and cmd[-2:] == ["-e", "true"]
    assert "--disable-kvm" not in kernels.vng_command(Path("/v/vng"), k, "true", Path("/o"), True)


def test_batches_keep_host_wide_scenarios_alone():
    items = ["a", "b", "FULL", "c", "d", "e"]
    assert kernels.batches(items, 2, lambda s: s.isupper()) == \
        [["a", "b"], ["FULL"], ["c", "d"], ["e"]]
    assert kernels.batches([], 8, lambda s: False) == []


def test_a_cause_the_kernel_cannot_give_is_not_attributable_but_must_not_be_mislabeled():
    doc = {"ok": True, "rows": {"skb:kfree_skb reason": ["missing", "no 'reason' field"]}}
    assert kernels.lost_causes(doc) == {"checksum": "skb:kfree_skb reason"}
    assert kernels.lost_causes({"rows": {"skb:kfree_skb reason": ["ok", ""]}}) == {}
    row = {"scenario": "offload-checksum", "expected": "checksum", "hit": 0.0, "events": 20,
           "labels": {"unknown": 20}, "attached": [], "fired": {}}
    r = {"kernel": "5.10.0-32-amd64", "accel": "TCG", "doctor": doc, "scenarios": [row]}
    assert kernels.failures([r]) == []
    assert "not attributable here (skb:kfree_skb reason missing)" in kernels.table([r])
    row["labels"] = {"unknown": 10, "peer_reset": 10}
    assert kernels.failures([r]) == [
        "5.10.0-32-amd64 offload-checksum: not attributable here (skb:kfree_skb reason "
        "missing), mislabeled {'peer_reset': 10} {'unknown': 10, 'peer_reset': 10}"]


def test_a_run_of_some_scenarios_replaces_theirs_and_keeps_the_rest_with_their_commit():
    row = dict(expected="proxy", hit=1.0, events=1, attached=[], fired={}, labels={})
    earlier = {"kernel": "6.1", "commit": "aaa", "doctor": {"ok": True},
               "scenarios": [dict(row, scenario="a"), dict(row, scenario="b", hit=0.0),
                             dict(row, scenario="c")]}
    now = {"kernel": "6.1", "commit": "bbb", "doctor": {"ok": True},
           "scenarios": [dict(row, scenario="b")]}
    got = kernels.merged(earlier, now)
    assert [(s["scenario"], s.get("earlier"), s["hit"]) for s in got["scenarios"]] == \
        [("a", "aaa", 1.0), ("b", None, 1.0), ("c", "aaa", 1.0)]
    assert kernels.merged(got, dict(now, commit="ccc"))["scenarios"][0]["earlier"] == "aaa"
    assert "100.0% (commit aaa)" in kernels.table([dict(got, accel="TCG", wall_s=1)])
    assert not kernels.failures([got])
    assert kernels.merged(earlier, {"kernel": "6.1", "error": "boot"}) == {"kernel": "6.1", "error": "boot"}


def test_the_page_keeps_every_stored_kernel_newest_first(tmp_path: Path):
    for release in ("5.10.0-32-amd64", "6.12.0-1-amd64", "6.1.0-50-amd64"):
        (tmp_path / "runs" / release).mkdir(parents=True)
        (tmp_path / "runs" / release / "result.json").write_text(f'{{"kernel": "{release}"}}')
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "result.json").write_text("{")
    assert [r["kernel"] for r in kernels.stored_results(tmp_path)] == \
        ["6.12.0-1-amd64", "6.1.0-50-amd64", "5.10.0-32-amd64"]


def test_the_sections_below_the_table_are_kept_and_the_table_is_not():
    page = ("# Kernel matrix\n\nintro\n\n| kernel |\n|---|\n| 6.1 |\n\n"
            "## Not booted here (inferred)\n\n| 5.15 |\n\n## Notes\n\n- a note\n")
    assert kernels.kept_sections(page) == \
        "## Not booted here (inferred)\n\n| 5.15 |\n\n## Notes\n\n- a note\n"
    assert kernels.kept_sections("# Kernel matrix\n\n| kernel |\n") == ""


def test_the_default_matrix_boots_every_known_suite_newest_first_and_ci_stays_on_6_1():
    assert sorted(kernels.DEFAULT_KERNELS) == sorted(kernels.SUITES)
    assert list(kernels.DEFAULT_KERNELS) == sorted(kernels.DEFAULT_KERNELS, key=kernels.release_key,
                                                   reverse=True)
    assert kernels.SHORT[0] == "6.1"


def test_a_run_stores_its_time_commit_and_accelerator_for_report_and_merges(tmp_path: Path,
                                                                            monkeypatch):
    release = "6.12.0-1-amd64"
    monkeypatch.setattr(kernels, "CACHE", tmp_path)
    monkeypatch.setattr(kernels, "ensure_tools", lambda: Path("vng"))
    monkeypatch.setattr(kernels, "fetch", lambda name: kernels.Kernel(name, "trixie", release,
                                                                     Path("vmlinuz")))
    monkeypatch.setattr(kernels, "kvm_works", lambda vng, k: False)

    def boot(vng, k, args, out, kvm, timeout):   # what the guest wrote, and what boot() adds
        out.mkdir(parents=True)
        (out / "result.json").write_text(f'{{"kernel": "{release}", "scenarios": []}}')
        return {"kernel": release, "doctor": {"ok": True}, "scenarios": [], "wall_s": 12.0,
                "commit": "abc1234"}
    monkeypatch.setattr(kernels, "boot", boot)
    assert kernels.main(["--kernel", "6.12"]) == 0
    stored = kernels.stored_results(tmp_path)
    assert [(r["wall_s"], r["commit"], r["accel"]) for r in stored] == [(12.0, "abc1234", "TCG")]
