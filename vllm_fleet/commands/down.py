"""`vllm-fleet down INVENTORY [--spec SPEC] [--limit HOSTS] [--purge] [--dry] [-y]`.

Checks the inputs as `vllm-fleet deploy` does (nothing contacted when they fail), then runs the
packaged deploy ``vllm_fleet.deploys.down.down`` with pyinfra: on each host the deployment's
units are stopped, disabled and removed, its env files, nginx site (then ``nginx -t`` and reload),
API firewall table and exporters' configuration removed: each role with ``present=False``
(docs/down.md).
Environments and weights stay unless ``--purge``. Other deployments on the hosts are left alone;
a second run changes nothing. A host that fails leaves the others going on; the per-host
summary, the retry line, ``--max-fail``, ``--parallel`` and the exit codes are deploy's
(vllm_fleet.commands.outcome): 0 done, 1 input problem (nothing contacted), 2 usage, 3 some
hosts failed, 4 nothing done, 130 interrupted.

Core module: pyinfra runs as a subprocess.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from vllm_fleet.commands.deploy import (
    again_command,
    checked_before_any_host,
    finish,
    pyinfra_argv,
    run_flags,
    run_pyinfra,
    summary,
)
from vllm_fleet.commands.outcome import EXIT_HELP, results_file

DOWN = "vllm_fleet.deploys.down.down"


def cmd_down(args: argparse.Namespace, runner: Callable[[list[str]], int] | None = None) -> int:
    planned = checked_before_any_host(args, "down", "nothing was removed", runner)
    if isinstance(planned, int):
        return planned
    deployments, data = planned
    if args.purge:
        data = [*data, "vllm_fleet_purge=true"]
    print(
        f"vllm-fleet down: removing {summary(deployments)}"
        + (" (purge: environments and weights too)" if args.purge else " (environments and weights stay)"),
        file=sys.stderr,
    )
    argv = pyinfra_argv(
        args.inventory, DOWN, data, args.limit or [], dry=args.dry, yes=args.yes, extra=run_flags(args, deployments)
    )
    print(f"vllm-fleet down: {' '.join(argv)}", file=sys.stderr)
    results_path = None if runner else results_file()
    rc = run_pyinfra(
        argv,
        runner,
        what="vllm-fleet down",
        again=again_command(args, "down") + (" --purge" if args.purge else ""),
        results=results_path,
    )
    return finish("down", args, rc, results_path)[0]


def add_cli(sub: Any) -> None:
    from vllm_fleet.commands.deploy import add_fleet_arguments
    from vllm_fleet.commands.outcome import add_run_arguments

    p = sub.add_parser(
        "down", help="remove a deployment from its hosts (units, files, nginx site, firewall)", description=EXIT_HELP
    )
    add_fleet_arguments(p)
    add_run_arguments(p)
    p.add_argument("--purge", action="store_true", help="also remove the environment, weights and caches")
    p.add_argument("--dry", action="store_true", help="show what would be removed; change nothing")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask before changing hosts")
    p.set_defaults(func=cmd_down)
