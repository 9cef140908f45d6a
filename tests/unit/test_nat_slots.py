"""natpeers.nat_key / nat_set mirror bpf/nptrace_events.h's npt_nat_key and bpf/npt_common.h's
npt_nat_set; that the two hashes agree is checked end to end by
tests/privileged/test_nat_tuples.py (user space finds the slot the kernel wrote)."""
from nptrace.kernel import natpeers


def test_key_layout_is_the_c_struct():
    k = natpeers.nat_key("10.0.0.1", 40000, "10.0.0.2", 30080)
    assert len(k) == 36 == natpeers.NAT_KEY.size    # u8 src[16], dst[16]; u16 sport, dport
    assert k[:4] == bytes([10, 0, 0, 1]) and k[16:20] == bytes([10, 0, 0, 2])
    assert k[32:] == (40000).to_bytes(2, "little") + (30080).to_bytes(2, "little")


def test_set_is_the_first_way_and_in_range():
    for port in range(1000, 1200):
        i = natpeers.nat_set(natpeers.nat_key("10.0.0.1", port, "10.0.0.2", 30080), 131072)
        assert i % 2 == 0 and 0 <= i < 131072


def test_sets_spread():
    sets = {natpeers.nat_set(natpeers.nat_key("10.0.0.1", p, "10.0.0.2", 30080), 1024)
            for p in range(1024, 3072)}
    assert len(sets) > 400      # 512 sets; a broken hash lands in a handful

