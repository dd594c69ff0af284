"""`vllm-fleet stage` on 4, 8, 16 and 32 lab hosts: bytes through the control machine's link, stage
time, the converged no-op (issue 36's proof).

    flock /tmp/vf-lab.lock .venv/bin/python bench/fleet_scale.py --sizes 4,8 [--rate 400mbit] [--model-mib 2048]
    .venv/bin/python bench/fleet_scale.py --table

Per size N (`vllm-fleet lab up --hosts N` grows or shrinks the running lab; at the end it goes
back to --final-hosts, 3):

- **The spec**: deployments/lab-tiny.yaml as `lab-scale` (own model path, port 8100, nginx on
  8080), its model a synthetic directory of real files: the tiny model's files plus random
  padding files (`--model-mib`; vLLM loads only the *.safetensors, so a host could serve it),
  `transfer: upload`.
- **Hosts**: lab4 onwards (N of them, added for the bench, removed at the end), lab1 the proxy
  (nothing of it staged); lab1..lab3, the other helpers' hosts, are left as they are.
- **Light hosts**: stage starts no vLLM. The vLLM env (3.5 GB, ~21,700 .pyc, the lab's wheel set
  installed with uv) is NOT installed N times on the 2 shared cores: hosts lacking it get lab1's
  installed env as hard links in their overlay's upper directory before the run (the bench
  spec's install.prefix is lab-tiny's, so the paths inside the env hold). The stage then finds
  the env in place (its state read, as on a host staged before), and what crosses the link is
  the model. The env's own per-host cost (900 MiB of wheels, ~60-250 s of uv on this machine)
  is measured by bench/cold_deploy.py (docs/benchmarks.md) and enters docs/scale.md from there.
- **Bytes the control machine sent**: the lab bridge's own counter
  (/sys/class/net/BRIDGE/statistics/tx_bytes) before/after, less what the lab's FORWARD rule
  counted into the bridge (the hosts' apt traffic from outside through the NAT). Traffic between
  two lab hosts does not leave through the bridge's own interface, so a peer-to-peer copy is
  not in it.
- **Stage**: the model's directory and stamp are removed on every host first, then one
  `vllm-fleet stage inventory/lab.py --spec SPEC -y` (lab1..labN the servers, lab1 the proxy):
  wall time, exit code, its per-host lines.
- **No-op**: stage again (the model's stamp and the env found in place): wall time of
  `vllm-fleet stage` (median of --noops), then one `pyinfra -vv` run of the same deploy for the
  commands sent per host.
- `--rate R` (tc's syntax, e.g. 50mbit): what the control machine itself sends on the bridge
  (source address the bridge's) shaped by an htb class for the whole size, so the control
  machine's link is what is measured; the hosts' apt through the NAT and host-to-host frames are
  not shaped (the series before 2026-12-05 05:00 UTC shaped all the bridge's egress with tbf,
  apt included); removed after.

Results merge into --out by "<N>" or "<N>@<rate>". Not a test: the machine has 2 cores shared
with other helpers' work (load average in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import labbench as lb  # noqa: E402
from cold_deploy import bridge_bytes, forward_bytes  # noqa: E402

NAME = "lab-scale"
#: the bench's hosts are lab4 onwards: hosts it adds, new (nothing on them looked the env's path up,
#: so the hard-linked env shows through their overlay), and the other helpers' lab1..lab3 untouched
FIRST = 3
ENV_PREFIX = (
    "/opt/vllm-fleet/lab-tiny"  # lab1's installed env (tests/lab/test_deploy.py); the bench spec's install.prefix
)
MODEL_CACHE = Path("/var/tmp/vllm-fleet-scale-models")
RESERVE = 6 * 2**30  # free disk kept for everyone else


def sh(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **kw)


def synthetic_model(mib: int) -> Path:
    """The tiny model's files plus random padding files totalling ``mib`` MiB (real bytes: no
    sparse file, nothing compressible), made once per size."""
    d = MODEL_CACHE / f"tiny-plus-{mib}mib"
    done = d / ".complete"
    if done.exists():
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    tiny = Path(os.path.expanduser("~/.cache/vllm-fleet/models/tiny-llama"))
    for f in tiny.iterdir():
        if f.is_file():
            shutil.copy2(f, d / f.name)
    parts = max(1, mib // 512)
    for i in range(parts):
        each = mib // parts + (mib % parts if i == parts - 1 else 0)
        with open(d / f"padding-{i:02d}.bin", "wb") as out:
            for _ in range(each):
                out.write(os.urandom(2**20))
    done.write_text(str(mib))
    return d


def tree_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file() and not p.name.startswith("."))


def spec_file(model: Path, subnet: str, out: Path) -> Path:
    import yaml

    spec = yaml.safe_load(lb.LAB_SPEC.read_text())
    spec["name"] = NAME
    spec["description"] = "bench/fleet_scale.py: lab-tiny with a synthetic model of real files"
    spec["model"]["source"] = str(model)
    spec["server"]["port"] = 8100
    spec["server"]["host"] = "0.0.0.0"
    spec["server"]["health_timeout"] = 900
    spec["server"]["api_key"] = {"file": f"~/.config/vllm-fleet/{NAME}.key", "generate": True}
    spec["proxy"]["listen"] = 8080
    spec["proxy"]["metrics_allow"] = ["127.0.0.1", subnet]
    spec["install"]["prefix"] = ENV_PREFIX
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = sh([str(lb.BIN / "vllm-fleet"), "validate", str(path)])
    if r.returncode != 0:
        raise SystemExit(f"bench spec invalid:\n{r.stdout}{r.stderr}")
    return path


def upper(name: str) -> Path:
    return lb.state_dir() / "hosts" / name / "upper"


def seed_env(st: dict, names: list[str]) -> dict:
    """lab1's installed env, hard-linked into each other host's overlay upper directory (no
    copy, no disk), before anything on that host looked the path up."""
    src = upper("lab1") / ENV_PREFIX.lstrip("/") / "env"
    if not (src / "bin" / "python").exists():
        raise SystemExit(
            f"no installed env on lab1 at {ENV_PREFIX}/env: deploy lab-tiny on lab1 first "
            "(tests/lab/test_deploy.py or `vllm-fleet deploy inventory/lab.py -y`)"
        )
    t0 = time.monotonic()
    seeded = []
    for name in names:
        dst = upper(name) / ENV_PREFIX.lstrip("/") / "env"
        if name == "lab1" or dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(dst.parent, 0o755)
        r = sh(["cp", "-al", str(src), str(dst)])
        if r.returncode != 0:
            raise SystemExit(f"seeding {name}: {r.stderr}")
        seeded.append(name)
    for name in seeded:  # the host sees it through its overlay
        lb.ssh(st, name, f"test -x {ENV_PREFIX}/env/bin/python")
    return {"hosts": seeded, "seconds": round(time.monotonic() - t0, 1)}


def clear_model(st: dict, names: list[str], model_path: str, config_dir: str) -> None:
    for name in names:
        lb.ssh(st, name, f"rm -rf {model_path} {config_dir}/model.stamp", check=False)


def shape(bridge: str, rate: str | None, source: str | None = None) -> None:
    """The bridge's egress shaped to ``rate`` (tc's syntax): with ``source`` (the control machine's
    address on the bridge) only what the control machine itself sends (htb: a shaped class for
    ``src SOURCE/32``, everything else, e.g. the hosts' apt through the NAT, in an unshaped one),
    so the shaped link is the control machine's; without, all of it (tbf: the series before
    2026-12-05 05:00 UTC). ``rate`` None: the qdisc removed."""
    sh(["tc", "qdisc", "del", "dev", bridge, "root"])
    if not rate:
        return
    if source is None:
        cmds = [["tc", "qdisc", "add", "dev", bridge, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "400ms"]]
    else:
        cmds = [
            ["tc", "qdisc", "add", "dev", bridge, "root", "handle", "1:", "htb", "default", "20"],
            ["tc", "class", "add", "dev", bridge, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate],
            ["tc", "class", "add", "dev", bridge, "parent", "1:", "classid", "1:20", "htb", "rate", "20gbit"],
            ["tc", "filter", "add", "dev", bridge, "parent", "1:", "protocol", "ip", "prio", "1", "u32"]
            + ["match", "ip", "src", f"{source}/32", "flowid", "1:10"],
        ]
    for c in cmds:
        r = sh(c)
        if r.returncode != 0:
            sh(["tc", "qdisc", "del", "dev", bridge, "root"])
            raise SystemExit(f"tc: {' '.join(c)}: {r.stderr}")


OUTSIDE_TAG = "vllm-fleet-bench:outside-in"


def outside_rule(bridge: str, add: bool) -> None:
    """A counting rule (no target: it counts and the chain goes on) at the head of FORWARD for
    what enters the lab from outside (``-o BRIDGE ! -i BRIDGE``: the hosts' apt through the NAT),
    so the bridge's tx can be split into the control machine's own bytes and the outside's.
    Frames from one lab host to another come in on the bridge (``-i BRIDGE``): not counted."""
    rule = ["FORWARD", "-o", bridge, "!", "-i", bridge, "-m", "comment", "--comment", OUTSIDE_TAG]
    while sh(["iptables", "-D", *rule]).returncode == 0:  # none left from an earlier run
        pass
    if add:
        r = sh(["iptables", "-I", rule[0], "1", *rule[1:]])
        if r.returncode != 0:
            raise SystemExit(f"iptables: {r.stderr}")


def outside_bytes() -> int:
    out = sh(["iptables", "-L", "FORWARD", "-v", "-x", "-n"]).stdout
    return sum(int(ln.split()[1]) for ln in out.splitlines() if OUTSIDE_TAG in ln and ln.split()[1].isdigit())


def fleet_env(servers: list[str]) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_FLEET_LAB_SERVERS": ",".join(servers),
        "VLLM_FLEET_LAB_PROXY": "lab1",
        "VLLM_FLEET_LAB_MONITORING": "lab1",
        "PYTHONUNBUFFERED": "1",
    }


def timed(argv: list[str], env: dict, timeout: float = 3600) -> dict:
    t0 = time.monotonic()
    r = subprocess.run(
        argv, cwd=lb.REPO, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    return {
        "rc": r.returncode,
        "wall_s": round(time.monotonic() - t0, 2),
        "out": r.stdout + r.stderr,
        "stdout": r.stdout,
    }


def per_host_lines(stdout: str, names: list[str]) -> dict[str, str]:
    """{host: status} from the run's per-host summary (vllm_fleet.commands.outcome.summary_lines:
    ``  failed:        HOST: why`` per failed host, ``  changed:       H1, H2`` grouped)."""
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        m = re.match(r"^\s+(failed|not attempted|changed|would change|converged):\s+(.*)$", line)
        if not m:
            continue
        if m.group(1) == "failed":
            host, _, why = m.group(2).partition(": ")
            out[host.strip()] = f"failed: {why}"
        else:
            for host in re.split(r",\s*", m.group(2).split(" (")[0]):
                if host in names:
                    out[host] = m.group(1)
    return out


def measure(n: int, args, st: dict, spec: Path, model: Path, resolved: dict) -> dict:
    names = [h["name"] for h in st["hosts"]][FIRST : FIRST + n]
    env = fleet_env(names)
    bridge = st["bridge"]
    entry: dict = {
        "hosts": n,
        "rate": args.rate,
        "peers": not args.no_peers,
        "model_bytes": tree_bytes(model),
        "model_dir": str(model),
        "commit": lb.git_commit(),
        "machine_before": lb.machine(),
    }
    entry["seed_env"] = seed_env(st, names)
    clear_model(st, names, resolved["model"]["path"], resolved["install"]["config_dir"])
    shape(bridge, args.rate, st.get("gateway"))
    entry["shaped"] = "the control machine's own traffic (src gateway), apt through the NAT not" if args.rate else None
    try:
        peers = ["--data", "peer_fetch=False"] if args.no_peers else []
        stage = [str(lb.BIN / "vllm-fleet"), "stage", "inventory/lab.py", "--spec", str(spec), *peers, "-y"]
        outside_rule(bridge, True)
        fw0, br0, out0 = forward_bytes(bridge), bridge_bytes(bridge), outside_bytes()
        print(
            f"[{n}{'@' + args.rate if args.rate else ''}{' no peers' if args.no_peers else ''}] stage of {len(names)} "
            "hosts ...",
            flush=True,
        )
        r = timed(stage, env)
        fw1, br1, out1 = forward_bytes(bridge), bridge_bytes(bridge), outside_bytes()
        outside_rule(bridge, False)
        # the bridge's own tx: what left the control machine's stack for the hosts (SSH, the
        # seed's copy, and what the hosts fetched from outside through the NAT: apt). Frames from
        # one host to another are bridged between ports and are not in it. Less what the counting
        # rule saw enter from outside: the control machine's own bytes to the hosts. (The lab's
        # own FORWARD rule is recorded beside them: with bridge netfilter on it also counts the
        # host-to-host frames.)
        sent = br1["tx"] - br0["tx"]
        outside = out1 - out0
        entry["stage"] = {
            "rc": r["rc"],
            "wall_s": r["wall_s"],
            "per_host": per_host_lines(r["stdout"], names),
            "tail": r["out"][-3000:] if r["rc"] else None,
            # the peer rounds' plan ("round k: HOST <- SOURCES") and each host's fetch line ("HOST:
            # fetch: ... verified in T s"): how long each copy took, round by round
            "peer_lines": [ln.strip() for ln in r["out"].splitlines() if re.search(r"round \d+: |: fetch: ", ln)][:400],
        }
        entry["bytes"] = {
            "control_to_hosts": sent - outside,
            "bridge_tx": sent,
            "outside_in": outside,
            "forward_rule_in": fw1["in"] - fw0["in"],
            "per_model_bytes": round((sent - outside) / entry["model_bytes"], 3),
            "bridge_tx_per_model_bytes": round(sent / entry["model_bytes"], 3),
        }
        print(
            f"[{n}] stage rc={r['rc']} {r['wall_s']} s, bridge tx {sent / 2**20:.0f} MiB, of it from outside "
            f"{outside / 2**20:.0f} MiB: control -> hosts {(sent - outside) / 2**20:.0f} MiB "
            f"({entry['bytes']['per_model_bytes']}x the model)",
            flush=True,
        )
        if r["rc"] != 0:
            print(r["out"][-5000:], file=sys.stderr)
        noops = []
        for _ in range(args.noops):
            b0 = bridge_bytes(bridge)
            x = timed(stage, env)
            noops.append(
                {
                    "rc": x["rc"],
                    "wall_s": x["wall_s"],
                    "bytes": bridge_bytes(bridge)["tx"] - b0["tx"],
                    "converged": sum(v == "converged" for v in per_host_lines(x["stdout"], names).values()),
                }
            )
        vv = timed(
            [
                str(lb.BIN / "pyinfra"),
                "-y",
                "-vv",
                "--data",
                "nvidia_reboot=False",
                *peers,
                "inventory/lab.py",
                "vllm_fleet.deploys.stage.stage",
            ],
            {**env, "VLLM_FLEET_SPEC": str(spec)},
        )
        cmds = lb.remote_commands(vv["out"])
        entry["noop"] = {
            "runs": noops,
            "median_wall_s": statistics.median(x["wall_s"] for x in noops) if noops else None,
            "commands_per_host": cmds,
            "commands_per_host_max": max(cmds.values()) if cmds else None,
            "grand_total": lb.grand_total(vv["out"]),
            "vv_rc": vv["rc"],
        }
        print(
            f"[{n}] no-op median {entry['noop']['median_wall_s']} s, commands per host "
            f"max {entry['noop']['commands_per_host_max']}, {noops}",
            flush=True,
        )
    finally:
        shape(bridge, None)
        outside_rule(bridge, False)
    entry["machine_after"] = lb.machine()
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,8")
    ap.add_argument(
        "--model-mib", type=int, default=0, help="synthetic model size (default 2048 up to 8 hosts, 512 above)"
    )
    ap.add_argument("--rate", default=None, help="shape the bridge's egress to this rate (tc syntax, e.g. 400mbit)")
    ap.add_argument("--noops", type=int, default=3)
    ap.add_argument(
        "--no-peers",
        action="store_true",
        help="host data peer_fetch=False: every host from the control machine (the path before host-to-host transfers)",
    )
    ap.add_argument("--final-hosts", type=int, default=3)
    ap.add_argument("--out", default=str(lb.REPO / "bench" / "results" / "lab-fleet-scale.json"))
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="with --table: docs/benchmarks.md's rows")
    ap.add_argument("--scale", action="store_true", help="print docs/scale.md's model from the measured results")
    args = ap.parse_args()
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.exists() else {}
    if args.table:
        print_rows(result) if args.markdown else print_table(result)
        return 0
    if args.scale:
        print_scale(result)
        return 0
    result.setdefault("sizes", {})
    result["bench"] = "fleet_scale"

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    from vllm_fleet.fetch.treehash import hash_tree
    from vllm_fleet.specs.load import load_and_check

    try:
        for n in [int(s) for s in args.sizes.split(",") if s]:
            mib = args.model_mib or (2048 if n <= 8 else 512)
            free = shutil.disk_usage(lb.state_dir()).free
            need = n * mib * 2**20 + RESERVE
            if free < need:
                why = f"{n} x {mib} MiB + {RESERVE >> 30} GiB reserve > {free >> 30} GiB free"
                print(f"[{n}] not measured: {why}", flush=True)
                result.setdefault("not_measured", {})[str(n)] = why
                save()
                continue
            model = synthetic_model(mib)
            hash_tree(str(model))  # the control machine's hashes, before the timed run (a cache kept across runs)
            entry_up = lb.lab_up(FIRST + n)
            st = lb.lab_state()
            spec = spec_file(model, st["subnet"], Path("/var/tmp/vllm-fleet-scale-spec"))
            resolved, _ = load_and_check(spec, hardware=False)
            entry = measure(n, args, st, spec, model, resolved)
            entry["lab_up_s"] = entry_up
            result["sizes"][f"{n}{'@' + args.rate if args.rate else ''}{'-nopeers' if args.no_peers else ''}"] = entry
            save()
    finally:
        st = lb.lab_state()
        if st:
            shape(st["bridge"], None)
            outside_rule(st["bridge"], False)
            for h in st["hosts"][
                :FIRST
            ]:  # what an earlier version of this bench staged on them: the bench's paths only
                lb.ssh(st, h["name"], f"rm -rf /var/lib/vllm-fleet/{NAME} /etc/vllm-fleet/{NAME}", check=False)
        lb.lab_up(args.final_hosts)
    print_table(result)
    return 0


def bridge_tx(e: dict) -> int:
    """The bridge's tx bytes during the stage (entries before the field: the difference they
    recorded plus the FORWARD count they subtracted)."""
    b = e.get("bytes", {})
    return b["bridge_tx"] if "bridge_tx" in b else b.get("control_to_hosts", 0) + b.get("outside_to_hosts", 0)


def _order(result: dict):
    return sorted(
        result.get("sizes", {}).items(),
        key=lambda kv: (kv[1].get("rate") or "", not kv[1].get("peers", True), kv[1]["hosts"]),
    )


def print_rows(result: dict) -> None:
    print(
        "| size | model | bridge tx | of it from outside (apt via NAT) | control -> hosts | x model | stage "
        "| no-op (stage again) | commands per host (no-op) | commit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, e in _order(result):
        b, st, no = e.get("bytes", {}), e.get("stage", {}), e.get("noop", {})
        where = (
            f"{e['hosts']} host(s)"
            + (f" at {e['rate']}" if e.get("rate") else "")
            + ("" if e.get("peers", True) else ", peers off")
        )
        tx = bridge_tx(e)
        outside = b.get("outside_in")
        control = f"{(tx - outside) / 1e6:.1f} MB" if outside is not None else "not counted apart"
        ratio = (
            f"{(tx - outside) / e['model_bytes']:.3f}x" if outside is not None else f"<= {tx / e['model_bytes']:.3f}x"
        )
        rc = "" if st.get("rc") == 0 else f" (rc {st.get('rc')})"
        print(
            f"| {where} | {e['model_bytes'] / 1e6:.1f} MB | {tx / 1e6:.1f} MB | "
            f"{'' if outside is None else f'{outside / 1e6:.1f} MB'} | {control} | {ratio} | "
            f"{st.get('wall_s', '')} s{rc} | {no.get('median_wall_s', '')} s | "
            f"{no.get('commands_per_host_max', '')} | {e.get('commit')} |"
        )


def print_table(result: dict) -> None:
    print(
        f"\n{'size':>10} {'model':>9} {'control->hosts':>15} {'x model':>8} {'stage':>8} {'no-op':>7} "
        f"{'cmds/host':>9} commit"
    )
    for key, e in sorted(result.get("sizes", {}).items(), key=lambda kv: (kv[1].get("rate") or "", kv[1]["hosts"])):
        b = e.get("bytes", {})
        print(
            f"{key:>10} {e['model_bytes'] / 2**20:>5.0f} MiB {b.get('control_to_hosts', 0) / 2**20:>11.0f} MiB "
            f"{b.get('per_model_bytes', ''):>8} {e.get('stage', {}).get('wall_s', ''):>6} s "
            f"{e.get('noop', {}).get('median_wall_s', ''):>5} s "
            f"{e.get('noop', {}).get('commands_per_host_max', ''):>9} {e.get('commit')}"
        )


#: what the model is asked for: bf16 weights (safetensors) and a CUDA wheel set (vLLM + torch + deps)
WEIGHTS = {"7B": 15.2e9, "70B": 141e9}
WHEELS = 3.0e9
LINKS_GBE = (1, 10, 25, 100)
FLEETS = (8, 32, 128, 512)


def control_bytes(e: dict) -> int:
    """What the control machine itself sent during the stage: the bridge's tx less what the
    counting rule saw enter from outside (entries before that rule: the whole tx, an upper bound)."""
    return bridge_tx(e) - (e.get("bytes", {}).get("outside_in") or 0)


def stage_overhead(result: dict) -> float:
    """Seconds of a stage not spent sending: a shaped one-host stage's wall time less its bytes at
    the shaped rate; the series that shapes only the control machine's traffic when there is one,
    else the oldest."""
    shaped = sorted(
        (e for e in result.get("sizes", {}).values() if e.get("rate") and e.get("stage", {}).get("rc") == 0),
        key=lambda e: (e["hosts"], not e.get("shaped")),
    )
    if not shaped:
        return 0.0
    e = shaped[0]
    return e["stage"]["wall_s"] - control_bytes(e) * 8 / _rate_bps(e["rate"])


def model_minutes(n: int, gbe: float, weights: float, overhead: float, peers: bool) -> float:
    """Stage time for ``n`` hosts: the wheels from the control machine to every host (N x), the
    weights N x (``peers`` False) or once and then 1 + ceil(log2 n) store-and-forward rounds between
    hosts on links of the same speed, plus the measured per-run overhead."""
    import math

    bps = gbe * 1e9 / 8
    wheels = n * WHEELS / bps
    model = (weights / bps) * (1 + math.ceil(math.log2(n))) if peers else n * weights / bps
    return (overhead + wheels + model) / 60


def _rate_bps(rate: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(rate)
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def print_scale(result: dict) -> None:
    over = stage_overhead(result)
    print(f"stage overhead (shaped series, smallest size): {over:.1f} s")
    for name, w in WEIGHTS.items():
        for peers in (False, True):
            print(
                f"\n{name} bf16 ({w / 1e9:.0f} GB) + wheels ({WHEELS / 1e9:.0f} GB), weights "
                f"{'once, then host to host' if peers else 'N x from the control machine'}: minutes"
            )
            print("| hosts | " + " | ".join(f"{g} GbE" for g in LINKS_GBE) + " |")
            print("|---|" + "---|" * len(LINKS_GBE))
            for n in FLEETS:
                print(f"| {n} | " + " | ".join(f"{model_minutes(n, g, w, over, peers):.1f}" for g in LINKS_GBE) + " |")


if __name__ == "__main__":
    sys.exit(main())
