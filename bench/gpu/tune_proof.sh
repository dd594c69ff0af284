#!/bin/bash
# Issue 17's H200 proof: `vllm-fleet tune` (the product's command) on the lent GPU machine, under
# real systemd (Debian 12's systemd as PID 1 of a PID + mount namespace, as bench/gpu/systemd_proof.sh
# does it), through the @local inventory bench/gpu/inventory_systemd.py, for Qwen2.5-7B AWQ
# (awq_marlin) and bf16 with random weights (deployments/h200-qwen7b-{awq,bf16}.yaml: proxy off,
# one replica, so the tune needs no upstream change).
#
#   bash bench/gpu/tune_proof.sh carry CARRY NN           copy CARRY/part-NN to /tmp/gpu-parts (one device call per part)
#   bash bench/gpu/tune_proof.sh setup CARRY              wheelhouse, pyinfra + jsonschema, systemd, model dirs, env links
#   bash bench/gpu/tune_proof.sh clean                    stop vllm-* units in every systemd namespace (a stray)
#   bash bench/gpu/tune_proof.sh deploy SPEC              stop the other tune spec's unit, then `vllm-fleet deploy` of SPEC
#   bash bench/gpu/tune_proof.sh tune SPEC NAME MINUTES   `vllm-fleet tune ... --budget MINUTES` (--resume when NAME's
#                                                         tune.jsonl exists); NAME.tar.gz (the --out folder) to $OUT
#   bash bench/gpu/tune_proof.sh routing SPEC NAME        issue 23: `vllm-fleet bench --multi-turn` across the routing
#                                                         policies (ROUTING_PROOF_ARGS); NAME.json + NAME.html to $OUT
#
# CARRY holds part-NN + SHA256SUMS (bench/gpu/build_parts.py), systemd-deb12.tar
# (shared/notes/gpu-systemd.md says how it is built) and, for a spec with a proxy, debs/nginx*.deb
# (Debian 12's nginx and nginx-common: `apt-get download nginx nginx-common`). The machine keeps systemd and the tune's
# --out folder between calls (setsid; /var/tmp), so a sweep cut by a call's limit goes on with
# --resume in the next call.
#
# TUNE_PROOF_LOCAL=1: the dry run on a control machine without the GPU, systemd or root image:
# no namespace, `deploy --dry` and `tune --dry` (prints the pruned grid), the specs as given (e.g.
# copies whose wheelhouse, model and key paths exist there). Nothing is changed.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
what=$1; shift
INV=bench/gpu/inventory_systemd.py
SPECS=${TUNE_PROOF_SPECS:-deployments/h200-qwen7b-awq.yaml deployments/h200-qwen7b-bf16.yaml}
# The 000 article's judgement: TPOT ~7 ms at concurrency 16 (on its 3090 + AWQ); TTFT p99 for chat.
TARGET=${TUNE_PROOF_TARGET:-ttft_p99_ms=500,tpot_p99_ms=7}
# The article's sweep by hand was max_num_seqs 16 vs 64 (and utilization 0.90 vs 0.95, which on a
# 140 GiB GPU only moves a KV cache of ~2M tokens that 128 sequences of 256 tokens never fill).
GRID=${TUNE_PROOF_GRID:-max_num_seqs=16,32,64,128}
PARTS=/tmp/gpu-parts
WH=/var/cache/vllm-fleet/wheelhouse
W=/var/tmp/vllm-fleet-proof   # not /tmp: systemd mounts a tmpfs there in its namespace
LOCAL=${TUNE_PROOF_LOCAL:-}
[ -n "$LOCAL" ] && W=${TMPDIR:-/tmp}/vllm-fleet-tune-proof-dry
OUT=${OUT:-$W/out}
PY=${TUNE_PROOF_PYTHON:-python3}
mkdir -p $W $OUT
log() { echo "[$(date -u +%T)] $*"; }

