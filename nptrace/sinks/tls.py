"""TLS for the metrics endpoint: --metrics-tls-cert, --metrics-tls-key and --metrics-client-ca
(NPTRACE_RUN_METRICS_TLS_CERT, ... in the environment), as node-exporter's web config does it
(`tls_server_config` with `client_auth_type: RequireAndVerifyClientCert`).

With a client CA, a client must present a certificate that CA signed, or the handshake fails
before a byte of HTTP is read (sinks/httpd.py drops it and counts `tls_refused`): a pod on the
node's network can open a connection, never scrape. Any certificate of that CA is accepted, so
the CA is nptrace's own (docs/deploy.md makes one), never the cluster's, whose CA signs every
kubelet's and every user's client certificate.

The files are read again when one of them changes (checked at most every CHECK_S seconds, as a
connection is accepted): cert-manager and a Secret's kubelet mount replace them in place, and
the endpoint runs for months. A change that does not load (a key written before its
certificate) keeps the previous files' context and is said once.
"""
from __future__ import annotations

import os
import ssl
import time
from typing import Callable, NamedTuple

from nptrace.config import ConfigError
from nptrace.errors import NptraceError

__all__ = ["TlsFiles", "ServerTls", "server_context", "tls_files"]

CHECK_S = 30.0


class TlsFiles(NamedTuple):
    cert: str
    key: str
    client_ca: str | None = None     # None: any client (TLS without client authentication)


def tls_files(cert: str | None, key: str | None, client_ca: str | None,
              metrics_addr: str | None) -> TlsFiles | None:
    """The run's TlsFiles from its options, None without them; ConfigError for a set that
    cannot mean anything (a certificate without its key, a client CA without a certificate)."""
    if not (cert or key or client_ca):
        return None
    if not metrics_addr:
        raise ConfigError("--metrics-tls-cert, --metrics-tls-key and --metrics-client-ca "
                          "serve --metrics-addr: give it too")
    if not (cert and key):
        raise ConfigError("--metrics-tls-cert and --metrics-tls-key go together (the "
                          "certificate and its private key)" if cert or key else
                          "--metrics-client-ca needs --metrics-tls-cert and --metrics-tls-key: "
                          "client certificates are asked for over TLS")
    return TlsFiles(cert, key, client_ca or None)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The server's SSLContext from the files, or NptraceError saying which file and why."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # client-started renegotiation (TLS 1.2) costs the server a handshake per request
    ctx.options |= getattr(ssl, "OP_NO_RENEGOTIATION", 0)
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except OSError as e:      # ssl.SSLError too: not PEM, or a key that is not the cert's
        raise NptraceError(_why("--metrics-tls-cert/--metrics-tls-key",
                                f"{files.cert}, {files.key}", e)) from None
    if files.client_ca:
        try:
            ctx.load_verify_locations(cafile=files.client_ca)
        except OSError as e:
            raise NptraceError(_why("--metrics-client-ca", files.client_ca, e)) from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _why(flag: str, paths: str, e: OSError) -> str:
    if isinstance(e, ssl.SSLError):
        detail = e.reason or str(e)
        return (f"{flag} {paths}: not a usable PEM certificate and key ({detail}): give the "
                "certificate (chain) and its own private key, PEM-encoded")
    return f"{flag} {paths}: cannot read it ({e.strerror or e})"


def _stamp(files: TlsFiles) -> tuple:
    out = []
    for p in files:
        if p is None:
            continue
        try:
            st = os.stat(p)             # follows the symlinks a Secret volume swaps
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


class ServerTls:
    """The current SSLContext of `files` (sinks/httpd.py calls context() per connection)."""

    def __init__(self, files: TlsFiles, check_s: float = CHECK_S,
                 clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None):
        self.files, self.check_s, self.clock, self.log = files, check_s, clock, log
        self.stamp = _stamp(files)
        self.ctx = server_context(files)       # at start a bad file is the run's error
        self.checked = clock()
        self.reloads = 0

    @property
    def client_auth(self) -> bool:
        return bool(self.files.client_ca)

    def context(self) -> ssl.SSLContext:
        now = self.clock()
        if now - self.checked >= self.check_s:
            self.checked = now
            stamp = _stamp(self.files)
            if stamp != self.stamp:
                self.stamp = stamp            # said once per change, not at every check
                try:
                    self.ctx = server_context(self.files)
                    self.reloads += 1
                    self._say("metrics TLS: certificate files changed: reloaded")
                except NptraceError as e:
                    self._say(f"metrics TLS: {e}; still serving the previous certificate")
        return self.ctx

    def _say(self, msg: str) -> None:
        if self.log is not None:
            self.log(msg)
