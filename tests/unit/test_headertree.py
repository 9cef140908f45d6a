"""nptrace/kernel/headertree.py, its pure parts: Debian's split trees, the merged farm, what
strace saw opened."""
from pathlib import Path

from nptrace.kernel import headertree as ht


def test_debian_split_tree_found_from_the_build_makefile(tmp_path):
    common = tmp_path / "linux-headers-6.1.0-9-common"
    build = tmp_path / "linux-headers-6.1.0-9-amd64"
    (common / "include/linux").mkdir(parents=True)
    (build / "include/generated").mkdir(parents=True)
    (build / "Makefile").write_text(f"include {common}/Makefile\n")
    assert ht.split_trees(build) == [build, common]


def test_single_tree_is_its_own_source(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "Makefile").write_text("VERSION = 6\nPATCHLEVEL = 1\n")
    assert ht.split_trees(tmp_path) == [tmp_path]


def test_merge_unites_both_halves_build_first(tmp_path):
    build, src, farm = tmp_path / "b", tmp_path / "s", tmp_path / "farm"
    for d, f, text in ((build, "include/generated/autoconf.h", "b"),
                       (src, "include/linux/kconfig.h", "s"),
                       (build, "include/linux/both.h", "from build"),
                       (src, "include/linux/both.h", "from source"),
                       (src, "scripts/big", "x")):
        (d / f).parent.mkdir(parents=True, exist_ok=True)
        (d / f).write_text(text)
    ht.merge([build, src], farm)
    assert (farm / "include/generated/autoconf.h").read_text() == "b"
    assert (farm / "include/linux/kconfig.h").read_text() == "s"
    assert (farm / "include/linux/both.h").read_text() == "from build"
    assert not (farm / "scripts").exists()


def test_opened_under_keeps_successful_opens_inside_the_tree():
    top = Path("/tmp/farm")
    log = "\n".join([
        '123 openat(AT_FDCWD, "./include/linux/kconfig.h", O_RDONLY|O_CLOEXEC) = 3',
        '123 openat(AT_FDCWD, "include/uapi/linux/bpf.h", O_RDONLY|O_CLOEXEC) = 4',
        '124 openat(AT_FDCWD, "/tmp/farm/arch/x86/include/asm/page.h", O_RDONLY) = 5',
        '123 openat(AT_FDCWD, "include/linux/missing.h", O_RDONLY) = -1 ENOENT (No such file)',
        '123 openat(AT_FDCWD, "/usr/lib/libbcc.so", O_RDONLY|O_CLOEXEC) = 3',
        '[pid   125] openat(AT_FDCWD, "arch/x86/include/generated/uapi/asm/types.h", O_RDONLY) = 6',
    ])
    assert ht.opened_under(log, top) == {
        "include/linux/kconfig.h", "include/uapi/linux/bpf.h", "arch/x86/include/asm/page.h",
        "arch/x86/include/generated/uapi/asm/types.h"}


def test_offset_defines_cover_every_macro_used():
    text = "NPT_READ(a, skb, NPT_OFF_sk_buff__head); x = NPT_OFF_nf_conn__status + NPT_OFF_sk_buff__head;"
    assert ht.offset_defines(text) == ["-DNPT_OFF_nf_conn__status=0", "-DNPT_OFF_sk_buff__head=0"]