source "$HERE/nsd.sh"  # install_systemd, systemd_pid (the namespace's PID 1, started once per machine)
ns() { if [ -n "$LOCAL" ]; then "$@"; else nsenter -t "$SD" -a "$@"; fi; }
in_root() { ns sh -c "cd '$ROOT' && $*"; }
spec_field() { (cd "$ROOT" && $PY -c "
from vllm_fleet.specs.load import load_and_check; r, _ = load_and_check('$1')
print(r['name'], r['install']['prefix'], r['model']['path'], r['model']['architecture'])"); }

case "$what" in
carry)
  CARRY=$(cd "$1" && pwd)
  mkdir -p $PARTS && cp "$CARRY/SHA256SUMS" $PARTS/ && cp "$CARRY/part-$2" $PARTS/ || exit 1
  (cd $PARTS && grep " part-$2\$" SHA256SUMS | sha256sum -c -) && ls $PARTS ;;

setup)
  T0=$(date +%s)
  CARRY=$(cd "$1" && pwd)
  { nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader; uname -r; } 2>&1 | tee $OUT/image.txt
  if [ -z "$LOCAL" ]; then
    if [ ! -d $WH ]; then
      (cd $PARTS && grep " part-" SHA256SUMS | sha256sum -c --quiet -) || { log "part checksum mismatch"; exit 1; }
      mkdir -p /var/cache/vllm-fleet && cat $PARTS/part-* | tar -x -C /var/cache/vllm-fleet || exit 1
      log "wheelhouse: $(ls $WH | wc -l) files, $(du -sm $WH | cut -f1) MiB"
    fi
    $PY -m pip install -q --disable-pip-version-check --no-index --find-links $WH pyinfra==3.10.0 jsonschema==4.26.0 || exit 1
    # Debian 12's systemd (the image's newer libraries stay), /lib/systemd and the C library's
    # /lib path as on Debian (systemd_proof.sh says why), then systemd as PID 1 of a namespace.
    install_systemd "$CARRY/systemd-deb12.tar"
    SD=$(systemd_pid) || { log "systemd did not start"; cat $W/systemd.out; exit 1; }
    for _ in $(seq 30); do st=$(ns systemctl is-system-running 2>/dev/null); case $st in running|degraded) break;; esac; sleep 1; done
    log "systemd PID $SD in its namespace: $st ($(ns systemctl --version | head -1))"
    # no package source is reachable there: apt-get update succeeds on nothing
    ns sh -c 'mkdir -p /run/no-apt-sources && mount --bind /run/no-apt-sources /etc/apt/sources.list.d && { [ ! -f /etc/apt/sources.list ] || mount --bind /dev/null /etc/apt/sources.list; }'
    # Debian 12's nginx as .deb files (its maintainer scripts start nothing: policy-rc.d), for specs
    # with a proxy; the nginx role then finds it installed (no package source to fetch it from)
    if ls "$CARRY"/debs/nginx*.deb >/dev/null 2>&1 && ! ns dpkg-query -W -f='${Status}' nginx 2>/dev/null | grep -q "install ok installed"; then
      ns sh -c "printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && \
                dpkg -i --force-depends '$CARRY'/debs/nginx*.deb > $W/nginx-dpkg.log 2>&1; rc=\$?; rm -f /usr/sbin/policy-rc.d; exit \$rc" \
        || { log "nginx dpkg failed"; tail -20 $W/nginx-dpkg.log; }
      log "$(ns nginx -v 2>&1)"
    fi
  fi
  # per spec: the image's Python env (torch 2.11.0+cu130) where roles.pyenv puts the env, and the
  # model directory (config.json + tokenizer; transfer: none)
  for spec in $SPECS; do
    read -r name prefix mpath arch < <(spec_field $spec) || exit 1
    if [ -z "$LOCAL" ]; then
      mkdir -p "$prefix" && ln -sfn /opt/torch/.venv "$prefix/env"
      [ -f "$mpath/config.json" ] || (cd "$ROOT" && $PY bench/gpu/make_model.py "$arch" "$mpath") || exit 1
    fi
    log "$name: prefix $prefix, model $mpath ($arch)"
  done
  NO_DEB=$(for p in python3-venv python3-dev gcc; do dpkg-query -W -f='${Status}' $p 2>/dev/null | grep -q "install ok installed" || printf '%s,' $p; done)
  echo "$NO_DEB" > $W/no_deb
  log "setup done in $(( $(date +%s) - T0 )) s; packages outside dpkg: ${NO_DEB:-none}" ;;

deploy)
  spec=$1; T0=$(date +%s)
  [ -z "$LOCAL" ] && { SD=$(systemd_pid) || exit 1; }
  read -r name _ _ _ < <(spec_field $spec) || exit 1
  for other in $SPECS; do  # one GPU: the other tune deployment's vLLM gives its memory back first
    read -r oname _ _ _ < <(spec_field $other)
    [ "$oname" = "$name" ] || [ -n "$LOCAL" ] || ns systemctl stop "vllm-$oname-0.service" 2>/dev/null
  done
  how="-y"; [ -n "$LOCAL" ] && how="--dry"  # --dry without -y: pyinfra plans every operation (-y would skip that)
  # bounded well inside a device call's 600 s, so that a hung deploy still returns its log and the
  # journal (issue 17's first try: a wait that could not succeed ran into the call's limit)
  in_root "VLLM_FLEET_PROOF_NO_DEB='$(cat $W/no_deb 2>/dev/null)' PYTHONUNBUFFERED=1 timeout ${TUNE_PROOF_DEPLOY_TIMEOUT:-420} $PY -m vllm_fleet deploy $INV --spec $spec $how" > $W/deploy-$name.log 2>&1
  rc=$?
  [ $rc -eq 124 ] && log "deploy $name: stopped after ${TUNE_PROOF_DEPLOY_TIMEOUT:-420} s"
  cp $W/deploy-$name.log $OUT/
  log "deploy $name: rc $rc in $(( $(date +%s) - T0 )) s"; grep -E "PASS|WARN|FAIL|Grand total|healthy after|rror" $W/deploy-$name.log | tail -20
  [ $rc -eq 0 ] || [ -n "$LOCAL" ] || { ns journalctl -u "vllm-$name-0.service" -n 60 --no-pager -o cat | tail -c 5000; exit 1; }
  exit $rc ;;

