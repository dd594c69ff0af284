"""`vllm-fleet tune INVENTORY --spec SPEC --target ttft_p99_ms=...,tpot_p99_ms=...`: the verb. The
sweep itself (the grid, the pruning, the replica taken out of the upstream, the load search, the
report and the overlay) is :mod:`vllm_fleet.serving.tune`; docs/tuning.md says how to read it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vllm_fleet.commands.argtypes import count, number
from vllm_fleet.specs.inventory import spec_for
from vllm_fleet.serving.tune import TUNABLE, Tuner, TuneError, format_table, parse_grid, parse_target, point_label


def _target_arg(text: str) -> dict[str, float]:
    """argparse's type for --target: a bad one is a usage error (exit 2) before any host."""
    try:
        return parse_target(text)
    except TuneError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--target ")) from None


def _multi_turn(args: argparse.Namespace) -> dict[str, Any] | None:
    """--multi-turn's workload (serving.multiturn.Workload; the conversations are the load)."""
    if not args.multi_turn:
        return None
    return {
        "prefix_words": args.prefix_len,
        "turns": args.turns,
        "user_words": args.user_len,
        "output_tokens": args.reply_len,
        "think_s": args.think_time,
    }


def cmd_tune(args: argparse.Namespace) -> int:
    try:
        try:
            spec = spec_for(args.inventory, args.spec, args.data or [])
        except ValueError as exc:
            raise TuneError(str(exc)) from None
        target = args.target if isinstance(args.target, dict) else parse_target(args.target)
        grid = parse_grid(args.grid) if args.grid else None
        out = args.out or f"tune-{Path(spec).stem}"
        tuner = Tuner(
            args.inventory,
            spec,
            target,
            out,
            grid=grid,
            host=args.host,
            budget_min=args.budget,
            resume=args.resume,
            in_place=args.in_place,
            input_len=args.input_len,
            output_len=args.output_len,
            max_probes=args.max_probes,
            max_load=args.max_load,
            prompts_per_stream=args.prompts_per_stream,
            min_prompts=args.min_prompts,
            dry=args.dry,
            load_kind=args.search,
            data=args.data or [],
            multi_turn=_multi_turn(args),
        )
        if args.dry:
            for p in tuner.points:
                print(
                    f"{p['id']} {p['status']:<8} {point_label(p['settings'])}"
                    + (f"  ({p['reason']})" if p["reason"] else "")
                )
            return 0
        state = tuner.run()
    except TuneError as exc:
        print(f"vllm-fleet tune: {exc}", file=sys.stderr)
        return 1
    print(format_table(state))
    print("report: " + ", ".join(state["report"]) + f"; results {tuner.results}")
    return 0 if state.get("winner") else 1


def add_cli(sub: Any) -> None:
    p = sub.add_parser(
        "tune",
        help=(
            "sweep engine settings on one replica against a latency target; write the winner as an overlay "
            "(docs/tuning.md)"
        ),
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
    p.add_argument(
        "--target",
        required=True,
        type=_target_arg,
        help="limits in ms, e.g. ttft_p99_ms=500,tpot_p99_ms=50 (ttft/tpot/itl/e2el, p50/p90/p99)",
    )
    p.add_argument(
        "--grid", help="instead of the default grid: KEY=V1,V2;KEY=... with KEY one of " + ", ".join(TUNABLE)
    )
    p.add_argument(
        "--budget",
        type=number(0, 525_600),
        metavar="MIN",
        help="stop before a point that would end past this many minutes",
    )
    p.add_argument(
        "--resume", action="store_true", help="go on with the results in --out (points done are not run again)"
    )
    p.add_argument(
        "--host",
        help=(
            "the replica to tune: HOST:N, or HOST for its first instance (default: the last replica not on a proxy "
            "host)"
        ),
    )
    p.add_argument(
        "--in-place", action="store_true", help="do not take the replica out of the upstream (e.g. the only replica)"
    )
    p.add_argument("--out", metavar="DIR", help="results, report, overlay (default ./tune-SPECNAME)")
    p.add_argument("--input-len", type=count(1, 1 << 20), default=128, help="random prompt tokens (default 128)")
    p.add_argument("--output-len", type=count(1, 1 << 20), default=128, help="output tokens per request (default 128)")
    p.add_argument(
        "--max-probes",
        type=count(1, 1000),
        help="benchmark runs per point in the load search (default: enough to double up to "
        "the highest load, + 2 bisection steps: 7 for max_num_seqs 16, 10 for 128)",
    )
    m = p.add_argument_group("a multi-turn chat workload instead of vLLM's single-turn benchmark (docs/kv-offload.md)")
    m.add_argument(
        "--multi-turn",
        action="store_true",
        help="each probe runs N conversations at once (N: the load searched) from this "
        "machine through the proxy, every turn resending the conversation (where the KV cache's CPU tier has work); "
        "needs a proxy, one replica and --in-place",
    )
    m.add_argument(
        "--prefix-len",
        type=count(0, 1 << 20),
        default=3000,
        help="private prefix per conversation, in words (default 3000)",
    )
    m.add_argument("--turns", type=count(1, 10_000), default=8, help="user turns per conversation (default 8)")
    m.add_argument("--user-len", type=count(1, 1 << 20), default=60, help="new words per user turn (default 60)")
    m.add_argument("--reply-len", type=count(1, 1 << 20), default=48, help="tokens generated per turn (default 48)")
    m.add_argument(
        "--think-time",
        type=number(0, 3600, lo_open=False),
        default=3.0,
        help="seconds, uniform(0, this) between turns (default 3)",
    )
    p.add_argument(
        "--search",
        choices=("concurrency", "rate"),
        default="concurrency",
        help="search the highest --max-concurrency (default) or request rate (requests/s) meeting the target",
    )
    p.add_argument(
        "--max-load",
        type=number(0, 1_000_000),
        help="highest load tried (default: the point's max_num_seqs; rate: 64/s)",
    )
    p.add_argument(
        "--prompts-per-stream",
        type=count(1, 1_000_000),
        default=4,
        help="prompts per probe = max(--min-prompts, this x concurrency)",
    )
    p.add_argument("--min-prompts", type=count(1, 1_000_000), default=8)
    p.add_argument("--dry", action="store_true", help="print the grid after pruning and stop (no host is touched)")
    p.set_defaults(func=cmd_tune)
