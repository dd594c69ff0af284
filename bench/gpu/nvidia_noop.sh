#!/bin/sh
# On the lent GPU machine (device `run`, carry .gpu-parts/ctl): the nvidia role's no-op and its
# after-reboot check (read_now) on a real GPU host (bench/gpu/nvidia_noop.py). The control
# machine's tools travel as wheels: on the control machine (with network)
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --implementation cp \
#     -d .gpu-parts/ctl pyinfra==3.10.0 'jsonschema>=4.20' 'pyyaml>=6' 'requests>=2.31' 'jinja2>=3.1'
# Prints the commands each run sent (pyinfra -vv's `[@local] >>>` lines) and its exit status;
# the logs land in $OUT.
set -u
PY=${PY:-/opt/torch/.venv/bin/python}
OUT=${OUT:-/tmp/nvidia-noop}
mkdir -p "$OUT" /var/tmp/ctl-site
"$PY" -m pip install -q --no-index --find-links .gpu-parts/ctl --target /var/tmp/ctl-site \
  pyinfra==3.10.0 jsonschema pyyaml requests jinja2 || exit 1
export PYTHONPATH="/var/tmp/ctl-site:$PWD" VLLM_FLEET_SPEC=deployments/h200-systemd.yaml
run() {  # NAME [VAR=VALUE]
  name=$1; shift
  env "$@" "$PY" -m pyinfra -y -vv bench/gpu/inventory_systemd.py bench/gpu/nvidia_noop.py > "$OUT/$name.log" 2>&1
  rc=$?
  sent=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/$name.log" | grep -c '^ *\[@local\] >>> ')
  echo "$name: rc=$rc, commands sent=$sent"
  sed 's/\x1b\[[0-9;]*m//g' "$OUT/$name.log" | grep -E 'NVIDIA driver branch|Grand total|GpuMismatch|after installing|\[@local\] (Success|Error|No changes)' | tail -8
}
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
run converged
run converged-again
run check-wants-999 VLLM_FLEET_CHECK_BRANCH=999
