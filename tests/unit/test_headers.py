"""nptrace/kernel/headers.py against fixture trees: the order bcc 0.26 looks in."""
from nptrace.kernel import headers


def tree(tmp_path, *dirs):
    for d in dirs:
        (tmp_path / d).mkdir(parents=True)
    return tmp_path


def test_node_headers_first(tmp_path):
    root = tree(tmp_path, "lib/modules/6.1.0/build/include", "sys/kernel")
    (root / "sys/kernel/kheaders.tar.xz").write_bytes(b"")
    s = headers.find("6.1.0", root=root, env={}, shipped=tmp_path / "none")
    assert s.kind == "node" and "build" in s.path


def test_env_wins_and_ikheaders_before_shipped(tmp_path):
    assert headers.find("6.1.0", root=tmp_path, env={"BCC_KERNEL_SOURCE": "/k"}).kind == "env"
    root = tree(tmp_path, "sys/kernel", "ship/include/linux")
    (root / "ship/include/linux/kconfig.h").write_text("")
    (root / "sys/kernel/kheaders.tar.xz").write_bytes(b"")
    assert headers.find("6.1.0", root=root, env={}, shipped=root / "ship").kind == "kheaders"


def test_shipped_tree_is_selected_for_bcc(tmp_path):
    root = tree(tmp_path, "ship/include/linux")
    (root / "ship/include/linux/kconfig.h").write_text("")
    s = headers.find("6.1.0", root=root, env={}, shipped=root / "ship")
    env = {}
    headers.select(s, env)
    assert s.kind == "shipped" and env == {"BCC_KERNEL_SOURCE": str(root / "ship")}


def test_none_says_what_to_install(tmp_path):
    s = headers.find("6.1.0", root=tmp_path, env={}, shipped=tmp_path / "none")
    assert s.kind == "none" and "linux-headers-6.1.0" in s.line()
