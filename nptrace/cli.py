"""Command line. Thin: parse, build a Config, hand over. Typed errors become one line on stderr
and exit code 2 here, in one place, so an expected failure never prints a traceback."""
from __future__ import annotations

import dataclasses
import importlib
import sys

import click

from nptrace import __version__
from nptrace.config import (MAX_RATE, MAX_RING_PAGES, SNAP_HEADERS, Config, ConfigError, IfaceSpec,
                            PortRange, parse_hosts)
from nptrace.errors import EXIT_USAGE, error_line, one_line_errors
from nptrace.flagtypes import Int, MetricsAddr, RingPages, Seconds, Snaplen
from nptrace.sessions.filteropts import FilteredSink, StopAfter, filter_options, live_filter

class LazyGroup(click.Group):
    """Subcommands owned by their own modules, imported only when one of them runs or help
    lists them: `nptrace run` does not pay for the lab, doctor, explain and session readers.
    The optional ones are missing where their module's own needs are (a stripped image)."""

    LAZY = {"doctor": ("nptrace.doctor", "doctor_command", True),
            "lab": ("nptrace.lab.cli", "lab", True),
            "explain": ("nptrace.explain.command", "explain_command", False),
            "replay": ("nptrace.sessions.commands", "replay_command", False),
            "report": ("nptrace.sessions.commands", "report_command", False),
            "merge": ("nptrace.sessions.commands", "merge_command", False)}

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.LAZY))

    def get_command(self, ctx, name):
        if name in self.LAZY and name not in self.commands:
            module, attr, optional = self.LAZY[name]
            try:
                self.add_command(getattr(importlib.import_module(module), attr), name)
            except ImportError:
                if not optional:
                    raise
                return None
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"],
                               "auto_envvar_prefix": "NPTRACE"})
@click.version_option(__version__, prog_name="nptrace")
def main_group():
    """Name the cause of TCP resets and drops on Kubernetes NodePort / LoadBalancer traffic.

    \b
    Examples:
      nptrace doctor                        what this kernel and node offer
      nptrace run                           trace every namespace, readable lines
      nptrace run --json --duration 30      JSON lines for 30 s
      nptrace run --iface eth0 --iface npt-node1/eth1 --port 30000-32767
      nptrace lab list                      the built-in repro scenarios
    """


