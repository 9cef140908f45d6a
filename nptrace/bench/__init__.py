"""Benchmarks: what nptrace costs a node and how much it can take, beside what an SRE would
use instead (an empty tc program, no tracer, tcpdump, bcc's tools), measured side by side in
one run (`make bench`, `make bench-quick`).

Sections, one module each, in the order they run:
  tc_cost      ns per packet of each nptrace tc program beside an empty program (veth, VXLAN)
  auto_ifaces  no --iface on a node namespace with 200 pods: the interfaces chosen, start, CPU
               and RSS at rest, CPU of a pod churn and tc ns per packet, beside --iface none
               and the node's devices named with --iface
  throughput   bulk TCP (iperf3) with nptrace on both veth ends / without, alternated
  connrate     new connections/s through an iptables-DNAT'd NodePort, with / without
  reset_storm  SYNs to a closed port at full speed: nptrace, tcpdump, bcc trace, bcc tcpdrop
  pipeline     decoder and decode+classify+JSON throughput on synthetic records (no kernel)
  startup      time to probes attached, RSS after start and over a churn of distinct flows
  soak         10 min of 3000 new failing flows/s + a pod a second with --record and metrics:
               RSS within 10% after warm-up, fds flat

`nptrace run` is driven as a subprocess everywhere (a black box, as an SRE runs it); the
namespaces are `npt-bn<pid>-*` and are removed, with every process started, even on failure.
Each module imports without bcc and without root; only running a section needs root.
"""
