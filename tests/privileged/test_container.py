"""The image built from deploy/Containerfile, run as deploy/daemonset.yaml says: host network
and PID namespaces, its securityContext (capabilities dropped to the listed ones, read-only
root, no privilege escalation, the runtime's default seccomp profile), its volumes with their
propagation (the metrics Secret's files from a folder scripts/metrics-certs.sh filled), its
environment and args. The podman command line is derived from the manifest
(nptrace/lab/daemonset.py), not retyped. From inside, it traces a lab reset in the host's
namespaces and its HTTPS metrics endpoint counts it for a client with the certificate (and
refuses one without); the kubelet's probes are answered on the plain health port; a SIGKILLed
container's clsact filters are removed by the next start.

The image is built by scripts/build-image.sh, which caches the debootstrapped base and skips
the build when nothing changed (about 1 s warm). Departures from what a kubelet does, all
node facts rather than manifest ones, come from scripts/podman-args.sh: the OCI runtime that
runs on this host, and rlimits capped at what this root may grant.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from nptrace.lab import daemonset

import promscrape   # tests/promscrape.py: the certificates, Prometheus's side of the TLS

pytestmark = [pytest.mark.privileged, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[2]
PREFIX = f"npt-ct{os.getpid() % 10000}-"
NODE_IP = "127.0.0.1"      # status.hostIP: metrics on $(NODE_IP):9464, probes on $(NODE_IP):9465


def _run(argv, timeout=120, check=True):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:4])}... exited {r.returncode}: {r.stderr[-2000:]}")
    return r


@pytest.fixture(scope="module")
def image():
    for tool in ("podman", "debootstrap"):
        if shutil.which(tool) is None:
            _run(["apt-get", "install", "-y", "-qq", "podman", "buildah", "debootstrap", "runc"],
                 timeout=900)
    t0 = time.monotonic()
    r = _run([str(ROOT / "scripts/build-image.sh")], timeout=1800)
    print(f"build-image: {time.monotonic() - t0:.1f}s: {r.stderr.strip()}")
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def node_args(image):
    return _run([str(ROOT / "scripts/podman-args.sh"), image]).stdout.split()


@pytest.fixture
def spec():
    return daemonset.load(ROOT / "deploy/daemonset.yaml")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """The Secret nptrace-metrics-tls as the kubelet writes it: its keys as files."""
    return promscrape.make_certs(tmp_path_factory.mktemp("metrics-tls"))


class Container:
    def __init__(self, name):
        self.name = name

    def logs(self) -> str:
        r = _run(["podman", "logs", self.name], check=False)
        return r.stdout + r.stderr

    def state(self) -> dict:
        r = _run(["podman", "inspect", "--format", "json", self.name])
        return json.loads(r.stdout)[0]["State"]

    def wait_attached(self, timeout=90):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            logs = self.logs()
            if "nptrace: attached" in logs:
                return logs
            if not self.state()["Running"]:
                raise AssertionError(f"container exited {self.state()['ExitCode']}: {logs[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"not attached in {timeout}s: {self.logs()[-3000:]}")

    def pid(self) -> int:
        return self.state()["Pid"]

    def remove(self):
        _run(["podman", "rm", "-f", "-t", "0", self.name], check=False)


@pytest.fixture
def start(image, node_args, spec, tmp_path, certs):
    made = []
    sessions = tmp_path / "sessions"   # the sessions hostPath, moved off the real node path

    def go(suffix="", extra_args=()):
        name = f"npt-test-{os.getpid()}{suffix}"
        _run(["podman", "rm", "-f", "-t", "0", name], check=False)
        spec.volumes["sessions"]["hostPath"]["path"] = str(sessions)
        daemonset.prepare_host_paths(spec, tmp_path)
        argv = daemonset.podman_run_args(spec, image, {"status.hostIP": NODE_IP,
                                                       "spec.nodeName": socket.gethostname()},
                                         name=name, scratch=tmp_path,
                                         secrets={"nptrace-metrics-tls": certs})
        # node facts (runtime, rlimits) after `podman`; detached; extra nptrace args at the end
        argv = argv[:1] + node_args[:2] + argv[1:2] + ["--detach"] + node_args[2:] + argv[2:]
        argv += list(extra_args)
        _run(argv)
        made.append(Container(name))
        return made[-1]
    yield go
    for c in made:
        c.remove()


@pytest.fixture
def lab_up():
    from nptrace import lab
    ups = []

    def go(name):
        ups.append(name)
        return lab.up(name, prefix=PREFIX)
    yield go
    for name in ups:
        lab.down(name, prefix=PREFIX)


def scrape(certs: Path) -> str:
    """/metrics as Prometheus gets it: HTTPS, the client certificate, the name checked."""
    code, body = promscrape.https_get(9464, promscrape.client_context(certs, certs), host=NODE_IP)
    assert code == 200, (code, body)
    return body


def sample(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_container_traces_a_lab_reset_and_exports_it(start, lab_up, certs):
    info = lab_up("no-listener")
    c = start()
    logs = c.wait_attached()
    from nptrace import lab
    attempts = lab.trigger("no-listener", count=5, prefix=PREFIX)
    assert attempts and all(a.outcome == "refused" for a in attempts)
    end, got = time.monotonic() + 15, 0.0
    while time.monotonic() < end:
        got = sample(scrape(certs), "nptrace_resets_total", cause="no_listener", direction="sent")
        if got >= len(attempts):
            break
        time.sleep(0.5)
    assert got >= len(attempts), (got, c.logs()[-3000:])
    text = scrape(certs)
    # the kubelet's probes (deploy/daemonset.yaml): plain HTTP on the health port, ready once
    # attached, live while looping; no metrics there
    for path in ("/healthz", "/livez"):
        with urllib.request.urlopen(f"http://{NODE_IP}:9465{path}", timeout=5) as r:
            assert r.status == 200, path
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(f"http://{NODE_IP}:9465/metrics", timeout=5)
    # a pod on the node's network without the client certificate gets no metrics
    refused, _ = promscrape.https_get(9464, promscrape.client_context(certs), host=NODE_IP)
    assert refused != 200
    assert sample(text, "nptrace_build_info", node=socket.gethostname()) == 1, text[-2000:]
    assert sample(text, "nptrace_probe_up", probe="skb:kfree_skb") == 1
    # the node's headers are mounted (/lib/modules) and preferred; the image's tree is there
    assert "kernel headers: node" in c.logs(), c.logs()[-3000:]
    # the image's compiled hot path (deploy/Containerfile stage 2) runs: run's log
    # has no pure-Python line, and doctor in the running container says so
    assert "hot path: python" not in c.logs(), c.logs()[-3000:]
    r = _run(["podman", "exec", c.name, "nptrace", "doctor", "--json", "--no-trials"],
             check=False)
    rows = [x for x in json.loads(r.stdout)["rows"] if x["check"] == "hot path"]
    assert [(x["status"], x["detail"]) for x in rows] == [
        ("ok", "compiled (events, classify.correlate, classify.flowkey, classify.incident, "
               "classify.rules, sinks.jsonl)")], r.stdout[-2000:]
    # the kubelet's TERM: probes detached, session closed, exit 0 within the grace period
    grace = spec_grace = 30
    _run(["podman", "stop", "-t", str(grace), c.name], timeout=grace + 30)
    st = c.state()
    assert st["ExitCode"] == 0, c.logs()[-3000:]
    assert "Traceback" not in c.logs()


def _filters(netns, dev):
    out = ""
    for parent in ("ingress", "egress"):
        out += _run(["tc", "-n", netns, "filter", "show", "dev", dev, parent], check=False).stdout
    return set(re.findall(r"npt_(\d+)_(?:ing|egr)", out))


def test_sigkilled_container_is_cleaned_up_by_the_next_start(start, lab_up):
    info = lab_up("no-listener")
    watch = info.watch[0]
    netns, dev = watch.split("/", 1)
    # clsact filters outlive their process (tcx links do not): they are what a crash leaves
    extra = ["--iface", watch, "--tc-mode", "clsact"]
    first = start("-a", extra)
    first.wait_attached()
    pid = first.pid()
    state = Path(f"/run/nptrace/tc-{pid}.json")
    assert state.exists() and str(pid) in _filters(netns, dev)
    _run(["podman", "kill", "--signal", "KILL", first.name])
    end = time.monotonic() + 10
    while first.state()["Running"] and time.monotonic() < end:
        time.sleep(0.1)
    assert not first.state()["Running"]
    assert state.exists() and str(pid) in _filters(netns, dev), "nothing left to clean up?"

    second = start("-b", extra)
    logs = second.wait_attached()
    assert not state.exists(), logs
    assert _filters(netns, dev) == {str(second.pid())}, logs
    _run(["podman", "stop", "-t", "30", second.name], timeout=60)
    assert second.state()["ExitCode"] == 0, second.logs()[-3000:]
    assert not _filters(netns, dev)
    assert not list(Path("/run/nptrace").glob(f"tc-{second.pid() or 0}.json"))


def test_container_without_node_headers_uses_its_own(start, lab_up, spec, certs):
    """A node with no headers (COS, Bottlerocket, Talos): the DaemonSet's /lib/modules and
    /usr/src mounts removed, the image's minimal tree (deploy/Containerfile stage 1) is used.
    Also the hot path run as Python (NPTRACE_PURE=1): run says so once, and it traces alike."""
    lab_up("no-listener")
    spec.container["volumeMounts"] = [m for m in spec.container["volumeMounts"]
                                      if m["name"] not in ("lib-modules", "usr-src")]
    spec.container["env"] = spec.container.get("env", []) + [{"name": "NPTRACE_PURE", "value": "1"}]
    c = start("-nh")
    logs = c.wait_attached()
    assert "kernel headers: shipped (nptrace's minimal tree /usr/share/nptrace/kheaders)" in logs, logs
    assert logs.count("hot path: python: nptrace.events: NPTRACE_PURE=1 (and 5 more);") == 1, logs
    from nptrace import lab
    attempts = lab.trigger("no-listener", count=3, prefix=PREFIX)
    end, got = time.monotonic() + 15, 0.0
    while time.monotonic() < end and got < len(attempts):
        got = sample(scrape(certs), "nptrace_resets_total", cause="no_listener", direction="sent")
        time.sleep(0.5)
    assert got >= len(attempts), (got, c.logs()[-3000:])
    _run(["podman", "stop", "-t", "30", c.name], timeout=60)
    assert c.state()["ExitCode"] == 0, c.logs()[-3000:]
