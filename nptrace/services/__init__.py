"""Name the kube-proxy Service behind an address:port, and the netfilter rule that drops it.

Input is the node's own rule dump, never the Kubernetes API:
  * ``iptables-save`` / ``ip6tables-save`` (iptables-nft or legacy, ``-c`` too), ``iptables -S``,
    and the ``iptables-restore`` input kube-proxy builds (no built-in chains, no ``/32``,
    kube-proxy's match order, bare ``-j REJECT``): :func:`parse_iptables_save` (alias
    :func:`parse_iptables_restore`);
  * ``nft [-a] list ruleset`` text and the knftables ``add table/chain/set/map/rule/element``
    dump form (kube-proxy's nftables mode, alpha in v1.29): :func:`parse_nft`.

Pure text processing: no subprocess, no root, no bcc. ``nptrace/node/rules_source.py`` reads the
live dump of a network namespace. What kube-proxy writes, and what is read from it:
iptables.py and nft_kube_proxy.py.

Limits:
  * nft mode cannot tell an ExternalIP from a LoadBalancer IP (both ``goto external-…``). An
    address in ``firewall-ips`` is reported as ``loadbalancer``, any other as ``externalip``.
    iptables mode says which in its comments, except for a Service with no endpoints at all
    (then ``externalip``).
  * ``local_endpoints`` is known only for eTP/iTP=Local Services (eTP=Cluster chains do not say
    which endpoints are on this node). ``health_check_port`` exists only in iptables mode (nft
    mode writes no ACCEPT rule for it).
  * "Any local address" NodePorts (``--dst-type LOCAL``, ``fib daddr type local``) cannot be
    checked without the node's addresses: give them with :meth:`ServiceMap.with_local_addrs`,
    otherwise every address except a known ClusterIP counts as possibly local.
  * Rule matching (:meth:`ServiceMap.matching_drop_rules`) is best effort, not an iptables or nft
    evaluator: match.py says what it evaluates and what not. kube-proxy's DNAT before the
    filter rules (``dnat_of``, what ``verdict_rules(saddr=)`` and ``matching_drop_rules`` ask)
    is modelled for iptables dumps only (nat.py). :meth:`ServiceMap.trace` walks both:
    nat.py for iptables, nft_trace.py for kube-proxy's nft table (vmaps, ``numgen``).

Cost, measured on the 2-vCPU test VM with 10,000 Services in the fixture pattern: 0.5 s to parse
``iptables-save`` (120k lines) or the knftables dump, 0.65 s for ``nft -a list ruleset``
(176k lines); ``lookup`` under 1 us, ``matching_drop_rules`` about 70 us. Keeping the nat rules
for nat.py's walk (built on first use) costs the iptables parse about 0.08 s of that.

Modules, each importing (at run time) only those listed before it:
  model.py           Service, Rule, KINDS, REASONS; address, port and protocol helpers
  match.py           Flow and Match: the best-effort matcher of one rule (MapView: what it
                     asks of the map)
  facts.py           Info/Scope per service port; Entry/Chain/Table for the rule walk
  nat.py             the nat walk: where kube-proxy DNATs a packet before filter sees it
  servicemap.py      ServiceMap (lookup, verdict_rules, matching_drop_rules) and merge
  nfcause.py         nf_cause: the rule behind a netfilter drop and its cause tag (IPVS's
                     own drops through ipvs.py, listed last although nfcause uses it)
  build.py           Builder, which a parse fills and finish()es into a ServiceMap
  iptables.py        parse_iptables_save / parse_iptables_restore
  nft_rules.py       NftTable, set elements, one nft rule -> Match, generic tables
  nft_trace.py       the packet walk of kube-proxy's nft table, for ServiceMap.trace
  nft_kube_proxy.py  kube-proxy's own nft table
  nft.py             parse_nft
  ipvs.py            kube-proxy's IPVS mode: virtual/real servers, ipsets, names; IPVS's own
                     drops for nf_cause (imports build.py)
"""

from . import ipvs
from .iptables import parse_iptables_restore, parse_iptables_save
from .model import KINDS, REASONS, Rule, Service
from .nfcause import nf_cause
from .nft import parse_nft
from .servicemap import ServiceMap, merge

__all__ = [
    "KINDS",
    "REASONS",
    "Rule",
    "Service",
    "ServiceMap",
    "ipvs",
    "merge",
    "nf_cause",
    "parse_iptables_restore",
    "parse_iptables_save",
    "parse_nft",
]
