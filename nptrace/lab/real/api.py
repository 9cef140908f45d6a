"""A small client of the lab cluster's API: JSON over HTTPS with the lab's admin client
certificate (or a bearer token), urllib only, as nptrace's own client (node/kubeapi.py)."""
from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request

from ..errors import LabError


class ApiError(LabError):
    def __init__(self, status: int, method: str, path: str, body: str):
        self.status = status
        try:
            msg = json.loads(body).get("message", body)
        except ValueError:
            msg = body
        super().__init__(f"API {method} {path}: {status} {str(msg)[:300]}")


class Api:
    def __init__(self, server: str, ca: str, cert: str | None = None, key: str | None = None,
                 token: str | None = None, timeout: float = 10.0):
        self.server = server.rstrip("/")
        self.ctx = ssl.create_default_context(cafile=ca)
        if cert:
            self.ctx.load_cert_chain(cert, key)
        self.token = token
        self.timeout = timeout

    def request(self, method: str, path: str, body=None, content_type: str = "application/json"):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, method, path, e.read().decode(errors="replace")) from None
        except (urllib.error.URLError, OSError) as e:
            raise LabError(f"API {method} {path}: {getattr(e, 'reason', e)}") from None
        return json.loads(raw) if raw else None

    def get(self, path: str):
        return self.request("GET", path)

    def create(self, path: str, obj: dict):
        return self.request("POST", path, obj)

    def patch(self, path: str, patch: dict):
        return self.request("PATCH", path, patch, "application/merge-patch+json")

    def delete(self, path: str, grace: int | None = None, missing_ok: bool = True):
        body = None if grace is None else {"kind": "DeleteOptions", "apiVersion": "v1",
                                           "gracePeriodSeconds": grace}
        try:
            return self.request("DELETE", path, body)
        except ApiError as e:
            if e.status == 404 and missing_ok:
                return None
            raise

    def ready(self) -> bool:
        try:
            req = urllib.request.Request(self.server + "/readyz")
            with urllib.request.urlopen(req, context=self.ctx, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait(self, what: str, check, timeout: float, every: float = 0.1):
        """``check()``'s first true value within ``timeout`` s; LabError naming ``what`` after."""
        deadline = time.monotonic() + timeout
        while True:
            v = check()
            if v:
                return v
            if time.monotonic() > deadline:
                raise LabError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(every)
