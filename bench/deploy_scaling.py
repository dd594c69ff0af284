"""Deploy times on the lab: a cold deploy, a no-op re-deploy, and no-op re-deploys on 1, 3, 6 hosts.

    .venv/bin/python bench/deploy_scaling.py [--sizes 1,3,6] [--repeat 5] [--spec SPEC] [--label LABEL]
        [--out bench/results/lab-deploy-scaling.json]

For each fleet size N (ascending) it grows the lab of this environment's instance to N hosts
(`vllm-fleet lab up --hosts N`; VLLM_FLEET_LAB_DIR/_BRIDGE/_SUBNET pick the instance), runs
`pyinfra -y inventory/lab.py deploys/serve.py` with lab1..labN in the `servers` group and nginx
on lab1 in front of all of them (VLLM_FLEET_LAB_SERVERS), once to converge, then --repeat more
times, which must change nothing. When lab1 has never been deployed, the first deploy at the
smallest size is the cold deploy (bare host to smoke passed); the pip cache's size is recorded
so the result says whether downloads were cached. The spec is deployments/lab-tiny.yaml renamed
`lab-bench` with a small KV cache and vLLM on 0.0.0.0 (bench/labbench.py: bench_spec).

Per deploy: wall time, time per pyinfra phase (load = python + inventory + the spec's checks;
connect; prepare = facts and planning; run = operations, smoke tests included), pyinfra's grand
total (changed must be 0 for a no-op) and which operations changed. Per size: RSS of each lab
host, load average and available memory of the control machine. Before growing, it checks that
the new vLLM servers fit in available memory (RSS of lab1's host after its deploy, plus a
reserve); if not it stops there and says so. Results are merged into --out by size; prints JSON
and a table. Not a test: numbers on a shared 2-core machine are noisy (the JSON says how busy
the machine was).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import labbench as lb  # noqa: E402

RESERVE_MIB = 3072  # left free for the machine and the other labs


def summarize(runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs]
    phases = {}
    for k in runs[0]["phases"] if runs else []:
        phases[k] = round(lb.median([r["phases"].get(k) for r in runs]), 2)
    smoke = [r["phases"].get("smoke_s") for r in runs if r["phases"].get("smoke_s") is not None]
    out = {
        "n": len(runs),
        "wall_median_s": round(lb.median(walls), 2),
        "wall_min_s": min(walls),
        "wall_max_s": max(walls),
        "phases_median_s": phases,
        "changed_ops_max": max(r["grand_total"]["changed"] for r in runs),
        "ops": runs[0]["grand_total"]["ops"],
    }
    if smoke:
        # the smoke tests' share of each run (they are part of every deploy), median over the runs
        out["smoke_median_s"] = round(lb.median(smoke), 2)
        out["smoke_min_s"], out["smoke_max_s"] = min(smoke), max(smoke)
        out["smoke_share"] = round(
            lb.median([r["phases"]["smoke_s"] / r["wall_s"] for r in runs if r["phases"].get("smoke_s") is not None]), 3
        )
        out["without_smoke_median_s"] = round(
            lb.median([r["wall_s"] - (r["phases"].get("smoke_s") or 0) for r in runs]), 2
        )
    return out


def error_lines(out: str, limit: int = 60) -> list[str]:
    """The lines of a deploy's output that say what failed (pyinfra's errors, failed checks)."""
    keys = ("error", "Error", "FAIL", "failed", "Traceback")
    return [line.rstrip() for line in out.splitlines() if any(k in line for k in keys)][:limit]


def strip(run: dict) -> dict:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,3,6", help="fleet sizes, ascending (default 1,3,6)")
    ap.add_argument(
        "--repeat", type=int, default=5, help="no-op re-deploys per size (default 5); median, min and max are reported"
    )
    ap.add_argument(
        "--label",
        default="",
        help="a name for this measurement (e.g. before/after a change): results go under "
        "result['labels'][LABEL]['sizes'] instead of result['sizes'], so two labels sit side by side in --out",
    )
    ap.add_argument(
        "--spec",
        default="",
        help="deploy this spec instead of the bench spec (1 host: its servers on lab1 "
        "only, e.g. deployments/lab-tiny.yaml; several servers behind one nginx need vLLM on 0.0.0.0)",
    )
    ap.add_argument(
        "--kv-gib",
        type=int,
        default=1,
        help="engine.cpu_kv_cache_gib of the bench spec (default 1, the schema's minimum)",
    )
    ap.add_argument("--out", default=str(lb.REPO / "bench" / "results" / "lab-deploy-scaling.json"))
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else ran on the machine)")
    ap.add_argument(
        "--fit", action="store_true", help="when a size does not fit in memory, measure the largest that does"
    )
    ap.add_argument("--table", action="store_true", help="only print the table of --out")
    args = ap.parse_args()
    if args.table:
        print_table(json.loads(Path(args.out).read_text()))
        return 0
    sizes = sorted(int(s) for s in args.sizes.split(","))
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.exists() else {}
    result.setdefault("sizes", {})
    if args.label:
        block = result.setdefault("labels", {}).setdefault(args.label, {"sizes": {}})
        block["commit"] = lb.git_commit()
        store = block["sizes"]
    else:
        store = result["sizes"]
    result["bench"] = "deploy_scaling"
    if args.note:
        result.setdefault("notes", []).append(args.note)

    st = lb.lab_state()
    if args.spec:  # e.g. deployments/lab-tiny.yaml as shipped: what `pyinfra inventory/lab.py deploys/serve.py` deploys
        spec = Path(args.spec).resolve()
        (block if args.label else result)["spec"] = {"file": args.spec}
    else:
        spec = lb.bench_spec(
            (st or {}).get("subnet") or __import__("os").environ.get("VLLM_FLEET_LAB_SUBNET", "10.10.0.0/24"),
            kv_gib=args.kv_gib,
        )
        (block if args.label else result)["spec"] = {
            "file": "deployments/lab-tiny.yaml, renamed lab-bench",
            "overrides": {
                "engine.cpu_kv_cache_gib": args.kv_gib,
                "server.host": "0.0.0.0",
                "server.health_timeout": 1200,
            },
        }

    import yaml

    spec_name = yaml.safe_load(Path(spec).read_text())["name"]

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    # RSS of a host running vLLM + nginx, from an earlier size's measurement (this run or the file)
    per_server_mib = max([e.get("host_rss_mib", {}).get("lab1") or 0 for e in store.values()] or [0]) or None
    for n in sizes:
        st = lb.lab_state()
        have = len(st["hosts"]) if st else 0
        entry: dict = {"hosts": n, "machine_before": lb.machine()}
        if have < n and st and per_server_mib:
            deployed = have  # hosts 1..have run a server already
            need = (n - deployed) * per_server_mib + RESERVE_MIB
            avail = entry["machine_before"]["mem_available_mib"]
            if avail < need:
                why = (
                    f"{n} hosts: {n - deployed} more vLLM servers need ~{(n - deployed) * per_server_mib} MiB "
                    f"(+{RESERVE_MIB} MiB reserve), {avail} MiB available"
                )
                fits = deployed + max(0, (avail - RESERVE_MIB) // per_server_mib)
                print(f"[{n}] does not fit: {why}; {fits} hosts would", flush=True)
                result.setdefault("not_measured", {})[str(n)] = why
                if not args.fit or fits <= max([deployed, *[int(k) for k in store if "noop" in store[k]]]):
                    save()
                    break
                entry["requested_hosts"], entry["memory_limited"] = n, why
                n = int(fits)
                entry["hosts"] = n
        if have != n or not st:
            entry["lab_up_s"] = lb.lab_up(n)
            st = lb.lab_state()
        servers = [h["name"] for h in st["hosts"]][:n]
        bare = lb.ssh(st, "lab1", f"test -e /opt/vllm-fleet/{spec_name}/env/bin/python", check=False).returncode != 0
        entry["pip_cache_before"] = lb.pip_cache()
        print(f"[{n}] first deploy ({'cold: lab1 bare' if bare else 'converge'}), servers {servers} ...", flush=True)
        first = lb.deploy(spec, servers)
        entry["first_deploy"] = {
            **strip(first),
            "kind": "cold (lab1 bare host to smoke passed)"
            if bare and n == 1
            else ("cold on the new hosts" if bare or have < n else "converge"),
        }
        print(f"[{n}] first deploy rc={first['rc']} {first['wall_s']} s {first['grand_total']}", flush=True)
        if first["rc"] != 0:
            # what failed, from the whole output (the tail is only the results table), then one
            # more deploy: it converges what the first left (recorded as such, not as a no-op)
            entry["first_deploy"]["error_lines"] = error_lines(first["_out"])
            print("\n".join(entry["first_deploy"]["error_lines"]), flush=True)
            first = lb.deploy(spec, servers)
            entry["first_deploy_retry"] = strip(first)
            print(f"[{n}] first deploy again: rc={first['rc']} {first['wall_s']} s {first['grand_total']}", flush=True)
        if first["rc"] != 0:
            store[str(n)] = entry
            save()
            print(first["_out"][-5000:], file=sys.stderr)
            return 1
        entry["pip_cache_after"] = lb.pip_cache()
        runs = []
        for i in range(args.repeat):
            r = lb.deploy(spec, servers)
            runs.append(strip(r))
            print(
                f"[{n}] no-op #{i + 1}: rc={r['rc']} {r['wall_s']} s {r['grand_total']} changed={r['changed_ops']}",
                flush=True,
            )
            if r["rc"] != 0:
                print(r["_out"][-5000:], file=sys.stderr)
                break
        entry["noop_runs"] = runs
        if runs and all(r["rc"] == 0 for r in runs):
            entry["noop"] = summarize(runs)
            entry["noop"]["per_host_s"] = round(entry["noop"]["wall_median_s"] / n, 2)
            # one more no-op with -vv, not timed: how many commands pyinfra sent each host
            counted = lb.deploy(spec, servers, count_commands=True)
            entry["noop"]["remote_commands"] = counted.get("remote_commands")
            entry["noop"]["counted_run_changed"] = (counted["grand_total"] or {}).get("changed")
            print(f"[{n}] remote commands per host (a -vv no-op): {counted.get('remote_commands')}", flush=True)
        entry["host_rss_mib"] = lb.host_rss_mib()
        entry["machine_after"] = lb.machine()
        rss = entry["host_rss_mib"].get("lab1")
        if rss:
            per_server_mib = max(per_server_mib or 0, rss)
        store[str(n)] = entry
        save()
        if any(r["rc"] for r in runs):
            return 1

    print(json.dumps(result, indent=2))
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    blocks = [("", result)] + [(f"[{label}] ", block) for label, block in (result.get("labels") or {}).items()]
    for label, block in blocks:
        if block.get("sizes"):
            if label:
                print(f"\n{label}commit {block.get('commit')}")
            _table(block, result)
    for n, why in (result.get("not_measured") or {}).items():
        print(f"{n:>5} not measured: {why}")
    print(
        "(seconds; no-op = a re-deploy that changes nothing, median of the repeats; smoke = the smoke tests' part of "
        "it; cmds/host = commands pyinfra sent each host in a no-op (-vv); the machine is shared: see machine_* in "
        "the JSON)"
    )


def _table(result: dict, top: dict) -> None:
    print(
        f"\n{'hosts':>5} {'first deploy':>13} {'kind':<34} {'no-op median':>12} {'min-max':>13} {'smoke (share)':>14} "
        f"{'per host':>8} {'changed':>7} {'ops':>4} {'cmds/host':>9}  {'lab1 RSS':>8}  load1"
    )
    for n, e in sorted(result["sizes"].items(), key=lambda kv: int(kv[0])):
        f = e.get("first_deploy", {})
        no = e.get("noop", {})
        rng = f"{no.get('wall_min_s', '')}-{no.get('wall_max_s', '')}"
        smoke = f"{no['smoke_median_s']} ({no['smoke_share'] * 100:.0f}%)" if "smoke_share" in no else ""
        cmds = no.get("remote_commands") or {}
        cmds = f"{max(cmds.values())}" if cmds else ""
        print(
            f"{n:>5} {f.get('wall_s', ''):>11} s {f.get('kind', ''):<34} {no.get('wall_median_s', ''):>10} s "
            f"{rng:>13} {smoke:>14} {no.get('per_host_s', ''):>6} s {no.get('changed_ops_max', ''):>7} "
            f"{no.get('ops', ''):>4} {cmds:>9}  {e.get('host_rss_mib', {}).get('lab1', '')!s:>4} MiB  "
            f"{e['machine_before']['loadavg_1_5_15'][0]}"
        )


if __name__ == "__main__":
    sys.exit(main())