def _run_options(fn):
    opts = [
        click.option("--json", "as_json", is_flag=True, help="Alias of -o json."),
        click.option("-o", "--output", "output", type=click.Choice(["text", "json", "table"]),
                     default=None, help="text: readable lines; json: one JSON object per "
                     "incident per line on stdout (status goes to stderr); table: one "
                     "fixed-width row per incident under a header (TIME CAUSE WHAT IFACE "
                     "SERVICE N FLOW), as it happens."),
        click.option("--local", is_flag=True,
                     help="Console times in local time with its UTC offset (default: UTC, "
                          "RFC 3339 with milliseconds; JSON `ts` is epoch seconds either way)."),
        click.option("-n", "no_names", is_flag=True,
                     help="No names the node resolved on the printed lines: addresses and "
                          "ifindexes, no Service, pod or interface names (causes are still "
                          "decided with them; metrics, -w and --record keep them)."),
        click.option("-c", "--count", "count", type=Int(1), default=None,
                     metavar="N", help="Exit after N incidents (after the filters)."),
        click.option("--duration", type=Seconds(above=0), metavar="SECONDS",
                     help="Stop by itself after SECONDS."),
        click.option("-i", "--iface", "ifaces", multiple=True, metavar="[NETNS/]IFNAME",
                     help="Watch this interface's packets with tc (repeatable), instead of "
                          "the devices chosen automatically (those holding the node's addresses "
                          "and default routes, VXLAN/Geneve overlays, bridges; pods' veths "
                          "only when named). `--iface none`: no tc programs."),
        click.option("--port", "ports", multiple=True, metavar="N[-M]",
                     help="Only flows with this port on either side (repeatable; default all)."),
        click.option("--host", "hosts", multiple=True, metavar="CIDR",
                     help="Only flows with an address in CIDR on either side (repeatable)."),
        click.option("--ring-pages", type=RingPages(), default=1024, show_default=True,
                     help=f"Ring buffer size in 4 KiB pages (a power of two, at most "
                          f"{MAX_RING_PAGES})."),
        click.option("--max-rate", type=Int(0, MAX_RATE), default=100, show_default=True,
                     metavar="N", help="Storm protection: per kind of record (type, hook, "
                     "reason, interface, namespace), send user space about N records a second "
                     "for the node (shared by its CPUs) after a burst of --max-burst (0 = send "
                     "all). Counts stay exact; records beyond it are reported as sampled, not "
                     "lost. A connection's records are sent all or none (its first decides)."),
        click.option("--max-burst", type=Int(1, 1000000), default=400,
                     show_default=True, metavar="N",
                     help="Records of one kind the node sends at once before --max-rate "
                     "applies (shared by its CPUs)."),
        click.option("--collapse", type=Int(0), default=None, metavar="N",
                     help="Print at most N alike incidents (same cause, Service, server end, "
                     "hook) per second; the rest become one line with `repeat` = how many. "
                     "0 prints every incident. Default: 20 on the console, 0 with --json. "
                     "Metrics and session files always see every incident."),
        click.option("--nft-trace/--no-nft-trace", default=True, show_default=True,
                     help="Name the rule behind a netfilter drop with nf_tables tracing: on a "
                     "namespace's first drop, add table inet nptrace_trace there and trace the "
                     "dropped destinations' next packets (at most 50/s; removed at exit)."),
        click.option("--tc-mode", type=click.Choice(["auto", "tcx", "clsact"]), default="auto",
                     show_default=True,
                     help="How the --iface programs attach: tcx links (Linux 6.6+; unlinked by "
                     "the kernel if nptrace dies), clsact + bpf filters, or auto: tcx where the "
                     "kernel has it."),
        click.option("--ready-file", hidden=True,
                     help="Write this file once every probe is attached."),
        click.option("--record", "record_dir", metavar="DIR",
                     help="Record raw kernel events to msgpack session files in DIR (0600) for "
                          "`nptrace replay` / `report` / `merge`."),
        click.option("--record-max-file-mb", type=Int(1), default=64, show_default=True,
                     help="Start a new session file past this size."),
        click.option("--record-max-age", type=Int(1), default=3600, show_default=True,
                     metavar="SECONDS", help="Start a new session file past this age."),
        click.option("--record-max-total-mb", type=Int(1), default=1024,
                     show_default=True, help="Delete the oldest session files past this total."),
        click.option("--metrics-addr", type=MetricsAddr(), metavar="[HOST:]PORT",
                     help="Serve Prometheus metrics; a bare PORT binds 127.0.0.1 (binding "
                          "elsewhere must be explicit)."),
        click.option("--metrics-tls-cert", metavar="FILE",
                     help="Serve --metrics-addr over TLS with this PEM certificate (chain); "
                          "read again when it changes."),
        click.option("--metrics-tls-key", metavar="FILE",
                     help="The private key of --metrics-tls-cert (PEM)."),
        click.option("--metrics-client-ca", metavar="FILE",
                     help="With --metrics-tls-*: only clients with a certificate this CA (PEM) "
                          "signed may connect; use a CA of nptrace's own, not the cluster's."),
        click.option("--health-addr", type=MetricsAddr(), metavar="[HOST:]PORT",
                     help="Also serve /healthz, /readyz and /livez, and nothing else, as plain "
                          "HTTP here (the kubelet's probes when --metrics-addr is TLS); a bare "
                          "PORT binds 127.0.0.1."),
        click.option("--metrics-final-scrape", type=Seconds(least=0), default=0,
                     metavar="SECONDS",
                     help="At stop, keep serving the final counts until one more scrape, at "
                          "most SECONDS (e.g. the scrape interval): the last incidents reach "
                          "Prometheus too. 0: stop at once."),
        click.option("--node-name", metavar="NAME",
                     help="The node's name on every output (JSON lines, session header, pcapng, "
                          "nptrace_build_info); default $NODE_NAME (the DaemonSet's downward "
                          "API), else the host name."),
        click.option("-w", "--pcap", "--output-pcap", "pcap", metavar="FILE",
                     help="Write the packets behind labeled events as pcapng (0600): the bytes "
                          "the kernel had at the hook (see --snaplen), with cause, Service and "
                          "hint as packet comments."),
        click.option("--snaplen", type=Snaplen(), default="headers", show_default=True,
                     metavar="headers|BYTES",
                     help="With -w or --record: what of each packet the files keep. headers: "
                     "its Ethernet, IP and TCP/UDP/ICMP headers, no payload; BYTES (1-9216): "
                     "the first BYTES, payload included. The session files keep them for "
                     "`replay -w`."),
        click.option("-C", "pcap_mb", type=Int(1), default=None, metavar="MB",
                     help="With -w: start a new file past MB megabytes (FILE1, FILE2, ...; as "
                          "tcpdump -C)."),
        click.option("-W", "pcap_files", type=Int(1), default=None, metavar="N",
                     help="With -C: keep N files, FILE0..FILE<N-1> reused in turn (tcpdump -W)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    for p in fn.__click_params__:     # every option also NPTRACE_RUN_<NAME>; --help says so
        p.show_envvar = True
    return fn


def pcap_snaplen(pcap, snaplen, pcap_mb, pcap_files, record=None) -> int:
    """The kernel's packet copy size: --snaplen with -w or --record (the session keeps the
    bytes for `replay -w`; `headers`: HEADERS_SNAPLEN, cut per packet by sinks/snap.py), else
    0 (no copies compiled in)."""
    from nptrace.config import HEADERS_SNAPLEN, SNAP_HEADERS, check_snaplen
    snaplen = HEADERS_SNAPLEN if snaplen == SNAP_HEADERS else check_snaplen(snaplen)
    if not pcap and (pcap_mb or pcap_files):
        raise ConfigError("-C and -W rotate the -w FILE: give -w too")
    if pcap_files and not pcap_mb:
        raise ConfigError("-W N needs -C MB (as tcpdump: it bounds the rotated files)")
    return snaplen if pcap or record else 0


def run_config(ifaces, ports, hosts, ring_pages, max_rate, max_burst, nft_trace, tc_mode, pcap,
               snaplen, pcap_mb, pcap_files, record=None) -> Config:
    """`run`'s Config from its options (dump-bpf builds the same one)."""
    n = pcap_snaplen(pcap, snaplen, pcap_mb, pcap_files, record)
    return dataclasses.replace(build_config(ifaces, ports, hosts, ring_pages), max_rate=max_rate,
                               max_burst=max_burst, nft_trace=nft_trace, tc_mode=tc_mode,
                               snaplen=n, snap_headers=bool(n) and snaplen == SNAP_HEADERS)


def build_config(ifaces, ports, hosts, ring_pages) -> Config:
    """No --iface: the node's devices, chosen by nptrace (node/ifchoice.py); `--iface none`:
    no tc programs at all."""
    if "none" in ifaces and len(ifaces) > 1:
        raise ConfigError("--iface none attaches to no interface: give it alone")
    return Config(ifaces=tuple(IfaceSpec.parse(i) for i in ifaces if i != "none"),
                  iface_auto=not ifaces,
                  ports=tuple(PortRange.parse(p) for p in ports),
                  hosts=parse_hosts(hosts), ringbuf_pages=ring_pages)


@main_group.command()
@_run_options
@filter_options(offline=False)
@one_line_errors
def run(as_json, output, local, no_names, count, duration, ifaces, ports, hosts, ring_pages, max_rate, max_burst, collapse,
        nft_trace, tc_mode, ready_file, record_dir, record_max_file_mb, record_max_age, record_max_total_mb, metrics_addr, pcap,
        metrics_final_scrape, node_name, snaplen, pcap_mb, pcap_files, metrics_tls_cert, metrics_tls_key,
        metrics_client_ca, health_addr, **filters):
    """Trace resets and drops and print each with its cause.

    \b
    Examples:
      nptrace run --json --duration 10 | jq .cause
      nptrace run --iface npt-node1/eth0 --port 30080
    """
    from nptrace.sinks.console import Console, LiveTable
    from nptrace.sinks.jsonl import JsonLines
    from nptrace.daemon.tracer import Outputs, Tracer, log

    cfg = run_config(ifaces, ports, hosts, ring_pages, max_rate, max_burst, nft_trace, tc_mode,
                     pcap, snaplen, pcap_mb, pcap_files, record_dir)
    from nptrace.sinks.tls import tls_files
    tls = tls_files(metrics_tls_cert, metrics_tls_key, metrics_client_ca, metrics_addr)
    from nptrace.node.identity import node_name as _node_name
    node, _how = _node_name(node_name)    # said in the tracer's "attached" line
    outputs = Outputs(record_dir=record_dir, record_max_file_bytes=record_max_file_mb << 20,
                      record_max_age_s=float(record_max_age),
                      record_max_total_bytes=record_max_total_mb << 20,
                      metrics_addr=metrics_addr, metrics_tls=tls, health_addr=health_addr,
                      metrics_final_scrape_s=metrics_final_scrape,
                      pcap=pcap, pcap_max_file_bytes=(pcap_mb or 0) * 1_000_000, pcap_max_files=pcap_files or 0,
                      node=node)
    from nptrace.sinks.fmt import output_mode
    mode = output_mode(output, as_json)
    as_json = mode == "json"
    flt = live_filter(filters, cfg)
    if flt is None:
        return
    if flt.kernel_ends():     # --service in the kernel too: other flows' records are not sent
        cfg = dataclasses.replace(cfg, service_gate=True)
    tracer = Tracer(cfg, [], ready_file=ready_file, outputs=outputs)
    tracer.service_gate = flt.kernel_ends
    from nptrace.sinks.collapse import storm_collapse
    storm = storm_collapse(collapse, as_json)
    sink = JsonLines(tracer.epoch_offset_ns, collapse=storm, node=node) if as_json \
        else (LiveTable if mode == "table" else Console)(tracer.epoch_offset_ns,
                                                         collapse=storm, local=local)
    from nptrace.sinks.fmt import Unnamed
    tracer.sinks.append(Unnamed(sink) if no_names else sink)
    try:
        tracer.start()
        if flt:   # printed lines and the pcap; metrics keep every incident
            tracer.sinks[:] = [s if s is tracer.metrics else FilteredSink(s, flt) for s in tracer.sinks]
        if count:
            stop = StopAfter(count, tracer)
            tracer.sinks.append(FilteredSink(stop, flt) if flt else stop)
        tracer.run(duration)
    finally:
        tracer.stop()
    if not as_json:
        log("summary:\n" + sink.summary())


@main_group.command("dump-bpf")
@_run_options
@filter_options(offline=False)
@one_line_errors
def dump_bpf(as_json, output, local, no_names, count, duration, ifaces, ports, hosts, ring_pages, max_rate,
             max_burst, collapse, nft_trace, tc_mode, ready_file, record_dir, record_max_file_mb,
             record_max_age, record_max_total_mb, metrics_addr, pcap, snaplen, pcap_mb,
             pcap_files, metrics_tls_cert, metrics_tls_key, metrics_client_ca, health_addr,
             **filters):
    """Print the BPF source and cflags `run` would compile with the same options (no root
    needed: without root the tracepoints count as present, and where the kernel's BTF is not
    readable the -DNPT_OFF_* offsets are left out, said in the output)."""
    from nptrace import reasons
    from nptrace.kernel import attach, btf, features, loader
    from nptrace.daemon.tracer import WAKE_EVERY
    cfg = run_config(ifaces, ports, hosts, ring_pages, max_rate, max_burst, nft_trace, tc_mode,
                     pcap, snaplen, pcap_mb, pcap_files, record_dir)
    # as Tracer() sets it; --service: the gate run compiles in when the Service has addresses
    cfg = dataclasses.replace(cfg, wake_every=WAKE_EVERY,
                              service_gate=bool(filters.get("f_service")))
    # run's plan and cflags; without root tracefs is unreadable: every tracepoint counts as there
    plan = attach.plan(features.probe(mount_tracefs=False), cfg, assume_unknown=True)
    notes = []
    try:
        kbtf = btf.default()
    except (btf.BtfError, OSError) as e:
        kbtf = None
        notes.append(f"kernel BTF not readable ({e}): the -DNPT_OFF_* offsets and the "
                     "netfilter-hook switches `run` adds from it are left out")
    kflags = []
    if kbtf is not None:
        drops, rsts = reasons.load_tables(kbtf)
        kflags = attach.kernel_flags(plan, kbtf, drops, rsts,
                                     lambda msg: click.echo(f"nptrace: {msg}", err=True))
    flags = attach.all_cflags(plan, kflags)
    for n in notes:
        click.echo(f"nptrace: {n}", err=True)
    for line in plan.lines():
        click.echo(f"/* plan: {line} */")
    click.echo("/* cflags: " + " ".join(flags) + " */")
    click.echo(loader.source_text())


def main(argv=None):
    """Entry point. Every expected failure is one line on stderr: `nptrace: error: ...`."""
    try:
        rc = main_group.main(args=argv, prog_name="nptrace", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("nptrace: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        msg = e.format_message()
        if isinstance(e, click.UsageError) and e.ctx is not None:
            msg += f" (see: {e.ctx.command_path} --help)"
        click.echo(error_line(msg), err=True)
        sys.exit(e.exit_code if e.exit_code else EXIT_USAGE)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
