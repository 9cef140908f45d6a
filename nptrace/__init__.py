"""nptrace: names the cause of TCP resets and drops on Kubernetes NodePort traffic."""
from nptrace import compiled as _compiled

_compiled.install()   # before any of the hot path's modules is imported
__version__ = "0.1.0"
