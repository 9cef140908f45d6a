#!/usr/bin/env bash
# Print the podman arguments this node needs, whatever the image: "--runtime R" first, then
# --ulimit flags. Used by scripts/build-image.sh and tests/privileged/test_container.py.
#   - podman asks the OCI runtime for RLIMIT_NOFILE and RLIMIT_NPROC of 1048576; without
#     CAP_SYS_RESOURCE (in the bounding set of this VM kind) the runtime may only lower them:
#     cap both at what this process holds (podman itself caps NPROC at 32768).
#   - crun 1.8 (Debian 12) refuses hosts with cgroup v1 and v2 controllers both mounted
#     ("cgroups in hybrid mode not supported"); runc runs there.
# usage: scripts/podman-args.sh IMAGE
set -euo pipefail
image=$1
nofile=$(ulimit -Hn); [ "$nofile" = unlimited ] && nofile=1048576
nproc=$(ulimit -Hu); [ "$nproc" = unlimited ] && nproc=32768
[ "$nofile" -gt 1048576 ] && nofile=1048576
[ "$nproc" -gt 32768 ] && nproc=32768
ul="--ulimit nofile=$nofile:$nofile --ulimit nproc=$nproc:$nproc"
for rt in crun runc; do
    command -v "$rt" >/dev/null || continue
    # shellcheck disable=SC2086
    if podman --runtime "$rt" run --rm --network=none $ul --entrypoint /bin/true "$image" >/dev/null 2>&1; then
        echo "--runtime $rt $ul"
        exit 0
    fi
done
echo "podman-args: no OCI runtime (crun, runc) can start $image here" >&2
exit 1
