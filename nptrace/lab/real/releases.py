"""The Kubernetes releases the lab's real tier runs (k8s/releases) and where k8s/build.sh
put their binaries (NPTRACE_K8S_CACHE, default /var/lib/nptrace/k8s/<version>/bin)."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import NotRunnable, UsageError

K8S_DIR = Path(__file__).resolve().parents[3] / "k8s"
# not /var/cache: the kernel matrix's guests see this machine's root with a tmpfs there
DEFAULT_CACHE = Path("/var/lib/nptrace/k8s")


@dataclass(frozen=True)
class Release:
    name: str            # current, older
    version: str         # v1.36.3
    components: tuple[str, ...]

    @property
    def minor(self) -> int:
        return int(self.version.split(".")[1])


def parse(text: str) -> list[Release]:
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].split()
        if len(line) >= 3:
            out.append(Release(line[0], line[1], tuple(line[2:])))
    return out


def all_releases(k8s_dir: Path = K8S_DIR) -> list[Release]:
    try:
        return parse((k8s_dir / "releases").read_text())
    except OSError as e:
        raise NotRunnable(f"no k8s/releases beside the package ({e.strerror}): the real tier runs "
                          f"from a checkout") from None


def get(name: str | None = None, k8s_dir: Path = K8S_DIR) -> Release:
    rels = all_releases(k8s_dir)
    if name is None:
        return rels[0]
    for r in rels:
        if name in (r.name, r.version):
            return r
    raise UsageError(f"no Kubernetes release {name!r} (k8s/releases: "
                     f"{', '.join(f'{r.name} {r.version}' for r in rels)})")


def cache_dir(env=os.environ) -> Path:
    return Path(env.get("NPTRACE_K8S_CACHE") or DEFAULT_CACHE)


def bin_dir(rel: Release, env=os.environ) -> Path:
    return cache_dir(env) / rel.version / "bin"


def built(rel: Release, k8s_dir: Path = K8S_DIR) -> bool:
    """Whether k8s/build.sh has this release's binaries, built from the pins as they are now."""
    r = subprocess.run(["bash", str(k8s_dir / "build.sh"), "--check", rel.name],
                       capture_output=True, timeout=30)
    return r.returncode == 0


def binary(rel: Release, component: str) -> str:
    """The path of one component's binary; NotRunnable (one line) when it was not built."""
    path = bin_dir(rel) / component
    if component not in rel.components:
        raise NotRunnable(f"Kubernetes {rel.version} is built without {component} (k8s/releases)")
    if not path.is_file() or not built(rel):
        raise NotRunnable(f"Kubernetes {rel.version} is not built here: run `make k8s` "
                          f"(k8s/build.sh {rel.name}; about 10 minutes from an empty Go cache)")
    return str(path)
