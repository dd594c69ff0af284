#!/bin/bash
# The CUDA IPC probe of issue 39 on the lent GPU machine, under Debian 12's systemd (bench/gpu/nsd.sh).
#
#   bash bench/gpu/ipc_probe.sh DIR
#
# DIR (the carried folder) holds systemd-deb12.tar and one folder per trial written here by
# `python bench/gpu/ipc_probe.py render DIR LABEL [--ref REF]`: the product's own vLLM unit for the
# TP 2 proof spec with its program replaced by bench/gpu/ipc_test.py. Each trial's unit is
# installed as vllm-ipc-LABEL.service (its env files beside it, Restart=no in a drop-in so a failed
# import is read once), started, and read back: the test's result file, the journal, `systemctl
# show` (systemd's own reading of SystemCallFilter) and `systemd-analyze security`. One more trial,
# `control-nofilter`, is the `before` trial's unit without its SystemCallFilter= lines: the test itself
# works there. $OUT/LABEL.json per trial, $OUT/h200-ipc-sandbox.json all of them.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
DIR=$(cd "$1" && pwd)
W=/var/tmp/vllm-fleet-ipc   # not /tmp: systemd mounts a tmpfs there in its namespace
OUT=${OUT:-$W/out}
mkdir -p $W $OUT
log() { echo "[$(date -u +%T)] $*"; }
source "$HERE/nsd.sh"

install_systemd "$DIR/systemd-deb12.tar"
SD=$(systemd_pid) || { log "systemd did not start"; cat $W/systemd.out; exit 1; }
for _ in $(seq 30); do st=$(ns systemctl is-system-running 2>/dev/null); case $st in running|degraded) break;; esac; sleep 1; done
log "systemd PID $SD: $st ($(ns systemctl --version | head -1)); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"

first="$DIR/before"; [ -d "$first" ] || first=$(ls -d "$DIR"/*/ | head -1)
mkdir -p "$DIR/control-nofilter"
grep -v '^SystemCallFilter=' "$first/unit" > "$DIR/control-nofilter/unit"
sed 's/"label": "[^"]*"/"label": "control-nofilter"/' "$first/meta.json" > "$DIR/control-nofilter/meta.json"

for d in "$DIR"/*/; do
  label=$(basename "$d"); name=vllm-ipc-$label.service
  read -r user state probe < <(python3 -c "import json; m = json.load(open('$d/meta.json')); print(m['user'], m['state_dir'], m['probe_dir'])")
  id -u "$user" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$user"
  # what the deploy would have put in place: the env files (their modes), the state dirs
  python3 - "$d/meta.json" <<'PY'
import json, os, sys
for path, f in json.load(open(sys.argv[1]))["env_files"].items():
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as out:
        out.write(f["content"])
    os.chmod(path, f["mode"])
PY
  mkdir -p "$probe" "$state/replica-0" && cp "$HERE/ipc_test.py" "$probe/" && rm -f "$probe/result.json"
  chown -R "$user:" "$state"
  cp "$d/unit" /etc/systemd/system/$name
  mkdir -p /etc/systemd/system/$name.d && printf '[Service]\nRestart=no\n' > /etc/systemd/system/$name.d/probe.conf
  ns systemctl daemon-reload
  ns systemctl reset-failed $name 2>/dev/null
  t0=$(date +%s)
  ns systemctl start $name
  for _ in $(seq 240); do s=$(ns systemctl show -p ActiveState --value $name); case $s in inactive|failed) break;; esac; sleep 1; done
  ns systemctl show -p Result,ExecMainStatus,User $name > $W/$label.show
  ns systemctl show -p SystemCallFilter --value $name | tr ' ' '\n' | grep -c . > $W/$label.count
  ns systemctl show -p SystemCallFilter --value $name | tr ' ' '\n' | grep -x pidfd_getfd > $W/$label.pidfd
  ns systemctl show -p SystemCallErrorNumber --value $name > $W/$label.errno
  ns journalctl -u $name --no-pager -o cat > $W/$label.journal
  ns systemd-analyze security $name > $W/$label.security 2>&1
  cp "$probe/result.json" $W/$label.result 2>/dev/null || echo '{"ok": false, "error": "no result file (see journal)"}' > $W/$label.result
  python3 - "$label" "$d" "$W" "$(( $(date +%s) - t0 ))" > $OUT/$label.json <<'PY'
import json, re, sys
label, d, w, secs = sys.argv[1:]
meta = json.load(open(f"{d}/meta.json"))
show = dict(l.split("=", 1) for l in open(f"{w}/{label}.show").read().split("\n") if "=" in l)
sec = open(f"{w}/{label}.security").read()
m = re.search(r"Overall exposure level for \S+: ([\d.]+) (\w+)", sec)
journal = open(f"{w}/{label}.journal").read().splitlines()
print(json.dumps({
    "label": label, "ref": meta["ref"], "spec": meta["spec"], "rendered_unit": meta["unit"],
    "syscall_lines": [l for l in open(f"{d}/unit").read().splitlines() if l.startswith("SystemCall")],
    "systemd_reads": {"SystemCallFilter_entries": int(open(f"{w}/{label}.count").read() or 0),
                      "pidfd_getfd_allowed": open(f"{w}/{label}.pidfd").read().strip() == "pidfd_getfd",
                      "SystemCallErrorNumber": open(f"{w}/{label}.errno").read().strip(), **show},
    "result": json.load(open(f"{w}/{label}.result")),
    "exposure": float(m.group(1)) if m else None, "exposure_word": m.group(2) if m else None,
    "debug_check": next((l.strip() for l in sec.splitlines() if "@debug" in l), None),
    "seconds": int(secs), "journal_tail": journal[-8:],
}, indent=1))
PY
  log "$label: $(python3 -c "import json; o = json.load(open('$OUT/$label.json')); print(o['result'].get('ok'), o['result'].get('error', ''), '| pidfd_getfd allowed:', o['systemd_reads']['pidfd_getfd_allowed'], '| exposure', o['exposure'])")"
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{sys.argv[1]}/*.json")) if not p.endswith("h200-ipc-sandbox.json")}
json.dump({"what": "CUDA IPC of cuMem memory (PyTorch expandable segments, reduce_tensor across two processes) under the product's rendered GPU unit, issue 39",
           "runs": runs}, open(f"{sys.argv[1]}/h200-ipc-sandbox.json", "w"), indent=1)
PY
log "done: $OUT/h200-ipc-sandbox.json"
