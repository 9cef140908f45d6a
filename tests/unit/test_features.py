"""features.probe() against fixture trees (tests/fixtures/features/<case>/); no root, no bcc."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nptrace.kernel import features as f
from nptrace.kernel.features import FeatureMissing, PrivilegeError, TrialResult

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "features"


def tree(name: str) -> Path:
    return FIXTURES / name


def copy_tree(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(tree(name), dst)
    return dst


def status(feats: f.Features, name: str) -> str:
    return feats.result(name).status


def test_every_probe_reports_once():
    feats = f.probe(tree("linux-6.18"))
    assert [r.name for r in feats.results] == list(f.PROBES)


def test_linux_6_18_like_this_vm():
    feats = f.probe(tree("linux-6.18"))
    assert feats.kernel == "6.18.44-fc-v857" and feats.version == (6, 18, 44)
    assert feats.tracing_possible and not feats.failures
    assert feats.caps_ok and feats.btf
    assert feats.tracefs == tree("linux-6.18") / "sys/kernel/tracing"
    assert feats.tracepoints == dict.fromkeys(f.TRACEPOINTS, True)
    assert feats.kfree_skb_reason and feats.tcp_send_reset_reason
    assert not feats.kprobes and status(feats, "kprobes") == "missing"
    assert not feats.result("kprobes").expected     # a config option, not a version, decides
    assert feats.fentry is None and feats.result("fentry").detail == "not tried"
    assert status(feats, "fentry") == "unknown"
    assert feats.ringbuf            # by version: the fixture's vmlinux is not real BTF
    assert feats.clsact is True and "built in" in feats.result("tc clsact").detail
    assert feats.nf_prog is True
    assert status(feats, "tcx") == "ok"         # 6.18 >= 6.6 (the fixture has no config)
    assert not feats.ipvs
    assert "nf_tables" in feats.result("netfilter backend").detail
    assert feats.conntrack and feats.result("conntrack").detail == "12/262144 entries"


def test_tracepoint_fields_from_format():
    feats = f.probe(tree("linux-6.18"))
    assert feats.tracepoint_fields("skb/kfree_skb") == (
        "skbaddr", "location", "rx_sk", "protocol", "reason")
    assert "saddr" in feats.tracepoint_fields("tcp/tcp_send_reset")   # array suffix stripped
    assert feats.tracepoint_fields("no/such") == ()
    assert f.tracepoint_fields(feats.tracefs, "icmp/icmp_send")[:3] == ("skbaddr", "type", "code")


def test_linux_5_4_no_reasons_no_icmp_send_debugfs_tracefs():
    feats = f.probe(tree("linux-5.4"))
    assert feats.version == (5, 4, 0)
    assert feats.tracefs == tree("linux-5.4") / "sys/kernel/debug/tracing"
    assert feats.tracepoints["skb/kfree_skb"] and not feats.kfree_skb_reason
    assert feats.tracepoints["tcp/tcp_send_reset"] and not feats.tcp_send_reset_reason
    assert feats.tracepoints["icmp/icmp_send"] is False
    icmp = feats.result("icmp:icmp_send")
    assert icmp.status == "missing" and not icmp.expected and "5.4 < 6.10" in icmp.detail
    assert "5.4 < 5.17" in feats.result("skb:kfree_skb reason").detail
    assert not feats.ringbuf and not feats.nf_prog and feats.fentry is False
    assert not feats.conntrack
    assert feats.clsact is True                 # sch_ingress in /proc/modules
    assert status(feats, "tcx") == "missing" and "clsact" in feats.result("tcx").cost
    assert feats.tracing_possible               # optional losses only


def test_kprobes_ipvs_tree():
    feats = f.probe(tree("kprobes-ipvs"))
    assert feats.version == (5, 15, 0)
    assert feats.kprobes
    assert feats.ipvs and "2 virtual services" in feats.result("ipvs").detail
    backend = feats.result("netfilter backend").detail
    assert "CONFIG_NF_TABLES" in backend and "mangle filter nat" in backend
    assert feats.config["CONFIG_NETFILTER_BPF_LINK"] == "n"     # /boot/config-<release>
    assert feats.ringbuf and feats.nf_prog is False
    # CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN without CAP_SYS_ADMIN is enough from 5.8.
    assert feats.caps_ok


def test_empty_tree_cannot_trace():
    feats = f.probe(tree("empty"))
    assert feats.kernel == "" and feats.version is None
    assert not feats.tracing_possible
    failed = {r.name for r in feats.failures}
    assert failed == {"capabilities", "bpf syscall", "btf", "tracefs"}
    assert feats.tracepoints == dict.fromkeys(f.TRACEPOINTS, False)
    assert status(feats, "skb:kfree_skb") == "unknown"    # no tracefs: cannot tell
    assert not feats.kprobes and not feats.ipvs and not feats.conntrack


def test_require_raises_typed_errors():
    feats = f.probe(tree("empty"))
    with pytest.raises(FeatureMissing) as e:
        feats.require("btf")
    assert e.value.name == "btf" and e.value.min_kernel == "5.4"
    assert str(e.value).startswith("btf not supported (requires >= 5.4)")
    with pytest.raises(PrivilegeError, match=r"needs root or CAP_BPF\+CAP_PERFMON\+CAP_NET_ADMIN"):
        feats.require("capabilities")
    f.probe(tree("linux-6.18")).require("btf")      # present: no error


def test_feature_missing_message_format():
    assert str(FeatureMissing("ring buffer", "5.8")) == "ring buffer not supported (requires >= 5.8)"
    assert str(FeatureMissing("ipvs", None)) == "ipvs not supported (requires kernel support)"


def test_missing_on_new_kernel_is_flagged_unexpected(tmp_path):
    root = copy_tree("linux-6.18", tmp_path)
    fmt = root / "sys/kernel/tracing/events/skb/kfree_skb/format"
    fmt.write_text(fmt.read_text().replace("reason;", "why;"))
    r = f.probe(root).result("skb:kfree_skb reason")
    assert r.status == "missing" and r.expected and "unexpected on kernel 6.18" in r.detail


def test_kfree_skb_absent_has_no_fallback(tmp_path):
    # there is no kprobe tcp_drop fallback (hooks.py: fallback "none"), so kprobes do not
    # make a kernel without kfree_skb traceable
    root = copy_tree("kprobes-ipvs", tmp_path)
    shutil.rmtree(root / "sys/kernel/tracing/events/skb")
    feats = f.probe(root)
    assert feats.kprobes
    assert status(feats, "skb:kfree_skb") == "fail" and not feats.tracing_possible
    shutil.rmtree(root / "sys/bus/event_source/devices/kprobe")
    (root / "sys/kernel/tracing/kprobe_events").unlink()
    cfg = root / "boot/config-5.15.0-91-generic"
    cfg.write_text(cfg.read_text().replace("CONFIG_KPROBES=y", "# CONFIG_KPROBES is not set"))
    feats = f.probe(root)
    assert status(feats, "skb:kfree_skb") == "fail" and not feats.tracing_possible


def test_trials_decide_fentry_clsact_nf_prog(tmp_path):
    calls = []

    def trials(kind):
        calls.append(kind)
        return {"fentry": TrialResult(False, "Need super-user privileges to run: bpf: "
                                             "Failed to load program: Operation not permitted"),
                "clsact": TrialResult(True)}.get(kind, TrialResult(False, f"unknown trial {kind}"))

    feats = f.probe(tree("linux-6.18"), trials=trials)
    assert calls == ["fentry", "clsact", "nf_prog"]
    fentry = feats.result("fentry")
    assert fentry.present is False and fentry.status == "missing"
    assert fentry.detail == "trial load failed: bpf: Failed to load program: Operation not permitted"
    assert feats.clsact is True and feats.result("tc clsact").detail == "trial attach ok"
    # The loader has no nf_prog trial: version evidence stands.
    assert feats.nf_prog is True and "not trial-loaded" in feats.result("netfilter bpf").detail


def test_trial_that_raises_is_a_failure_not_a_crash():
    def trials(kind):
        raise RuntimeError("bcc exploded")
    feats = f.probe(tree("linux-6.18"), trials=trials)
    assert feats.fentry is False and "bcc exploded" in feats.result("fentry").detail


def test_trials_not_run_below_min_kernel():
    calls = []
    f.probe(tree("linux-5.4"), trials=lambda k: calls.append(k) or TrialResult(True))
    assert "fentry" not in calls and "nf_prog" not in calls


def test_never_mounts_tracefs_on_a_fixture_root(monkeypatch):
    def no_mount(*a, **kw):
        raise AssertionError("mount attempted on a fixture root")
    monkeypatch.setattr(subprocess, "run", no_mount)
    feats = f.probe(tree("empty"), mount_tracefs=True)
    assert status(feats, "tracefs") == "fail"
    assert "mount -t tracefs nodev /sys/kernel/tracing" in feats.result("tracefs").detail


@pytest.mark.parametrize("capeff,release,ok", [
    ("000001ffffffffff", "6.18.0", True),                     # root
    ("0000000000200000", "6.18.0", True),                     # CAP_SYS_ADMIN alone
    (f"{(1 << 39) | (1 << 38) | (1 << 12):016x}", "6.18.0", True),
    (f"{(1 << 39) | (1 << 38):016x}", "6.18.0", False),      # no CAP_NET_ADMIN
    (f"{(1 << 39) | (1 << 38) | (1 << 12):016x}", "5.4.0", False),  # CAP_BPF is 5.8+
    ("0000000000000000", "6.18.0", False),
])
def test_has_bpf_caps(tmp_path, capeff, release, ok):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/self/status").write_text(f"Name:\tx\nCapInh:\t0\nCapEff:\t{capeff}\n")
    (tmp_path / "proc/sys/kernel/osrelease").write_text(release + "\n")
    assert f.has_bpf_caps(tmp_path) is ok


def test_has_bpf_caps_without_status_file(tmp_path):
    assert f.has_bpf_caps(tmp_path) is False


@pytest.mark.parametrize("text,version", [
    ("6.18.44-fc-v857", (6, 18, 44)), ("5.4.0-150-generic", (5, 4, 0)),
    ("6.1", (6, 1, 0)), ("", None), ("garbage", None),
])
def test_kernel_version(text, version):
    assert f.kernel_version(text) == version


def test_kernel_config_from_proc_config_gz(tmp_path):
    import gzip
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/config.gz").write_bytes(
        gzip.compress(b"CONFIG_KPROBES=y\n# CONFIG_IP_VS is not set\nCONFIG_HZ=250\n"))
    cfg = f.kernel_config(tmp_path, "6.1.0")
    assert cfg == {"CONFIG_KPROBES": "y", "CONFIG_IP_VS": "n", "CONFIG_HZ": "250"}


def test_features_to_dict_is_json_ready():
    import json
    d = f.probe(tree("kprobes-ipvs")).to_dict()
    json.dumps(d)
    assert d["kernel"] == "5.15.0-91-generic"
    assert {p["name"] for p in d["probes"]} == set(f.PROBES)
