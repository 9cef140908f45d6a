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

pkgs=(python3-bpfcc bpfcc-tools python3-venv python3-pip iproute2 iptables nftables conntrack ethtool ipvsadm ipset
      nfacct clang bpftool tcpdump tshark kmod procps shellcheck iperf3 python3-matplotlib hping3
      podman buildah debootstrap runc    # the container test (scripts/build-image.sh)
      strace                             # kernel/headertree.py: which headers bcc's compile reads; tshark: the pcap test
      gcc libc6-dev python3-dev          # setup.py: the hot path compiled by Cython
      prometheus)                        # tests/privileged/test_fleet_metrics.py runs the server binary
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
if [ ! -e "$kbuild/include" ] || [ ! -e "/lib/modules/$(uname -r)/source/include/linux" ]; then
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

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import bcc' 2>/dev/null; then
    rm -rf .venv
    /usr/bin/python3 -m venv --system-site-packages .venv
fi
# py-spy is a binary, not a module: checked by its path, so an older venv picks it up
if ! .venv/bin/python -c 'import nptrace, pytest, pyroute2, msgpack, click, prometheus_client' 2>/dev/null \
   || [ ! -x .venv/bin/py-spy ] || [ pyproject.toml -nt .venv/.installed ] \
   || [ setup.py -nt .venv/.installed ] \
   || ! .venv/bin/python -c 'from nptrace import compiled; assert compiled.hot_path() == "compiled"' 2>/dev/null; then
    log "installing nptrace into .venv"
    .venv/bin/pip install -q --disable-pip-version-check -e ".[test,bench]"
    touch .venv/.installed
fi
ln -sfn "$top/.venv/bin/nptrace" /usr/local/bin/nptrace
# nptrace's own minimal kernel headers (about 150 files), for nodes and units that hide
# /lib/modules (ProtectKernelModules=yes in deploy/nptrace.service): remade when the headers
# it came from or the BPF sources are newer.
kh=/usr/share/nptrace/kheaders
if [ ! -f "$kh/include/linux/kconfig.h" ] || [ -n "$(find bpf nptrace/kernel/headertree.py -newer "$kh/SOURCE" 2>/dev/null | head -n1)" ]; then
    mkdir -p "$(dirname "$kh")"
    .venv/bin/python -m nptrace.kernel.headertree "$kh" >&2
fi
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
log "ready: $(command -v nptrace)"
