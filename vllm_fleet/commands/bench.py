"""`vllm-fleet bench INVENTORY --spec SPEC`: vLLM's own serving benchmark against a deployment.

Runs `vllm bench serve` ON a server host, where the deploy already installed vLLM (nothing is
installed on the control machine), through the proxy and straight at the replica, at a list of
concurrencies (default 1, 4, 16) or request rates, random prompts unless ``--dataset`` names a
file on that host. Prints progress and a table; writes ``bench.json`` (the spec, its sha256, vLLM
version, GPU and driver read from the host (none on a CPU host: said so), time, every run) and
the report (``report.html``, self-contained, inline SVG; PNG plots with the ``bench`` extra).

The host side is ``vllm_fleet/host/scripts/benchhost.py`` (a file streamed through the one transport,
vllm_fleet.host.transport: vLLM imported once, one JSON request per line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from vllm_fleet.render.fleetview import FleetView
from vllm_fleet.specs.inventory import spec_for
from vllm_fleet.specs.load import routing_policies
from vllm_fleet.serving.session import (
    BenchError,
    HostSession,  # noqa: F401  (bench's names too)
    load_fleet,
    served_tokenizer,
    spec_digest,
)

METRICS = (
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "p50_itl_ms",
    "p99_itl_ms",
    "output_throughput",
    "request_throughput",
    "completed",
    "failed",
)


#: The longest prompt or output (tokens) a command line may ask for (the schema's max_model_len bound).
MAX_TOKENS = 1 << 20


def targets(view: FleetView, host: str) -> dict[str, str]:
    """Base URLs as seen from the host of instance ``host`` (``HOST:N``, or a host's first
    instance): the proxy (when it runs there, or a proxy host's address) and that instance's port."""
    rep = view.replica(host)
    host = rep.host if rep else host
    out = {}
    if view.proxy_listen is not None and view.proxies:
        where = (
            "127.0.0.1"
            if host in view.proxies
            else (view.hosts.get(view.proxies[0]) or {}).get("address", view.proxies[0])
        )
        out["proxy"] = f"http://{where}:{view.proxy_listen}"
    if rep:
        out["direct"] = f"http://127.0.0.1:{rep.port}"
    return out


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    r = run.get("result") or {}
    return {k: r.get(k) for k in METRICS}


def format_table(runs: list[dict[str, Any]]) -> str:
    head = (
        "path",
        "load",
        "TTFT p50",
        "p99",
        "TPOT p50",
        "p99",
        "ITL p50",
        "p99",
        "out tok/s",
        "req/s",
        "done",
        "fail",
    )
    rows = [head]
    for run in runs:
        s = summarize(run)
        load = f"c={run['concurrency']}" if run.get("concurrency") else f"r={run.get('rate')}"
        if not run.get("result"):
            rows.append((run["target"], load, "error", "", "", "", "", "", "", "", "", (run.get("error") or "")[:40]))
            continue
        f = lambda k, d=1: "-" if s.get(k) is None else f"{s[k]:.{d}f}"  # noqa: E731
        rows.append(
            (
                run["target"],
                load,
                f("p50_ttft_ms"),
                f("p99_ttft_ms"),
                f("p50_tpot_ms", 2),
                f("p99_tpot_ms", 2),
                f("p50_itl_ms", 2),
                f("p99_itl_ms", 2),
                f("output_throughput", 0),
                f("request_throughput", 2),
                f("completed", 0),
                f("failed", 0),
            )
        )
    w = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    return (
        "\n".join("  ".join(str(c).rjust(w[i]) if i > 1 else str(c).ljust(w[i]) for i, c in enumerate(r)) for r in rows)
        + "\n(ms; output tokens/s and requests/s; vllm bench serve on the server host)"
    )


def run_bench(
    inventory: str,
    spec_path: str,
    *,
    host: str | None = None,
    concurrency: list[int] | None = None,
    rates: list[float] | None = None,
    input_len: int = 128,
    output_len: int = 128,
    prompts_per_level: int = 8,
    min_prompts: int = 16,
    warmups: int = 2,
    dataset: str | None = None,
    only: list[str] | None = None,
    say: Callable[[str], None] = print,
    data: Sequence[str] = (),
    seed: int | None = None,
) -> dict[str, Any]:
    from vllm_fleet.serving.multiturn import new_seed

    resolved, _, view, key = load_fleet(inventory, spec_path, data=data)
    rep = (
        view.replica(host) if host else next((r for r in view.replicas if r.host not in view.proxies), view.replicas[0])
    )
    if not rep:
        raise BenchError(
            f"--host {host}: not a replica of {resolved['name']} (replicas: {', '.join(r.id for r in view.replicas)})"
        )
    tg = targets(view, rep.id)
    host = rep.host
    if only:
        tg = {k: v for k, v in tg.items() if k in only}
    levels: list[tuple[str, float]] = [("concurrency", c) for c in (concurrency or [])] + [
        ("rate", r) for r in (rates or [])
    ]
    if not levels:
        levels = [("concurrency", c) for c in (1, 4, 16)]
    say(
        f"bench {resolved['name']}: on {host}, {', '.join(f'{k} {v}' for k, v in tg.items())}; "
        f"{len(levels)} load level(s) x {len(tg)} path(s); "
        + (f"dataset {dataset}" if dataset else f"random {input_len} in / {output_len} out tokens")
    )
    t0 = time.monotonic()
    sess = HostSession(view, host, resolved, key, say)
    try:
        info = sess.call("info")
        say(
            f"  {host}: {info.get('vllm_version')}; "
            + (
                ", ".join(g["name"] for g in info["gpus"]) + f", driver {info['driver']}"
                if info.get("gpus")
                else info.get("accelerator_note") or ""
            )
        )
        runs = []
        first = seed = new_seed() if seed is None else seed  # the invocation's own (--seed repeats one)
        for i, (kind, value) in enumerate(levels):
            order = list(tg.items())
            if i % 2:
                order.reverse()  # proxy and direct alternate who goes first
            for target, base in order:
                seed += 1  # a new seed per run: prefix caching cannot serve one path from the other's prompts
                n = max(min_prompts, int(prompts_per_level * (value if kind == "concurrency" else max(1, value))))
                req = {
                    "base": base,
                    "num_prompts": n,
                    "input_len": input_len,
                    "output_len": output_len,
                    "seed": seed,
                    "warmups": warmups,
                    "dataset": dataset,
                    kind: value,
                }
                ans = sess.call("bench", **req)
                run = {"target": target, "base_url": base, kind: value, "num_prompts": n, "seed": seed, **ans}
                runs.append(run)
                s = summarize(run)
                say(
                    f"  {target:<6} {kind} {value:<5} "
                    + (
                        f"TTFT p99 {s['p99_ttft_ms']:.1f} ms, TPOT p99 {s['p99_tpot_ms']:.2f} ms, "
                        f"{s['output_throughput']:.0f} tok/s, {s['failed']} failed ({ans['wall_s']:.0f} s)"
                        if ans.get("result")
                        else f"ERROR {ans.get('error')}"
                    )
                )
    finally:
        sess.close()
    return {
        "kind": "vllm-fleet bench",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seed": first,
        "spec_file": os.path.abspath(spec_path),
        "spec_sha256": spec_digest(spec_path),
        "spec": resolved,
        "deployment": resolved["name"],
        "host": host,
        "replica": rep.id,
        "unit": rep.unit,
        "targets": tg,
        "host_info": info,
        "dataset": {"file": dataset}
        if dataset
        else {"name": "random", "input_len": input_len, "output_len": output_len},
        "levels": [{kind: v} for kind, v in levels],
        "runs": runs,
        "seconds": round(time.monotonic() - t0, 1),
    }


def cmd_multi_turn(args: argparse.Namespace, spec: str) -> int:
    from vllm_fleet.serving import multiturn

    policies = [p.strip() for p in args.policies.split(",")] if args.policies else None
    allowed = [p for p in routing_policies() if p != "auto"]  # a policy in effect, as the schema names them
    bad = [p for p in policies or [] if p not in allowed]
    if bad:
        print(f"vllm-fleet bench: --policies: unknown {', '.join(bad)} (one of: {', '.join(allowed)})", file=sys.stderr)
        return 2
    base = dict(
        conversations=args.conversations,
        prefix_words=args.prefix_len,
        turns=args.turns,
        user_words=args.user_len,
        output_tokens=args.reply_len,
        think_s=args.think_time,
        concurrency=args.conversation_concurrency,
    )
    workloads = {}
    for n in args.system_prompt_len:
        workloads["private" if n == 0 else f"shared-system-{n}"] = multiturn.Workload(**base, system_words=n)
    out = Path(args.out or f"bench-{Path(spec).stem}-routing-{time.strftime('%Y%m%d-%H%M%S')}")

    def write(result: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "routing.json").write_text(json.dumps(result, indent=2, default=str) + "\n")

    try:
        result = multiturn.compare(
            args.inventory, spec, policies, workloads, on_run=write, data=args.data or [], seed=args.seed
        )
    except (BenchError, ValueError, RuntimeError) as exc:
        print(f"vllm-fleet bench: {exc}", file=sys.stderr)
        if (out / "routing.json").exists():
            print(f"vllm-fleet bench: the runs finished before that are in {out / 'routing.json'}", file=sys.stderr)
        return 1
    write(result)
    files = multiturn.report(result, out)
    print(multiturn.format_table(result["runs"]))
    print(f"wrote {out / 'routing.json'}, " + ", ".join(str(f) for f in files))
    return 1 if any(r["result"]["failed"] for r in result["runs"]) else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from vllm_fleet.serving import report

    try:
        spec = spec_for(args.inventory, args.spec, args.data or [])
    except ValueError as exc:
        print(f"vllm-fleet bench: {exc}", file=sys.stderr)
        return 1
    if args.multi_turn:
        return cmd_multi_turn(args, spec)
    conc, rates = args.concurrency, args.rate  # parsed and range-checked by argparse (commands.argtypes)
    try:
        result = run_bench(
            args.inventory,
            spec,
            host=args.host,
            concurrency=conc,
            rates=rates,
            input_len=args.input_len,
            output_len=args.output_len,
            prompts_per_level=args.prompts_per_level,
            min_prompts=args.min_prompts,
            warmups=args.warmups,
            dataset=args.dataset,
            data=args.data or [],
            seed=args.seed,
        )
    except (BenchError, ValueError) as exc:
        print(f"vllm-fleet bench: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out or f"bench-{result['deployment']}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    files = report.bench_report(result, out)
    print(format_table(result["runs"]))
    print(f"wrote {out / 'bench.json'}, " + ", ".join(str(f) for f in files))
    return 1 if any(not r.get("result") or (r["result"].get("failed") or 0) for r in result["runs"]) else 0


def add_cli(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="vLLM's own serving benchmark on a server host, through the proxy and direct (docs/tuning.md)"
    )
    from vllm_fleet.commands.argtypes import add_inventory_arguments

    add_inventory_arguments(p)
    p.add_argument(
        "--spec",
        help=(
            "the deployed spec (default: the inventory's data vllm_fleet_spec, $VLLM_FLEET_SPEC; the lab: "
            "deployments/lab-tiny.yaml)"
        ),
    )
    g = p.add_mutually_exclusive_group()
    from vllm_fleet.commands.argtypes import count, counts, number, numbers

    g.add_argument(
        "--concurrency", type=counts(1, 100_000), help="comma-separated --max-concurrency levels (default 1,4,16)"
    )
    g.add_argument(
        "--rate", type=numbers(0, 1_000_000), help="comma-separated request rates (requests/s) instead of concurrencies"
    )
    p.add_argument(
        "--host",
        help=(
            "the replica (HOST:N, or HOST for its first instance) whose host runs the benchmark and whose port is "
            "the direct path (default: one not on a proxy host)"
        ),
    )
    p.add_argument(
        "--dataset", help="a dataset file ON that host (vLLM's `custom` JSONL format); default random prompts"
    )
    p.add_argument("--input-len", type=count(1, MAX_TOKENS), default=128, help="random prompt tokens (default 128)")
    p.add_argument(
        "--output-len", type=count(1, MAX_TOKENS), default=128, help="output tokens per request (default 128)"
    )
    p.add_argument(
        "--prompts-per-level",
        type=count(1, 1_000_000),
        default=8,
        help="prompts per level = max(--min-prompts, this x level)",
    )
    p.add_argument("--min-prompts", type=count(1, 1_000_000), default=16)
    p.add_argument("--warmups", type=count(0, 10_000), default=2, help="warm-up requests before each run")
    p.add_argument("--out", metavar="DIR", help="where bench.json and the report go (default ./bench-NAME-TIME)")
    p.add_argument(
        "--seed",
        type=count(0, 1_000_000_007),
        help="the invocation's seed (its prompts and conversations; run k uses seed + k); "
        "default: a new one from the clock, so no run meets another invocation's prompts in a warm cache. "
        "The JSON records it: --seed repeats a run",
    )
    m = p.add_argument_group("multi-turn chat across routing policies (docs/routing.md)")
    m.add_argument(
        "--multi-turn",
        action="store_true",
        help="run the multi-turn chat workload from this machine through the proxy, "
        "reading every replica's prefix-cache counters before and after; writes routing.json and routing.html",
    )
    m.add_argument(
        "--policies",
        help="comma-separated proxy.routing policies to compare (each a deploy of the proxy part only: "
        "no vLLM restart); default: the deployed one",
    )
    m.add_argument("--conversations", type=count(1, 100_000), default=16, help="conversations (default 16)")
    m.add_argument(
        "--conversation-concurrency",
        type=count(0, 100_000),
        default=0,
        help="conversations in flight at once (default all)",
    )
    m.add_argument(
        "--prefix-len",
        type=count(0, MAX_TOKENS),
        default=200,
        help="private prefix per conversation, in words (~tokens; default 200)",
    )
    m.add_argument(
        "--system-prompt-len",
        type=counts(0, MAX_TOKENS),
        default=[0],
        help="shared system prompt in words; comma-separated for several workloads "
        "(e.g. 0,2000: without and with; default 0)",
    )
    m.add_argument("--turns", type=count(1, 10_000), default=4, help="user turns per conversation (default 4)")
    m.add_argument("--user-len", type=count(1, MAX_TOKENS), default=20, help="new words per user turn (default 20)")
    m.add_argument("--reply-len", type=count(1, MAX_TOKENS), default=16, help="tokens generated per turn (default 16)")
    m.add_argument(
        "--think-time",
        type=number(0, 3600, lo_open=False),
        default=1.0,
        help="seconds, each conversation waits uniform(0, this) between turns (default 1)",
    )
    p.set_defaults(func=cmd_bench)