tune)
  spec=$1; out=$2; budget=$3; T0=$(date +%s)
  [ -z "$LOCAL" ] && { SD=$(systemd_pid) || exit 1; }
  more=""; [ -s $W/$out/tune.jsonl ] && more="--resume"
  [ -n "$LOCAL" ] && more="--dry"
  in_root "PYTHONUNBUFFERED=1 $PY -m vllm_fleet tune $INV --spec $spec --target '$TARGET' --grid '$GRID' --budget $budget --out $W/$out $more" 2>&1 | tee $W/$out.log
  rc=${PIPESTATUS[0]}
  log "tune $out: rc $rc in $(( $(date +%s) - T0 )) s"
  mkdir -p $W/$out && cp $W/$out.log $W/$out/tune-proof.log
  tar -czf $OUT/$out.tar.gz -C $W $out && ls -l $OUT/$out.tar.gz
  exit $rc ;;
routing)
  # issue 23's comparison (docs/routing.md): each policy is a deploy of the proxy part only; the
  # result is written after every run, so a call cut short keeps the runs it finished
  spec=$1; out=$2; T0=$(date +%s)
  [ -z "$LOCAL" ] && { SD=$(systemd_pid) || exit 1; }
  ARGS=${ROUTING_PROOF_ARGS:---policies least_conn,session,cache_aware --conversations 96 --prefix-len 3000 --turns 8 --user-len 60 --reply-len 48 --think-time 3 --system-prompt-len 0,2000}
  [ -n "$LOCAL" ] && { in_root "$PY -m vllm_fleet bench $INV --spec $spec --multi-turn --help" | tail -3; exit 0; }
  log "vllm serve processes now: $(ps -eo pid,args | grep -c '[v]llm serve') (one deployment's replicas, no stray)"
  in_root "PYTHONUNBUFFERED=1 timeout ${ROUTING_PROOF_TIMEOUT:-560} $PY -m vllm_fleet bench $INV --spec $spec --multi-turn $ARGS --out $W/$out" 2>&1 | tee $W/$out.log
  rc=${PIPESTATUS[0]}
  log "routing $out: rc $rc in $(( $(date +%s) - T0 )) s"
  cp $W/$out/routing.json $OUT/$out.json 2>/dev/null; cp $W/$out/routing.html $OUT/$out.html 2>/dev/null
  cp $W/$out/routing.png $OUT/$out.png 2>/dev/null; cp $W/$out.log $OUT/ 2>/dev/null
  for u in $(ns systemctl list-units --no-legend --plain 'vllm-*' | cut -d' ' -f1); do
    ns journalctl -u "$u" --no-pager -o cat 2>/dev/null | grep -E "KV cache|Available|prefix cache|ERROR|Traceback" | tail -5 | sed "s/^/$u: /"
  done > $OUT/$out.units.txt
  exit $rc ;;
clean)
  # Before a deploy that changes a running vLLM: stop the vllm-* units in EVERY systemd namespace on
  # the machine. A call may start a second systemd (the last one's PID not seen again), and the
  # first one's vLLM then keeps serving beside the new one: both bind the port with SO_REUSEPORT,
  # and the deploy's health wait and the bench read the old process (issue 37's first "without" runs).
  for u in $(pgrep -x unshare); do
    for sd in $(pgrep -P "$u"); do
      [ "$(cat /proc/$sd/comm 2>/dev/null)" = systemd ] || continue
      n=$(nsenter -t "$sd" -a systemctl list-units --no-legend --plain 'vllm-*' 2>/dev/null | wc -l)
      nsenter -t "$sd" -a sh -c "systemctl stop 'vllm-*.service'; systemctl reset-failed 'vllm-*'" 2>/dev/null
      log "systemd $sd: stopped its $n vllm-* unit(s)"
    done
  done
  for _ in $(seq 30); do ps -eo args | grep -q "^[^ ]*python[^ ]* [^ ]*vllm serve" || break; sleep 1; done
  log "vllm serve processes left: $(ps -eo pid,args | grep -c '[v]llm serve'); GPU used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)" ;;
*) echo "usage: $0 carry CARRY NN | setup CARRY | clean | deploy SPEC | tune SPEC NAME MINUTES | routing SPEC NAME" >&2; exit 2 ;;
esac
