#!/bin/bash
# Issue 26's proof on a lent machine of two GPUs (nvidia-h200-x2): TP 2 and one replica per GPU,
# both through the product's own deploy under real systemd (Debian 12's systemd as PID 1 of a PID +
# mount namespace, as tune_proof.sh starts it), with the rendered sandbox, and the
# SystemCallFilter trial under TP 2. Everything that runs on the GPU machine is a step below; the
# machine keeps systemd, the wheelhouse and $W between back-to-back calls.
#
#   bash bench/gpu/x2_proof.sh carry CARRY NN     copy CARRY/part-NN to /tmp/gpu-parts (as tune_proof.sh)
#   bash bench/gpu/x2_proof.sh setup CARRY        wheelhouse, pyinfra, systemd, model dirs (tune_proof.sh setup)
#   bash bench/gpu/x2_proof.sh tp2                deploy h200-qwen7b-bf16-tp2; diff = no change; kill -9 the
#                                                 main PID: restarted + healthy; bench c1/c16; KV tokens vs plan
#   bash bench/gpu/x2_proof.sh filter             TP 2 with SystemCallFilter off (drop-in) and on: health, smoke,
#                                                 any EPERM in the journal (which syscall), exposure scores
#   bash bench/gpu/x2_proof.sh replicas           deploy h200x2-qwen7b-replicas: each unit's GPU (environ +
#                                                 nvidia-smi by cgroup), smoke through nginx, rollout under load
#   bash bench/gpu/x2_proof.sh collect            bench/results/h200x2-*.json from what the steps wrote, to $OUT
#
# X2_PROOF_LOCAL=1: the dry run on a control machine (no GPU, no namespace): deploy/diff/rollout --dry,
# no kill, no bench; it checks that every command line of the plan is well formed.
# What to look for in `filter`: @system-service (systemd 252) has no pidfd_getfd (it is in @debug);
# CUDA IPC of cuMem/expandable-segment memory imports peers' file descriptors with it (PyTorch,
# some NCCL/UCX paths), so an EPERM there names the call that would keep the filter off.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
what=${1:-}; shift || true
INV=bench/gpu/inventory_systemd.py
TP2=deployments/h200-qwen7b-bf16-tp2.yaml
REP=deployments/h200x2-qwen7b-replicas.yaml
export TUNE_PROOF_SPECS="$TP2 $REP" TUNE_PROOF_LOCAL=${X2_PROOF_LOCAL:-}
LOCAL=${X2_PROOF_LOCAL:-}
W=/var/tmp/vllm-fleet-x2-proof; [ -n "$LOCAL" ] && W=${TMPDIR:-/tmp}/vllm-fleet-x2-proof-dry
OUT=${OUT:-$W/out}
PY=${X2_PROOF_PYTHON:-python3}; export TUNE_PROOF_PYTHON=$PY
mkdir -p "$W" "$OUT"
if [ -n "$LOCAL" ]; then  # copies of the specs whose wheelhouse exists here (an empty folder: --dry reads no wheel)
  mkdir -p "$W/wheelhouse"
  for s in $TP2 $REP; do
    n=$(basename $s .yaml)
    sed -e "s|^  wheelhouse: .*|  wheelhouse: $W/wheelhouse|" -e "s|/var/lib/vllm-fleet/$n/model|$W/$n/model|g" "$ROOT/$s" > "$W/$n.yaml"
    [ -f "$W/$n/model/config.json" ] || "${X2_PROOF_MODEL_PYTHON:-$PY}" "$HERE/make_model.py" qwen2.5-7b-instruct "$W/$n/model" >/dev/null || exit 1
  done
  TP2=$W/$(basename $TP2); REP=$W/$(basename $REP); export TUNE_PROOF_SPECS="$TP2 $REP"
fi
log() { echo "[$(date -u +%T)] $*"; }
sd() { cat /var/tmp/vllm-fleet-proof/sd.pid 2>/dev/null; }   # tune_proof.sh's systemd (setup starts it)
ns() { if [ -n "$LOCAL" ]; then "$@"; else nsenter -t "$(sd)" -a "$@"; fi; }
in_root() { ns sh -c "cd '$ROOT' && $*"; }
fleet() { in_root "PYTHONUNBUFFERED=1 timeout ${X2_PROOF_TIMEOUT:-420} $PY -m vllm_fleet $*"; }
unit_prop() { ns systemctl show -p "$2" --value "$1"; }
health_wait() {  # UNIT PORT: seconds until /health answers 200 (or "timeout")
  local t0=$(date +%s)
  for _ in $(seq 300); do
    curl -fsS -o /dev/null "http://127.0.0.1:$2/health" && { echo $(( $(date +%s) - t0 )); return 0; }
    sleep 2
  done
  echo timeout; return 1
}
security() { ns systemd-analyze security "$1" 2>/dev/null | tail -1 | sed 's/.*exposure level for [^:]*: *//'; }

case "$what" in
carry|setup) exec bash "$HERE/tune_proof.sh" "$what" "$@" ;;

