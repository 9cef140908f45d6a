"""Kernel side: everything that touches bcc, bpf(2), tc/tcx and netlink."""
