"""``nptrace lab``: bring NodePort failure scenarios up in network namespaces and trigger them."""
from __future__ import annotations

import collections
import json

import click

from . import runner
from nptrace.errors import one_line_errors

from .errors import LabError, UsageError
from .model import BACKENDS, load_scenarios
from .slots import SLOTS

EPILOG = """\b
Examples:
  nptrace lab list
  sudo nptrace lab up no-listener
  sudo nptrace lab up etp-local-no-endpoint --backend nft
  sudo nptrace lab up ipvs-no-endpoints          # kube-proxy's IPVS mode (needs ip_vs)
  sudo nptrace lab up no-listener --real --backend nft   # a real control plane and kube-proxy
  sudo nptrace lab trigger no-listener --count 100 --json
  sudo nptrace lab down no-listener
  sudo nptrace lab down --all          # after a crash: every lab namespace of the prefix
  sudo nptrace lab down --all --every-prefix   # ... and of every other prefix on the node
The namespace prefix is $NPT_LAB_PREFIX (default npt-)."""


def _call(fn, *args, **kwargs):
    # a scenario that does not exist is bad input (exit 2); a lab operation that failed, exit 1
    return one_line_errors(fn, usage=(UsageError,), failures=(LabError,))(*args, **kwargs)


@click.group(epilog=EPILOG)
@click.option("--prefix", envvar="NPT_LAB_PREFIX", default=None,
              help="Namespace name prefix (default npt-; must start with npt-).")
@click.pass_context
def lab(ctx, prefix):
    """Repro lab: real NodePort resets and drops in network namespaces."""
    ctx.obj = {"prefix": prefix}


@lab.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per scenario.")
def list_(as_json):
    """Each scenario with its one-line story and the cause nptrace must name."""
    for s in load_scenarios():
        if as_json:
            click.echo(json.dumps({"name": s.name, "story": s.story, "cause": s.cause, "service": s.service,
                                   "backends": list(s.backends), "variants": list(s.variants),
                                   "expect": list(s.expect)}))
            continue
        cause = s.cause or "none (healthy)"
        variants = f"  variants: {', '.join(s.variants)}" if s.variants else ""
        click.echo(f"{s.name:24} cause={cause:18} client sees: {'/'.join(s.expect)}{variants}")
        click.echo(f"{'':24} {s.story}")


@lab.command()
@click.argument("name")
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="kube-proxy mode: iptables (iptables-nft), iptables-legacy, nft or ipvs "
                   "[default: the scenario's first, iptables but for the ipvs-* scenarios].")
@click.option("--variant", default=None, help="A variant of the scenario (see `lab list`).")
@click.option("--slot", type=click.IntRange(0, SLOTS - 1), default=0, show_default=True,
              help="Move the lab's addresses by this much (slot 1: 10.244.0.10 -> 10.245.0.10, "
                   "192.168.10.11 -> 192.168.11.11, fd00:: -> fd01::), so that labs up at once "
                   "under other prefixes stay apart for one tracer.")
@click.option("--real", is_flag=True,
              help="The real tier: a real control plane (etcd, kube-apiserver, "
                   "kube-controller-manager) and one real kube-proxy per node write the rules "
                   "(`make k8s` builds them); backends iptables, nft and ipvs.")
@click.option("--release", default=None, metavar="NAME",
              help="With --real: the Kubernetes release (k8s/releases: current, older) [default: current].")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def up(obj, name, backend, variant, slot, real, release, as_json):
    """Build the scenario's namespaces, links, rules and servers."""
    if release and not real:
        raise click.UsageError("--release goes with --real")
    info = _call(runner.up, name, backend=backend, prefix=obj["prefix"], variant=variant, slot=slot,
                 real=real, release=release)
    if as_json:
        click.echo(json.dumps(info.as_dict(), indent=1))
        return
    title = info.scenario + (f" (variant {info.variant})" if info.variant else "")
    click.echo(f"{title} is up, kube-proxy backend {info.backend}, prefix {info.prefix}")
    click.echo(f"  story: {info.story}")
    click.echo(f"  expected cause: {info.cause or 'none'}   service: {info.service}")
    if info.notes:
        click.echo(f"  notes: {info.notes}")
    click.echo("  watch (NETNS/IFNAME): " + " ".join(info.watch))
    if info.env:   # the real tier: a tracer reads its API with the shipped ServiceAccount
        click.echo("  a tracer's API access (nptrace run reads these): "
                   + " ".join(f"{k}={v}" for k, v in info.env.items()))
    click.echo("enter:")
    for e in info.enter:
        click.echo(f"  {e}")
    click.echo("try:")
    for t in info.try_:
        click.echo(f"  {t}")


