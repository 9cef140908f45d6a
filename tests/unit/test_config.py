import pytest

from nptrace.config import Config, ConfigError, IfaceSpec, PortRange, parse_hosts
from nptrace.kernel.cflags import build_cflags


def test_cflags_defaults_have_no_filters_and_no_tc():
    f = build_cflags(Config())
    assert "-DNPT_FILTER_PORTS=0" in f and "-DNPT_FILTER_HOSTS=0" in f
    assert "-DNPT_WITH_TC=0" in f and "-DNPT_RINGBUF_PAGES=1024" in f
    assert "-DNPT_TP_KFREE_SKB=1" in f


def test_cflags_gates_follow_config_and_kernel():
    cfg = Config(ifaces=(IfaceSpec.parse("ns/eth0"),), ports=(PortRange.parse("30000-32767"),),
                 hosts=parse_hosts(["10.0.0.0/8"]))
    f = build_cflags(cfg, available_tracepoints={"skb/kfree_skb"}, offset_flags=["-DX=1"])
    assert "-DNPT_FILTER_PORTS=1" in f and "-DNPT_FILTER_HOSTS=1" in f and "-DNPT_WITH_TC=1" in f
    assert "-DNPT_TP_KFREE_SKB=1" in f and "-DNPT_TP_ICMP_SEND=0" in f and f[-1] == "-DX=1"


def test_ring_pages_must_be_power_of_two():
    with pytest.raises(ConfigError, match="power of two"):
        build_cflags(Config(ringbuf_pages=3000))


@pytest.mark.parametrize("text,netns,name", [("eth0", None, "eth0"), ("npt-node1/eth1", "npt-node1", "eth1")])
def test_iface_spec(text, netns, name):
    s = IfaceSpec.parse(text)
    assert (s.netns, s.name) == (netns, name) and str(s) == text


@pytest.mark.parametrize("bad", ["", "ns/", "/eth0", "a" * 16])
def test_bad_iface_spec(bad):
    with pytest.raises(ConfigError):
        IfaceSpec.parse(bad)


@pytest.mark.parametrize("bad", ["0", "70000", "5-3", "x", "1-y"])
def test_bad_port(bad):
    with pytest.raises(ConfigError):
        PortRange.parse(bad)


def test_port_set():
    assert Config(ports=(PortRange.parse("3001-3003"), PortRange.parse("80"))).port_set() == {80, 3001, 3002, 3003}


def test_bad_host():
    with pytest.raises(ConfigError, match="--host"):
        parse_hosts(["10.0.0.0/33"])


def test_rate_budgets_are_for_the_node_and_split_among_cpus():
    # --max-rate / --max-burst are node-wide; the kernel's buckets are per CPU
    f = build_cflags(Config(max_rate=100, max_burst=200, cpus=2))
    assert "-DNPT_MAX_RATE=50" in f and "-DNPT_MAX_BURST=100" in f
    f = build_cflags(Config(max_rate=100, max_burst=200, cpus=64))
    assert "-DNPT_MAX_RATE=2" in f and "-DNPT_MAX_BURST=4" in f      # rounded up
    f = build_cflags(Config(max_rate=0, cpus=8))
    assert "-DNPT_MAX_RATE=0" in f                                    # 0: no limit at all
