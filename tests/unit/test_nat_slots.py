"""natpeers.nat_key / nat_set mirror bpf/nptrace_events.h's npt_nat_key and bpf/npt_common.h's
npt_nat_set; that the two hashes agree is checked end to end by
tests/privileged/test_nat_tuples.py (user space finds the slot the kernel wrote)."""
import socket

from nptrace.kernel import natpeers


def test_key_layout_is_the_c_struct():
    k = natpeers.nat_key("10.0.0.1", 40000, "10.0.0.2", 30080)
    assert len(k) == 36 == natpeers.NAT_KEY.size    # u8 src[16], dst[16]; u16 sport, dport
    assert k[:4] == bytes([10, 0, 0, 1]) and k[16:20] == bytes([10, 0, 0, 2])
    assert k[32:] == (40000).to_bytes(2, "little") + (30080).to_bytes(2, "little")


A = bytes([10, 0, 0, 1]) + bytes(12)


def test_set_in_range():
    for port in range(1000, 1200):
        assert 0 <= natpeers.nat_set(A, port, 65536) < 65536


def test_sets_spread():
    sets = {natpeers.nat_set(A, p, 512) for p in range(1024, 3072)}
    assert len(sets) > 400      # 512 sets; a broken hash lands in a handful


def _mem_with(size, orig, reply, ends, way=1):
    """Sets as nf_hook.bpf.c writes them: the pair (orig, reply) in a way of the set of each
    end (way[w].key = orig, way[w].nat = 1, nat[w].peer = reply)."""
    mem = bytearray(size * natpeers.CONN_SET)
    for addr, port in ends:
        o = natpeers.nat_set(socket.inet_pton(socket.AF_INET, addr) + bytes(12), port, size) * natpeers.CONN_SET
        w = o + 64 * way
        mem[w:w + 36] = natpeers.nat_key(*orig)
        mem[w + 61] = 1                                 # nat: the pair is there
        mem[o + 128 + 64 * way:o + 164 + 64 * way] = natpeers.nat_key(*reply)
    return bytes(mem)


def test_find_by_either_tuple_without_snat():
    orig = ("10.0.0.1", 40000, "10.0.0.2", 30080)      # client -> NodePort
    reply = ("10.1.0.5", 8080, "10.0.0.1", 40000)      # pod -> client: same client end
    mem = _mem_with(1024, orig, reply, [("10.0.0.1", 40000)])
    assert natpeers.find(mem, 1024, *orig) == reply
    assert natpeers.find(mem, 1024, *reply) == orig
    assert natpeers.find(mem, 1024, "10.0.0.1", 40001, "10.0.0.2", 30080) is None


def test_find_by_either_tuple_with_snat():
    orig = ("10.0.0.1", 40000, "10.0.0.2", 30080)
    reply = ("10.1.0.5", 8080, "10.1.0.1", 61000)      # masqueraded: the node's end
    mem = _mem_with(1024, orig, reply, [("10.0.0.1", 40000), ("10.1.0.1", 61000)])
    assert natpeers.find(mem, 1024, *orig) == reply
    assert natpeers.find(mem, 1024, *reply) == orig



def test_either_way_and_only_ways_with_nat():
    orig = ("10.0.0.1", 40000, "10.0.0.2", 30080)
    reply = ("10.1.0.5", 8080, "10.0.0.1", 40000)
    mem = bytearray(_mem_with(1024, orig, reply, [("10.0.0.1", 40000)], way=0))
    assert natpeers.find(mem, 1024, *reply) == orig
    o = natpeers.nat_set(socket.inet_pton(socket.AF_INET, "10.0.0.1") + bytes(12), 40000, 1024)
    mem[o * natpeers.CONN_SET + 61] = 0      # tc's slot of the SYN alone: no NAT pair
    assert natpeers.find(bytes(mem), 1024, *orig) is None
