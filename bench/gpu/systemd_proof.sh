#!/bin/bash
# The systemd proof on the lent GPU machine (docs/gpu-proof.md): Debian 12's systemd as PID 1 of a
# PID + mount namespace, the project's real deploys/serve.py with the @local connector, nginx,
# smoke tests, a second deploy, benchmarks, kill -9, systemd-analyze security.
#
#   bash bench/gpu/systemd_proof.sh carry CARRY NN   copy CARRY/part-NN (one device call each) to /tmp/gpu-parts
#   bash bench/gpu/systemd_proof.sh one CARRY        wheelhouse, systemd, nginx, deploy 1 (+smoke), deploy 2
#   bash bench/gpu/systemd_proof.sh two CARRY STEP.. then the steps (bench kill security), and the JSON
#
# CARRY (the carried folder) holds part-NN + SHA256SUMS (bench/gpu/build_parts.py),
# systemd-deb12.tar and debs/*.deb (docs/gpu-proof.md says how they are built). Files for the
# device tool go to $OUT. Run from anywhere: the checkout is this script's ../..
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
what=$1; CARRY=$(cd "$2" && pwd); shift 2
SPEC=deployments/h200-systemd.yaml
# The unit the layout renders for that spec (vllm-NAME-N.service, issue 14); the recorded run used
# the earlier release's vllm.service.
UNIT=vllm-h200-systemd-0.service
PARTS=/tmp/gpu-parts
WH=/var/cache/vllm-fleet/wheelhouse
W=/var/tmp/vllm-fleet-proof   # not /tmp: systemd mounts a tmpfs there in its namespace
OUT=${OUT:-$W/out}
mkdir -p $W $OUT
log() { echo "[$(date -u +%T)] $*"; }
note() { python3 "$ROOT/bench/gpu/systemd_proof.py" note "$@"; }

source "$HERE/nsd.sh"  # install_systemd, systemd_pid (the namespace's PID 1, started once per machine), ns
in_root() { ns sh -c "cd '$ROOT' && $*"; }

case "$what" in
carry)
  mkdir -p $PARTS && cp "$CARRY/SHA256SUMS" $PARTS/ && cp "$CARRY/part-$1" $PARTS/ || exit 1
  (cd $PARTS && grep " part-$1\$" SHA256SUMS | sha256sum -c -) && ls $PARTS ;;

