"""make vagrant-smoke's reading of what the VMs printed (nptrace/lab/vmsmoke.py): pure."""
from nptrace.lab import vmsmoke

APPLY = """==> node1: Running provisioner: lab (shell)...
    node1: Running: /tmp/vagrant-shell.sh
    node1: node1: rp-filter-asymmetric applied (profile netns, backend iptables): 41 commands, 1 server(s)
    node1:   NICs: eth0=eth1 eth1=eth2 ul0=eth3
    node1:   trace here: sudo nptrace run --iface eth1 --iface eth2 --iface eth3 --iface flannel.1 --iface cni0
==> node2: Running provisioner: lab (shell)...
    node2:   NICs: eth0=eth1 ul0=eth2
    node2:   trace here: sudo nptrace run --iface eth1 --iface eth2
"""


def test_the_traced_vms_nics_and_trace_command_are_read_from_its_own_lines():
    nics, watch = vmsmoke.parse_apply(APPLY, "node1")
    assert nics == {"eth0": "eth1", "eth1": "eth2", "ul0": "eth3"}
    assert watch == ["eth1", "eth2", "eth3", "flannel.1", "cni0"]


def _lines(*spec):
    return [{"kind": "rst", "cause": c, "iface": i} for c, i, n in spec for _ in range(n)] + \
        [{"kind": "loss", "loss": "ring_lost"}, {"kind": "rst", "cause": None}]


def test_a_scenario_passes_on_its_cause_and_the_interface_the_topology_gives():
    nics = {"eth0": "eth1", "eth1": "eth2", "ul0": "eth3"}
    s = vmsmoke.summarize(_lines(("no_listener", "eth3", 16), ("no_listener", "npt-web-0/eth0", 4),
                                 ("peer_reset", "eth3", 1)))
    assert s["incidents"] == 21 and s["losses"] == ["ring_lost"]
    assert vmsmoke.verdict("no-listener", "no_listener", s, nics) == (True, "no_listener", "eth3")
    rp = vmsmoke.summarize(_lines(("rp_filter", "eth3", 5)))     # lab eth1 is the VM's eth2
    assert vmsmoke.verdict("rp-filter-asymmetric", "rp_filter", rp, nics) == (False, "rp_filter", "eth3")
    assert vmsmoke.verdict("wrong-interface", "wrong_iface", vmsmoke.summarize([]), nics)[0] is False
    row = {"scenario": "no-listener", "expected": "no_listener", "labeled": "no_listener", "iface": "eth3",
           "incidents": 21, "client": "20/20", "to_ready": 40, "seconds": 60, "ok": True}
    assert "| no-listener | no_listener | no_listener | eth3 | 21 | 20/20 | 40 s | 60 s | ok |" in \
        vmsmoke.table([row], {"box": 150})
