"""The Vagrant lab's files, without starting a VM: one source of addresses (vagrant/plan.json
is what the topology data produces), `vagrant validate` for both providers, shellcheck on the
provisioning scripts, and the k8s manifests against the scenario data.

`vagrant` and `shellcheck` are Debian packages; where they are missing the tests that need
them skip with the reason."""
import functools
import ipaddress
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nptrace.lab import model, vm

REPO = Path(__file__).resolve().parents[2]
VAGRANT_DIR = REPO / "vagrant"
VAGRANTFILE = REPO / "Vagrantfile"
SCRIPTS = sorted(VAGRANT_DIR.rglob("*.sh"))


# ---------------------------------------------------------------- one source of addresses

def test_plan_json_is_what_the_topology_produces():
    assert (VAGRANT_DIR / "plan.json").read_text() == vm.render_plan(), (
        "vagrant/plan.json is stale: run `python3 -m nptrace.lab.vm vagrant-json > vagrant/plan.json`")


def test_vagrant_json_command_prints_the_plan():
    r = subprocess.run([sys.executable, "-m", "nptrace.lab.vm", "vagrant-json"], capture_output=True,
                       text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == vm.render_plan()


def _topology_literals():
    plan = vm.vagrant_plan()
    addrs = {a.split("/")[0] for v in plan["vms"] for n in v["nics"] for a in n["addrs"]}
    addrs |= {str(ipaddress.ip_network(s).network_address) for net in plan["networks"].values()
              for s in net["subnets"]}
    macs = {n["mac"] for v in plan["vms"] for n in v["nics"]}
    return addrs, macs | {m.replace(":", "") for m in macs}


@pytest.mark.parametrize("path", [VAGRANTFILE, *sorted((VAGRANT_DIR / "provision").glob("*.sh"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_address_or_mac_is_retyped(path):
    """The Vagrantfile and provisioning take addresses and MACs from plan.json only."""
    text = path.read_text()
    addrs, macs = _topology_literals()
    found = sorted(x for x in addrs | macs if re.search(rf"(?<![\w.:]){re.escape(x)}(?![\w:]|\.\d)", text))
    assert not found, f"{path.name} retypes {found}"


def test_vagrantfile_reads_the_plan_and_its_scripts_exist():
    text = VAGRANTFILE.read_text()
    assert '"vagrant", "plan.json"' in text
    for rel in re.findall(r'path: "([^"]+)"', text):
        assert (REPO / rel).is_file(), rel


# ---------------------------------------------------------------- vagrant validate

def _vagrant_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPTRACE_", "VAGRANT_"))}
    env.update(VAGRANT_HOME=str(tmp_path / "vagrant.d"), VAGRANT_CHECKPOINT_DISABLE="1",
               VAGRANT_CWD=str(tmp_path / "proj"), VAGRANT_NO_COLOR="1", **extra)
    return env


@pytest.fixture(scope="module")
def vagrant_copy(tmp_path_factory):
    """The Vagrantfile and vagrant/ in a scratch folder: validation writes .vagrant/ beside them."""
    if not shutil.which("vagrant"):
        pytest.skip("vagrant is not installed (Debian package `vagrant`)")
    tmp = tmp_path_factory.mktemp("vagrant")
    (tmp / "proj").mkdir()
    shutil.copy(VAGRANTFILE, tmp / "proj" / "Vagrantfile")
    shutil.copytree(VAGRANT_DIR, tmp / "proj" / "vagrant")
    # VirtualBox's provider checks its settings only once VBoxManage answers a version
    # query; a stand-in that answers nothing else lets them run where VirtualBox is absent.
    fake = tmp / "fakevbox"
    fake.mkdir()
    (fake / "VBoxManage").write_text('#!/bin/sh\n[ "$1" = --version ] && echo 7.0.14r161095\nexit 0\n')
    (fake / "VBoxManage").chmod(0o755)
    return tmp


def _validate(tmp, provider, **env):
    e = _vagrant_env(tmp, VAGRANT_DEFAULT_PROVIDER=provider, **env)
    if provider == "virtualbox" and not shutil.which("VBoxManage"):
        e["PATH"] = f"{tmp / 'fakevbox'}:{e.get('PATH', '')}"
    return subprocess.run(["vagrant", "validate"], capture_output=True, text=True, env=e, timeout=120)


@functools.lru_cache(maxsize=None)
def _has_libvirt_plugin(tmp):
    r = subprocess.run(["vagrant", "plugin", "list"], capture_output=True, text=True, env=_vagrant_env(tmp),
                       timeout=120)
    return "vagrant-libvirt" in r.stdout


@pytest.mark.parametrize("provider", ["virtualbox", "libvirt"])
@pytest.mark.parametrize("settings", [
    {},
    {"NPTRACE_LAB_PROFILE": "k8s", "NPTRACE_KUBE_PROXY_MODE": "ipvs"},
    {"NPTRACE_LAB_PROFILE": "k8s", "NPTRACE_KUBE_PROXY_MODE": "nftables", "NPTRACE_NODE_MEMORY": "3072"},
], ids=["netns", "k8s-ipvs", "k8s-nftables"])
def test_vagrant_validate(vagrant_copy, provider, settings):
    if provider == "libvirt" and not _has_libvirt_plugin(vagrant_copy):
        pytest.skip("the vagrant-libvirt plugin is not installed (Debian package `vagrant-libvirt`)")
    r = _validate(vagrant_copy, provider, **settings)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "validated successfully" in r.stdout


@pytest.mark.parametrize("setting,value", [("NPTRACE_LAB_PROFILE", "k3s"), ("NPTRACE_KUBE_PROXY_MODE", "userspace"),
                                           ("NPTRACE_NODE_MEMORY", "lots")])
def test_vagrant_rejects_bad_settings(vagrant_copy, setting, value):
    r = _validate(vagrant_copy, "virtualbox", **{setting: value})
    assert r.returncode != 0
    assert setting in r.stdout + r.stderr


# ---------------------------------------------------------------- shell scripts

@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck(script):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (Debian package `shellcheck`)")
    r = subprocess.run(["shellcheck", "-x", str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_scripts_parse_and_are_strict(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "set -euo pipefail" in script.read_text()


def test_setup_uses_the_readme_setup_command_and_writes_the_marker():
    text = (VAGRANT_DIR / "provision" / "setup.sh").read_text()
    assert 'make -C "$src" setup' in text
    assert str(vm.MARKER) in text and "role=$role" in text and "profile=$profile" in text
    lab = (VAGRANT_DIR / "provision" / "lab.sh").read_text()
    assert "-m nptrace.lab.vm" in lab and "apply-role" in lab


# ---------------------------------------------------------------- k8s profile

def _yaml_docs(name):
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all((VAGRANT_DIR / "k8s" / name).read_text()) if d]


def _kind(docs, kind):
    return next(d for d in docs if d["kind"] == kind)


def _check_service(svc, data):
    spec = svc["spec"]
    port = spec["ports"][0]
    assert (svc["metadata"]["namespace"], svc["metadata"]["name"]) == (data.namespace, data.name)
    assert spec["clusterIP"] == data.cluster_ip and spec["externalTrafficPolicy"] == data.etp
    assert (port["name"], port["port"], port["targetPort"], port["nodePort"], port["protocol"]) == (
        data.port_name, data.port, data.endpoints[0].port, data.node_port, data.protocol.upper())
    assert spec.get("healthCheckNodePort", 0) == data.health_check_node_port
    if data.health_check_node_port:
        assert spec["type"] == "LoadBalancer"


def test_web_manifest_is_the_seed_service():
    spec = model.compile_spec("healthy")
    web = next(s for s in spec.services if s.name == "web")
    docs = _yaml_docs("web.yaml")
    _check_service(_kind(docs, "Service"), web)
    dep = _kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == len(web.endpoints) == 3
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    server = spec.hosts["web-0"]["server"]
    assert c["args"] == ["--listen", f"{server['port']}:{server['mode']}"]
    assert c["ports"][0]["containerPort"] == server["port"]
    mount = pod["volumes"][0]["hostPath"]["path"]
    assert mount == "/vagrant/" + str(Path(vm.hostplan.SERVER).relative_to(REPO))
    assert c["command"][-1] == c["volumeMounts"][0]["mountPath"]


def test_web_local_manifest_is_the_healthy_scenarios_second_service():
    spec = model.compile_spec("healthy")
    data = next(s for s in spec.services if s.name == "web-local")
    _check_service(_kind(_yaml_docs("web-local.yaml"), "Service"), data)


def test_networkpolicy_admits_only_ingress_nginx_on_the_target_port():
    docs = _yaml_docs("networkpolicy.yaml")
    pol = _kind(docs, "NetworkPolicy")
    assert _kind(docs, "Namespace")["metadata"]["name"] == "ingress-nginx"
    (rule,) = pol["spec"]["ingress"]
    (src,) = rule["from"]
    assert src == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert pol["spec"]["podSelector"] == {"matchLabels": {"app": "web"}}
    # The namespace lab's stand-in for the same policy names the same namespace.
    assert "allow from namespace ingress-nginx" in model.compile_spec("networkpolicy-drop").hosts["node1"]["iptables_restore"]


def test_k8s_scenario_script_covers_every_scenario():
    text = (VAGRANT_DIR / "k8s" / "scenario.sh").read_text()
    unsupported = set(re.search(r'^UNSUPPORTED="([^"]*)"', text, re.M).group(1).split())
    case = text[text.index('case "$name" in'):text.index("esac")]
    handled = set(re.findall(r"^    ([a-z0-9-]+)\)", case, re.M))
    names = {s.name for s in model.load_scenarios()}
    assert handled | unsupported == names and not handled & unsupported


def test_readme_names_every_scenario():
    text = (VAGRANT_DIR / "README.md").read_text()
    for s in model.load_scenarios():
        assert f"`{s.name}`" in text, s.name


def test_emulator_compiles_and_knows_every_case(monkeypatch):
    import importlib.util
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    spec = importlib.util.spec_from_file_location("npt_emulate", VAGRANT_DIR / "emulate.py")
    emulate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulate)
    assert len(emulate.all_cases()) == sum(1 + len(s.variants) for s in model.load_scenarios())
