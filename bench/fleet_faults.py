"""A fleet run with real faults injected: which hosts converged, the exit code, the retry line and
what its re-run touched (issue 36's proof: "one host powered off, one disk filled, one vLLM that
never gets healthy").

    flock /tmp/vf-lab.lock .venv/bin/python bench/fleet_faults.py stage --hosts 32
    flock /tmp/vf-lab.lock .venv/bin/python bench/fleet_faults.py rollout --hosts 6
    .venv/bin/python bench/fleet_faults.py --table

The hosts are lab4 onwards (added for the run, removed at the end: the lab goes back to
--final-hosts, 3); lab1..lab3 are not touched. The faults, each made for real on one host:

- **powered off**: ``systemctl poweroff`` inside the host (its systemd-nspawn container exits,
  the lab's supervisor does not start it again: the address answers nothing); powered on again
  for the re-run with ``vllm-fleet lab up --hosts N`` (it boots the hosts that are not running).
- **disk full**: a 16 MiB filesystem (tmpfs) mounted inside the host at the model's directory
  and filled to its last byte with ``fallocate``; ``df`` there says 0 free. The product's own
  plan-time check (roles/model ``NoSpace``) is what refuses the host. (The hosts' real disk is
  the control machine's, shared with everyone: it is not filled.) Fixed for the re-run: the
  file removed, the filesystem unmounted (the model directory is on the host's disk again).
- **vLLM never healthy** (``rollout`` only: staging starts no vLLM): a systemd drop-in on that
  host gives the replica's unit ``VLLM_LOGGING_CONFIG_PATH`` naming a file that does not exist:
  vLLM's own start-up refuses it (``RuntimeError: Could not load logging config``), systemd
  restarts it, it never answers /health. Put there while the old replica still serves (a latent
  misconfiguration of that host that the next restart meets). Fixed for the re-run: the
  drop-in removed, ``daemon-reload``, the unit stopped (what an operator does before retrying).

Two runs (subcommands):

- ``stage --hosts N``: `vllm-fleet stage` of lab-scale (bench/fleet_scale.py's spec: the tiny model
  plus --model-mib of padding, ``transfer: upload``) on N hosts, 2 faults (powered off, disk
  full). Light hosts: the env is lab1's, hard-linked (fleet_scale.seed_env), no vLLM starts.
- ``rollout --hosts N``: lab-scale with the tiny model deployed on N hosts (each a real vLLM CPU
  replica, lab4 the proxy too), then `vllm-fleet rollout` to a new model version (tiny + padding,
  at a new model.path) with ``--max-fail 3`` and the 3 faults. N is what fits: a lab-tiny
  replica is ~2.1 GiB of this machine's 24 GiB (the env's RSS is in the JSON).

Per run, read independently of the command's own summary: on each host over OpenSSH, the
model's manifest and stamp (stage) or the unit's state, model path and start time (rollout); the
hosts the re-run touched from each host's own sshd journal (``Accepted publickey`` lines since
the re-run started) and from the stamp's mtime / the unit's start time before and after it.
Results merge into bench/results/lab-fleet-faults.json by "<run>-<N>".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import labbench as lb  # noqa: E402
from fleet_scale import FIRST, NAME, clear_model, fleet_env, seed_env, spec_file, synthetic_model, timed  # noqa: E402

OUT = lb.REPO / "bench" / "results" / "lab-fleet-faults.json"
FULL_MIB = 16
UNIT = f"vllm-{NAME}-0.service"
FAULT_DROPIN = f"/etc/systemd/system/{UNIT}.d/zz-bench-fault.conf"
MISSING_LOG_CONFIG = "/etc/vllm-fleet-bench-fault/no-such-logging-config.json"


def parallel(fn, names: list[str]) -> dict[str, object]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as ex:
        return dict(zip(names, ex.map(fn, names)))


# -- the faults ----------------------------------------------------------------------------------


def power_off(st: dict, name: str) -> dict:
    from vllm_fleet.lab import nspawn

    cfg = nspawn.LabConfig()
    lb.ssh(st, name, "systemctl poweroff", check=False, timeout=30)
    t0 = time.monotonic()
    while any(nspawn.host_pids(cfg, name)) and time.monotonic() - t0 < 60:
        time.sleep(0.5)
    gone = not any(nspawn.host_pids(cfg, name))
    probe = lb.ssh(st, name, "true", check=False, timeout=30)
    return {"container_exited": gone, "ssh_rc_after": probe.returncode, "ssh_err": probe.stderr.strip()[-200:]}


def fill_disk(st: dict, name: str, path: str) -> dict:
    q = shlex.quote(path)
    lb.ssh(
        st,
        name,
        f"install -d -m 755 {q} && mount -t tmpfs -o size={FULL_MIB}m,mode=755 vllm-fleet-bench-full {q} && "
        f"fallocate -l {FULL_MIB}m {q}/.bench-disk-full",
    )
    df = lb.ssh(st, name, f"df -B1 --output=avail,target {q} | tail -1").stdout.split()
    return {"path": path, "df_avail_bytes": int(df[0]), "mount": df[1]}


def unfill_disk(st: dict, name: str, path: str) -> None:
    q = shlex.quote(path)
    lb.ssh(st, name, f"rm -f {q}/.bench-disk-full; umount {q}; rmdir {q} 2>/dev/null; true")


def break_vllm(st: dict, name: str) -> dict:
    lb.ssh(
        st,
        name,
        f"install -d {shlex.quote(str(Path(FAULT_DROPIN).parent))} && "
        f"printf '[Service]\\nEnvironment=VLLM_LOGGING_CONFIG_PATH={MISSING_LOG_CONFIG}\\n' > {FAULT_DROPIN} && "
        "systemctl daemon-reload",
    )
    env = lb.ssh(st, name, f"systemctl show -p Environment --value {UNIT}").stdout.strip()
    return {"dropin": FAULT_DROPIN, "unit_environment": env}


def unbreak_vllm(st: dict, name: str) -> None:
    lb.ssh(
        st,
        name,
        f"rm -rf {shlex.quote(str(Path(FAULT_DROPIN).parent))} && systemctl daemon-reload && "
        f"systemctl stop {UNIT}; systemctl reset-failed {UNIT}; true",
    )


# -- independent reads ---------------------------------------------------------------------------


def host_now(st: dict, name: str) -> float | None:
    r = lb.ssh(st, name, "date +%s.%N", check=False, timeout=30)
    return float(r.stdout) if r.returncode == 0 else None


def ssh_logins_since(st: dict, names: list[str], since: dict[str, float | None]) -> dict[str, int | None]:
    """Accepted SSH logins on each host since its own clock read ``since`` (its sshd's journal),
    less the one this read makes."""

    def one(n: str):
        if since.get(n) is None:
            return None
        r = lb.ssh(
            st,
            n,
            f"journalctl -q --no-pager -o cat --since @{since[n]:.3f} -t sshd -g 'Accepted publickey' | wc -l",
            check=False,
            timeout=60,
        )
        return int(r.stdout.strip()) - 1 if r.returncode == 0 and r.stdout.strip().isdigit() else None

    return parallel(one, names)


def staged_state(st: dict, names: list[str], model_path: str, stamp: str) -> dict[str, dict]:
    def one(n: str):
        r = lb.ssh(
            st,
            n,
            f"test -f {model_path}/MANIFEST.sha256 && echo manifest; stat -c 'stamp %y' {stamp} 2>/dev/null; true",
            check=False,
            timeout=30,
        )
        if r.returncode == 255:
            return {"reachable": False}
        lines = r.stdout.splitlines()
        return {
            "reachable": True,
            "manifest": "manifest" in lines,
            "stamp_mtime": next((ln[6:] for ln in lines if ln.startswith("stamp ")), None),
        }

    return parallel(one, names)


def unit_state(st: dict, names: list[str], port: int) -> dict[str, dict]:
    def one(n: str):
        r = lb.ssh(
            st,
            n,
            f"systemctl show -p ActiveState -p NRestarts -p ExecMainStartTimestampMonotonic -p ExecMainStartTimestamp "
            f"{UNIT}; grep -o -- '--model [^ ]*' /etc/systemd/system/{UNIT} | head -1; "
            f"curl -s -o /dev/null -w 'health=%{{http_code}}\\n' --max-time 5 http://127.0.0.1:{port}/health",
            check=False,
            timeout=30,
        )
        if r.returncode == 255:
            return {"reachable": False}
        out = {"reachable": True}
        for line in r.stdout.splitlines():
            if "=" in line:
                k, _, v = line.partition("=")
                out[k] = v
            elif line.startswith("--model "):
                out["model"] = line.split(" ", 1)[1]
        return out

    return parallel(one, names)


# -- the runs ------------------------------------------------------------------------------------


SUMMARY = re.compile(r"^\s+(failed|not attempted|changed|would change|converged):\s+(.*)$")


def summary(stdout: str) -> dict:
    """The command's own per-host (or per-replica) summary lines and its retry line."""
    out: dict = {"failed": {}, "not attempted": [], "changed": [], "converged": []}
    for line in stdout.splitlines():
        m = SUMMARY.match(line)
        if not m:
            continue
        if m.group(1) == "failed":
            who, _, why = m.group(2).partition(": ")
            out["failed"][who.strip()] = why.strip()
        else:
            out.setdefault(m.group(1), []).extend(x.strip() for x in m.group(2).split(" (")[0].split(","))
    m = re.search(r"retry only those: (.*)$", stdout, re.M)
    out["retry_line"] = m.group(1).strip() if m else None
    m = re.search(r"^vllm-fleet \w+: (\d+ \w+\(s\): .*)$", stdout, re.M)
    out["counts"] = m.group(1) if m else None
    return out


def run_retry(line: str, env: dict) -> dict:
    argv = shlex.split(line)
    assert argv[0] == "vllm-fleet", argv
    r = timed([str(lb.BIN / "vllm-fleet"), *argv[1:]], env)
    return {
        "argv": argv,
        "rc": r["rc"],
        "wall_s": r["wall_s"],
        "summary": summary(r["out"]),
        "tail": r["out"][-4000:],
        "pyinfra_hosts": sorted(set(re.findall(r"\[(lab\d+)\] Connected", r["out"]))),
    }


def stage_run(args, st: dict, names: list[str]) -> dict:
    from vllm_fleet.specs.load import load_and_check

    model = synthetic_model(args.model_mib)
    spec = spec_file(model, st["subnet"], Path("/var/tmp/vllm-fleet-faults-spec"))
    resolved, _ = load_and_check(spec, hardware=False)
    model_path = resolved["model"]["path"].rstrip("/")
    stamp = f"{resolved['install']['config_dir']}/model.stamp"
    env = fleet_env(names)
    entry: dict = {"run": "stage", "hosts": len(names), "names": [names[0], names[-1]], "model_mib": args.model_mib}
    entry["seed_env"] = seed_env(st, names)
    clear_model(st, names, model_path, resolved["install"]["config_dir"])
    off, full = names[len(names) // 3], names[(2 * len(names)) // 3]
    entry["faults"] = {
        "powered_off": {"host": off, **power_off(st, off)},
        "disk_full": {"host": full, **fill_disk(st, full, model_path)},
    }
    print(f"[stage {len(names)}] faults: {json.dumps(entry['faults'])}", flush=True)
    argv = [str(lb.BIN / "vllm-fleet"), "stage", "inventory/lab.py", "--spec", str(spec), "-y"]
    r = timed(argv, env)
    entry["run_1"] = {
        "argv": ["vllm-fleet", *argv[1:]],
        "rc": r["rc"],
        "wall_s": r["wall_s"],
        "summary": summary(r["out"]),
    }
    entry["run_1"]["tail"] = r["out"][-4000:]
    s1 = entry["run_1"]["summary"]
    print(f"[stage {len(names)}] rc {r['rc']} in {r['wall_s']} s: {s1['counts']}; failed {s1['failed']}", flush=True)
    print(f"[stage {len(names)}] retry line: {s1['retry_line']}", flush=True)
    before = staged_state(st, names, model_path, stamp)
    entry["after_run_1"] = {
        "staged": sorted(n for n, v in before.items() if v.get("manifest") and v.get("stamp_mtime")),
        "not_staged": sorted(n for n, v in before.items() if not (v.get("manifest") and v.get("stamp_mtime"))),
        "unreachable": sorted(n for n, v in before.items() if not v.get("reachable")),
    }
    # the fixes
    unfill_disk(st, full, model_path)
    entry["power_on_s"] = lb.lab_up(FIRST + len(names))
    clocks = parallel(lambda n: host_now(st, n), names)
    if s1["retry_line"]:
        entry["retry"] = run_retry(s1["retry_line"], env)
        print(
            f"[stage {len(names)}] retry rc {entry['retry']['rc']} in {entry['retry']['wall_s']} s: "
            f"{entry['retry']['summary']['counts']}",
            flush=True,
        )
    logins = ssh_logins_since(st, names, clocks)  # first: the reads below log in too
    after = staged_state(st, names, model_path, stamp)
    entry["after_retry"] = {
        "staged": sorted(n for n, v in after.items() if v.get("manifest") and v.get("stamp_mtime")),
        "not_staged": sorted(n for n, v in after.items() if not (v.get("manifest") and v.get("stamp_mtime"))),
        "stamp_changed": sorted(n for n in names if before[n].get("stamp_mtime") != after[n].get("stamp_mtime")),
        "ssh_logins_during_retry": {n: c for n, c in logins.items() if c},
        "hosts_without_login": sum(1 for c in logins.values() if c == 0),
    }
    print(f"[stage {len(names)}] after the retry: {json.dumps(entry['after_retry'])}", flush=True)
    return entry


def rollout_run(args, st: dict, names: list[str]) -> dict:
    import yaml

    from vllm_fleet.specs.load import load_and_check

    out = Path("/var/tmp/vllm-fleet-faults-spec")
    tiny = Path(os.path.expanduser("~/.cache/vllm-fleet/models/tiny-llama"))
    v1 = spec_file(tiny, st["subnet"], out / "v1")
    v2_model = synthetic_model(args.model_mib)
    v2 = spec_file(v2_model, st["subnet"], out / "v2")
    for path, model_dir in ((v1, "model-v1"), (v2, "model-v2")):
        doc = yaml.safe_load(path.read_text())
        doc["model"]["path"] = f"/var/lib/vllm-fleet/{NAME}/{model_dir}"
        doc["server"]["health_timeout"] = 600
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r1, _ = load_and_check(v1, hardware=False)
    r2, _ = load_and_check(v2, hardware=False)
    port = r2["server"]["port"]
    env = {**fleet_env(names), "VLLM_FLEET_LAB_PROXY": names[0], "VLLM_FLEET_LAB_MONITORING": names[0]}
    entry: dict = {"run": "rollout", "hosts": len(names), "names": names, "model_mib": args.model_mib}
    entry["seed_env"] = seed_env(st, names)
    print(f"[rollout {len(names)}] deploy v1 (the tiny model) on {','.join(names)} ...", flush=True)
    d = timed([str(lb.BIN / "vllm-fleet"), "deploy", "inventory/lab.py", "--spec", str(v1), "-y"], env)
    entry["deploy_v1"] = {"rc": d["rc"], "wall_s": d["wall_s"], "summary": summary(d["out"])}
    print(f"[rollout {len(names)}] deploy v1 rc {d['rc']} in {d['wall_s']} s", flush=True)
    if d["rc"] != 0:
        entry["deploy_v1"]["tail"] = d["out"][-5000:]
        return entry
    entry["memory"] = {"host_rss_mib": lb.host_rss_mib(), "machine": lb.machine()}
    if len(names) < 4:
        raise SystemExit("rollout: at least 4 hosts (the proxy's replica and one per fault)")
    off, full, broken = names[1], names[max(2, len(names) // 2)], names[-1]
    entry["faults"] = {
        "powered_off": {"host": off, **power_off(st, off)},
        "disk_full": {"host": full, **fill_disk(st, full, r2["model"]["path"].rstrip("/"))},
        "vllm_never_healthy": {"host": broken, **break_vllm(st, broken)},
    }
    print(f"[rollout {len(names)}] faults: {json.dumps(entry['faults'])}", flush=True)
    argv = [
        str(lb.BIN / "vllm-fleet"),
        "rollout",
        "inventory/lab.py",
        "--spec",
        str(v2),
        "--batch-size",
        str(args.batch_size),
        "--max-fail",
        "3",
    ]
    r = timed(argv, env)
    entry["run_1"] = {
        "argv": ["vllm-fleet", *argv[1:]],
        "rc": r["rc"],
        "wall_s": r["wall_s"],
        "summary": summary(r["out"]),
    }
    entry["run_1"]["tail"] = r["out"][-6000:]
    s1 = entry["run_1"]["summary"]
    print(f"[rollout {len(names)}] rc {r['rc']} in {r['wall_s']} s: {s1['counts']}; failed {s1['failed']}", flush=True)
    print(f"[rollout {len(names)}] retry line: {s1['retry_line']}", flush=True)
    before = unit_state(st, names, port)
    entry["after_run_1"] = before
    unfill_disk(st, full, r2["model"]["path"].rstrip("/"))
    unbreak_vllm(st, broken)
    entry["power_on_s"] = lb.lab_up(FIRST + len(names))
    clocks = parallel(lambda n: host_now(st, n), names)
    if s1["retry_line"]:
        entry["retry"] = run_retry(s1["retry_line"], env)
        print(
            f"[rollout {len(names)}] retry rc {entry['retry']['rc']} in {entry['retry']['wall_s']} s: "
            f"{entry['retry']['summary']['counts']}",
            flush=True,
        )
    logins = ssh_logins_since(st, names, clocks)  # first: the reads below log in too
    after = unit_state(st, names, port)
    entry["after_retry"] = {
        "units": after,
        "serving_v2": sorted(
            n
            for n, v in after.items()
            if v.get("model") == r2["model"]["path"].rstrip("/") and v.get("health") == "200"
        ),
        "restarted_by_retry": sorted(
            n for n in names if before[n].get("ExecMainStartTimestamp") != after[n].get("ExecMainStartTimestamp")
        ),
        "ssh_logins_during_retry": {n: c for n, c in logins.items() if c},
        "hosts_without_login": sorted(n for n, c in logins.items() if c == 0),
    }
    print(f"[rollout {len(names)}] after the retry: {json.dumps(entry['after_retry'], default=str)[:3000]}", flush=True)
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", choices=("stage", "rollout"))
    ap.add_argument("--hosts", type=int, default=6)
    ap.add_argument("--model-mib", type=int, default=128, help="padding of the staged (stage) / new (rollout) model")
    ap.add_argument("--batch-size", type=int, default=3)
    ap.add_argument("--final-hosts", type=int, default=3)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.exists() else {"bench": "fleet_faults", "runs": {}}
    if args.table:
        print_table(result)
        return 0
    if not args.run:
        ap.error("give a run: stage or rollout")
    try:
        up_s = lb.lab_up(FIRST + args.hosts)
        st = lb.lab_state()
        names = [h["name"] for h in st["hosts"]][FIRST : FIRST + args.hosts]
        t0 = time.monotonic()
        entry = (stage_run if args.run == "stage" else rollout_run)(args, st, names)
        entry.update(
            {
                "lab_up_s": up_s,
                "seconds": round(time.monotonic() - t0, 1),
                "commit": lb.git_commit(),
                "machine": lb.machine(),
            }
        )
        result["runs"][f"{args.run}-{args.hosts}"] = entry
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    finally:
        lb.lab_up(args.final_hosts)
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    print(
        "| run | hosts | faults | done after run 1 | failed (why, first words) | exit | retry line "
        "| re-run exit | hosts the re-run logged into |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for key, e in sorted(result.get("runs", {}).items()):
        s1 = e.get("run_1", {}).get("summary", {})
        done = len(s1.get("changed", [])) + len(s1.get("converged", []))
        failed = "; ".join(f"{h}: {why[:60]}" for h, why in s1.get("failed", {}).items())
        faults = ", ".join(f"{k}: {v['host']}" for k, v in e.get("faults", {}).items())
        rt = e.get("retry", {})
        touched = ", ".join(e.get("after_retry", {}).get("ssh_logins_during_retry", {}))
        rc1 = e.get("run_1", {}).get("rc")
        print(
            f"| {e['run']} | {e['hosts']} | {faults} | {done} | {failed} | {rc1} | `{s1.get('retry_line')}` "
            f"| {rt.get('rc')} | {touched} |"
        )


if __name__ == "__main__":
    sys.exit(main())
