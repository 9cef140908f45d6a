#!/usr/bin/env bash
# First provisioning step of every lab VM (root, once): mark the VM as an nptrace lab VM with
# its role, then install nptrace with the project's one set-up command, `make setup`, from the
# synced folder (/vagrant), exactly as the README does on any Debian 12 machine.
#
# The marker /etc/nptrace-lab-role is what lets `nptrace lab apply-role` rewrite this
# machine's network without --force.
set -euo pipefail
log() { echo "nptrace-lab setup: $*" >&2; }

role=${NPTRACE_ROLE:?NPTRACE_ROLE is not set (the Vagrantfile sets it)}
profile=${NPTRACE_LAB_PROFILE:-netns}
src=${NPTRACE_SRC:-/vagrant}

cat >/etc/nptrace-lab-role <<EOF
# Written by vagrant/provision/setup.sh: this machine is an nptrace lab VM.
# \`nptrace lab apply-role\` may flush its lab NICs, routes, firewall and sysctls.
role=$role
profile=$profile
EOF

# The scenarios set conf.all.rp_filter; every interface's own value stays 0 so that conf.all
# alone decides, as in the namespace lab. Where systemd's 50-default.conf sets
# net.ipv4.conf.*.rp_filter=2, udev applies it to every new interface (veths, cni0,
# flannel.1), and the kernel uses max(all, interface): a later file with the same key wins.
cat >/etc/sysctl.d/90-nptrace-lab.conf <<'EOF'
# nptrace lab VM: conf.all alone sets the reverse-path filter mode (see vagrant/README.md).
net.ipv4.conf.default.rp_filter = 0
net.ipv4.conf.*.rp_filter = 0
EOF
if [ -x /lib/systemd/systemd-sysctl ]; then
    /lib/systemd/systemd-sysctl /etc/sysctl.d/90-nptrace-lab.conf || true
fi

export DEBIAN_FRONTEND=noninteractive
if ! command -v make >/dev/null; then
    log "installing make"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends make >/dev/null
fi
log "role $role, profile $profile: make setup in $src"
# runtime on the nodes (they trace), host on the client and the router (the Vagrantfile says
# which): the test suite's tools (podman, tshark, ...) stay off every lab VM
NPTRACE_SETUP=${NPTRACE_SETUP:-runtime} make -C "$src" setup
