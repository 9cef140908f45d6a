#!/usr/bin/env bash
# Idempotent set-up of nptrace on a fresh Debian 12 machine (run as root).
#   - Debian packages: bcc (python3-bpfcc), its tools (the bench compares against them),
#     iproute2, iptables, nftables, conntrack, clang (layout test), bpftool (BTF test).
#   - Kernel headers: bcc compiles against /lib/modules/$(uname -r)/build. Where that is
#     missing (custom kernels, these VMs) we install the newest Debian linux-headers we can
#     get and link them there. Their struct layouts are NOT used: every kernel-struct offset
#     the probes read comes from BTF at load time (nptrace/kernel/btf.py).
#   - A venv made from Debian's /usr/bin/python3 with --system-site-packages, because bcc
#     imports only there; `nptrace` is linked into /usr/local/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
log() { echo "setup: $*" >&2; }

[ "$(id -u)" = 0 ] || { echo "setup: must run as root (try: sudo make setup)" >&2; exit 2; }
export DEBIAN_FRONTEND=noninteractive

# NPTRACE_SETUP: full (default: the tests and the bench too), runtime (what `nptrace run` and
# the lab need: a node that traces, the Vagrant lab's node VMs), host (a lab host that does not
# trace, the Vagrant lab's client and router: no bcc, no compiler, the hot path not compiled).
host_pkgs=(python3-venv python3-pip iproute2 iptables nftables conntrack ethtool kmod procps)
pkgs=(python3-bpfcc python3-venv python3-pip iproute2 iptables nftables conntrack ethtool ipvsadm ipset
      kmod procps
      strace                             # kernel/headertree.py: which headers bcc's compile reads
      gcc libc6-dev python3-dev)         # setup.py: the hot path compiled by Cython
# What the tests and the bench use besides.
test_pkgs=(bpfcc-tools nfacct clang bpftool tcpdump tshark shellcheck iperf3 python3-matplotlib hping3
      podman buildah debootstrap runc    # the container test (scripts/build-image.sh); tshark: the pcap test
      prometheus)                        # tests/privileged/test_fleet_metrics.py runs the server binary
profile=${NPTRACE_SETUP:-full}
case $profile in
    full) pkgs+=("${test_pkgs[@]}"); extras="[test,bench]" ;;
    runtime) extras="" ;;
    host) pkgs=("${host_pkgs[@]}"); extras=""; export NPTRACE_COMPILE=0 ;;
    *) echo "setup: NPTRACE_SETUP=$profile is not one of full, runtime, host" >&2; exit 2 ;;
esac
if [ "${1:-}" = --packages ]; then     # the Debian packages this profile installs (vagrant-box.sh)
    echo "${pkgs[*]}"
    exit 0
fi
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

kbuild=/lib/modules/$(uname -r)/build
if [ "$profile" != host ] && { [ ! -e "$kbuild/include" ] || [ ! -e "/lib/modules/$(uname -r)/source/include/linux" ]; }; then
    # shellcheck disable=SC2010  # version order (sort -V) of the few header folders
    hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | grep -v -e cloud -e rt | sort -V | tail -n1 || true)
    if [ -z "$hdr" ]; then
        apt-get update -qq
        name=$(apt-cache search --names-only '^linux-headers-[0-9.]+-?[0-9]*\+?[a-z0-9]*-amd64$' \
               | awk '{print $1}' | grep -v -e cloud -e rt | sort -V | tail -n1)
        [ -n "$name" ] || { echo "setup: no linux-headers package found in apt" >&2; exit 1; }
        apt-get install -y -qq --no-install-recommends "$name" >/dev/null
        hdr=/usr/src/$name
    fi
    common=${hdr%-amd64}-common     # Debian splits generated (arch) and common headers
    [ -d "$common" ] || common=$hdr
    mkdir -p "/lib/modules/$(uname -r)"
    ln -sfn "$hdr" "$kbuild"
    ln -sfn "$common" "/lib/modules/$(uname -r)/source"
    log "no headers for kernel $(uname -r): linked $(basename "$hdr") for bcc (offsets come from BTF)"
fi

needs_bcc="import bcc" && hot=compiled
[ "$profile" = host ] && needs_bcc="" && hot=python
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "$needs_bcc" 2>/dev/null; then
    rm -rf .venv
    /usr/bin/python3 -m venv --system-site-packages .venv
fi
# py-spy is a binary, not a module: checked by its path, so an older venv picks it up
if [ "$profile" = full ]; then probe="import pytest, xdist" && tool=.venv/bin/py-spy; else probe="" && tool=.venv/bin/python; fi
if ! .venv/bin/python -c "import nptrace, pyroute2, msgpack, click, prometheus_client; $probe" 2>/dev/null \
   || [ ! -x "$tool" ] || [ pyproject.toml -nt .venv/.installed ] \
   || [ setup.py -nt .venv/.installed ] \
   || ! .venv/bin/python -c 'from nptrace import compiled; assert compiled.hot_path().startswith("'"$hot"'")' 2>/dev/null; then
    log "installing nptrace into .venv"
    .venv/bin/pip install -q --disable-pip-version-check -e ".$extras"
    touch .venv/.installed
fi
ln -sfn "$top/.venv/bin/nptrace" /usr/local/bin/nptrace
# nptrace's own minimal kernel headers (about 150 files), for nodes and units that hide
# /lib/modules (ProtectKernelModules=yes in deploy/nptrace.service): remade when the headers
# it came from or the BPF sources are newer.
kh=/usr/share/nptrace/kheaders
if [ "$profile" != host ] && { [ ! -f "$kh/include/linux/kconfig.h" ] || [ -n "$(find bpf nptrace/kernel/headertree.py -newer "$kh/SOURCE" 2>/dev/null | head -n1)" ]; }; then
    mkdir -p "$(dirname "$kh")"
    .venv/bin/python -m nptrace.kernel.headertree "$kh" >&2
fi
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
log "ready: $(command -v nptrace)"
