"""nptrace: names the cause of TCP resets and drops on Kubernetes NodePort traffic."""
__version__ = "0.1.0"