tp2)
  u=vllm-h200-qwen7b-bf16-tp2-0.service
  [ -n "$LOCAL" ] || ns systemctl stop vllm-h200x2-qwen7b-replicas-0.service vllm-h200x2-qwen7b-replicas-1.service 2>/dev/null
  T0=$(date +%s)
  bash "$HERE/tune_proof.sh" deploy $TP2 > "$W/tp2-deploy.txt" 2>&1; rc=$?
  log "tp2 deploy: rc $rc in $(( $(date +%s) - T0 )) s"; tail -25 "$W/tp2-deploy.txt"
  [ $rc -eq 0 ] || exit 1
  fleet diff $INV --spec $TP2 > "$W/tp2-diff.txt" 2>&1; echo "diff rc $? (0 = a second deploy changes nothing)" | tee -a "$W/tp2-diff.txt"
  [ -n "$LOCAL" ] && exit 0
  ns systemctl cat $u > "$W/tp2-unit.txt"; security $u > "$W/tp2-exposure.txt"
  pid=$(unit_prop $u MainPID); n0=$(unit_prop $u NRestarts)
  log "kill -9 $pid (NRestarts $n0)"; kill -9 "$pid"
  sleep 5; h=$(health_wait $u 8000); n1=$(unit_prop $u NRestarts)
  echo "{\"killed_pid\": $pid, \"nrestarts_before\": $n0, \"nrestarts_after\": $n1, \"healthy_after_s\": \"$h\"}" > "$W/tp2-restart.json"
  cat "$W/tp2-restart.json"
  fleet deploy $INV --spec $TP2 -y > "$W/tp2-redeploy.txt" 2>&1; echo "re-deploy (smoke) rc $?"; grep -E "PASS|FAIL|WARN" "$W/tp2-redeploy.txt" | tail -12
  fleet bench $INV --spec $TP2 --concurrency 1,16 --input-len 512 --output-len 128 --out "$W/tp2-bench" > "$W/tp2-bench.txt" 2>&1; echo "bench rc $?"; tail -8 "$W/tp2-bench.txt"
  ns journalctl -u $u --no-pager -o cat | grep -E "KV cache size|Maximum concurrency|ulimit|Operation not permitted|EPERM" | tail -8 | tee "$W/tp2-journal.txt"
  fleet plan $TP2 --json > "$W/tp2-plan.json" 2>&1 ;;

filter)
  u=vllm-h200-qwen7b-bf16-tp2-0.service; d=/etc/systemd/system/$u.d
  [ -n "$LOCAL" ] && { echo "filter: needs the GPU machine's systemd (nothing done here)"; exit 0; }
  for mode in off on; do
    ns mkdir -p $d
    if [ $mode = off ]; then printf '[Service]\nSystemCallFilter=\n' | ns tee $d/x2-proof-filter.conf >/dev/null
    else ns rm -f $d/x2-proof-filter.conf; fi
    ns systemctl daemon-reload; t0=$(date +%s); ns systemctl restart $u
    h=$(health_wait $u 8000)
    eperm=$(ns journalctl -u $u --since "@$t0" --no-pager -o cat | grep -ciE "operation not permitted|EPERM|pidfd_getfd")
    echo "{\"filter\": \"$mode\", \"healthy_after_s\": \"$h\", \"eperm_lines\": $eperm, \"exposure\": \"$(security $u)\"}" | tee "$W/filter-$mode.json"
    ns journalctl -u $u --since "@$t0" --no-pager -o cat | grep -iE "operation not permitted|EPERM|pidfd|custom allreduce|P2P|NCCL" | tail -15 > "$W/filter-$mode-journal.txt"
  done
  fleet deploy $INV --spec $TP2 -y > "$W/filter-smoke.txt" 2>&1; echo "smoke with the filter on: rc $?" ;;

replicas)
  [ -n "$LOCAL" ] || ns systemctl stop vllm-h200-qwen7b-bf16-tp2-0.service 2>/dev/null
  T0=$(date +%s)
  bash "$HERE/tune_proof.sh" deploy $REP > "$W/rep-deploy.txt" 2>&1; rc=$?
  log "replicas deploy: rc $rc in $(( $(date +%s) - T0 )) s"; tail -25 "$W/rep-deploy.txt"
  [ $rc -eq 0 ] || exit 1
  [ -n "$LOCAL" ] && exit 0
  : > "$W/rep-gpus.txt"
  nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader > "$W/rep-apps.csv"
  for i in 0 1; do
    u=vllm-h200x2-qwen7b-replicas-$i.service; pid=$(unit_prop $u MainPID)
    cvd=$(tr '\0' '\n' < /proc/$pid/environ | grep ^CUDA_VISIBLE_DEVICES=)
    cg=$(unit_prop $u ControlGroup)
    mine=$(while IFS=, read -r p uuid mem; do grep -q "$cg" /proc/$p/cgroup 2>/dev/null && echo "$uuid$mem"; done < "$W/rep-apps.csv" | sort -u | tr '\n' ';')
    echo "$u main $pid $cvd gpus-used: $mine exposure $(security $u)" | tee -a "$W/rep-gpus.txt"
  done
  in_root "$PY bench/rollout.py --inventory $INV --spec $REP --concurrency 8 --max-tokens 64 --batch-size 1 --out $W/rep-rollout.json" > "$W/rep-rollout.txt" 2>&1
  echo "rollout rc $?"; tail -6 "$W/rep-rollout.txt" ;;

collect)
  cd "$W" && tar -czf "$OUT/x2-proof.tar.gz" --ignore-failed-read ./*.txt ./*.json ./*.csv tp2-bench 2>/dev/null
  ls -l "$OUT" ;;

*) echo "usage: $0 carry CARRY NN | setup CARRY | tp2 | filter | replicas | collect" >&2; exit 2 ;;
esac
