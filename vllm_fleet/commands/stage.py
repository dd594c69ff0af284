"""`vllm-fleet stage INVENTORY [--spec SPEC] [--limit HOSTS] [--data K=V] [--dry] [-y]`.

Puts what a deploy would transfer on every host of the layout ahead of it: the Python env, the
wheels and the pinned vLLM installed from them, the model weights (and their stamp): the parts
of vllm_fleet.roles.parts.PARTS marked ``stages``, run by the packaged deploy
``vllm_fleet.deploys.stage.stage``. No unit, no service config, no restart. A later `deploy` or
`rollout` finds them in place: a rollout batch then costs a restart and a health wait.

The inputs are checked as `vllm-fleet deploy` checks them (nothing contacted when they fail), an
uploaded model is hashed here first, pyinfra runs with its own progress output, and the run ends
as every fleet command ends (vllm_fleet.commands.outcome): the per-host summary (changed: staged
now; converged: already in place; failed and why; not attempted), a line that stages again only
the failed hosts, and its exit codes. ``--max-fail`` and ``--parallel`` are pyinfra's
``--fail-percent`` and ``--parallel``. Host data ``nvidia_reboot=False`` is passed: a GPU host
whose new driver needs a reboot stops with the fix instead of rebooting.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from vllm_fleet.commands import outcome
from vllm_fleet.commands.deploy import again_command, checked_and_warned, hash_models, pyinfra_argv, summary

STAGE = "vllm_fleet.deploys.stage.stage"
#: host data the stage run passes: never reboot a host (the nvidia role stops it with the fix)
NO_REBOOT = "nvidia_reboot=False"


def staged_hosts(deployments: list) -> list[str]:
    """The hosts of the run the layout gives a part that stages (vllm_fleet.roles.parts: the
    install stack of a server or Ray node), in inventory order; the others get nothing."""
    from vllm_fleet.render.layout import SERVICE_PARTS, build

    out: list[str] = []
    for d in deployments:
        layout = build([d.resolved], d.inventory)
        for h in d.hosts:
            node = layout.hosts[h].parts.get(d.resolved["name"]) if h in layout.hosts else None
            if node is not None and node.roles & SERVICE_PARTS and h not in out:
                out.append(h)
    return out


def _options(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """The options the user gave, for the retry line (its --limit replaced by the failed hosts)."""
    out: list[tuple[str, str | None]] = []
    if args.spec:
        out.append(("--spec", args.spec))
    out += [("--data", d) for d in args.data or []]
    if getattr(args, "max_fail", None) is not None:
        out.append(("--max-fail", str(args.max_fail)))
    if getattr(args, "parallel", None):
        out.append(("--parallel", str(args.parallel)))
    return out


def cmd_stage(args: argparse.Namespace, runner: Callable[[list[str]], int] | None = None) -> int:
    planned = checked_and_warned(args, "stage", "nothing was staged", runner)
    if isinstance(planned, int):
        return planned
    deployments, data = planned
    hosts = staged_hosts(deployments)
    print(
        f"vllm-fleet stage: env, vLLM and weights of {summary(deployments)} on {len(hosts)} host(s) "
        "(no unit, no restart)",
        file=sys.stderr,
    )
    hash_models(deployments, lambda m: print(f"vllm-fleet stage: {m}", file=sys.stderr))
    flags = outcome.pyinfra_run_flags(args, len(hosts), lambda m: print(f"vllm-fleet stage: {m}", file=sys.stderr))
    argv = pyinfra_argv(
        args.inventory, STAGE, [*data, NO_REBOOT], args.limit or [], dry=args.dry, yes=args.yes, extra=flags
    )
    print(f"vllm-fleet stage: {' '.join(argv)}", file=sys.stderr)
    if runner is not None:
        rc, results = runner(argv), None
    else:
        from vllm_fleet.host.pyinfra_run import run

        path = outcome.results_file()
        rc = run(argv, "vllm-fleet stage", again_command(args, "stage"), env=outcome.with_results(None, path))
        results = outcome.read_results(path)
    if rc == outcome.EXIT_INTERRUPTED:
        return rc
    if results is not None:
        # the hosts the layout stages; the others of the inventory had nothing to do
        mine = [r for r in results if r.host in hosts] or results
        options = _options(args) + ([("-y", None)] if args.yes else [])
        retry = outcome.retry_line("stage", [args.inventory], options, outcome.retry_hosts(mine))
        for line in outcome.summary_lines("stage", mine, retry):
            print(line)
        return outcome.exit_code(mine, rc)
    if rc != 0:
        print(f"vllm-fleet stage: pyinfra exited {rc} before any host's result (see its output above)", file=sys.stderr)
    return outcome.exit_code(None, rc)


def add_cli(sub: Any) -> None:
    from vllm_fleet.commands.deploy import add_fleet_arguments

    p = sub.add_parser(
        "stage",
        help="put env, vLLM and weights on the hosts ahead of a deploy or rollout (no unit, no restart)",
        description="Install what a deploy would transfer (env, wheels, vLLM, model weights) on every host of "
        "the layout, changing no unit and restarting nothing; a later deploy or rollout finds it in place. "
        + outcome.EXIT_HELP,
    )
    add_fleet_arguments(p)
    outcome.add_run_arguments(p)
    p.add_argument("--dry", action="store_true", help="show what would be staged; change nothing")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask before changing hosts")
    p.set_defaults(func=cmd_stage)
