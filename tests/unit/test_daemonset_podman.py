"""nptrace/lab/daemonset.py: the DaemonSet's container spec as podman arguments (pure)."""
from pathlib import Path

import pytest

pytest.importorskip("yaml", reason="PyYAML not importable")
from nptrace.lab import daemonset  # noqa: E402

MANIFEST = Path(__file__).resolve().parents[2] / "deploy/daemonset.yaml"


def test_podman_command_is_the_manifest(tmp_path):
    spec = daemonset.load(MANIFEST)
    argv = daemonset.podman_run_args(spec, "img", {"status.hostIP": "10.0.0.7", "spec.nodeName": "n1"},
                                     name="x",
                                     scratch=tmp_path,
                                     secrets={"nptrace-metrics-tls": tmp_path / "certs"})
    sc = spec.container["securityContext"]
    assert "--cap-drop=all" in argv
    assert {a.split("=", 1)[1] for a in argv if a.startswith("--cap-add=")} == \
        {"CAP_" + c for c in sc["capabilities"]["add"]}
    assert "--read-only" in argv and "--read-only-tmpfs=false" in argv
    # RuntimeDefault: podman's own default profile, as the kubelet gives the runtime's
    assert not any(a.startswith("seccomp=") for a in argv) and "no-new-privileges" in argv
    assert "--network=host" in argv and "--pid=host" in argv
    assert "/run/netns:/run/netns:ro,rslave" in argv
    assert "/run/nptrace:/run/nptrace:rw,rprivate" in argv
    assert "--memory" in argv and argv[argv.index("--memory") + 1] == str(768 << 20)
    assert f"{tmp_path / 'certs'}:/etc/nptrace/metrics-tls:ro,rprivate" in argv
    assert argv[argv.index("img") + 1:] == [
        "run", "--record", "/var/lib/nptrace", "--metrics-addr", "10.0.0.7:9464",
        "--metrics-tls-cert", "/etc/nptrace/metrics-tls/tls.crt",
        "--metrics-tls-key", "/etc/nptrace/metrics-tls/tls.key",
        "--metrics-client-ca", "/etc/nptrace/metrics-tls/ca.crt",
        "--health-addr", "10.0.0.7:9465"]
    with pytest.raises(daemonset.SpecError, match="Secret nptrace-metrics-tls"):
        daemonset.podman_run_args(spec, "img", {"status.hostIP": "1.2.3.4", "spec.nodeName": "n1"},
                                  name="x", scratch=tmp_path)


def test_unknown_fields_are_refused_not_dropped(tmp_path):
    spec = daemonset.load(MANIFEST)
    spec.container["securityContext"]["procMount"] = "Unmasked"
    with pytest.raises(daemonset.SpecError, match="procMount"):
        daemonset.podman_run_args(spec, "img", {"status.hostIP": "1.2.3.4", "spec.nodeName": "n1"},
                                  name="x")
    spec = daemonset.load(MANIFEST)
    with pytest.raises(daemonset.SpecError, match="status.hostIP"):
        daemonset.podman_run_args(spec, "img", {}, name="x",
                                  secrets={"nptrace-metrics-tls": Path("/c")})


@pytest.mark.parametrize("s, want", [("$(A):1", "a:1"), ("$$(A)", "$(A)"), ("$(B)", "$(B)"),
                                     ("x", "x")])
def test_kubernetes_var_expansion(s, want):
    assert daemonset.expand(s, {"A": "a"}) == want


@pytest.mark.parametrize("q, n", [("64Mi", 64 << 20), ("1G", 10**9), (1000, 1000)])
def test_quantity(q, n):
    assert daemonset.quantity(q) == n
