#!/bin/bash
# The GPU proof's steps on the lent GPU machine (docs/gpu-proof.md). Run from the repo root there.
#   bench/gpu/device.sh carry NN          copy .gpu-parts/part-NN (carried by the device tool) to /tmp/gpu-parts
#   bench/gpu/device.sh install SPEC...   check + unpack the parts into /var/cache/vllm-fleet/wheelhouse,
#                                          pyinfra from it, then per spec: model dir + @local deploy
#   bench/gpu/device.sh serve OUT SPEC... run_spec.py per spec (serve, smoke, bench, KV vs planner)
set -uo pipefail
cd "$(dirname "$0")/../.."
PARTS=/tmp/gpu-parts
WH=/var/cache/vllm-fleet/wheelhouse
what=$1; shift
case "$what" in
carry)
  mkdir -p $PARTS && cp .gpu-parts/SHA256SUMS $PARTS/ && cp ".gpu-parts/part-$1" $PARTS/ || exit 1
  (cd $PARTS && grep " part-$1\$" SHA256SUMS | sha256sum -c -) && ls $PARTS ;;
install)
  if [ ! -d $WH ]; then
    (cd $PARTS && grep " part-" SHA256SUMS | sha256sum -c --quiet -) || exit 1
    mkdir -p /var/cache/vllm-fleet
    cat $PARTS/part-* | tee >(sha256sum | sed 's/-$/wheelhouse.tar/' > /tmp/wh.sum) | tar -x -C /var/cache/vllm-fleet || exit 1
    sleep 1; grep -q "$(cut -d' ' -f1 /tmp/wh.sum)" $PARTS/SHA256SUMS && echo "wheelhouse.tar: OK" || { echo "wheelhouse.tar checksum mismatch"; exit 1; }
    echo "wheelhouse: $(ls $WH | wc -l) files, $(du -sm $WH | cut -f1) MiB"
  fi
  # The control machine's own tools (pyinfra, and jsonschema for vllm-fleet's spec checks), from the same wheelhouse.
  python3 -m pip install -q --disable-pip-version-check --no-index --find-links $WH pyinfra==3.10.0 jsonschema==4.26.0 || exit 1
  for spec in "$@"; do
    read -r prefix mpath arch < <(python3 -c "
from vllm_fleet.specs.load import load_and_check; r, _ = load_and_check('$spec')
print(r['install']['prefix'], r['model']['path'], r['model']['architecture'])")
    # The image's Python env (torch 2.11.0+cu130) stands in for the env roles.pyenv would create.
    mkdir -p "$prefix" && ln -sfn /opt/torch/.venv "$prefix/env"
    [ -f "$mpath/config.json" ] || python3 bench/gpu/make_model.py "$arch" "$mpath" || exit 1
    t0=$(date +%s)
    VLLM_FLEET_SPEC=$spec python3 -m pyinfra -y bench/gpu/inventory_local.py bench/gpu/deploy_gpu.py || exit 1
    echo "deploy $spec: $(( $(date +%s) - t0 )) s"
  done ;;
serve)
  out=$1; shift
  for spec in "$@"; do python3 bench/gpu/run_spec.py "$spec" "$out" || echo "run_spec $spec failed"; done ;;
esac
