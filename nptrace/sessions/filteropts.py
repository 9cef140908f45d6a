"""The filter options as click decorators, shared by `run` (cli.py) and the offline commands
(sessions/commands.py); the logic is nptrace.classify.filters."""
from __future__ import annotations

import time

import click

from nptrace.classify.filters import Filter, build


def filter_options(offline: bool):
    opts = [
        click.option("--service", "f_service", metavar="NS/NAME[:PORT]",
                     help="Only incidents of this Service (its ClusterIP, NodePort, external "
                          "IPs and endpoints" + (", as the sessions recorded them)." if offline
                                                 else ", from the node's rules, followed as they change).")),
        click.option("--pod", "f_pods", multiple=True, metavar="NS/NAME|ADDR|CIDR",
                     help="Only incidents with this pod (or address) at one end (repeatable)."),
        click.option("--cause", "f_causes", multiple=True, metavar="CAUSE",
                     help="Only incidents with this cause (repeatable, or comma-separated)."),
        click.option("--node", "f_node", metavar="NAME",
                     help="Only incidents recorded on this node." if offline else
                     "Only when this node is NAME (for fleet-wide command lines)."),
    ]
    if offline:
        opts += [
            click.option("--since", "f_since", metavar="TIME",
                         help="Only incidents at or after TIME: RFC 3339 (2026-01-01T10:40:00Z) "
                              "or a duration ago (10m, 2h, 1d)."),
            click.option("--until", "f_until", metavar="TIME", help="Only incidents up to TIME."),
        ]

    def deco(fn):
        for o in reversed(opts):
            fn = o(fn)
        return fn
    return deco


def filter_from(kw: dict, *, services=None, pod_resolver=None, clock=None) -> Filter:
    """Pop the filter options out of a command's keyword arguments and build the Filter."""
    return build(kw.pop("f_service", None), kw.pop("f_pods", ()), kw.pop("f_causes", ()),
                 kw.pop("f_node", None), kw.pop("f_since", None), kw.pop("f_until", None),
                 now_ns=time.time_ns(), services=services, pod_resolver=pod_resolver,
                 clock=clock)


class OnlyMatching:
    """A Replay whose items() yields only what the filter matches (report, replay)."""

    def __init__(self, replay, flt: Filter):
        self._r, self._flt = replay, flt

    def items(self):
        flt = self._flt
        for it in self._r.items():
            if not flt or flt.matches(it.verdict, it.epoch_ns, it.node, it.header.get("services", [])):
                yield it

    def __getattr__(self, name):
        return getattr(self._r, name)


def live_filter(kw: dict, cfg):
    """`run`'s Filter: Services from the rules of the host namespace and of the --iface
    namespaces (re-read every 10 s), pods from crictl. None: --node names another node."""
    import socket

    from nptrace.node import pods

    def services():
        from nptrace.node.rules_source import load_service_map
        from nptrace.services import merge
        maps = []
        for ns in [None, *sorted({i.netns for i in cfg.ifaces if i.netns})]:
            try:
                maps.append(load_service_map(ns))
            except Exception:   # unreadable rules: the classifier's Service names still match
                pass
        return merge(*maps) if maps else None
    flt = filter_from(kw, services=services, pod_resolver=pods.resolve, clock=time.monotonic_ns)
    if flt.node is not None and flt.node != socket.gethostname():
        click.echo(f"nptrace: this node is {socket.gethostname()}, not {flt.node}: nothing to trace",
                   err=True)
        return None
    return flt


from nptrace.classify.filters import FilteredSink, StopAfter  # noqa: E402  (re-exported for cli.py)