@lab.command()
@click.argument("name")
@click.option("--count", default=50, show_default=True, type=click.IntRange(1, 2000),
              help="Connections to make at once.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per attempt.")
@click.pass_obj
def trigger(obj, name, count, as_json):
    """Make COUNT real client connections at once and report what each saw."""
    attempts = _call(runner.trigger, name, count=count, prefix=obj["prefix"])
    if as_json:
        for a in attempts:
            click.echo(json.dumps(a.as_dict()))
        return
    by = collections.Counter((a.dst, a.dport, a.outcome, a.error) for a in attempts)
    for (dst, dport, outcome, error), n in sorted(by.items()):
        click.echo(f"{n:5}  {dst}:{dport}  {outcome:11} {error}")
    good = sum(a.expected for a in attempts)
    click.echo(f"{good}/{len(attempts)} attempts showed the expected symptom")
    lb = _call(runner.lb_view, name, prefix=obj["prefix"])
    for v in lb:
        click.echo(f"health check {v['dst']}:{v['port']} -> HTTP {v['status']} (expect {v['expect']}) "
                   f"{' '.join(v['body'].split())}")


@lab.command()
@click.argument("name", required=False)
@click.option("--all", "all_", is_flag=True, help="Remove every lab namespace of the prefix, up or not.")
@click.option("--every-prefix", is_flag=True,
              help="With --all: the labs of every prefix found on the node (other users' too).")
@click.pass_obj
def down(obj, name, all_, every_prefix):
    """Kill the scenario's servers and delete its namespaces."""
    if every_prefix and not all_:
        raise click.UsageError("--every-prefix goes with --all")
    if every_prefix:
        got = _call(runner.down_every_prefix)
        n = sum(len(v) for v in got.values())
        click.echo(f"removed {n} namespace(s) of {len(got)} prefix(es)"
                   + "".join(f"\n  {p}: {' '.join(v) or '-'}" for p, v in got.items()))
        return
    if all_:
        removed = _call(runner.down_all, prefix=obj["prefix"])
        click.echo(f"removed {len(removed)} namespace(s)" + (f": {' '.join(removed)}" if removed else ""))
        return
    if not name:
        raise click.UsageError("give a scenario NAME or --all")
    _call(runner.down, name, prefix=obj["prefix"])
    click.echo(f"{name} is down")


@lab.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def status(obj, as_json):
    """Which scenario is up under the prefix, and whether its namespaces and servers live."""
    st = _call(runner.status, prefix=obj["prefix"])
    if as_json:
        click.echo(json.dumps(st))
        return
    if st is None:
        click.echo("nothing is up")
        return
    variant = f" variant {st['variant']}" if st.get("variant") else ""
    variant += f" slot {st['slot']}" if st.get("slot") else ""
    click.echo(f"{st['scenario']}{variant} is up (backend {st['backend']}, prefix {st['prefix']}): "
               f"{len(st['namespaces'])} namespaces, {st['servers_alive']}/{len(st['pids'])} servers alive")
    if st["missing"]:
        click.echo(f"missing namespaces: {' '.join(st['missing'])}")


def _register_vm_commands():
    """Real-VM commands (Vagrant lab): apply a scenario role to this host, trigger from it."""
    from .vm import apply_role_command, nics_command, vm_trigger_command
    lab.add_command(apply_role_command)
    lab.add_command(vm_trigger_command)
    lab.add_command(nics_command)


_register_vm_commands()
