"""The compiled-object cache (kernel/objcache.py) and the snapshot it holds
(kernel/bpfobject.py): map references relinked by index, entries that are damaged, hostile,
foreign or for another key are misses with a reason, never an exception; writes are atomic
and pruned."""
import os
import random
import struct

import msgpack
import pytest

from nptrace.kernel import bpfobject as bo
from nptrace.kernel import objcache as oc


def ld_map(dst: int, fd: int) -> bytes:
    """A 16-byte BPF_LD_MAP_FD(dst, fd)."""
    return struct.pack("<BBhi", 0x18, dst | (bo.BPF_PSEUDO_MAP_FD << 4), 0, fd) + \
        struct.pack("<BBhi", 0, 0, 0, 0)


EXIT = struct.pack("<BBhi", 0x95, 0, 0, 0)
MOV64 = struct.pack("<BBhi", 0xB7, 0, 0, 7)
# a plain 64-bit immediate load (src_reg 0) whose value looks like a map index: left alone
LD_IMM = struct.pack("<BBhi", 0x18, 1, 0, 1) + struct.pack("<BBhi", 0, 0, 0, 0)


def snap(progs=None) -> bo.Snapshot:
    maps = (bo.MapSpec("events", 27, 0, 0, 1 << 22, 0, '"int"', '"int"'),
            bo.MapSpec("stats", 6, 4, 8, 7, 0, '"unsigned int"', '"unsigned long long"'))
    return bo.Snapshot(b"GPL", 396406, maps, progs if progs is not None else
                       {"tracepoint__tcp__tcp_send_reset": MOV64 + ld_map(1, 1) + LD_IMM
                        + ld_map(2, 0) + EXIT})


def test_relink_rewrites_map_references_only():
    code = MOV64 + ld_map(1, 40) + LD_IMM + ld_map(2, 41) + EXIT
    by_index = bo.relink(code, {40: 0, 41: 1})
    assert [imm for _, imm in bo.map_refs(by_index)] == [0, 1]
    back = bo.relink(by_index, [40, 41])
    assert back == code
    assert bo.relink(by_index, [7, 9])[8:16] == ld_map(1, 7)[:8]
    assert by_index[24:40] == LD_IMM        # not a map reference: untouched


def test_snapshot_round_trip_through_an_entry():
    s = snap()
    k = oc.key("src", ["-DA=1"], "0.26.0")
    assert oc.decode(oc.encode(k, s), k) == s


def test_key_covers_source_flags_bcc_and_order():
    base = oc.key("src", ["-DA=1", "-DB=2"], "0.26.0")
    assert base == oc.key("src", ["-DA=1", "-DB=2"], "0.26.0")
    for other in (oc.key("src ", ["-DA=1", "-DB=2"], "0.26.0"),
                  oc.key("src", ["-DA=1", "-DB=3"], "0.26.0"),
                  oc.key("src", ["-DB=2", "-DA=1"], "0.26.0"),
                  oc.key("src", ["-DA=1", "-DB=2"], "0.27.0"),
                  oc.key("src", ["-DA=1-DB=2"], "0.26.0")):
        assert other != base


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    return d


def test_save_then_load(folder):
    k = oc.key("src", [], "v")
    assert oc.save(folder, k, snap()) == ""
    got, why = oc.load(folder, k)
    assert why == "" and got == snap()
    assert oc.load(folder, oc.key("src2", [], "v")) == (None, "")   # a plain miss: no reason
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_entry_for_another_key_is_refused(folder):
    k, other = oc.key("a", [], "v"), oc.key("b", [], "v")
    (folder / (other + oc.SUFFIX)).write_bytes(oc.encode(k, snap()))
    os.chmod(folder / (other + oc.SUFFIX), 0o600)
    got, why = oc.load(folder, other)
    assert got is None and "another key" in why


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "magic", "huge"])
def test_damaged_entries_are_misses_with_a_reason(folder, damage):
    k = oc.key("src", [], "v")
    data = oc.encode(k, snap())
    bad = {"truncated": data[:len(data) // 2], "flipped": data[:-5] + b"\xff" + data[-4:],
           "empty": b"", "magic": b"X" + data[1:],
           "huge": data + b"\0" * (oc.MAX_BYTES + 1)}[damage]
    p = folder / (k + oc.SUFFIX)
    p.write_bytes(bad)
    os.chmod(p, 0o600)
    got, why = oc.load(folder, k)
    assert got is None and str(p) in why


def _signed(k: str, obj) -> bytes:
    """An entry whose digest is right and whose payload is whatever `obj` is: what a hostile
    writer with access to the folder could make."""
    import hashlib
    payload = msgpack.packb(obj, use_bin_type=True)
    return oc.MAGIC + hashlib.sha256(payload).digest() + payload


def _hostile(k: str):
    good = snap().to_data()
    yield {"key": k, "object": None}
    yield {"key": k, "object": []}
    yield {"key": k, "object": {**good, "maps": [["m", 1, 2]]}}
    yield {"key": k, "object": {**good, "maps": [["m", "1", 4, 4, 1, 0, "", ""]]}}
    yield {"key": k, "object": {**good, "maps": [["m", 1, 4, 4, 1 << 40, 0, "", ""]]}}
    yield {"key": k, "object": {**good, "maps": [["m", -1, 4, 4, 1, 0, "", ""]]}}
    yield {"key": k, "object": {**good, "license": "GPL"}}
    yield {"key": k, "object": {**good, "kern_version": 1 << 40}}
    yield {"key": k, "object": {**good, "progs": {"p": b"\0" * 7}}}
    yield {"key": k, "object": {**good, "progs": {"p": ld_map(0, 2) + EXIT}}}   # no map 2
    yield {"key": k, "object": {**good, "progs": {"p": ld_map(0, -1) + EXIT}}}
    yield {"key": k, "object": {**good, "progs": {1: EXIT}}}
    yield {"key": k, "object": {**good, "progs": [["p", EXIT, 3]]}}
    yield [k]
    yield "x" * 100


def test_hostile_payloads_with_a_right_digest_are_misses(folder):
    k = oc.key("src", [], "v")
    p = folder / (k + oc.SUFFIX)
    n = 0
    for obj in _hostile(k):
        p.write_bytes(_signed(k, obj))
        os.chmod(p, 0o600)
        got, why = oc.load(folder, k)
        assert got is None and why, obj
        n += 1
    # random bytes after a right digest: never an exception
    rnd = random.Random(7)
    for _ in range(300):
        payload = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 200)))
        import hashlib
        p.write_bytes(oc.MAGIC + hashlib.sha256(payload).digest() + payload)
        assert oc.load(folder, k)[0] is None
    assert n >= 15


