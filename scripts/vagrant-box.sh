#!/usr/bin/env bash
# Build a vagrant-libvirt box of Debian 12 from Debian's archive and add it to Vagrant (root).
#   scripts/vagrant-box.sh                  box nptrace/bookworm, skipped when it is there already
#   NPT_BOX_REFRESH=1 scripts/vagrant-box.sh  build it again
#   NPT_BOX_PACKAGES="a b" ...              Debian packages to put in the box beforehand
#
# No box registry may be reachable (debian/bookworm64 cannot be downloaded then), so the box is
# made here as the official one is: debootstrap of bookworm with its kernel, sshd, sudo and
# rsync, the `vagrant` user with Vagrant's published insecure key (Vagrant swaps it for a key
# of its own at the first `vagrant up`), eth0 on DHCP for Vagrant's management network, every
# other NIC left alone, and extlinux as the boot loader on one partition of a qcow2 disk.
# NPT_BOX_PACKAGES only saves the VMs time: `make setup` still runs in every VM and installs
# whatever is missing, exactly as on a machine made from any other box.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "vagrant-box: $*" >&2; }
[ "$(id -u)" = 0 ] || { echo "vagrant-box: must run as root" >&2; exit 2; }

NAME=${NPT_BOX_NAME:-nptrace/bookworm}
SUITE=bookworm
SIZE_GB=${NPT_BOX_DISK_GB:-16}
WORK=${NPT_BOX_WORK:-/var/tmp/nptrace-box}
# the machine's own Debian source, so the box reaches the archive the way this machine does
MIRROR=${NPT_DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

# what the box is made of: it is built again when this script, its packages or the mirror changed
stamp_dir=/var/lib/nptrace/boxes
stamp=$stamp_dir/${NAME//\//_}.inputs
inputs=$(printf '%s\n' "$(sha256sum scripts/vagrant-box.sh)" "${NPT_BOX_PACKAGES:-}" "$MIRROR" "$SIZE_GB" | sha256sum | cut -d' ' -f1)
if [ -z "${NPT_BOX_REFRESH:-}" ] && vagrant box list 2>/dev/null | grep -q "^$NAME .*libvirt" \
   && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then
    log "box $NAME is there already and up to date (NPT_BOX_REFRESH=1 builds it again)"
    exit 0
fi

need=()
for tool in debootstrap:debootstrap qemu-img:qemu-utils sfdisk:fdisk extlinux:extlinux \
            vagrant:vagrant; do
    command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
[ -f /usr/lib/syslinux/mbr/mbr.bin ] || need+=(syslinux-common)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
key=""
for k in /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub; do [ -f "$k" ] && key=$k; done
[ -n "$key" ] || { echo "vagrant-box: Vagrant's insecure public key (keys/vagrant.pub) not found" >&2; exit 2; }

start=$(date +%s)
rm -rf "$WORK"
mkdir -p "$WORK/root"
raw=$WORK/disk.raw
loop=""
cleanup() {
    set +e
    for m in dev/pts dev proc sys ""; do
        mountpoint -q "$WORK/root/$m" && umount -l "$WORK/root/$m"
    done
    [ -n "$loop" ] && losetup -d "$loop"
}
trap cleanup EXIT

# One partition from 1 MiB, marked active; the loop device maps only the partition, so no
# partition devices are needed (there may be no udev to make them).
truncate -s "${SIZE_GB}G" "$raw"
printf 'label: dos\nstart=2048, type=83, bootable\n' | sfdisk -q "$raw"
loop=$(losetup -f --show -o $((2048 * 512)) "$raw")
mkfs.ext4 -q -L nptrace-root "$loop"
uuid=$(blkid -s UUID -o value "$loop")
mount "$loop" "$WORK/root"

include=linux-image-amd64,openssh-server,sudo,rsync,ifupdown,isc-dhcp-client,ca-certificates,make,locales
log "debootstrap $SUITE from $MIRROR"
debootstrap --include="$include" "$SUITE" "$WORK/root" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -n 20 "$WORK/debootstrap.log" >&2; exit 1; }

R=$WORK/root
for m in proc sys dev dev/pts; do mount --bind "/$m" "$R/$m"; done
cat >"$R/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
EOF
# The certificate authorities this machine added itself (a TLS-inspecting proxy's, a company's):
# the VMs reach PyPI and the archive through the same network, so they must trust them too.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$R/usr/local/share/ca-certificates/"
    chroot "$R" update-ca-certificates >/dev/null
fi
chroot "$R" apt-get update -qq
if [ -n "${NPT_BOX_PACKAGES:-}" ]; then
    log "packages in the box beforehand: $NPT_BOX_PACKAGES"
    # shellcheck disable=SC2086  # a list of package names
    chroot "$R" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        $NPT_BOX_PACKAGES >"$WORK/packages.log" 2>&1 || { tail -n 20 "$WORK/packages.log" >&2; exit 1; }
fi
chroot "$R" apt-get clean

echo "UUID=$uuid / ext4 errors=remount-ro 0 1" >"$R/etc/fstab"
echo debian12 >"$R/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 debian12\n' >"$R/etc/hosts"
# eth0 is Vagrant's management NIC; the lab's NICs stay unconfigured (auto_config: false)
cat >"$R/etc/network/interfaces" <<'EOF'
source /etc/network/interfaces.d/*
auto lo
iface lo inet loopback
allow-hotplug eth0
iface eth0 inet dhcp
EOF
chroot "$R" useradd -m -s /bin/bash vagrant
echo vagrant:vagrant | chroot "$R" chpasswd
echo 'vagrant ALL=(ALL) NOPASSWD: ALL' >"$R/etc/sudoers.d/vagrant"
chmod 440 "$R/etc/sudoers.d/vagrant"
install -d -m 700 -o 1000 -g 1000 "$R/home/vagrant/.ssh"
install -m 600 -o 1000 -g 1000 "$key" "$R/home/vagrant/.ssh/authorized_keys"
# reverse lookups of the management network's addresses would hold every ssh login up
echo 'UseDNS no' >"$R/etc/ssh/sshd_config.d/vagrant.conf"
sed -i 's/^# *en_US.UTF-8/en_US.UTF-8/' "$R/etc/locale.gen" && chroot "$R" locale-gen >/dev/null
# each VM makes its own host keys and machine id at first boot, not one set shared by all
rm -f "$R"/etc/ssh/ssh_host_*
cat >"$R/etc/systemd/system/ssh-hostkeys.service" <<'EOF'
[Unit]
Description=Make the SSH host keys this VM lacks
Before=ssh.service
[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A
[Install]
WantedBy=multi-user.target
EOF
chroot "$R" systemctl enable ssh-hostkeys.service >/dev/null 2>&1
: >"$R/etc/machine-id"

# extlinux: net.ifnames=0 keeps the NICs eth0, eth1, ... as on Debian's official box
install -d "$R/boot/extlinux"
extlinux --install "$R/boot/extlinux" 2>/dev/null
cat >"$R/boot/extlinux/extlinux.conf" <<EOF
default debian
timeout 1
label debian
  kernel /vmlinuz
  append initrd=/initrd.img root=UUID=$uuid ro net.ifnames=0 console=tty0 console=ttyS0,115200
EOF
dd if=/usr/lib/syslinux/mbr/mbr.bin of="$raw" bs=440 count=1 conv=notrunc status=none

cleanup
loop=""
trap - EXIT
log "qcow2 image"
qemu-img convert -O qcow2 "$raw" "$WORK/box.img"
rm -f "$raw"
printf '{"provider": "libvirt", "format": "qcow2", "virtual_size": %d}\n' "$SIZE_GB" >"$WORK/metadata.json"
cat >"$WORK/Vagrantfile" <<'EOF'
Vagrant.configure("2") do |config|
  config.vm.provider :libvirt do |libvirt|
    libvirt.disk_bus = "virtio"
  end
end
EOF
tar -C "$WORK" -cf "$WORK/nptrace-bookworm.box" metadata.json Vagrantfile box.img
# vagrant-libvirt copies a box into libvirt's pool once per `box add`: the older box's copy
# would stay there, a gigabyte each, and the VMs made from it go with it
if command -v virsh >/dev/null; then
    prefix="${NAME//\//-VAGRANTSLASH-}_vagrant_box_image_"
    for v in $(virsh -c qemu:///system vol-list default 2>/dev/null | awk -v p="$prefix" 'index($1, p) == 1 {print $1}'); do
        virsh -c qemu:///system vol-delete --pool default "$v" >/dev/null 2>&1 || true
    done
fi
vagrant box add --force --name "$NAME" --provider libvirt "$WORK/nptrace-bookworm.box" >&2
rm -rf "$WORK"
mkdir -p "$stamp_dir" && echo "$inputs" >"$stamp"
log "box $NAME added ($(( $(date +%s) - start )) s)"
