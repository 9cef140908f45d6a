"""The instance lock is per node. The systemd unit and the DaemonSet name the
same host directory, with the same meaning, and the unit does not remove it on stop."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_deploy import daemonset, unit_values

from nptrace.daemon import preflight


def test_unit_and_daemonset_share_the_lock_directory():
    ds = daemonset()
    pod = ds["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for c in pod["containers"] for m in c.get("volumeMounts", [])}
    run = [n for n, m in mounts.items() if m["mountPath"] == "/run/nptrace"]
    assert run, "the pod mounts no /run/nptrace"
    assert vols[run[0]]["hostPath"]["path"] == "/run/nptrace"
    assert unit_values("RuntimeDirectory") == ["nptrace"]            # /run/nptrace
    assert unit_values("RuntimeDirectoryPreserve") == ["yes"]
    assert str(preflight.LOCK_FILE.parent) == "/run/nptrace" or "NPTRACE_LOCK_FILE" in os.environ


def test_lock_refuses_a_planted_symlink(tmp_path):
    from nptrace.errors import LockError
    target = tmp_path / "victim"
    target.write_text("keep me")
    link = tmp_path / "nptrace.lock"
    link.symlink_to(target)
    with pytest.raises(LockError):
        preflight.InstanceLock(link).acquire()
    assert target.read_text() == "keep me"


def test_ready_file_refuses_a_planted_symlink(tmp_path):
    from nptrace.errors import NptraceError
    target = tmp_path / "victim"
    target.write_text("keep me")
    link = tmp_path / "ready"
    link.symlink_to(target)
    with pytest.raises(NptraceError):
        preflight.write_ready_file(str(link))
    assert target.read_text() == "keep me"
    preflight.write_ready_file(str(tmp_path / "ok"))
    assert (tmp_path / "ok").read_text() == f"{os.getpid()}\n"
