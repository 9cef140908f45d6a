"""The lab cluster's PKI, made with the openssl command as kubeadm lays it out: one CA that
signs the API server's serving certificate and every client certificate (a client's user is
its CN, its groups its O), and the ServiceAccount token key pair.

Identities, as a cluster has them (the API server's default RBAC binds each):
  admin                     O=system:masters: the lab itself, writing objects as a user and
                            a kubelet would
  system:kube-controller-manager, system:kube-scheduler, system:kube-proxy
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import LabError

DAYS = "2"
CLIENTS = {
    "admin": "/O=system:masters/CN=admin",
    "controller-manager": "/CN=system:kube-controller-manager",
    "scheduler": "/CN=system:kube-scheduler",
    "kube-proxy": "/CN=system:kube-proxy",
}


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def cert(self, who: str) -> Path:
        return self.dir / f"{who}.crt"

    def key(self, who: str) -> Path:
        return self.dir / f"{who}.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def _openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise LabError(f"openssl {args[0]} failed: {r.stderr.strip()[-300:]}")


def _key(path: Path, cwd: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path), cwd=cwd)


def _signed(d: Path, who: str, subj: str, ext: str) -> None:
    _key(d / f"{who}.key", d)
    _openssl("req", "-new", "-key", f"{who}.key", "-subj", subj, "-out", f"{who}.csr", cwd=d)
    (d / f"{who}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", DAYS, "-extfile", f"{who}.ext", "-out", f"{who}.crt", cwd=d)


def make(d: Path, server_ips: list[str]) -> Pki:
    """A CA, the API server's certificate for ``server_ips`` (and the in-cluster names), the
    client certificates of CLIENTS and the ServiceAccount key pair, in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    _key(d / "ca.key", d)
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=nptrace-lab-ca", "-days", DAYS,
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", "ca.crt", cwd=d)
    names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local", "localhost"]
    san = ",".join([f"DNS:{n}" for n in names] + [f"IP:{ip}" for ip in ["127.0.0.1", *server_ips]])
    _signed(d, "apiserver", "/CN=kube-apiserver",
            f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage=serverAuth\nsubjectAltName={san}\n")
    for who, subj in CLIENTS.items():
        _signed(d, who, subj, "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                              "extendedKeyUsage=clientAuth\n")
    _key(d / "sa.key", d)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    for f in d.glob("*.csr"):
        f.unlink()
    return Pki(d)


def kubeconfig(pki: Pki, who: str, server: str) -> str:
    """A kubeconfig for identity ``who`` (a key of CLIENTS) against ``server``."""
    return f"""apiVersion: v1
kind: Config
clusters:
- name: lab
  cluster:
    server: {server}
    certificate-authority: {pki.ca}
users:
- name: {who}
  user:
    client-certificate: {pki.cert(who)}
    client-key: {pki.key(who)}
contexts:
- name: lab
  context: {{cluster: lab, user: {who}}}
current-context: lab
"""
