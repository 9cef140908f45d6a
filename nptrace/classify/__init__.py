"""Attribution: decoded kernel events in, labeled verdicts out.

A pure function of its inputs: no I/O, no clock (time is `event.ts_ns`, or the `now_ns` the
caller passes to `tick`), no globals. What it knows about the node arrives in a `Context` of
plain lookups built by the caller, so the same code runs live and over recorded sessions.

  verdict.py    the vocabulary (CAUSES, PRIORITY, KIND, ...), Labeled, Evidence, Verdict, Context
  rules.py      one rule function per cause with its hint; RULES (ordered), applies_to
  correlate.py  flows across NAT, interfaces and namespaces; Classifier, classify()
  labelmemo.py  an event's own label kept by the values its rules read (the storm's hot path)

Add a cause by adding a rule function to rules.RULES and its name to verdict.PRIORITY.
"""
from .correlate import Classifier, Flow, classify, flow_keys
from .rules import RULES, UNKNOWN_HINT, Rule, applies_to
from .verdict import (APP_RESETS, CAUSES, EVIDENCE_ONLY, HOOKS, KIND, MAX_EVIDENCE, NOT_NETWORK,
                      PRIORITY, RANK, WEAK_CAUSES, WEAK_DROPS, Context, Evidence, Labeled,
                      Verdict, evidence_dicts, reason_name)

__all__ = [
    "APP_RESETS", "CAUSES", "EVIDENCE_ONLY", "HOOKS", "KIND", "MAX_EVIDENCE", "NOT_NETWORK",
    "PRIORITY", "RANK", "RULES", "UNKNOWN_HINT", "WEAK_CAUSES", "WEAK_DROPS",
    "Classifier", "Context", "Evidence", "Flow", "Labeled", "Rule", "Verdict",
    "applies_to", "classify", "evidence_dicts", "flow_keys", "reason_name",
]
