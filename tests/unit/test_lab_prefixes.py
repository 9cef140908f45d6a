"""lab down --all --every-prefix: which lab prefixes a node holds (runner.lab_prefixes)."""
from nptrace.lab.runner import lab_prefixes

HOSTS = {"sw", "client", "node1", "node2", "mbox", "web-2"}


def test_prefixes_come_from_state_files_and_from_namespaces_left_without_state():
    got = lab_prefixes(["npt-client", "npt-node1", "npt-at42-node2", "npt-x-web-2", "other-node1",
                        "npt-", "cni-1234"],
                       HOSTS, ["npt-k3-state.json", "npt-at42-state.json", "unrelated.json"])
    assert got == {"npt-", "npt-at42-", "npt-x-", "npt-k3-"}


def test_the_longest_host_decides_where_the_prefix_ends():
    # both "web-2" and "b-2" end the name: the longer one is the host
    assert lab_prefixes(["npt-aweb-2"], HOSTS | {"b-2"}, []) == {"npt-a"}
