"""The daemon `nptrace run` is: the live loop (tracer.py), its checks and lock
(preflight.py), its stop (lifecycle.py), systemd notification (sdnotify.py) and the loss
ledger (losses.py)."""