one)
  T0=$(date +%s)
  # -- what the image is (recorded in the JSON)
  { echo "kernel: $(uname -r)"; grep PRETTY /etc/os-release
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "nvidia-modprobe: $(command -v nvidia-modprobe || echo absent) $(ls -l "$(command -v nvidia-modprobe 2>/dev/null)" 2>/dev/null)"
    echo "sudo: $(command -v sudo || echo absent); curl: $(command -v curl || echo absent)"
    ls -l /dev/nvidia* 2>&1; grep -i nvidia /proc/devices
    echo "nvswitch pci: $(for d in /sys/bus/pci/devices/*; do echo "$(cat $d/vendor) $(cat $d/class)"; done 2>/dev/null | grep -c '^0x10de 0x0680')"
    echo "secure boot efivar: $(ls /sys/firmware/efi/efivars 2>/dev/null | grep -c SecureBoot)"
    for p in python3-venv python3-dev gcc curl sudo nginx libssl3 libssl3t64; do
      echo "dpkg $p: $(dpkg-query -W -f='${Status} ${Version}' $p 2>/dev/null || echo not-installed)"; done
    ls /usr/include/python3*/Python.h 2>&1; gcc --version 2>&1 | head -1; /opt/torch/.venv/bin/python -V
  } > $W/image.txt 2>&1
  cat $W/image.txt

  # -- the wheelhouse (carried in parts), the control machine's tools
  if [ ! -d $WH ]; then
    (cd $PARTS && grep " part-" SHA256SUMS | sha256sum -c --quiet -) || { log "part checksum mismatch"; exit 1; }
    mkdir -p /var/cache/vllm-fleet
    cat $PARTS/part-* | tar -x -C /var/cache/vllm-fleet || exit 1
    log "wheelhouse: $(ls $WH | wc -l) files, $(du -sm $WH | cut -f1) MiB"
  fi
  python3 -m pip install -q --disable-pip-version-check --no-index --find-links $WH pyinfra==3.10.0 jsonschema==4.26.0 || exit 1
  note image "@$W/image.txt"

  # -- Debian 12's systemd, sudo where the image lacks it (roles run some probes with _sudo)
  install_systemd "$CARRY/systemd-deb12.tar"
  if ! command -v sudo >/dev/null && ls "$CARRY"/debs/sudo_*.deb >/dev/null 2>&1; then dpkg -x "$CARRY"/debs/sudo_*.deb /; fi
  SD=$(systemd_pid) || { log "systemd did not start"; ls -l /usr/lib/systemd/systemd; cat $W/systemd.out; dmesg | grep -i systemd | tail -20; exit 1; }
  for _ in $(seq 30); do st=$(ns systemctl is-system-running 2>/dev/null); case $st in running|degraded) break;; esac; sleep 1; done
  log "systemd PID $SD in its namespace: $st ($(ns systemctl --version | head -1))"
  ns systemctl --failed --no-legend --no-pager | head

  # -- inside the namespace: no package source (none is reachable: apt-get update succeeds on
  #    nothing), and Debian's nginx from .deb files (policy-rc.d: its scripts start nothing).
  ns sh -c 'mkdir -p /run/no-apt-sources && mount --bind /run/no-apt-sources /etc/apt/sources.list.d && { [ ! -f /etc/apt/sources.list ] || mount --bind /dev/null /etc/apt/sources.list; }'
  ns sh -c "printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && \
            dpkg -i --force-depends '$CARRY'/debs/nginx*.deb > $W/nginx-dpkg.log 2>&1; rc=\$?; rm -f /usr/sbin/policy-rc.d; exit \$rc" \
    || { log "nginx dpkg failed"; tail -20 $W/nginx-dpkg.log; }
  ns sh -c 'nginx -v 2>&1; dpkg-query -W -f="\${Package} \${Status}\n" nginx nginx-common'

  # -- the model directory (config.json + tokenizer; transfer: none) and the env: the image's
  #    Python env holds the CUDA torch that vLLM 0.20.2 pins, linked where roles.pyenv puts the env
  read -r prefix mpath arch < <(cd "$ROOT" && python3 -c "
from vllm_fleet.specs.load import load_and_check; r, _ = load_and_check('$SPEC')
print(r['install']['prefix'], r['model']['path'], r['model']['architecture'])")
  mkdir -p "$prefix" && ln -sfn /opt/torch/.venv "$prefix/env"
  [ -f "$mpath/config.json" ] || (cd "$ROOT" && python3 bench/gpu/make_model.py "$arch" "$mpath") || exit 1
  NO_DEB=$(for p in python3-venv python3-dev gcc; do dpkg-query -W -f='${Status}' $p 2>/dev/null | grep -q "install ok installed" || printf '%s,' $p; done)
  note no_deb "\"$NO_DEB\""
  log "setup done in $(( $(date +%s) - T0 )) s; packages outside dpkg (left out of the roles' apt lists): ${NO_DEB:-none}"

  # -- deploy 1: the project's deploys/serve.py, as a user runs it
  t0=$(date +%s)
  in_root "VLLM_FLEET_PROOF_NO_DEB='$NO_DEB' VLLM_FLEET_SPEC=$SPEC PYTHONUNBUFFERED=1 python3 -m pyinfra -y bench/gpu/inventory_systemd.py deploys/serve.py" > $W/deploy1.log 2>&1
  rc=$?; note deploy1_s "$(( $(date +%s) - t0 ))"; note deploy1_rc "$rc"
  log "deploy 1: rc $rc in $(( $(date +%s) - t0 )) s"; grep -E "PASS|WARN|FAIL|Grand total|healthy after|Error|error:" $W/deploy1.log | tail -25
  cp $W/deploy1.log $OUT/
  if [ $rc -ne 0 ]; then ns systemctl status $UNIT --no-pager -n 80 | tail -c 6000; ns journalctl -u $UNIT -n 80 --no-pager -o cat | tail -c 5000; exit 1; fi
  in_root "python3 bench/gpu/systemd_proof.py deployed $SPEC $W/deploy1.log" || log "deployed step failed"
  cp /etc/systemd/system/$UNIT $OUT/rendered-$UNIT; note rendered_unit "@/etc/systemd/system/$UNIT"
  ns systemctl show -p ExecStartPre $UNIT > $W/execstartpre.txt; note exec_start_pre "@$W/execstartpre.txt"; cat $W/execstartpre.txt

  # -- deploy 2: nothing may change
  t0=$(date +%s)
  in_root "VLLM_FLEET_PROOF_NO_DEB='$NO_DEB' VLLM_FLEET_SPEC=$SPEC PYTHONUNBUFFERED=1 python3 -m pyinfra -y bench/gpu/inventory_systemd.py deploys/serve.py" > $W/deploy2.log 2>&1
  rc=$?; note deploy2_s "$(( $(date +%s) - t0 ))"
  log "deploy 2: rc $rc in $(( $(date +%s) - t0 )) s"; grep -E "Grand total" $W/deploy2.log
  in_root "python3 bench/gpu/systemd_proof.py second $SPEC $W/deploy2.log"
  cp $W/deploy2.log $OUT/
  log "call one done in $(( $(date +%s) - T0 )) s" ;;

two)
  T0=$(date +%s)
  SD=$(systemd_pid) || exit 1
  log "systemd PID $SD ($(ns systemctl is-active $UNIT nginx.service | tr '\n' ' '))"
  for step in "$@"; do
    in_root "PYTHONUNBUFFERED=1 timeout 420 python3 bench/gpu/systemd_proof.py $step $SPEC" 2>&1 | tail -15
    log "$step done ($(( $(date +%s) - T0 )) s)"
  done
  cp $W/security-rendered.txt $OUT/ 2>/dev/null
  in_root "python3 bench/gpu/systemd_proof.py report $SPEC $OUT/h200-systemd-h200-systemd.json"
  ns journalctl -u $UNIT --no-pager -o cat > $W/vllm-journal.txt 2>&1; tail -c 4000000 $W/vllm-journal.txt > $OUT/vllm-journal.txt
  log "call two done in $(( $(date +%s) - T0 )) s" ;;
esac
