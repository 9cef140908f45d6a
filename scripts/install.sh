#!/usr/bin/env bash
# Install nptrace for root's daemon (deploy/nptrace.service) on a bare-metal node: a
# non-editable copy of this checkout in a root-owned prefix, so that what runs as root for days
# is code nobody else can write.
#
#   sudo scripts/install.sh                 # -> /opt/nptrace (a venv), /usr/local/bin/nptrace
#   sudo systemctl restart nptrace          # a running unit keeps the old code until then
#
# `make setup` is for working on nptrace: it links the checkout's editable install into
# /usr/local/bin, so the code root runs is the checkout's, writable by whoever owns it (and a
# checkout under /tmp is hidden from the unit by PrivateTmp=: "setpriv: failed to execute
# /usr/local/bin/nptrace"). This script instead:
#   1. copies the sources (nptrace/, bpf/, setup.py, pyproject.toml, README.md) into a
#      root-owned build directory: what it installs is what the checkout held at that moment;
#   2. builds a wheel there with the hot path compiled (Cython pinned by hash,
#      deploy/requirements-build.txt; gcc and python3-dev from Debian);
#   3. makes PREFIX a venv (Debian's python3, --system-site-packages: bcc imports only there),
#      installs the runtime dependencies pinned by hash (deploy/requirements.txt, as the image
#      does) and the wheel, and the BPF sources into PREFIX/share/nptrace/bpf (where
#      nptrace/kernel/loader.py finds them for an installed copy);
#   4. refuses to finish unless PREFIX, every folder above it and every file in it belong to
#      root and are writable by nobody else;
#   5. links NPTRACE_BIN (default /usr/local/bin/nptrace; empty: no link) to PREFIX/bin/nptrace.
# The unit runs /opt/nptrace/bin/nptrace itself, so a later `make setup` relinking
# /usr/local/bin changes what a shell runs, never what the unit runs.
#
# Debian packages: what `NPTRACE_SETUP=runtime make setup` installs (python3-bpfcc, iproute2,
# nftables, ..., gcc, python3-dev), installed here when bcc does not import. nptrace's minimal
# kernel-header tree (/usr/share/nptrace/kheaders, for the unit's ProtectKernelModules=) is made
# when missing. NPTRACE_PREFIX moves the prefix (then edit the unit's ExecStart to match).
set -euo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
prefix=${NPTRACE_PREFIX:-/opt/nptrace}
bin=${NPTRACE_BIN-/usr/local/bin/nptrace}
log() { echo "install: $*" >&2; }
die() { echo "install: $*" >&2; exit 2; }

[ "$(id -u)" = 0 ] || die "must run as root (try: sudo scripts/install.sh)"
case $prefix in /*) ;; *) die "NPTRACE_PREFIX=$prefix: give an absolute path" ;; esac
umask 022

# Every folder from / down to $1 (which may not exist yet): root's, writable by root alone. A
# folder others may write (/tmp, a user's home) lets them swap what root runs.
check_parents() {
    local d=$1
    while [ "$d" != / ]; do
        d=$(dirname "$d")
        [ -e "$d" ] || continue
        read -r uid mode < <(stat -L -c '%u %a' "$d")
        if [ "$uid" != 0 ] || (( 8#$mode & 8#022 )); then
            die "$d (above $prefix) is owned by uid $uid with mode $mode: root's daemon must not run from a folder others can write; choose another NPTRACE_PREFIX"
        fi
    done
}
check_parents "$prefix"

if ! /usr/bin/python3 -c "import bcc" 2>/dev/null || ! command -v gcc >/dev/null; then
    pkgs=$(NPTRACE_SETUP=runtime bash scripts/setup.sh --packages)
    log "installing Debian packages: $pkgs"
    apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
fi

build=$(mktemp -d /var/tmp/nptrace-install.XXXXXX)   # root's, 0700
trap 'rm -rf "$build"' EXIT
# the sources, without what a checkout's own build left beside them
tar -C "$top" --exclude='*.so' --exclude=__pycache__ --exclude='*.pyc' \
    -cf - pyproject.toml setup.py README.md nptrace bpf deploy/requirements.txt \
    deploy/requirements-build.txt | tar -C "$build" -xf -
src=$build
version=$(/usr/bin/python3 -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['project']['version'])" "$src/pyproject.toml")

log "building nptrace $version from a copy of $top"
/usr/bin/python3 -m venv --system-site-packages "$build/venv"
"$build/venv/bin/pip" install -q --disable-pip-version-check --require-hashes --no-deps \
    -r "$src/deploy/requirements-build.txt"
"$build/venv/bin/pip" wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$build/dist" "$src" >/dev/null
wheel=$(ls "$build"/dist/nptrace-*.whl)

log "installing into $prefix"
if [ ! -x "$prefix/bin/python" ] || ! "$prefix/bin/python" -c "import bcc" 2>/dev/null; then
    rm -rf "$prefix"
    /usr/bin/python3 -m venv --system-site-packages "$prefix"
fi
"$prefix/bin/pip" install -q --disable-pip-version-check --no-compile --require-hashes --no-deps \
    -r "$src/deploy/requirements.txt"
"$prefix/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
# pip unpacks a module's .so before its .py; nptrace/compiled.py takes an extension only while it
# is newer than its source (the guard against a stale build in a checkout): here both come from
# the one wheel, so the extensions are dated after their sources
site=$("$prefix/bin/python" -c "import nptrace, os; print(os.path.dirname(nptrace.__file__))")
find "$site" -name '*.so' -exec touch {} +
rm -rf "$prefix/share/nptrace/bpf"
install -d -m 0755 "$prefix/share/nptrace/bpf"
install -m 0644 "$src"/bpf/* "$prefix/share/nptrace/bpf/"

chown -R root:root "$prefix"
chmod -R go-w "$prefix"
check_parents "$prefix/bin"
bad=$(find "$prefix" ! -type l \( ! -user root -o -perm /022 \) -print -quit)
[ -z "$bad" ] || die "$bad: not root's, or writable by others"

kh=/usr/share/nptrace/kheaders
if [ ! -f "$kh/include/linux/kconfig.h" ]; then
    install -d -m 0755 "$(dirname "$kh")"
    "$prefix/bin/python" -m nptrace.kernel.headertree "$kh" >&2 \
        || log "nptrace's kernel-header tree not made (the unit then needs the node's headers)"
fi

hot=$("$prefix/bin/python" -c "from nptrace import compiled; print(compiled.hot_path())")
"$prefix/bin/nptrace" --version >/dev/null
if [ -n "$bin" ]; then
    was=$(readlink "$bin" 2>/dev/null || true)
    ln -sfn "$prefix/bin/nptrace" "$bin"
    if [ -n "$was" ] && [ "$was" != "$prefix/bin/nptrace" ]; then
        log "$bin pointed at $was: now at $prefix/bin/nptrace"
    fi
fi
log "nptrace $version in $prefix (hot path: $hot); the unit runs $prefix/bin/nptrace:"
log "  install -m 0644 deploy/nptrace.service /etc/systemd/system/ && systemctl daemon-reload && systemctl restart nptrace"
