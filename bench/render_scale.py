"""What grows with the fleet on the control machine (issue 36, item 5), on a fake inventory of N
servers (no host is contacted): the spec checks, the layout and every rendered file (time, bytes,
the largest host's bytes), the rollout's plan (replicas in order and batches) and the deploy's
end (summary and retry line), with and without a `proxy` group.

    .venv/bin/python bench/render_scale.py [--sizes 8,32,128] [--repeat 3] [--json bench/results/render-scale.json]

The spec is deployments/lab-tiny-replicas.yaml (server.host 0.0.0.0, so every replica is behind the
API firewall); its model directory must exist (`vllm-fleet tiny-model`), as for `vllm-fleet render`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_fleet.commands.outcome import retry_line, summary_lines  # noqa: E402
from vllm_fleet.commands.rollout import plan_batches  # noqa: E402
from vllm_fleet.host.results import CHANGED, FAILED, HostResult  # noqa: E402
from vllm_fleet.render.layout import build, render_entry  # noqa: E402
from vllm_fleet.specs.load import load_and_check  # noqa: E402

SPEC = REPO / "deployments" / "lab-tiny-replicas.yaml"


def inventory(n: int, proxies: int) -> dict[str, dict]:
    """N servers (10.20.x.y); the first ``proxies`` of them also in the `proxy` group (0: none)."""
    out = {}
    for i in range(n):
        name = f"gpu{i + 1:03d}"
        groups = ["servers"] + (["proxy"] if i < proxies else [])
        out[name] = render_entry(name, groups, {"ssh_hostname": f"10.20.{i // 250}.{i % 250 + 1}"})
    return out


def timed(fn, repeat: int):
    times, value = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), value


def measure(n: int, proxies: int, repeat: int) -> dict:
    check_s, (resolved, _) = timed(lambda: load_and_check(str(SPEC)), repeat)
    inv = inventory(n, proxies)
    build_s, layout = timed(lambda: build([resolved], inv, sources={resolved["name"]: str(SPEC)}), repeat)
    files = layout.files()
    per_host = {h: sum(len(f.content.encode()) for f in fs.values()) for h, fs in files.items() if h != "client"}
    replicas = [i.id for i in layout.instances(resolved["name"]) if i.role == "server"]
    plan_s, batches = timed(lambda: plan_batches(replicas, 1, replicas[: max(1, n // 10)]), repeat)
    results = [HostResult(h, FAILED if k % 10 == 0 else CHANGED, "x") for k, h in enumerate(inv)]
    end_s, _ = timed(
        lambda: (
            summary_lines("deploy", results),
            retry_line("deploy", ["inv.py"], [("--spec", "s.yaml")], [r.host for r in results if r.status == FAILED]),
        ),
        repeat,
    )
    return {
        "servers": n,
        "proxy_group": proxies,
        "nginx_hosts": len(layout.hosts_with("proxy", resolved["name"])),
        "warnings": len(layout.warnings),
        "checks_s": round(check_s, 4),
        "layout_and_render_s": round(build_s, 4),
        "rendered_bytes": sum(per_host.values()),
        "largest_host_bytes": max(per_host.values()),
        "rollout_plan_s": round(plan_s, 6),
        "batches": len(batches),
        "summary_and_retry_s": round(end_s, 6),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,32,128")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        for proxies in (0, 1):
            rows.append(measure(n, proxies, a.repeat))
    cols = list(rows[0])
    print("  ".join(cols))
    for r in rows:
        print("  ".join(str(r[c]) for c in cols))
    if a.json:
        Path(a.json).write_text(
            json.dumps({"spec": str(SPEC.relative_to(REPO)), "repeat": a.repeat, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
