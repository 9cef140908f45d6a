"""deploy/: the DaemonSet against the Kubernetes schemas, the systemd unit through
systemd-analyze (and the root-owned copy it runs, scripts/install.sh), the Grafana dashboard
against the metrics nptrace really exposes."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nptrace.config import DEFAULT_METRICS_ADDR as DEFAULT_ADDR
from nptrace.sinks.prometheus import METRIC_NAMES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCRIPTS = DEPLOY.parent / "scripts"
CAPS = {"BPF", "PERFMON", "NET_ADMIN", "SYS_ADMIN", "SYS_RESOURCE"}


def docs():
    yaml = pytest.importorskip("yaml", reason="PyYAML not importable")
    return list(yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text()))


def daemonset():
    [ds] = [d for d in docs() if d["kind"] == "DaemonSet"]
    return ds


def test_daemonset_validates_against_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate not installed (pip install kubernetes-validate)")
    for d in docs():
        kv.validate(d, kv.latest_version(), strict=True)   # raises on any schema error


def test_the_validator_catches_a_broken_manifest():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    ds = daemonset()
    ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilitiez"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, kv.latest_version(), strict=True)


def test_daemonset_shape():
    ds = daemonset()
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["hostPID"] is True
    [c] = pod["containers"]
    sc = c["securityContext"]
    assert sc.get("privileged") is False
    assert sc["capabilities"]["drop"] == ["ALL"] and set(sc["capabilities"]["add"]) == CAPS
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path in ("/sys/kernel/btf", "/sys/kernel/tracing", "/run/netns", "/lib/modules",
                 "/usr/src", "/var/lib/nptrace"):
        assert path in mounts, path
    assert mounts["/run/netns"]["mountPropagation"] == "HostToContainer"
    assert mounts["/sys/kernel/btf"].get("readOnly") is True
    vols = {v["name"]: v for v in pod["volumes"]}
    assert all(m["name"] in vols for m in c["volumeMounts"])
    args = c["args"]
    assert args[0] == "run" and args[args.index("--record") + 1] == "/var/lib/nptrace"
    port = int(args[args.index("--metrics-addr") + 1].rsplit(":", 1)[1])
    health = int(args[args.index("--health-addr") + 1].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": port, "health": health}
    assert port == int(DEFAULT_ADDR.rsplit(":", 1)[1]) and health != port
    # the kubelet's probes: the plain health port (sinks/health.py serve_probes), not the TLS one
    for kind, path in (("livenessProbe", "/livez"), ("readinessProbe", "/healthz")):
        probe = c[kind]["httpGet"]
        assert probe["path"] == path and probe["port"] in ("health", health)
        assert probe.get("scheme", "HTTP") == "HTTP"
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # the annotation-driven jobs speak plain HTTP without a client certificate
    assert not any(k.startswith("prometheus.io/")
                   for k in ds["spec"]["template"]["metadata"].get("annotations", {}))


def test_metrics_port_is_tls_with_the_secrets_files():
    """--metrics-tls-* name files of the Secret the pod mounts, under the keys
    scripts/metrics-certs.sh and a cert-manager Certificate give them."""
    pod = daemonset()["spec"]["template"]["spec"]
    [c] = pod["containers"]
    args = c["args"]
    files = {flag: args[args.index(flag) + 1]
             for flag in ("--metrics-tls-cert", "--metrics-tls-key", "--metrics-client-ca")}
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "metrics-tls"]
    assert mount["readOnly"] is True
    assert {str(Path(f).parent) for f in files.values()} == {mount["mountPath"]}
    assert {Path(f).name for f in files.values()} == {"tls.crt", "tls.key", "ca.crt"}
    [vol] = [v for v in pod["volumes"] if v["name"] == "metrics-tls"]
    assert vol["secret"]["secretName"] == "nptrace-metrics-tls"
    assert vol["secret"]["defaultMode"] == 0o400
    certs = (SCRIPTS / "metrics-certs.sh").read_text()
    assert all(f"--from-file={k}=" in certs for k in ("tls.crt", "tls.key", "ca.crt"))
    assert "secret generic nptrace-metrics-tls" in certs


def scrape_job():
    import yaml
    [job] = yaml.safe_load((DEPLOY / "prometheus-scrape.yaml").read_text())
    return job


def test_scrape_job_finds_the_daemonsets_metrics_port_and_checks_its_name():
    job, ds = scrape_job(), daemonset()
    assert job["scheme"] == "https" and job["metrics_path"] == "/metrics"
    [sd] = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [ds["metadata"]["namespace"]]
    keep = job["relabel_configs"][0]
    app = ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    assert keep["action"] == "keep" and keep["regex"] == f"{app};metrics"
    # the name every node's certificate is for (metrics-certs.sh's default)
    name = re.search(r"NPTRACE_METRICS_NAME:-([\w.-]+)", (SCRIPTS / "metrics-certs.sh").read_text())
    assert job["tls_config"]["server_name"] == name.group(1)
    assert {"ca_file", "cert_file", "key_file"} <= set(job["tls_config"])


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    import promscrape
    return promscrape.make_certs(tmp_path_factory.mktemp("certs"))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian: prometheus)")
def test_scrape_job_passes_promtool(certs, tmp_path):
    """Debian's promtool knows no kubernetes_sd_configs: the job is checked with static targets
    in their place, every other field as shipped."""
    import promscrape
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(json.dumps({"scrape_configs": [
        promscrape.local_job(certs, [promscrape.pod_target("127.0.0.1:9464")])]}))
    r = subprocess.run(["promtool", "check", "config", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (Debian: prometheus)")
def test_prometheus_scrapes_nptrace_over_tls_with_the_shipped_job(certs, tmp_path):
    """A real Prometheus (Go's TLS) with the shipped job scrapes nptrace's HTTPS endpoint with
    the client certificate, checks the server name, keeps the metrics port of the pod and drops
    its health port; the same job without a client certificate is refused."""
    import time

    import promscrape
    from prometheus_client import CollectorRegistry, Counter
    from nptrace.sinks import health
    from nptrace.sinks.tls import ServerTls, TlsFiles
    reg = CollectorRegistry()
    Counter("npt_tls_scraped", "x", registry=reg).inc(3)
    h = health.Health()
    h.ready("x")
    srv = health.serve("127.0.0.1:0", reg, h, tls=ServerTls(TlsFiles(
        str(certs / "tls.crt"), str(certs / "tls.key"), str(certs / "ca.crt"))))
    probes = health.serve_probes("127.0.0.1:0", h)
    targets = [promscrape.pod_target(f"127.0.0.1:{srv.port}", "metrics"),
               promscrape.pod_target(f"127.0.0.1:{probes.port}", "health")]
    jobs = [promscrape.local_job(certs, targets),
            promscrape.local_job(certs, targets[:1], client_cert=False, name="no-client-cert")]
    try:
        with promscrape.prometheus(shutil.which("prometheus"), jobs, tmp_path) as base:
            end = time.monotonic() + 30
            while time.monotonic() < end:
                up = {(s["metric"]["job"], s["metric"]["instance"]): s["value"][1]
                      for s in promscrape.query(base, "up")}
                got = promscrape.query(base, "npt_tls_scraped_total")
                if got and ("no-client-cert", f"127.0.0.1:{srv.port}") in up:
                    break
                time.sleep(0.5)
    finally:
        srv.close()
        probes.close()
    assert up == {("nptrace", f"127.0.0.1:{srv.port}"): "1",
                  ("no-client-cert", f"127.0.0.1:{srv.port}"): "0"}, up
    [sample] = got
    assert sample["value"][1] == "3" and sample["metric"]["node"] == "node-a"
    assert sample["metric"]["job"] == "nptrace"


def unit_text():
    return (DEPLOY / "nptrace.service").read_text()


def unit_values(key):
    return [line.split("=", 1)[1] for line in unit_text().splitlines()
            if line.startswith(key + "=")]


def test_unit_runs_the_daemon_with_the_documented_flags():
    [cmd] = unit_values("ExecStart")
    assert cmd == "/opt/nptrace/bin/nptrace run --record /var/lib/nptrace --metrics-addr 127.0.0.1:9464"
    assert unit_values("Type") == ["notify"] and unit_values("Restart") == ["on-failure"]
    assert unit_values("RestartPreventExitStatus") == ["2"] and unit_values("WatchdogSec")
    assert unit_values("RuntimeDirectory") == ["nptrace"]
    [caps] = unit_values("CapabilityBoundingSet")
    assert set(caps.split()) == {"CAP_" + c for c in CAPS}
    assert unit_values("ProtectSystem") == ["strict"]
    # what a runaway (a thread leak, a child per event) may take of the node, and who may
    # reach the metrics port: the node itself (systemd's cgroup BPF firewall)
    assert unit_values("TasksMax") == ["256"]
    assert unit_values("IPAddressDeny") == ["any"] and unit_values("IPAddressAllow") == ["localhost"]
    assert cmd.split("--metrics-addr ")[1].startswith("127.0.0.1:")
    assert "/var/lib/nptrace" in unit_values("ReadWritePaths")
    # Hardening known to break the tracer stays off (see the unit's comments).
    assert not unit_values("MemoryDenyWriteExecute") and not unit_values("ProtectKernelTunables")


def test_unit_runs_the_root_owned_copy_install_sh_makes():
    """Not /usr/local/bin/nptrace, which `make setup` links to a checkout's editable install
    (code its owner can change; under /tmp, hidden by PrivateTmp=): the prefix install.sh
    fills, checked root's alone before it finishes."""
    exe = unit_values("ExecStart")[0].split()[0]
    script = (SCRIPTS / "install.sh").read_text()
    [prefix] = re.findall(r"^prefix=\$\{NPTRACE_PREFIX:-(\S+)\}$", script, re.M)
    assert exe == f"{prefix}/bin/nptrace" and not exe.startswith(("/tmp", "/home", "/usr/local"))
    assert unit_values("PrivateTmp") == ["yes"]
    # the checks that make it root's: every folder above, every file in it
    assert 'check_parents "$prefix"' in script and "-perm /022" in script
    assert "--require-hashes" in script and "--no-build-isolation" in script


def test_an_installed_copy_finds_its_bpf_sources(tmp_path):
    """A non-editable install has no checkout beside its package: the loader takes the BPF
    sources install.sh puts in the prefix (PREFIX/share/nptrace/bpf)."""
    from nptrace.kernel.loader import bpf_dir
    checkout = DEPLOY.parent / "bpf"
    installed = tmp_path / "share/nptrace/bpf"
    installed.mkdir(parents=True)
    assert bpf_dir(None, checkout, str(tmp_path)) == checkout            # make setup's
    site = tmp_path / "lib/python3.11/site-packages/bpf"                 # none beside the package
    assert bpf_dir(None, site, str(tmp_path)) == installed
    assert bpf_dir("/opt/img/bpf", site, str(tmp_path)) == Path("/opt/img/bpf")   # the image's


@pytest.mark.parametrize("script", ["install.sh", "metrics-certs.sh"])
def test_deploy_scripts_pass_shellcheck(script):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (Debian package `shellcheck`)")
    r = subprocess.run(["shellcheck", str(SCRIPTS / script)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    text = unit_text()
    exe = unit_values("ExecStart")[0].split()[0]
    if not Path(exe).exists():
        # verify insists the executable exists; scripts/install.sh makes it, a bare checkout may not.
        text = text.replace(exe, shutil.which("true") or "/bin/true")
    unit = tmp_path / "nptrace.service"
    unit.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    ours = [line for line in (r.stdout + r.stderr).splitlines() if "nptrace.service" in line]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr


def test_dashboard_queries_only_metrics_that_exist():
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("expr", "definition") and isinstance(v, str):
                    exprs.append(v)
                elif k == "query" and isinstance(v, str):
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(dash)
    assert len(exprs) >= 8
    used = {m for e in exprs for m in re.findall(r"\bnptrace_[a-z_]+", e)}
    assert used and used <= METRIC_NAMES, used - METRIC_NAMES
    # The panels the dashboard must have.
    titles = " | ".join(p.get("title", "") for p in dash["panels"]).lower()
    for want in ("by cause", "service", "interface", "lost", "probe"):
        assert want in titles, want
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_containerfile_is_debian_12_with_bcc():
    text = (DEPLOY / "Containerfile").read_text()
    # FROM the debootstrapped Debian 12 base scripts/build-image.sh passes in
    assert re.search(r"^ARG BASE_IMAGE=\S*bookworm\S*$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert "python3-bpfcc" in text and "--system-site-packages" in text
    assert "NPTRACE_BPF_DIR" in text


def test_containerfile_copies_every_compiled_source():
    """The helpers' stage copies the source of each module setup.py compiles (nptrace/compiled.py
    MODULES) and compiled.py itself: one left out would fail the image build only on a node."""
    from nptrace import compiled
    files = {m.replace(".", "/") + ".py" for m in compiled.MODULES} | {"nptrace/compiled.py"}
    copied = set()
    for m in re.finditer(r"^COPY ((?:.*\\\n)*.*)$", (DEPLOY / "Containerfile").read_text(), re.M):
        copied.update(m.group(1).replace("\\\n", " ").split()[:-1])
    assert files <= copied, files - copied


def test_build_requirements_pin_the_cython_of_pyproject():
    """The image compiles with the Cython `make setup` compiles with, pinned by hash."""
    import tomllib
    req = (DEPLOY / "requirements-build.txt").read_text()
    pin = re.search(r"^cython==([\d.]+) \\\n\s+--hash=sha256:[0-9a-f]{64}$", req, re.M | re.I)
    assert pin, req
    build = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["build-system"]["requires"]
    assert f"Cython=={pin.group(1)}" in build, build


def test_image_python_dependencies_are_pinned_with_hashes():
    """deploy/requirements.txt pins every runtime dependency of pyproject.toml exactly."""
    import tomllib
    deps = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ ]", d)[0].lower().replace("_", "-") for d in deps}
    text = (DEPLOY / "requirements.txt").read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)\s+--hash=sha256:[0-9a-f]{64}", line.strip())
            assert m, line
            pins[m.group(1).lower()] = m.group(2)
    assert set(pins) == names
    assert "--require-hashes" in (DEPLOY / "Containerfile").read_text()


def test_daemonset_may_watch_pods_services_and_endpointslices_only():
    by_kind = {d["kind"]: d for d in docs()}
    sa = by_kind["ServiceAccount"]["metadata"]
    assert daemonset()["spec"]["template"]["spec"]["serviceAccountName"] == sa["name"]
    rules = {(g, r): set(rule["verbs"]) for rule in by_kind["ClusterRole"]["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {("", "pods"): {"list", "watch"},      # what node/kubeapi.py asks, no more
                     ("", "services"): {"list", "watch"},    # IPVS Service names
                     ("discovery.k8s.io", "endpointslices"): {"list", "watch"}}
    b = by_kind["ClusterRoleBinding"]
    assert b["roleRef"]["name"] == by_kind["ClusterRole"]["metadata"]["name"]
    assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"],
                              "namespace": sa["namespace"]}]
