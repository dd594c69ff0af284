#!/bin/bash
# Build the lab hosts' Debian 12 root filesystem into directory $1 (must not exist or be empty).
#
# This file is the recipe: the rootfs cache key is a hash of it (vllm_fleet/lab/nspawn.py), so any
# edit here rebuilds the cached tarball on the next `vllm-fleet lab up`. Keep it lean: deploys
# install what they need themselves (nginx, Ray, vLLM, ...).
#
# Only generic settings live here. Per-lab (SSH key, CA certificates) and per-host (hostname,
# address, SSH host key) settings are applied at bring-up.
#
# Apt sources: $LAB_APT_SOURCES (a .sources/.list file or a mirror line); default: the control
# machine's own Debian sources file, so the rootfs uses the same mirror (or proxy) as the host.
set -euo pipefail

target=${1:?usage: rootfs.sh TARGET_DIR}

sources=${LAB_APT_SOURCES:-}
if [ -z "$sources" ]; then
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
        if [ -s "$f" ] && grep -qE '^[^#]*bookworm' "$f"; then sources=$f; break; fi
    done
fi
if [ -z "$sources" ]; then
    echo "rootfs.sh: no Debian bookworm apt sources found on this machine; set LAB_APT_SOURCES" >&2
    exit 2
fi

packages=(
    systemd-sysv dbus udev
    openssh-server sudo
    python3 python3-venv python3-pip
    iproute2 iputils-ping ca-certificates curl procps
    nftables rsync less
)

hook=$(cat <<'EOF'
set -eu
r="$1"
chroot "$r" systemctl enable ssh.service systemd-networkd.service
# apt-daily takes the dpkg lock in the middle of deploys; e2scrub and ifupdown have no place here.
chroot "$r" systemctl mask apt-daily.timer apt-daily-upgrade.timer apt-daily.service \
    apt-daily-upgrade.service e2scrub_all.timer e2scrub_reap.service networking.service
# SSH host keys: none baked in; bring-up installs one per host, ssh-keygen -A fills the rest.
rm -f "$r"/etc/ssh/ssh_host_*
mkdir -p "$r/etc/systemd/system/ssh.service.d"
printf '[Service]\nExecStartPre=\nExecStartPre=/usr/bin/ssh-keygen -A\nExecStartPre=/usr/sbin/sshd -t\n' \
    > "$r/etc/systemd/system/ssh.service.d/10-lab-hostkeys.conf"
# A fresh machine-id per host at first boot.
: > "$r/etc/machine-id"
rm -f "$r/var/lib/dbus/machine-id"
# A LABEL= line breaks systemd-remount-fs in a container.
: > "$r/etc/fstab"
# The lab user: passwordless sudo.
chroot "$r" useradd --create-home --shell /bin/bash --groups sudo lab
printf 'lab ALL=(ALL:ALL) NOPASSWD: ALL\n' > "$r/etc/sudoers.d/lab"
chmod 0440 "$r/etc/sudoers.d/lab"
install -d -m 0700 "$r/root/.ssh"
install -d -m 0700 -o "$(chroot "$r" id -u lab)" -g "$(chroot "$r" id -g lab)" "$r/home/lab/.ssh"
# /proc/uptime in a container is the host's: bind lxcfs's per-container one over it (the
# control machine binds its lxcfs mount at /var/lib/lxcfs), so reboot detection works.
mkdir -p "$r/var/lib/lxcfs"
cat > "$r/etc/systemd/system/lab-lxcfs-uptime.service" <<'UNIT'
[Unit]
Description=Per-container /proc/uptime from lxcfs (vllm-fleet lab)
DefaultDependencies=no
ConditionPathExists=/var/lib/lxcfs/proc/uptime
Before=sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/mount --bind /var/lib/lxcfs/proc/uptime /proc/uptime

[Install]
WantedBy=sysinit.target
UNIT
chroot "$r" systemctl enable lab-lxcfs-uptime.service
# Lean: no package lists or downloaded debs (deploys run apt-get update themselves).
rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/*.bin "$r"/var/cache/apt/archives/*.deb
EOF
)

exec mmdebstrap --variant=apt --mode=root --format=directory \
    --include="$(IFS=,; echo "${packages[*]}")" \
    --customize-hook="$hook" \
    bookworm "$target" "$sources" </dev/null
