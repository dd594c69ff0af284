# Debian 12's systemd as PID 1 of a PID + mount namespace on the lent GPU machine (its own PID 1 is
# not systemd: ../shared/notes/gpu-systemd.md). Sourced by the GPU proofs (systemd_proof.sh,
# ipc_probe.sh); they set W (a work dir outside /tmp: systemd mounts a tmpfs there) first.
#   install_systemd TAR   unpack Debian 12's systemd (the image's newer libraries stay) and make
#                         /lib/systemd and the C library's /lib paths what Debian's units expect
#   systemd_pid           the namespace's PID 1 (started once per machine), printed
#   ns CMD...             run CMD inside that namespace (systemctl, journalctl, ...); needs SD

install_systemd() {
  # --skip-old-files: the image's own (newer) libraries stay; only what it lacks is added
  tar --skip-old-files -xf "$1" -C / 2>&1 | tail -2
  # Debian's units name /lib/systemd/...; this image's /lib is a directory of its own (not a link
  # to /usr/lib as on Debian 12), and the tar holds the real /usr/lib paths.
  [ -e /lib/systemd/systemd ] || { [ -d /lib/systemd ] && ! [ -L /lib/systemd ] && cp -an /lib/systemd/. /usr/lib/systemd/ && rm -rf /lib/systemd; ln -sfn /usr/lib/systemd /lib/systemd; }
  # The same for the C library: libc.so (the linker script gcc reads) names /lib/x86_64-linux-gnu/
  # libc.so.6, which this image's /lib lacks (Triton's launcher build failed with "ld: cannot find").
  [ -e /lib/x86_64-linux-gnu/libc.so.6 ] || [ -e /lib/x86_64-linux-gnu ] || ln -s /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu
}

systemd_pid() {
  local sd=""
  [ -f $W/sd.pid ] && sd=$(cat $W/sd.pid) && [ -d /proc/$sd ] && [ "$(cat /proc/$sd/comm)" = systemd ] && { echo $sd; return; }
  setsid unshare --pid --fork --mount --mount-proc --propagation private \
      /usr/lib/systemd/systemd --system --log-target=kmsg </dev/null >$W/systemd.out 2>&1 &
  local u
  for _ in $(seq 40); do
    sleep 0.5
    for u in $(pgrep -x unshare); do
      sd=$(pgrep -P $u | head -1)
      [ -n "$sd" ] && [ "$(cat /proc/$sd/comm 2>/dev/null)" = systemd ] && { echo $sd > $W/sd.pid; echo $sd; return; }
    done
  done
  return 1
}

ns() { nsenter -t "$SD" -a "$@"; }
