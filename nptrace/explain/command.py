"""`nptrace explain`: the click command. Bad input is one line and exit 2 (errors.py)."""
from __future__ import annotations

import json
import time

import click

from nptrace.config import parse_address, parse_endpoint
from nptrace.errors import one_line_errors
from nptrace.flagtypes import Seconds
from nptrace.services.model import fmt_ep

from .gather import ExplainError


def resolve_service(smap, spec: str) -> tuple[str, int, str]:
    """`NS/NAME[:PORT]` -> (service port name, NodePort, ...) through the Service map."""
    base, _, pname = spec.partition(":")
    if base.count("/") != 1 or not all(base.split("/")):
        raise ExplainError(f"bad --service {spec!r}: want NAMESPACE/NAME[:PORT]")
    names = [n for n in smap.names if n == base or n.startswith(base + ":")]
    if pname:
        names = [n for n in names if n == f"{base}:{pname}" or
                 (smap.service(n) and str(smap.service(n).node_port) == pname)]
    if not names:
        known = ", ".join(smap.names[:8]) or "none"
        raise ExplainError(f"unknown Service {spec!r} in this namespace's rules (known: {known})")
    for n in names:
        s = smap.service(n)
        if s is not None and s.node_port:
            return n, s.node_port, "nodeport"
    raise ExplainError(f"Service {spec!r} has no NodePort here: give --to ADDR:PORT")


def render_text(pred, facts, observed=None) -> str:
    lines = [f"explain {facts.client} > {fmt_ep(facts.dst, facts.port)}"
             + (f" (netns {facts.netns})" if facts.netns else "")]
    for s in pred.steps:
        mark = f"  [{s.cause}]" if s.cause else ""
        lines.append(f"  {s.stage:<9} {s.text}{mark}")
    lines.append(pred.summary)
    if observed is not None:
        got = ", ".join(f"{c} x{n}" for c, n in sorted(observed["causes"].items())) \
            or "no incident"
        same = observed["cause"] == pred.cause
        lines.append(f"observed in {observed['seconds']:g} s: {got} "
                     f"({'as predicted' if same else 'differs from the prediction'})")
        if observed.get("hint"):
            lines.append(f"  hint: {observed['hint']}")
    return "\n".join(lines)


@click.command("explain")
@click.option("--from", "client", required=True, metavar="ADDR", help="The client's address.")
@click.option("--to", "to", metavar="ADDR:PORT", help="What the client connects to (NodePort, "
              "ClusterIP, external or LB IP).")
@click.option("--service", metavar="NS/NAME[:PORT]", help="Instead of --to: the Service's "
              "NodePort on the node address the client reaches.")
@click.option("-i", "--iface", metavar="IFNAME", help="The interface the SYN arrives on "
              "(default: the one holding the address, else the route toward the client).")
@click.option("--netns", metavar="NAME", help="The node's network namespace (ip netns name).")
@click.option("--probe/--no-probe", default=True, show_default=True,
              help="Connect once from the node to each endpoint (sends a HEAD request).")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
              show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Alias of -o json.")
@click.option("--ready-file", hidden=True, help="With --confirm: written once attached.")
@click.option("--confirm", type=Seconds(above=0), metavar="SECONDS",
              help="Then trace the client's connections for SECONDS and print the observed "
                   "cause beside the prediction (loads BPF).")
@one_line_errors
def explain_command(client, to, service, iface, netns, probe, output, as_json, ready_file, confirm):
    """Predict what happens to a client's SYN and its reply on this node, and the cause
    nptrace would label.

    \b
    Examples:
      nptrace explain --from 198.51.100.7 --to 10.0.0.5:30080
      nptrace explain --from 192.168.10.100 --service default/web --netns npt-node1
      nptrace explain --from 192.168.10.100 --to 192.168.10.11:30080 --confirm 10
    """
    from . import gather as g
    from .predict import predict, service_map
    from .facts import Facts

    c = parse_address(client, "--from")
    if bool(to) == bool(service):
        raise ExplainError("give exactly one of --to ADDR:PORT and --service NS/NAME")
    g.check_netns(netns)
    if service:
        smap = service_map(Facts(c, "", 0, rules=g.rules(netns)))
        _, port, _ = resolve_service(smap, service)
        addrs = g.addresses(netns)
        dev = iface or g.route_get(netns, c).dev
        dst = next((a for a in addrs.get(dev, []) if (":" in a) == (":" in c)), None)
        if dst is None:
            raise ExplainError(f"no address on {dev} to reach the NodePort at: give --to")
    else:
        dst, port = parse_endpoint(to, "--to")
    t0 = time.monotonic()
    facts = g.gather(c, dst, port, netns=netns, iif=iface, do_probe=probe)
    pred = predict(facts)
    observed = None
    if confirm:
        from .confirm import observe
        observed = observe(facts, confirm, ready_file)
        # predicted again with the counters' increase over the trace too: bad checksums from
        # another host move only while packets flow
        facts.moved = g.moved(facts.counters, g.counters(netns), time.monotonic() - t0)
        pred = predict(facts)
    if as_json or output == "json":
        d = {"prediction": pred.to_dict(), "facts": facts.to_dict()}
        if observed is not None:
            d["observed"] = observed
        click.echo(json.dumps(d, sort_keys=True))
    else:
        click.echo(render_text(pred, facts, observed))
