"""One table of everything `make bench` measured, with the 1-minute load average of each run.

Reads the JSON files the benchmarks wrote under bench/results/ (whichever exist):
  lab-deploy-scaling.json  bench/deploy_scaling.py: cold deploy and no-op re-deploys per fleet size
  lab-cold-deploy.json     bench/cold_deploy.py: cold deploys of N bare hosts, pip vs uv
  lab-serve-latency.json   bench/serve_latency.py: `vllm bench serve` through nginx and direct
and prints one row per measurement: what, hosts, median, min, max, n, and the load average
before the run (the lab shares 2 cores with the control machine: a loaded machine explains a
slow number). Nothing is measured here.

    python bench/summary.py [--results DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _load1(machine: dict | None) -> float | None:
    la = (machine or {}).get("loadavg_1_5_15")
    return la[0] if la else None


def _span(loads: list[float]) -> Any:
    if not loads:
        return None
    return loads[0] if min(loads) == max(loads) else f"{min(loads):.2f}-{max(loads):.2f}"


def _row(what: str, hosts: Any, values: list[float], load1: Any, unit: str = "s") -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {
            "what": what,
            "hosts": hosts,
            "median": None,
            "min": None,
            "max": None,
            "n": 0,
            "unit": unit,
            "load1": load1,
        }
    return {
        "what": what,
        "hosts": hosts,
        "median": round(statistics.median(vals), 2),
        "min": round(min(vals), 2),
        "max": round(max(vals), 2),
        "n": len(vals),
        "unit": unit,
        "load1": load1,
    }


def deploy_rows(d: dict) -> list[dict]:
    """The unlabelled sizes, then each ``--label``'s (``labels``: e.g. before/after a change)."""
    rows = _deploy_size_rows(d.get("sizes", {}), "")
    for label, block in (d.get("labels") or {}).items():
        rows += _deploy_size_rows(block.get("sizes", {}), f"[{label}] ")
    return rows


def _deploy_size_rows(sizes: dict, prefix: str) -> list[dict]:
    rows = []
    for size, s in sorted(sizes.items(), key=lambda kv: int(kv[0])):
        fd = s.get("first_deploy") or {}
        if fd.get("wall_s") is not None:
            failed = f" (failed, rc {fd['rc']})" if fd.get("rc") else ""
            rows.append(
                _row(
                    f"{prefix}deploy: {fd.get('kind', 'first deploy')}{failed}",
                    s["hosts"],
                    [fd["wall_s"]],
                    _load1(s.get("machine_before")),
                )
            )
        runs = [r for r in s.get("noop_runs", []) if r.get("rc") == 0]
        if runs:
            loads = [r.get("loadavg1_before") for r in runs if r.get("loadavg1_before") is not None]
            load = _span(loads) if loads else _load1(s.get("machine_before"))
            rows.append(
                _row(f"{prefix}deploy: no-op re-deploy (whole run)", s["hosts"], [r["wall_s"] for r in runs], load)
            )
            smoke = [(r.get("phases") or {}).get("smoke_s") for r in runs]
            if any(v is not None for v in smoke):
                rows.append(_row(f"{prefix}  of it: smoke tests", s["hosts"], smoke, load))
        for label, v in sorted((s.get("restart_to_healthy_s") or {}).items()):
            rows.append(_row(f"vLLM start to healthy ({label})", s["hosts"], v if isinstance(v, list) else [v], None))
    return rows


def cold_rows(d: dict) -> list[dict]:
    rows = []
    for size, s in sorted(d.get("sizes", {}).items(), key=lambda kv: int(kv[0])):
        dep, ins = s.get("deploy") or {}, s.get("install") or {}
        if dep.get("rc") == 0:
            what = f"cold deploy of bare hosts (wheels {ins.get('wheels', '?')}, {ins.get('installer', '?')})"
            rows.append(
                _row(what, s["hosts"], [dep.get("wall_s")], dep.get("loadavg1_before", _load1(s.get("machine_before"))))
            )
        fill = s.get("wheelhouse_fill") or {}
        if fill.get("seconds") is not None:
            rows.append(_row("  of it: the fleet wheelhouse's one download", s["hosts"], [fill["seconds"]], None))
    by: dict[str, list[dict]] = {}
    for r in (d.get("installers") or {}).get("runs", []):
        if r.get("rc") == 0:
            by.setdefault(r["installer"], []).append(r)
    for installer, runs in sorted(by.items()):
        rows.append(
            _row(
                f"vLLM install into a fresh env, {installer}",
                1,
                [r["seconds"] for r in runs],
                _span([r["loadavg1_before"] for r in runs if r.get("loadavg1_before") is not None]),
            )
        )
    return rows


def serve_rows(d: dict) -> list[dict]:
    rows = []
    by: dict[tuple[str, int], list[dict]] = {}
    for r in d.get("runs", []):
        if r.get("rc") == 0 and r.get("result"):
            by.setdefault((r["target"], int(r["concurrency"])), []).append(r)
    for (target, conc), runs in sorted(by.items()):
        load = [r.get("loadavg1_before") for r in runs if r.get("loadavg1_before") is not None]
        load_s = _span(load)
        for key, label, unit in (
            ("p99_ttft_ms", "TTFT p99", "ms"),
            ("p99_tpot_ms", "TPOT p99", "ms"),
            ("output_throughput", "output tok/s", "tok/s"),
        ):
            rows.append(
                _row(f"serve {target} c={conc}: {label}", 1, [r["result"].get(key) for r in runs], load_s, unit)
            )
    return rows


READERS = {
    "lab-deploy-scaling.json": deploy_rows,
    "lab-cold-deploy.json": cold_rows,
    "lab-serve-latency.json": serve_rows,
}


def collect(results: Path) -> tuple[list[dict], list[str]]:
    rows, missing = [], []
    for name, reader in READERS.items():
        path = results / name
        if not path.is_file():
            missing.append(name)
            continue
        rows += reader(json.loads(path.read_text()))
    return rows, missing


def table(rows: list[dict]) -> str:
    head = ("measurement", "hosts", "median", "min", "max", "n", "unit", "load1")
    cells = [head] + [
        tuple(
            "-" if r[k] is None else str(r[k]) for k in ("what", "hosts", "median", "min", "max", "n", "unit", "load1")
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = [
        "  ".join(c[i].ljust(widths[i]) if i == 0 else c[i].rjust(widths[i]) for i in range(len(head))) for c in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--json", action="store_true", help="the rows as JSON instead of a table")
    a = ap.parse_args(argv)
    rows, missing = collect(a.results)
    if a.json:
        print(json.dumps({"rows": rows, "missing": missing}, indent=2))
        return 0
    print(table(rows) if rows else "no benchmark results yet")
    for name in missing:
        print(f"(no {name} in {a.results}: its benchmark did not run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
