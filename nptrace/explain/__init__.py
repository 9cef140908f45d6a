"""`nptrace explain`: predict, from the node's own state, what happens to a client's SYN to a
NodePort or Service and to its reply, and name the cause nptrace would label.

facts.py holds the gathered state as plain data (JSON round trip, unit-test fixtures);
predict.py is the pure predictor over it; gather.py reads the node (routes, sysctls, rules,
local pods, one probe connection per endpoint); command.py is the click command and
confirm.py the optional `--confirm SECONDS` trace.
"""
from .facts import Facts, Route
from .predict import Prediction, Step, predict

__all__ = ["Facts", "Prediction", "Route", "Step", "predict"]
