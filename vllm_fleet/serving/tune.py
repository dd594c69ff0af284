"""`vllm-fleet tune INVENTORY --spec SPEC --target ttft_p99_ms=...,tpot_p99_ms=...`: a sweep of engine
settings on one replica of a live fleet, judged by vLLM's own serving benchmark.

1. The grid (:func:`default_grid`, or ``--grid``) over the settings that matter: max_num_seqs,
   max_num_batched_tokens, gpu_memory_utilization (CUDA) / cpu_kv_cache_gib (CPU), prefix caching,
   chunked prefill; the KV cache's CPU tier where the spec has one (``kv_offload_gib``: off and its
   size, or ``--grid kv_offload_gib=0,20,40``); kv_cache_dtype fp8 where the GPU has FP8 (compute capability 8.9+); TP
   vs DP with more than one GPU per node. The spec's own settings are point p00, the baseline.
2. Pruning (:func:`prune`), each skipped point with its reason: the schema and the checks (the
   merged spec must validate: e.g. FP8 KV cache on Ampere, a token budget below max_model_len
   with chunked prefill off), the planner (weights + overhead do not fit; the KV cache cannot
   hold max_num_seqs sequences of the workload's length), and points whose vLLM command line
   and environment equal an earlier point's (e.g. gpu_memory_utilization on the CPU build).
3. On one replica (``--host``, default a replica that is not the proxy) taken out of the nginx
   upstream the way `vllm-fleet rollout` does (its packaged step, through pyinfra; the others
   keep serving): per point, its files (unit, env) rendered with the point's settings, a drain,
   a restart until /health; a warm-up; then a load search (:func:`search`) for the highest
   concurrency (or rate) that meets the target. Afterwards the replica gets its own files back
   (as read from it before the first point), restarts, and goes back into the upstream.
4. ``tune.jsonl`` in ``--out`` gets one line per finished point as it goes: ``--resume``
   continues a cut sweep; ``--budget`` (minutes) stops before a point that would not fit.
5. Output: a table, report.html (+ pareto.png with the ``bench`` extra): the Pareto front
   (throughput vs latency) and the winner; ``overlay.yaml`` (the winning settings, the measured
   evidence in comments) and ``tuned-spec.yaml`` (the spec with it merged, validated) for
   ``vllm-fleet rollout``. No winner: how close the best point came.

Wall time per point: restart, warm-up, search. The upstream step runs pyinfra as a subprocess,
the rollout's own (:mod:`vllm_fleet.host.rollout_step`); the host sessions go through
vllm_fleet.host's transport (pyinfra's connectors). The verb and its arguments are
:mod:`vllm_fleet.commands.tune`.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import yaml

from vllm_fleet.render.fleetview import instance_files
from vllm_fleet.host.rollout_step import failure_tail, run_step, step_command
from vllm_fleet.render.command import vllm_argv, vllm_env
from vllm_fleet.render.layout import LayoutError
from vllm_fleet.serving import report
from vllm_fleet.serving.session import BenchError, HostSession, load_fleet, spec_digest
from vllm_fleet.specs import catalog, checks, planner
from vllm_fleet.specs.hwchecks import apply_model_facts
from vllm_fleet.specs.load import Spec, resolve, schema_problems

#: Grid keys -> their path in the spec (section, key[, subkey]).
TUNABLE = {
    "max_num_seqs": ("engine", "max_num_seqs"),
    "max_num_batched_tokens": ("engine", "max_num_batched_tokens"),
    "gpu_memory_utilization": ("engine", "gpu_memory_utilization"),
    "cpu_kv_cache_gib": ("engine", "cpu_kv_cache_gib"),
    # the KV cache's CPU tier per replica, GiB (0: off; engine.kv_offload, docs/kv-offload.md)
    "kv_offload_gib": ("engine", "kv_offload", "size_gib"),
    "enable_prefix_caching": ("engine", "enable_prefix_caching"),
    "enable_chunked_prefill": ("engine", "enable_chunked_prefill"),
    "kv_cache_dtype": ("engine", "kv_cache_dtype"),
    "enforce_eager": ("engine", "enforce_eager"),
    "quantization": ("model", "quantization"),
    "tensor": ("parallel", "tensor"),
    "data": ("parallel", "data"),
}
#: Target keys -> the benchmark's metric.
TARGET_KEYS = {f"{m}_{q}_ms": f"{q}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for q in ("p50", "p90", "p99")}


class TuneError(Exception):
    """The tune cannot start or go on; says what to do."""


# ---------------------------------------------------------------------------------------------
# target, grid


#: The highest latency limit --target takes: one day, in ms.
TARGET_MAX_MS = 86_400_000


def parse_target(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in TARGET_KEYS:
            raise TuneError(
                f"--target {part!r}: unknown metric {key!r}; use {', '.join(k for k in TARGET_KEYS if 'p99' in k)} "
                "(or p50/p90)"
            )
        if key in out:
            raise TuneError(f"--target {part!r}: {key} is given twice; give each metric once")
        try:
            out[key] = float(value)
        except ValueError:
            raise TuneError(f"--target {part!r}: {value!r} is not a number of milliseconds") from None
        if not math.isfinite(out[key]) or not 0 < out[key] <= TARGET_MAX_MS:
            raise TuneError(
                f"--target {part!r}: give a finite number of milliseconds above 0 and at most {TARGET_MAX_MS} (a day)"
            )
    if not out:
        raise TuneError("--target: give at least one limit, e.g. ttft_p99_ms=500,tpot_p99_ms=50")
    return out


def meets(metrics: dict[str, Any] | None, target: dict[str, float]) -> bool:
    """Every limit met, every request completed, none failed."""
    if not metrics or not metrics.get("completed") or (metrics.get("failed") or 0) > 0:
        return False
    return all(metrics.get(TARGET_KEYS[k]) is not None and metrics[TARGET_KEYS[k]] <= v for k, v in target.items())


def excess(metrics: dict[str, Any] | None, target: dict[str, float]) -> float:
    """The worst measured / limit ratio (<= 1 meets it); inf without a measurement."""
    if not metrics or not metrics.get("completed"):
        return float("inf")
    return max((metrics.get(TARGET_KEYS[k]) or float("inf")) / v for k, v in target.items())


def _value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "on", "yes"):
        return True
    if low in ("false", "off", "no"):
        return False
    if low in ("none", "null", "default"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text.strip()


def parse_grid(text: str) -> dict[str, list[Any]]:
    """``max_num_seqs=8,16;enable_prefix_caching=true,false`` -> {key: [values]}."""
    out: dict[str, list[Any]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, values = part.partition("=")
        key = key.strip()
        if not sep or key not in TUNABLE:
            raise TuneError(f"--grid {part!r}: use KEY=V1,V2 with KEY one of {', '.join(TUNABLE)}")
        out[key] = [_value(v) for v in values.split(",") if v.strip()]
        if not out[key]:
            raise TuneError(f"--grid {part!r}: no values")
    return out


def default_grid(resolved: dict[str, Any], gpu: dict[str, Any] | None = None) -> dict[str, list[Any]]:
    """The settings that matter for this deployment's hardware (see the module docstring)."""
    e, hw = resolved["engine"], resolved["hardware"]
    seqs = int(e["max_num_seqs"])
    grid: dict[str, list[Any]] = {"max_num_seqs": sorted({max(1, seqs // 2), seqs, seqs * 2, seqs * 4})}
    if resolved["install"]["accelerator"] == "cpu":
        grid["enable_prefix_caching"] = [True, False]
        grid["max_num_batched_tokens"] = [None, 2 * int(resolved["model"]["max_model_len"])]
        return grid
    # None = vLLM's own default for its API server, which depends on the GPU (vllm/engine/arg_utils.py,
    # 0.20-0.32): 8192 on GPUs of 70 GiB or more other than A100s, 2048 below (0.32: 16384 from 160 GiB).
    # The other value is one above it: the same number twice would be one setting restarted twice.
    big = bool(gpu) and float(gpu.get("cuda_total_gib") or 0) >= 70 and "a100" not in str(gpu.get("name", ""))
    grid["max_num_batched_tokens"] = [None, 16384 if big else 8192]
    grid["gpu_memory_utilization"] = sorted({float(e["gpu_memory_utilization"]), 0.90, 0.95})
    grid["enable_prefix_caching"] = [True]
    grid["enable_chunked_prefill"] = [True]
    tier = e["kv_offload"]["size_gib"]
    if tier and tier != "auto":  # the spec has a CPU tier of the KV cache: kept only where it wins
        grid["kv_offload_gib"] = [0, tier]
    if gpu and float(gpu.get("compute_capability") or 0) >= 8.9:
        grid["kv_cache_dtype"] = ["auto", "fp8"]
    n = int(hw.get("gpus_per_node") or 1)
    if n > 1 and int(resolved["parallel"]["nodes"]) == 1:
        grid["tensor"] = [1, n]
        grid["data"] = [1, n]
    return grid


def _get(resolved: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = resolved
    for part in path:
        node = (node or {}).get(part)
    return node


def base_settings(resolved: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    return {k: _get(resolved, TUNABLE[k]) for k in keys}


def points(grid: dict[str, list[Any]], base: dict[str, Any]) -> list[dict[str, Any]]:
    """p00 = the spec's own settings, then every combination of the grid (without a repeat)."""
    keys = list(grid)
    out = [dict(base)]
    for combo in itertools.product(*(grid[k] for k in keys)):
        s = dict(zip(keys, combo))
        if s not in out:
            out.append(s)
    return out


def overlay_of(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for k, v in settings.items():
        *parents, key = TUNABLE[k]
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = v
    return out


def merge(raw: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """The spec with the overlay on top (a mapping merges key by key; None deletes: vLLM's default)."""
    out = copy.deepcopy(raw)
    for k, v in overlay.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        elif v is None:
            out.pop(k, None)
        elif isinstance(v, dict):
            out[k] = merge({}, v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# ---------------------------------------------------------------------------------------------
# pruning


def check_point(spec: Any, settings: dict[str, Any], workload_tokens: int) -> tuple[dict[str, Any] | None, str | None]:
    """(resolved spec of the point, None) or (None, why it is skipped)."""
    merged = Spec(raw=merge(spec.raw, overlay_of(settings)), lines={}, path=spec.path)
    problems = schema_problems(merged)
    if not any(p.severity == "error" for p in problems):
        resolved = resolve(merged)
        apply_model_facts(resolved)
        problems += checks.run(resolved, merged)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        return None, "checks: " + "; ".join(f"{p.path}: {p.message}" for p in errors[:2])
    try:
        plan = planner.plan(resolved)
    except (KeyError, ValueError):
        return resolved, None  # nothing to plan against (no GPU named): run it
    if plan.get("fits") is False:
        return None, "planner: does not fit: " + ("; ".join(plan.get("notes") or []) or "no KV cache left")
    tokens, seqs = plan.get("kv_tokens"), int(resolved["engine"]["max_num_seqs"])
    if tokens is not None and workload_tokens > 0 and tokens // workload_tokens < seqs:
        return None, (
            f"planner: the KV cache holds {tokens:,} tokens = {tokens // workload_tokens} sequences of the workload's "
            f"{workload_tokens} tokens, fewer than max_num_seqs {seqs}"
        )
    return resolved, None


def command_key(resolved: dict[str, Any]) -> str:
    return json.dumps([vllm_argv(resolved), sorted(vllm_env(resolved).items()), resolved["parallel"]], default=str)


def prune(spec: Any, candidates: list[dict[str, Any]], workload_tokens: int) -> list[dict[str, Any]]:
    """Every candidate as a point: {id, settings, status: 'pending' | 'skipped', reason, resolved}."""
    out, seen = [], {}
    for i, s in enumerate(candidates):
        pid = f"p{i:02d}"
        resolved, why = check_point(spec, s, workload_tokens)
        if resolved is not None:
            key = command_key(resolved)
            if key in seen:
                resolved, why = None, f"same vLLM command line and environment as {seen[key]}"
            else:
                seen[key] = pid
        out.append(
            {
                "id": pid,
                "settings": s,
                "status": "pending" if resolved is not None else "skipped",
                "reason": why,
                "resolved": resolved,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# load search, Pareto front


def search(
    measure: Callable[[float], dict[str, Any] | None],
    ok: Callable[[dict[str, Any] | None], bool],
    *,
    lo: float = 1,
    hi: float = 64,
    max_probes: int = 6,
    integer: bool = True,
    tolerance: float = 1.15,
) -> tuple[float | None, list[dict[str, Any]]]:
    """The highest load in [lo, hi] that ``ok`` accepts: double from ``lo`` until a load fails (or
    ``hi``), then bisect between the last pass and the first failure; at most ``max_probes``
    measurements. Returns (best load or None when even ``lo`` fails, the probes in order)."""
    probes: list[dict[str, Any]] = []

    def probe(load: float) -> bool:
        m = measure(load)
        good = ok(m)
        probes.append({"load": load, "ok": good, "metrics": m})
        return good

    best, bad = None, None
    load = lo
    while len(probes) < max_probes:
        if probe(load):
            best = load
            if load >= hi:
                break
            load = min(hi, load * 2)
        else:
            bad = load
            break
    while best is not None and bad is not None and len(probes) < max_probes:
        if (integer and bad - best <= 1) or (not integer and bad / best <= tolerance):
            break
        mid = (best + bad) // 2 if integer else round((best * bad) ** 0.5, 3)
        if probe(mid):
            best = mid
        else:
            bad = mid
    return best, probes


def default_probes(lo: float, hi: float) -> int:
    """Enough probes for :func:`search` to double from ``lo`` up to ``hi``, plus 2 bisection
    steps: a cap that cannot reach ``hi`` would judge every point at the same load (on a GPU with
    max_num_seqs 128, five probes from 1 stop at 16)."""
    steps, load = 0, lo
    while load < hi:
        load, steps = load * 2, steps + 1
    return steps + 1 + 2


def pareto(measured: list[dict[str, Any]], latency_key: str) -> list[dict[str, Any]]:
    """Points not dominated in (higher output throughput, lower latency), by latency."""
    pts = [
        p
        for p in measured
        if p.get("best") and p["best"].get("output_throughput") is not None and p["best"].get(latency_key) is not None
    ]
    front = []
    for p in pts:
        t, lat = p["best"]["output_throughput"], p["best"][latency_key]
        dominated = any(
            q is not p
            and q["best"]["output_throughput"] >= t
            and q["best"][latency_key] <= lat
            and (q["best"]["output_throughput"] > t or q["best"][latency_key] < lat)
            for q in pts
        )
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: p["best"][latency_key])


def winner(front: list[dict[str, Any]], latency_key: str) -> dict[str, Any] | None:
    """The front point with the most output tokens/s (all meet the target); ties: lower latency."""
    if not front:
        return None
    return max(front, key=lambda p: (p["best"]["output_throughput"], -p["best"][latency_key]))


def closest(points_: list[dict[str, Any]], target: dict[str, float]) -> str:
    best, how = None, None
    for p in points_:
        for pr in p.get("probes") or []:
            r = excess(pr.get("metrics"), target)
            if best is None or r < best:
                best, how = r, (p, pr)
    if how is None:
        return "no point was measured"
    p, pr = how
    m = pr["metrics"] or {}
    got = ", ".join(
        f"{k} {m.get(TARGET_KEYS[k]):.1f} (limit {v:g})" for k, v in target.items() if m.get(TARGET_KEYS[k]) is not None
    )
    return (
        f"the closest was {p['id']} ({', '.join(f'{k}={v}' for k, v in p['settings'].items())}) at load "
        f"{pr['load']:g}: {got}: {best:.2f}x the target" + (f", {m.get('failed')} failed" if m.get("failed") else "")
    )


# ---------------------------------------------------------------------------------------------
# results file (resume)


def read_results(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    header, rows = None, []
    if not path.exists():
        return None, []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash: that point runs again
        if row.get("kind") == "header":
            header = row
        elif row.get("kind") == "point":
            rows.append(row)
    return header, rows


def append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def settings_key(settings: dict[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True)


# ---------------------------------------------------------------------------------------------
# overlay


def overlay_text(state: dict[str, Any], win: dict[str, Any], base: dict[str, Any] | None) -> str:
    b = win["best"]
    kind = state["load_kind"]
    lines = [
        f"# vllm-fleet tune: the winning engine settings for {state['deployment']} (point {win['id']})",
        f"# target: {', '.join(f'{k} <= {v:g}' for k, v in state['target'].items())}; measured on {state['host']} "
        f"{state['started']}; {state.get('vllm_version') or 'vLLM ?'}; GPU: {state.get('gpu') or '-'}",
        f"# workload: {json.dumps(state['workload'])}; spec {state['spec_file']} (sha256 {state['spec_sha256'][:16]})",
        f"# evidence: {kind} {win['best_load']:g} meets it: TTFT p99 {b.get('p99_ttft_ms', 0):.1f} ms, TPOT p99 "
        f"{b.get('p99_tpot_ms', 0):.2f} ms, ITL p99 {b.get('p99_itl_ms') or 0:.2f} ms, "
        f"{b.get('output_throughput', 0):.0f} output tok/s, {b.get('completed')} requests, {b.get('failed') or 0} "
        "failed",
    ]
    if base and base.get("best"):
        bb = base["best"]
        gain = (b["output_throughput"] / bb["output_throughput"] - 1) * 100 if bb.get("output_throughput") else 0
        lines.append(
            f"# the spec's own settings ({base['id']}): {kind} {base['best_load']:g}, "
            f"{bb.get('output_throughput', 0):.0f} output tok/s within the target: {gain:+.0f} % output tokens/s for "
            "this overlay"
        )
    elif base:
        lines.append(f"# the spec's own settings ({base['id']}): met the target at no load tried ({base['status']})")
    lines += [
        f"# points: {sum(1 for p in state['points'] if p['status'] == 'measured')} measured, "
        f"{sum(1 for p in state['points'] if p['status'] == 'skipped')} skipped; report: report.html",
        "# use: merge into the spec (tuned-spec.yaml beside this file is the merged spec, validated), then",
        "#      vllm-fleet rollout INVENTORY --spec tuned-spec.yaml",
        "# a null value means: leave the key out (vLLM's default)",
    ]
    body = yaml.safe_dump(overlay_of(win["settings"]), sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + "\n" + body


def write_overlay(
    out: Path, spec: Any, state: dict[str, Any], win: dict[str, Any], base: dict[str, Any] | None
) -> tuple[Path, Path]:
    ov = out / "overlay.yaml"
    ov.write_text(overlay_text(state, win, base))
    merged = merge(spec.raw, yaml.safe_load(ov.read_text()))
    tuned = out / "tuned-spec.yaml"
    tuned.write_text(
        f"# {spec.path}, with {ov.name} merged (vllm-fleet tune, point {win['id']})\n"
        + yaml.safe_dump(merged, sort_keys=False)
    )
    return ov, tuned


# ---------------------------------------------------------------------------------------------
# the run


class Tuner:
    """One tune; see the module docstring. ``runner(argv, env) -> (rc, output)`` runs pyinfra."""

    def __init__(
        self,
        inventory: str,
        spec_path: str,
        target: dict[str, float],
        out: str,
        *,
        grid: dict[str, list[Any]] | None = None,
        host: str | None = None,
        budget_min: float | None = None,
        resume: bool = False,
        in_place: bool = False,
        input_len: int = 128,
        output_len: int = 128,
        prompts_per_stream: int = 4,
        min_prompts: int = 8,
        max_probes: int | None = None,
        max_load: float | None = None,
        warmup_prompts: int = 4,
        health_timeout: float = 900,
        dry: bool = False,
        load_kind: str = "concurrency",
        multi_turn: dict[str, Any] | None = None,
        say: Callable[[str], None] = print,
        runner: Callable[[list[str], dict[str, str]], tuple[int, str]] | None = None,
        data: Sequence[str] = (),
    ):
        self.inventory, self.spec_path, self.target, self.say, self.data = inventory, spec_path, target, say, list(data)
        try:
            self.resolved, self.spec, self.view, self.key = load_fleet(
                inventory, spec_path, need_key=not dry, data=self.data
            )
        except BenchError as exc:
            raise TuneError(str(exc)) from None
        v = self.view
        if host:
            rep = v.replica(host)
            if not rep:
                raise TuneError(
                    f"--host {host}: not a replica of {self.resolved['name']} in {inventory} "
                    f"(replicas: {', '.join(r.id for r in v.replicas)})"
                )
        else:
            rep = next((r for r in reversed(v.replicas) if r.host not in v.proxies), v.replicas[-1])
        self.rep = rep
        self.upstream = bool(v.proxies) and not in_place
        if self.upstream and len(v.replicas) < 2:
            raise TuneError(
                f"{rep.id} ({rep.unit}) is the only replica: taking it out of the upstream stops the service. Add a "
                "replica, or pass --in-place (the tune restarts it while clients use it)"
            )
        self.out = Path(out)
        self.results = self.out / "tune.jsonl"
        self.budget_s = budget_min * 60 if budget_min else None
        self.resume = resume
        self.workload = {"dataset": "random", "input_len": input_len, "output_len": output_len}
        # A multi-turn chat workload (serving.multiturn: the load is the number of conversations at
        # once), sent from this machine through the proxy: the KV cache's CPU tier only has work
        # where conversations come back. The proxy must reach this replica alone.
        self.multi_turn = dict(multi_turn) if multi_turn else None
        if self.multi_turn:
            if not v.proxies or self.upstream or len(v.replicas) != 1 or load_kind != "concurrency":
                raise TuneError(
                    "--multi-turn sends the conversations through the proxy: it needs a deployment with a proxy and "
                    f"one replica (here {len(v.replicas)}), --in-place, and --search concurrency"
                )
            from vllm_fleet.serving import multiturn

            self.proxy_url = multiturn.proxy_url(self.resolved, v)
            self.workload = {"dataset": "multi-turn", **self.multi_turn}
            mt = self.multi_turn
            input_len = (
                int(mt.get("prefix_words", 0))
                + int(mt.get("system_words", 0))
                + int(mt.get("turns", 1)) * int(mt.get("user_words", 0))
            )
            output_len = int(mt.get("turns", 1)) * int(mt.get("output_tokens", 0))
        self.prompts_per_stream, self.min_prompts, self.max_probes = prompts_per_stream, min_prompts, max_probes
        self.max_load, self.warmup_prompts, self.health_timeout = max_load, warmup_prompts, health_timeout
        if load_kind not in ("concurrency", "rate"):
            raise TuneError(f"--search {load_kind}: use concurrency or rate")
        self.load_kind = load_kind
        self.grid = grid or default_grid(self.resolved, self._gpu())
        self.points = prune(
            self.spec, points(self.grid, base_settings(self.resolved, self.grid)), input_len + output_len
        )
        self._prune_layout()
        self.runner = runner or run_step
        self.pyinfra = str(Path(sys.executable).parent / "pyinfra")

    def _gpu(self) -> dict[str, Any] | None:
        try:
            return catalog.gpu(self.resolved["hardware"].get("gpu") or "cpu")
        except KeyError:
            return None

    # -- hosts ------------------------------------------------------------------------------

    def set_upstream(self, down: list[str]) -> float:
        """The rollout's own upstream step on the proxies (nginx -t, reload, old workers gone)."""
        from vllm_fleet.specs.inventory import for_pyinfra

        argv, env = step_command(
            self.pyinfra,
            for_pyinfra(self.inventory),
            self.spec_path,
            "upstream",
            limit=list(self.view.proxies),
            down=down,
            drain_timeout=self.resolved["rollout"]["drain_timeout"],
            data=self.data,
        )
        t0 = time.monotonic()
        rc, text = self.runner(argv, env)
        (self.out / "pyinfra.log").open("a").write(f"\n===== upstream down={down}: rc {rc}\n{text}")
        if rc != 0:
            raise TuneError(
                f"putting {', '.join(down) or 'every replica'} {'out of' if down else 'back into'} the upstream on "
                f"{', '.join(self.view.proxies)} failed:\n{failure_tail(text)}"
            )
        return time.monotonic() - t0

    def _prune_layout(self) -> None:
        """Skip, with the reason, a point that does not lay out on the inventory (e.g. TP over more
        GPUs than this instance holds) or that changes a file the replica's siblings on its host
        read too (vllm.env, node.env): the tune restarts one instance, the others keep theirs."""
        base = instance_files(self.resolved, self.view.hosts, self.rep)
        for p in self.points:
            if p["status"] != "pending":
                continue
            try:
                files = instance_files(p["resolved"], self.view.hosts, self.rep)
            except LayoutError as exc:
                p.update(status="skipped", reason=f"layout: {str(exc).splitlines()[0]}", resolved=None)
                continue
            changed = [
                path
                for path in self.rep.shared
                if (files.get(path) and files[path].content) != (base.get(path) and base[path].content)
            ]
            if changed:
                p.update(
                    status="skipped",
                    resolved=None,
                    reason=f"changes {', '.join(changed)}, which the other replica(s) of {self.rep.host} read too: "
                    "tune on a host with one replica (--host)",
                )

    def files_for(self, resolved: dict[str, Any]) -> dict[str, dict[str, Any]]:
        files = instance_files(resolved, self.view.hosts, self.rep)
        return {p: {"content": f.content, "mode": f.mode, "owner": f.owner, "group": f.group} for p, f in files.items()}

    # -- the sweep --------------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        return {
            "kind": "header",
            "deployment": self.resolved["name"],
            "spec_file": os.path.abspath(self.spec_path),
            "spec_sha256": spec_digest(self.spec_path),
            "target": self.target,
            "workload": {**self.workload, "search": self.load_kind},
            "host": self.rep.host,
            "replica": self.rep.id,
            "grid": self.grid,
        }

    def prepare_results(self) -> dict[str, dict[str, Any]]:
        """{settings key: finished row} from an earlier run (--resume), after checking it matches."""
        self.out.mkdir(parents=True, exist_ok=True)
        header, rows = read_results(self.results)
        mine = self.header()
        if header is None:
            if rows or (self.results.exists() and self.results.read_text().strip()):
                raise TuneError(f"{self.results}: not a tune results file: use another --out")
            self.results.write_text("")
            append(self.results, {**mine, "started": _now()})
            return {}
        if not self.resume:
            raise TuneError(
                f"{self.results} exists ({len(rows)} point(s) done): pass --resume to go on with it, or another --out"
            )
        for k in ("spec_sha256", "target", "workload", "host"):
            if header.get(k) != mine[k]:
                raise TuneError(
                    f"{self.results}: --resume with another {k} ({header.get(k)!r}, now {mine[k]!r}): use another --out"
                )
        return {settings_key(r["settings"]): r for r in rows}

    def run(self) -> dict[str, Any]:
        done = self.prepare_results()
        t_start = time.monotonic()
        pending = [p for p in self.points if p["status"] == "pending" and settings_key(p["settings"]) not in done]
        if not self.budget_s:
            # p00 (the spec's own settings) last: the replica ends on its own files (the way back is
            # then a no-op; the restart moves to p00, the count is the same). With a budget it goes
            # first, so that a cut sweep still has the baseline.
            pending.sort(key=lambda p: p["id"] == "p00")
        for p in self.points:
            row = done.get(settings_key(p["settings"]))
            if row:
                p.update({k: v for k, v in row.items() if k not in ("kind", "id", "settings")})
            elif p["status"] == "skipped":
                self.say(f"  {p['id']} skipped: {point_label(p['settings'])}: {p['reason']}")
                append(self.results, _row(p))
        self.say(
            f"tune {self.resolved['name']}: {len(self.points)} point(s), "
            f"{sum(p['status'] == 'skipped' for p in self.points)} skipped, {len(done)} done before, {len(pending)} "
            f"to run on {self.rep.id} ({self.rep.unit}, port {self.rep.port}); target "
            f"{', '.join(f'{k} <= {v:g}' for k, v in self.target.items())}; results {self.results}"
        )
        info: dict[str, Any] = {}
        if pending:
            info = self._sweep(pending, t_start, HostSession)
        return self.finish(info, time.monotonic() - t_start)

    def _sweep(self, pending: list[dict[str, Any]], t_start: float, session_cls: Any) -> dict[str, Any]:
        orig_file = self.out / "original-files.json"
        sess = session_cls(self.view, self.rep.host, self.resolved, self.key, self.say)
        info: dict[str, Any] = {}
        out_of_upstream = False
        try:
            info = sess.call("info")
            if orig_file.exists():  # a cut run: the host may still have a point's files
                original = json.loads(orig_file.read_text())
            else:
                original = sess.call("read", paths=list(self.rep.files))["files"]
                missing = [p for p, f in original.items() if f is None]
                if missing:
                    raise TuneError(
                        f"{self.rep.host}: {', '.join(missing)} missing: is {self.resolved['name']} deployed there?"
                    )
                orig_file.write_text(json.dumps(original))
            if self.upstream:
                s = self.set_upstream([self.rep.id])
                out_of_upstream = True
                self.say(f"  {self.rep.id}: out of the upstream on {', '.join(self.view.proxies)} ({s:.1f} s)")
            times: list[float] = []
            for p in pending:
                elapsed = time.monotonic() - t_start
                if self.budget_s and times and elapsed + sum(times) / len(times) > self.budget_s:
                    self.say(
                        f"  budget: {elapsed / 60:.1f} of {self.budget_s / 60:g} min used, a point takes "
                        f"~{sum(times) / len(times) / 60:.1f} min: stopping "
                        f"({sum(1 for q in pending if q['status'] == 'pending')} point(s) not run; --resume goes on)"
                    )
                    break
                t0 = time.monotonic()
                self.run_point(sess, p)
                times.append(time.monotonic() - t0)
                append(self.results, _row(p))
        finally:
            try:
                if orig_file.exists():
                    self.say(f"  {self.rep.id} ({self.rep.unit}): back to its own configuration")
                    back = sess.call(
                        "apply",
                        files=json.loads(orig_file.read_text()),
                        unit=self.rep.unit,
                        port=self.rep.port,
                        health_timeout=self.health_timeout,
                        drain_timeout=self.resolved["rollout"]["drain_timeout"],
                    )
                    if not back.get("ok"):
                        raise TuneError(
                            f"{self.rep.id} ({self.rep.unit}): its own configuration did not come back healthy: "
                            f"{back.get('error')}\n{back.get('journal', '')[-1500:]}\n  it stays OUT of the upstream; "
                            f"look: journalctl -u {self.rep.unit}; then redeploy it (deploys/serve.py or vllm-fleet "
                            "rollout)"
                        )
                    self.say(f"  {self.rep.id}: healthy again ({back.get('restart_s', 0):.0f} s)")
                    orig_file.unlink()
            finally:
                sess.close()
            if out_of_upstream:
                s = self.set_upstream([])
                self.say(f"  {self.rep.id}: back in the upstream ({s:.1f} s)")
        return info

    def run_point(self, sess: Any, p: dict[str, Any]) -> None:
        self.say(f"  {p['id']} {point_label(p['settings'])}: restart")
        ans = sess.call(
            "apply",
            files=self.files_for(p["resolved"]),
            unit=self.rep.unit,
            port=self.rep.port,
            health_timeout=self.health_timeout,
            drain_timeout=self.resolved["rollout"]["drain_timeout"],
        )
        p["times"] = {
            "drain_s": ans.get("drain_s"),
            "restart_s": ans.get("restart_s"),
            "restarted": ans.get("restarted"),
        }
        if not ans.get("ok"):
            p.update(
                status="failed",
                reason=f"did not start: {ans.get('error')}; journal: {(ans.get('journal') or '')[-600:]}",
            )
            self.say(f"  {p['id']} FAILED to start: {ans.get('error')}")
            return
        if self.multi_turn:
            best, probes = self._search_multi_turn(p)
            return self._record(p, best, probes)
        base = f"http://127.0.0.1:{self.rep.port}"
        t0 = time.monotonic()
        warm = sess.call(
            "bench",
            base=base,
            concurrency=1,
            num_prompts=self.warmup_prompts,
            input_len=self.workload["input_len"],
            output_len=self.workload["output_len"],
            seed=1,
            warmups=0,
        )
        p["times"]["warmup_s"] = round(time.monotonic() - t0, 1)
        if not warm.get("result"):
            p.update(status="failed", reason=f"warm-up failed: {warm.get('error')}")
            self.say(f"  {p['id']} warm-up FAILED: {warm.get('error')}")
            return
        seed = [100]

        def measure(load: float) -> dict[str, Any] | None:
            seed[0] += 1
            n = max(self.min_prompts, int(self.prompts_per_stream * load))
            how = {"concurrency": int(load)} if self.load_kind == "concurrency" else {"rate": load}
            r = sess.call(
                "bench",
                base=base,
                **how,
                num_prompts=n,
                input_len=self.workload["input_len"],
                output_len=self.workload["output_len"],
                seed=seed[0],
                warmups=0,
            )
            m = r.get("result")
            self.say(
                f"    load {load:g}: "
                + (
                    f"TTFT p99 {m['p99_ttft_ms']:.1f} ms, TPOT p99 {m['p99_tpot_ms']:.2f} ms, "
                    f"{m['output_throughput']:.0f} tok/s, {m['failed']} failed ({r['wall_s']:.0f} s)"
                    if m
                    else f"ERROR {r.get('error')}"
                )
            )
            return m

        t1 = time.monotonic()
        if self.load_kind == "concurrency":
            hi = self.max_load or int(p["resolved"]["engine"]["max_num_seqs"])
            best, probes = search(
                measure,
                lambda m: meets(m, self.target),
                lo=1,
                hi=int(hi),
                max_probes=self.max_probes or default_probes(1, int(hi)),
            )
        else:  # requests/s, from 0.5 up to --max-load (default 64), bisected geometrically
            hi = float(self.max_load or 64)
            best, probes = search(
                measure,
                lambda m: meets(m, self.target),
                lo=0.5,
                hi=hi,
                max_probes=self.max_probes or default_probes(0.5, hi),
                integer=False,
            )
        p["times"]["search_s"] = round(time.monotonic() - t1, 1)
        self._record(p, best, probes)

    def _record(self, p: dict[str, Any], best: float | None, probes: list[dict[str, Any]]) -> None:
        """A point's search result: its probes, the best load meeting the target and its metrics."""
        p["probes"] = probes
        p["best_load"] = best
        p["best"] = (
            next((pr["metrics"] for pr in probes if pr["load"] == best and pr["ok"]), None)
            if best is not None
            else None
        )
        p["status"] = "measured"
        p["reason"] = (
            None
            if best is not None
            else f"even load 1 misses the target ({excess(probes[0]['metrics'], self.target):.2f}x)"
        )
        self.say(
            f"  {p['id']} "
            + (f"best load {best:g}: {p['best']['output_throughput']:.0f} tok/s" if best is not None else p["reason"])
            + f" (restart {p['times']['restart_s']} s, warm-up {p['times']['warmup_s']} s, search "
            f"{p['times']['search_s']} s)"
        )

    def _search_multi_turn(self, p: dict[str, Any]) -> tuple[float | None, list[dict[str, Any]]]:
        """The load search of one point with the multi-turn workload: load = conversations at once
        (each one private prefix, ``turns`` turns); a new seed per run, so no run meets another's
        prompts in the cache."""
        from vllm_fleet.serving import multiturn

        model, header = p["resolved"]["model"]["served_name"], self.resolved["proxy"]["routing"]["session_header"]
        seed = [multiturn.new_seed()]

        def run(n: int) -> dict[str, Any]:
            seed[0] += 1
            wl = multiturn.Workload(**{**self.multi_turn, "conversations": int(n), "concurrency": 0})
            return multiturn.run_workload(
                self.proxy_url,
                model,
                self.key,
                wl,
                seed=seed[0],
                run_id=f"tune-{p['id']}-{seed[0]}",
                session_header=header,
                say=self.say,
            )

        t0 = time.monotonic()
        run(1)  # warm-up: one conversation
        p["times"]["warmup_s"] = round(time.monotonic() - t0, 1)

        def measure(load: float) -> dict[str, Any] | None:
            m = multiturn.as_bench_metrics(run(int(load)))
            self.say(
                f"    {int(load)} conversations: TTFT p99 {m['p99_ttft_ms'] or 0:.1f} ms, TPOT p99 "
                f"{m['p99_tpot_ms'] or 0:.2f} ms, {m['output_throughput'] or 0:.0f} tok/s, {m['failed']} failed"
            )
            return m

        t1 = time.monotonic()
        hi = self.max_load or int(p["resolved"]["engine"]["max_num_seqs"])
        best, probes = search(
            measure,
            lambda m: meets(m, self.target),
            lo=1,
            hi=int(hi),
            max_probes=self.max_probes or default_probes(1, int(hi)),
        )
        p["times"]["search_s"] = round(time.monotonic() - t1, 1)
        return best, probes

    def finish(self, info: dict[str, Any], seconds: float) -> dict[str, Any]:
        header, _ = read_results(self.results)
        lat_key = "p99_tpot_ms" if "tpot_p99_ms" in self.target else TARGET_KEYS[next(iter(self.target))]
        for p in self.points:
            if p["status"] == "pending":
                p["status"], p["reason"] = "not-run", "budget" if self.budget_s else "not run"
        measured = [p for p in self.points if p["status"] == "measured"]
        front = pareto(measured, lat_key)
        win = winner(front, lat_key)
        gpu = (
            (", ".join(g["name"] for g in info.get("gpus") or []) + f" (driver {info.get('driver')})")
            if info.get("gpus")
            else info.get("accelerator_note")
        )
        state = {
            "deployment": self.resolved["name"],
            "host": self.rep.host,
            "replica": self.rep.id,
            "target": self.target,
            "workload": self.workload,
            "spec_file": os.path.abspath(self.spec_path),
            "spec_sha256": self.header()["spec_sha256"],
            "load_kind": self.load_kind,
            "started": (header or {}).get("started", _now()),
            "vllm_version": info.get("vllm_version"),
            "gpu": gpu,
            "points": [_row(p) for p in self.points],
            "front": [_row(p) for p in front],
            "winner": _row(win) if win else None,
            "seconds": round(seconds, 1),
            "overlay_file": None,
            "tuned_spec": None,
            "closest": None,
        }
        base = self.points[0]
        if win:
            ov, tuned = write_overlay(self.out, self.spec, state, win, base)
            state["overlay_file"], state["tuned_spec"] = str(ov), str(tuned)
        else:
            state["closest"] = closest(measured, self.target)
        state["report"] = [str(f) for f in report.tune_report(state, self.out)]
        (self.out / "tune.json").write_text(json.dumps(state, indent=2, default=str) + "\n")
        return state


def _row(p: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "point", **{k: v for k, v in p.items() if k != "resolved"}}


def point_label(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def format_table(state: dict[str, Any]) -> str:
    head = ("point", "settings", "status", "load", "TTFT p99", "TPOT p99", "out tok/s", "restart", "warm-up", "search")
    rows = [head]
    win = (state.get("winner") or {}).get("id")
    front = {p["id"] for p in state["front"]}
    for p in state["points"]:
        b, t = p.get("best") or {}, p.get("times") or {}
        f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        mark = " *" if p["id"] == win else " f" if p["id"] in front else ""
        rows.append(
            (
                p["id"] + mark,
                point_label(p["settings"]),
                p["status"],
                "-" if p.get("best_load") is None else f"{p['best_load']:g}",
                f(b.get("p99_ttft_ms")),
                f(b.get("p99_tpot_ms"), 2),
                f(b.get("output_throughput"), 0),
                f(t.get("restart_s")),
                f(t.get("warmup_s")),
                f(t.get("search_s")),
            )
        )
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    skipped = [p for p in state["points"] if p["status"] in ("skipped", "failed")]
    lines += [f"  {p['id']} {p['status']}: {p['reason']}" for p in skipped]
    lines.append("(* winner, f on the Pareto front; ms, output tokens/s, seconds)")
    if state.get("winner"):
        lines.append(
            f"winner {win}: {point_label(state['winner']['settings'])}; overlay {state['overlay_file']}; "
            f"merged spec {state['tuned_spec']} (vllm-fleet rollout INVENTORY --spec {state['tuned_spec']})"
        )
    else:
        lines.append(f"no winner: {state.get('closest')}")
    return "\n".join(lines)
