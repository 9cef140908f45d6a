#!/usr/bin/env bash
# Build the nptrace image from deploy/Containerfile, idempotently (run as root, from anywhere).
#   scripts/build-image.sh           prints the image name (localhost/nptrace:<version>) last
#   NPT_REFRESH_BASE=1 scripts/...   debootstrap a new base even if one is cached
#
# No registry answers here, so the Debian 12 base is made locally: debootstrap (minbase) of
# bookworm from deb.debian.org, imported with `podman import` as
#   localhost/nptrace-base:bookworm-<Version>-<Release date>   e.g. bookworm-12.15-20260711
# read from the archive's Release file: one tag, one package set. It is cached: a base whose
# tag matches today's Release is reused; when the archive cannot be asked, the newest cached
# base is. The image is rebuilt only when its inputs change (a hash of the build context and
# the base's id, kept as a label); podman's layer cache keeps the apt and pip layers when only
# nptrace's code changed.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "build-image: $*" >&2; }
[ "$(id -u)" = 0 ] || { echo "build-image: must run as root" >&2; exit 2; }

MIRROR=${NPT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
REPO=localhost/nptrace-base
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)
IMAGE=localhost/nptrace:$VERSION

need=()
command -v podman >/dev/null || need+=(podman)
command -v buildah >/dev/null || need+=(buildah)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v runc >/dev/null || need+=(runc)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# The tag of a Release file: bookworm-<Version>-<Date as YYYYMMDD>.
release_tag() {
    python3 -c '
import sys, email.utils
f = dict(l.split(": ", 1) for l in sys.stdin.read().splitlines() if ": " in l and not l.startswith(" "))
d = email.utils.parsedate_to_datetime(f["Date"])
print("%s-%s-%s" % (f["Codename"], f["Version"], d.strftime("%Y%m%d")))'
}

base=""
if [ -z "${NPT_REFRESH_BASE:-}" ]; then
    if want=$(curl -fsS --max-time 20 "$MIRROR/dists/$SUITE/Release" 2>/dev/null | release_tag); then
        podman image exists "$REPO:$want" && base=$REPO:$want
    else
        base=$(podman images --format '{{.Repository}}:{{.Tag}}' --filter "reference=$REPO:$SUITE-*" \
               | sort -V | tail -n1)
        [ -n "$base" ] && log "archive not reachable: using the cached base $base"
    fi
fi
if [ -z "$base" ]; then
    root=$(mktemp -d /var/tmp/npt-base.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    log "debootstrap $SUITE (minbase) from $MIRROR"
    t0=$(date +%s)
    debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 \
        || { tail -n 20 "$root.log" >&2; exit 1; }
    rm -f "$root.log"
    tag=$(release_tag <"$root/var/lib/apt/lists/"*"_dists_${SUITE}_Release")
    # apt in the image reads the same archive (debootstrap writes only the main suite)
    printf 'deb %s %s main\ndeb %s %s-updates main\ndeb http://deb.debian.org/debian-security %s-security main\n' \
        "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" "$SUITE" >"$root/etc/apt/sources.list"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" --numeric-owner -c . \
        | podman import --change 'CMD ["/bin/bash"]' \
              --message "debootstrap --variant=minbase $SUITE $MIRROR" - "$REPO:$tag" >/dev/null
    rm -rf "$root"; trap - EXIT
    base=$REPO:$tag
    log "base $base made in $(( $(date +%s) - t0 ))s"
fi
podman tag "$base" "$REPO:$SUITE"

# The node's limits, not the image's: podman asks the runtime for RLIMIT_NOFILE/NPROC of
# 1048576, which a root without CAP_SYS_RESOURCE (this VM kind) may not grant; crun 1.8 refuses
# hybrid cgroup v1+v2 hosts, runc runs there. scripts/podman-args.sh prints what fits.
read -r -a node_args <<<"$(scripts/podman-args.sh "$base")"

# Rebuild only when an input changed: the files the Containerfile copies, and the base.
# (.so files: a `make setup` of this tree; .containerignore keeps them out of the image)
files=$(find deploy/Containerfile deploy/requirements.txt deploy/requirements-build.txt pyproject.toml README.md setup.py bpf nptrace \
        -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.so' ! -path 'nptrace/*.c' | LC_ALL=C sort)
ctx=$( { podman image inspect --format '{{.Id}}' "$base"; sha256sum $files; } | sha256sum | cut -c1-16)
have=$(podman image inspect --format '{{index .Labels "org.nptrace.context"}}' "$IMAGE" 2>/dev/null || true)
if [ "$have" = "$ctx" ]; then
    log "$IMAGE is up to date (context $ctx)"
else
    # pip's CA bundle, where a proxy re-signs TLS (PIP_CERT or pip.conf's cert), as a secret
    ca=${PIP_CERT:-$(pip3 config get global.cert 2>/dev/null || true)}
    secret=(); [ -n "$ca" ] && [ -s "$ca" ] && secret=(--secret "id=ca,src=$ca")
    log "building $IMAGE FROM $base (context $ctx)"
    old=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
    t0=$(date +%s)
    podman "${node_args[@]:0:2}" build -q "${node_args[@]:2}" --network=host --layers -f deploy/Containerfile \
        "${secret[@]}" --build-arg "BASE_IMAGE=$base" --label "org.nptrace.context=$ctx" \
        --label "org.nptrace.base=$base" -t "$IMAGE" . >/dev/null
    # the build this one replaced, now untagged, with its own layers. Not `podman image prune`:
    # that also dropped the other stages' cached layers (kheaders, helpers), so every build
    # re-ran their apt-get installs (~2 min instead of ~30 s after a code change)
    new=$(podman image inspect --format '{{.Id}}' "$IMAGE")
    if [ -n "$old" ] && [ "$old" != "$new" ]; then podman rmi "$old" >/dev/null 2>&1 || true; fi
    log "built $IMAGE in $(( $(date +%s) - t0 ))s"
fi
echo "$IMAGE"