def test_entries_others_could_have_written_are_not_used(folder):
    k = oc.key("src", [], "v")
    assert oc.save(folder, k, snap()) == ""
    p = folder / (k + oc.SUFFIX)
    os.chmod(p, 0o666)
    got, why = oc.load(folder, k)
    assert got is None and "writable by group or others" in why
    os.chmod(p, 0o600)
    os.chmod(folder, 0o777)
    got, why = oc.load(folder, k)
    assert got is None and str(folder) in why
    assert "writable" in oc.save(folder, k, snap())      # and nothing written there
    os.chmod(folder, 0o700)
    link = folder / (oc.key("other", [], "v") + oc.SUFFIX)
    link.symlink_to(p)
    got, why = oc.load(folder, oc.key("other", [], "v"))
    assert got is None and "cannot open" in why


def test_entries_of_another_user_are_not_used(folder):
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    k = oc.key("src", [], "v")
    oc.save(folder, k, snap())
    os.chown(folder / (k + oc.SUFFIX), 65534, 65534)
    got, why = oc.load(folder, k)
    assert got is None and "owned by uid 65534" in why


def test_unwritable_folder_is_a_reason_not_an_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    why = oc.save(f / "sub", "k", snap())          # a file where the folder should be
    assert why.startswith("cannot write to")


def test_prune_keeps_the_most_recently_used(folder):
    keys = [oc.key(str(i), [], "v") for i in range(6)]
    for i, k in enumerate(keys):
        oc.save(folder, k, snap())
        os.utime(folder / (k + oc.SUFFIX), (1000 + i, 1000 + i))
    oc.load(folder, keys[0])                        # used now: newest
    stale = folder / ".npt-x.bpfobj.tmp"
    stale.write_bytes(b"")
    os.utime(stale, (1, 1))
    oc.prune(folder, keep=3)
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted(k + oc.SUFFIX for k in (keys[0], keys[4], keys[5]))


def test_cache_dir_from_the_environment(monkeypatch):
    monkeypatch.delenv(oc.ENV, raising=False)
    assert str(oc.cache_dir()) == oc.DEFAULT_DIR
    for off in ("off", "", "0", "none"):
        monkeypatch.setenv(oc.ENV, off)
        assert oc.cache_dir() is None
    monkeypatch.setenv(oc.ENV, "/tmp/x")
    assert str(oc.cache_dir()) == "/tmp/x"


def test_an_edited_header_is_another_key(tmp_path):
    """The BPF source #includes bpf/*.h: the same file names with other contents compile to
    other code, so the key changes; so does the kernel header tree's stamp."""
    bpf = tmp_path / "bpf"
    bpf.mkdir()
    (bpf / "nptrace_events.h").write_text("struct npt_event { int a; };\n")
    kh = tmp_path / "kheaders"
    kh.mkdir()
    (kh / "SOURCE").write_text("linux-headers-6.1\n")
    first = oc.key("src", [], "v", oc.include_identity(bpf, str(kh)))
    assert first == oc.key("src", [], "v", oc.include_identity(bpf, str(kh)))
    (bpf / "nptrace_events.h").write_text("struct npt_event { int a, b; };\n")
    second = oc.key("src", [], "v", oc.include_identity(bpf, str(kh)))
    assert second != first
    os.utime(kh / "SOURCE", ns=(1, 1))
    assert oc.key("src", [], "v", oc.include_identity(bpf, str(kh))) != second
    assert oc.include_identity(bpf, None) == [
        f"nptrace_events.h:{__import__('hashlib').sha256(b'struct npt_event { int a, b; };' + bytes([10])).hexdigest()}"]


def test_every_libbcc_call_of_the_snapshot_has_a_prototype():
    """An undeclared ctypes call passes bcc's module pointer as a C int, cut to 32 bits: it
    works while python's heap is low and reads garbage (then a null function pointer: a
    segfault) when the module sits above 4 GiB. Every accessor snapshot() calls on its own
    handle is in MODULE_CALLS; those on bcc's are declared by bcc."""
    import inspect
    import re
    src = inspect.getsource(bo.snapshot)
    own = set(re.findall(r"\blib\.(\w+)\(", src))
    assert own and own <= {name for name, _ in bo.MODULE_CALLS}, own
    from pathlib import Path
    declared = Path("/usr/lib/python3/dist-packages/bcc/libbcc.py")
    if declared.exists():
        text = declared.read_text()
        for name in set(re.findall(r"\bbcc_lib\.(\w+)\(", src)):
            assert f"lib.{name}.argtypes" in text, name
