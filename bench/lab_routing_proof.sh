#!/bin/bash
# Issue 23's lab proof in one go, holding the lab lock the whole time (another helper's deploy
# between the steps would replace the fleet):
#   flock /tmp/vllm-fleet-lab.lock bash bench/lab_routing_proof.sh OUTDIR
# 1. deploy deployments/lab-tiny-routing.yaml on lab1..lab3 (cache_aware; router + nginx on lab1)
# 2. the multi-turn comparison of every policy (bench/lab_routing.py compare -> OUTDIR/compare)
# 3. kill lab3's vLLM under load (bench/lab_routing.py kill -> OUTDIR/kill.json)
# 4. a rolling update under load through the router (bench/rollout.py -> OUTDIR/rollout.json)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-/tmp/lab-routing-proof}; mkdir -p "$OUTDIR"
export VLLM_FLEET_LAB_SERVERS=lab1,lab2,lab3 PYTHONUNBUFFERED=1
PY=.venv/bin/python
log() { echo "[$(date -u +%T)] $*"; }
# lab1 may run another test's lab-tiny on the same ports: out of the way first (its env stays)
env -u VLLM_FLEET_LAB_SERVERS $PY -m vllm_fleet down inventory/lab.py --spec deployments/lab-tiny.yaml --limit lab1 -y > "$OUTDIR/down-lab-tiny.log" 2>&1; log "down lab-tiny on lab1: rc $?"
log "deploy (cache_aware)"; T0=$(date +%s)
$PY -m vllm_fleet deploy inventory/lab.py --spec deployments/lab-tiny-routing.yaml -y > "$OUTDIR/deploy.log" 2>&1 || { log "deploy failed"; tail -40 "$OUTDIR/deploy.log"; exit 1; }
log "deployed in $(( $(date +%s) - T0 )) s"; grep -E "PASS|FAIL|Grand total|router up" "$OUTDIR/deploy.log" | tail -12
log "compare"; $PY bench/lab_routing.py compare --out "$OUTDIR/compare" 2>&1 | tee "$OUTDIR/compare.log"
log "kill"; $PY bench/lab_routing.py kill --out "$OUTDIR/kill.json" 2>&1 | tee "$OUTDIR/kill.log"
sleep 5
log "wait for lab3 back"; for _ in $(seq 60); do $PY -m vllm_fleet status inventory/lab.py --spec deployments/lab-tiny-routing.yaml > "$OUTDIR/status.log" 2>&1 && break; sleep 5; done
log "rollout"; $PY bench/rollout.py --spec deployments/lab-tiny-routing.yaml --concurrency 3 --out "$OUTDIR/rollout.json" 2>&1 | tail -30 | tee "$OUTDIR/rollout.log"
# leave the lab as other tests expect it: no lab-tiny-routing on the hosts (their deploys bring theirs)
$PY -m vllm_fleet down inventory/lab.py --spec deployments/lab-tiny-routing.yaml -y > "$OUTDIR/down.log" 2>&1; log "down lab-tiny-routing: rc $?"
# the CI lab test (tests/lab/test_rollout.py: session routing on the 3 replicas), timed
if [ -n "${LAB_ROUTING_CI_TEST:-1}" ]; then
  log "CI lab test"; T0=$(date +%s)
  env -u VLLM_FLEET_LAB_SERVERS VLLM_FLEET_KEEP_LAB=1 VLLM_FLEET_REQUIRE_LAB=1 VLLM_FLEET_LAB_TEST_HOSTS=3 \
      .venv/bin/pytest -q -p no:randomly tests/lab/test_rollout.py -k session_routing > "$OUTDIR/ci-test.log" 2>&1
  log "CI lab test: rc $? in $(( $(date +%s) - T0 )) s"; tail -5 "$OUTDIR/ci-test.log"
fi
log "done"
