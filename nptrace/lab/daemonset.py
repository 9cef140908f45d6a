"""The DaemonSet's container spec (deploy/daemonset.yaml) as a `podman run` command line.

Used by the container test to run the image under exactly what the kubelet would give it:
host namespaces, securityContext (capabilities, read-only root, no privilege escalation,
seccomp), volumes and mounts (with their propagation), environment (downward API values
passed in), args with Kubernetes' $(VAR) expansion, and the resource limits. Derived from the
YAML, never retyped: a field this module does not know how to translate raises, so the
emulation cannot drift silently from the manifest.

    spec = load(Path("deploy/daemonset.yaml"))
    argv = podman_run_args(spec, image, downward={"status.hostIP": "127.0.0.1", "spec.nodeName": "n1"},
                             name="npt", secrets={"nptrace-metrics-tls": Path("certs")})

A Secret volume is a folder the caller made with the Secret's keys as files (what the kubelet
writes), given by the Secret's name in `secrets`, mounted read-only.

Pure apart from `prepare_host_paths` (creates DirectoryOrCreate paths as the kubelet does).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# Fields that change scheduling or cluster behaviour, not what the process sees on the node.
IGNORED_POD = {"dnsPolicy", "priorityClassName", "tolerations", "terminationGracePeriodSeconds",
               "containers", "volumes", "hostNetwork", "hostPID", "hostIPC", "serviceAccountName",
               "nodeSelector", "affinity", "automountServiceAccountToken"}
IGNORED_CONTAINER = {"name", "image", "imagePullPolicy", "ports", "livenessProbe", "readinessProbe",
                     "startupProbe", "args", "command", "env", "volumeMounts", "resources",
                     "securityContext"}
PROPAGATION = {None: "rprivate", "None": "rprivate", "HostToContainer": "rslave",
               "Bidirectional": "rshared"}
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}


class SpecError(ValueError):
    """The manifest holds something this emulation does not translate."""


@dataclass
class PodSpec:
    pod: dict
    container: dict
    volumes: dict = field(default_factory=dict)

    def probe(self, kind: str) -> dict | None:
        return self.container.get(kind)


def load(path: Path, container: str = "nptrace") -> PodSpec:
    import yaml   # test-time dependency (kubernetes-validate brings it)
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    ds = [d for d in docs if d.get("kind") == "DaemonSet"]
    if len(ds) != 1:
        raise SpecError(f"{path}: expected one DaemonSet, found {len(ds)}")
    pod = ds[0]["spec"]["template"]["spec"]
    cs = [c for c in pod["containers"] if c["name"] == container]
    if not cs:
        raise SpecError(f"{path}: no container named {container}")
    return PodSpec(pod, cs[0], {v["name"]: v for v in pod.get("volumes", [])})


def quantity(q) -> int:
    """A Kubernetes memory quantity in bytes ("768Mi", "64Mi", "1G", 1000)."""
    m = re.fullmatch(r"(\d+)([KMG]i?)?", str(q))
    if not m:
        raise SpecError(f"quantity {q!r} not understood")
    return int(m.group(1)) * _UNITS.get(m.group(2) or "", 1)


def cpus(q) -> str:
    s = str(q)
    return str(int(s[:-1]) / 1000) if s.endswith("m") else s


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values: $$ escapes, unknown stays as is."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), s)


def environment(spec: PodSpec, downward: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in spec.container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif "fieldRef" in e.get("valueFrom", {}):
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            if path not in downward:
                raise SpecError(f"env {e['name']}: no value given for downward API field {path}")
            env[e["name"]] = downward[path]
        else:
            raise SpecError(f"env {e['name']}: only value and fieldRef are translated")
    return env


def security_args(spec: PodSpec) -> list[str]:
    sc = dict(spec.container.get("securityContext", {}))
    out: list[str] = []
    if sc.pop("privileged", False):
        out.append("--privileged")
    if sc.pop("allowPrivilegeEscalation", True) is False:
        out += ["--security-opt", "no-new-privileges"]
    if sc.pop("readOnlyRootFilesystem", False):
        # podman would mount tmpfs on /run, /tmp and /var/tmp; the kubelet does not.
        out += ["--read-only", "--read-only-tmpfs=false"]
    if "runAsUser" in sc:
        out += ["--user", str(sc.pop("runAsUser"))]
    caps = sc.pop("capabilities", {})
    for c in caps.get("drop", []):
        out.append("--cap-drop=all" if c == "ALL" else f"--cap-drop=CAP_{c}")
    for c in caps.get("add", []):
        out.append(f"--cap-add=CAP_{c}")
    seccomp = sc.pop("seccompProfile", {"type": "RuntimeDefault"})
    if seccomp["type"] == "Unconfined":
        out += ["--security-opt", "seccomp=unconfined"]
    elif seccomp["type"] == "Localhost":
        out += ["--security-opt", f"seccomp={seccomp['localhostProfile']}"]
    if sc:
        raise SpecError(f"securityContext fields not translated: {sorted(sc)}")
    return out


def mount_args(spec: PodSpec, scratch: Path, secrets: dict | None = None) -> list[str]:
    out: list[str] = []
    for m in spec.container.get("volumeMounts", []):
        vol = spec.volumes.get(m["name"])
        if vol is None:
            raise SpecError(f"volumeMount {m['name']}: no such volume")
        extra = set(m) - {"name", "mountPath", "readOnly", "mountPropagation"}
        if extra:
            raise SpecError(f"volumeMount {m['name']}: fields not translated: {sorted(extra)}")
        if "hostPath" in vol:
            opts = ["ro" if m.get("readOnly") else "rw", PROPAGATION[m.get("mountPropagation")]]
            out += ["--volume", f"{vol['hostPath']['path']}:{m['mountPath']}:{','.join(opts)}"]
        elif "emptyDir" in vol:
            ed = vol["emptyDir"] or {}
            if ed.get("medium") == "Memory":
                opts = ["rw", "mode=1777"] + ([f"size={quantity(ed['sizeLimit'])}"]
                                              if "sizeLimit" in ed else [])
                out += ["--mount", f"type=tmpfs,destination={m['mountPath']},"
                        + ",".join(f"tmpfs-{o}" if o.startswith(("size", "mode")) else o
                                   for o in opts)]
            else:   # the kubelet makes a node directory per pod volume
                d = scratch / m["name"]
                out += ["--volume", f"{d}:{m['mountPath']}:rw"]
        elif "secret" in vol:
            name = vol["secret"]["secretName"]
            if name not in (secrets or {}):
                raise SpecError(f"volume {m['name']}: Secret {name}: give a folder of its files "
                                "(secrets=)")
            out += ["--volume", f"{secrets[name]}:{m['mountPath']}:ro,rprivate"]
        else:
            raise SpecError(f"volume {m['name']}: only hostPath, emptyDir and secret are translated")
    return out


def prepare_host_paths(spec: PodSpec, scratch: Path) -> None:
    """What the kubelet does before starting the container: DirectoryOrCreate paths are made
    (0755), Directory paths must exist, emptyDir (disk) directories are made."""
    for name, vol in spec.volumes.items():
        if "hostPath" in vol:
            p, kind = Path(vol["hostPath"]["path"]), vol["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                p.mkdir(mode=0o755, parents=True, exist_ok=True)
            elif kind == "Directory" and not p.is_dir():
                raise SpecError(f"volume {name}: hostPath {p} is not a directory on this node "
                                "(the kubelet would refuse to start the pod)")
        elif "emptyDir" in vol and (vol["emptyDir"] or {}).get("medium") != "Memory":
            (scratch / name).mkdir(parents=True, exist_ok=True)


def podman_run_args(spec: PodSpec, image: str, downward: dict[str, str], name: str,
                    scratch: Path = Path("/var/tmp"), secrets: dict | None = None) -> list[str]:
    pod = spec.pod
    unknown = set(pod) - IGNORED_POD
    if unknown:
        raise SpecError(f"pod fields not translated: {sorted(unknown)}")
    unknown = set(spec.container) - IGNORED_CONTAINER
    if unknown:
        raise SpecError(f"container fields not translated: {sorted(unknown)}")
    argv = ["podman", "run", "--name", name]
    if pod.get("hostNetwork"):
        argv.append("--network=host")
    if pod.get("hostPID"):
        argv.append("--pid=host")
    if pod.get("hostIPC"):
        argv.append("--ipc=host")
    argv += security_args(spec)
    argv += mount_args(spec, scratch, secrets)
    env = environment(spec, downward)
    for k, v in env.items():
        argv += ["--env", f"{k}={v}"]
    limits = spec.container.get("resources", {}).get("limits", {})
    if "memory" in limits:
        argv += ["--memory", str(quantity(limits["memory"]))]
    if "cpu" in limits:
        argv += ["--cpus", cpus(limits["cpu"])]
    if "command" in spec.container:
        argv += ["--entrypoint", expand(spec.container["command"][0], env)]
    argv.append(image)
    argv += [expand(a, env) for a in spec.container.get("command", [])[1:]]
    argv += [expand(a, env) for a in spec.container.get("args", [])]
    return argv
