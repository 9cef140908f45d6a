"""node/rules_source.py against a hostile namespace: nf_tables table names made to be read by
nft as more commands, and tools that print without end. A name that is not an nft identifier
never reaches nft's command line; it is counted and said once, never skipped silently; every
child's output is bounded."""
import subprocess
import sys

import pytest

from nptrace.node import nftrace_live, rules_source

HOSTILE = [
    "x; flush ruleset",
    "x\nflush ruleset",
    "x\rflush ruleset",
    'x" ; flush ruleset ; "',
    "x' ; list ruleset",
    'include "/etc/shadow"',
    "x;include \"/etc/shadow\"",
    "a" * 300,              # past NFT_NAME_MAXLEN
    "x y",
    "x\tz",
    "$var",
    "{ x }",
    "x#comment",
    "",
    "-a",
    "\ufffd\ufffd",         # undecodable bytes, as the netlink reader replaces them
]


def test_one_validator_for_every_nft_argument():
    assert nftrace_live.nft_name is rules_source.nft_name
    assert rules_source.nft_name("kube-proxy") == "kube-proxy"
    assert rules_source.nft_name("nptrace_trace") == "nptrace_trace"
    assert rules_source.nft_name("cali.filter/x") == "cali.filter/x"
    for name in HOSTILE:
        assert rules_source.nft_name(name) is None, name
    assert rules_source.nft_name(None) is None and rules_source.nft_name(b"x") is None


@pytest.fixture
def nft(monkeypatch):
    """Every nft argv rules_source would run, answered with an empty table listing."""
    ran, said = [], []
    monkeypatch.setattr(rules_source, "REFUSED", rules_source.RefusedNames(log=said.append))

    def run(netns, argv, *, check=True):
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0, f"table {argv[-2]} {argv[-1]} {{\n}}\n", "")
    monkeypatch.setattr(rules_source, "run_in_netns", run)
    return ran, said


def test_hostile_table_names_never_reach_nft(nft):
    ran, said = nft
    tables = [("ip", "filter"), ("ip", "nat"), ("ip", "kube-proxy"), ("inet", "cni_fw")]
    tables += [("inet", n) for n in HOSTILE]
    text = rules_source._read_nft("pod1", tables)
    # per table (an iptables-nft table is there): only the identifiers are listed
    assert ran == [["nft", "-a", "list", "table", "ip", "kube-proxy"],
                   ["nft", "-a", "list", "table", "inet", "cni_fw"]]
    assert "kube-proxy" in text and "cni_fw" in text
    refused = len(HOSTILE)
    assert rules_source.REFUSED.count == refused and len(said) == refused
    assert all("not an nft identifier" in s and "netns pod1" in s for s in said)
    assert all("\n" not in s for s in said)                    # said as repr: one line each
    assert max(len(s) for s in said) < 400                     # a long name is cut when said
    # read again: counted once, said once
    rules_source._read_nft("pod1", tables)
    assert rules_source.REFUSED.count == refused and len(said) == refused
    # the same name in another namespace is another table
    rules_source._read_nft("pod2", [("ip", "filter"), ("inet", "x; flush ruleset")])
    assert rules_source.REFUSED.count == refused + 1 and "netns pod2" in said[-1]


def test_hostile_family_is_refused_too(nft):
    ran, said = nft
    rules_source._read_nft(None, [("ip", "filter"), ("inet; flush ruleset", "t")])
    assert ran == [] and rules_source.REFUSED.count == 1 and "host namespace" in said[0]


def test_only_native_tables_are_listed_whole_without_a_name(nft):
    """Without an iptables-nft table to leave out, `list ruleset`: no name on the line, so a
    hostile table is read like any other, not refused."""
    ran, said = nft
    rules_source._read_nft("pod1", [("inet", "x; flush ruleset"), ("ip", "kube-proxy")])
    assert ran == [["nft", "-a", "list", "ruleset"]] and not said


def test_refused_names_are_bounded():
    said = []
    r = rules_source.RefusedNames(log=said.append)
    for i in range(r.MAX_SEEN + 100):
        r.refuse("pod", "inet", f"x;{i}")
    assert r.count == r.MAX_SEEN + 100 and len(said) == r.MAX_SEEN


def test_names_from_nft_list_tables_keep_spaces(monkeypatch):
    """Where the namespace cannot be entered, `nft list tables` names them: a name with a
    space is kept whole (and then refused), not dropped as a line of another shape."""
    monkeypatch.setattr(rules_source, "in_netns", lambda ns, fn: (_ for _ in ()).throw(OSError()))
    monkeypatch.setattr(rules_source.shutil, "which", lambda tool: "/usr/sbin/" + tool)
    monkeypatch.setattr(rules_source, "run_in_netns", lambda ns, argv, check=True:
                        subprocess.CompletedProcess(argv, 0, "table ip filter\ntable inet x; flush ruleset\n", ""))
    assert rules_source._nft_tables(None) == [("ip", "filter"), ("inet", "x; flush ruleset")]


# --- bounded child output ---------------------------------------------------------------------

PY = sys.executable


def test_child_printing_past_the_bound_is_killed():
    with pytest.raises(rules_source.OutputTooLarge):
        rules_source.run_bounded([PY, "-c", "import sys\nwhile True: sys.stdout.write('x' * 65536)"],
                                 timeout=20, limit=1 << 20)


def test_stderr_is_kept_to_its_start_and_the_child_still_finishes():
    r = rules_source.run_bounded([PY, "-c", "import sys\nsys.stderr.write('e' * (4 << 20))\nprint('ok')"],
                                 timeout=20, limit=1 << 20, err_limit=1000)
    assert r.returncode == 0 and r.stdout == "ok\n" and r.stderr == "e" * 1000


def test_timeout_kills_the_child():
    with pytest.raises(subprocess.TimeoutExpired):
        rules_source.run_bounded([PY, "-c", "import time\ntime.sleep(30)"], timeout=0.3, limit=100)


def test_undecodable_output_is_replaced_not_raised():
    r = rules_source.run_bounded([PY, "-c", "import sys\nsys.stdout.buffer.write(b'a\\xff\\xfeb')"],
                                 timeout=20, limit=100)
    assert r.stdout == "a\ufffd\ufffdb"


def test_run_in_netns_says_when_a_tool_printed_too_much(monkeypatch):
    monkeypatch.setattr(rules_source, "MAX_OUTPUT", 1 << 20)
    with pytest.raises(rules_source.RulesSourceError, match="printed more than 1 MiB"):
        rules_source.run_in_netns(None, ["yes"])
