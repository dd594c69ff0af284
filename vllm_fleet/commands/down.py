"""`vllm-fleet down INVENTORY [--spec SPEC] [--limit HOSTS] [--purge] [--dry] [-y]`.

Checks the inputs as `vllm-fleet deploy` does (nothing contacted when they fail), then runs the
packaged deploy ``vllm_fleet.deploys.down.down`` with pyinfra: on each host the deployment's
units are stopped, disabled and removed, its env files, nginx site (then ``nginx -t`` and reload),
API firewall table and exporters' configuration removed: each role with ``present=False``
(docs/down.md).
Environments and weights stay unless ``--purge``. Other deployments on the hosts are left alone;
a second run changes nothing. Exit codes as `deploy`: 0 done, 1 input problem (nothing
contacted), 2 usage, 3 pyinfra failed on a host.

Core module: pyinfra runs as a subprocess.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from vllm_fleet.commands.deploy import (EXIT_OK, EXIT_PYINFRA, again_command, checked_before_any_host, pyinfra_argv,
                                        run_pyinfra, summary)

DOWN = "vllm_fleet.deploys.down.down"


def cmd_down(args: argparse.Namespace, runner: Callable[[list[str]], int] | None = None) -> int:
    planned = checked_before_any_host(args, "down", "nothing was removed", runner)
    if isinstance(planned, int):
        return planned
    deployments, data = planned
    if args.purge:
        data = [*data, "vllm_fleet_purge=true"]
    print(f"vllm-fleet down: removing {summary(deployments)}"
          + (" (purge: environments and weights too)" if args.purge else " (environments and weights stay)"), file=sys.stderr)
    argv = pyinfra_argv(args.inventory, DOWN, data, args.limit or [], dry=args.dry, yes=args.yes)
    print(f"vllm-fleet down: {' '.join(argv)}", file=sys.stderr)
    rc = run_pyinfra(argv, runner, what="vllm-fleet down", again=again_command(args, "down") + (" --purge" if args.purge else ""))
    if rc == 130:
        return rc
    if rc != 0:
        print(f"vllm-fleet down: pyinfra exited {rc}: see its output above", file=sys.stderr)
        return EXIT_PYINFRA
    return EXIT_OK


def add_cli(sub: Any) -> None:
    from vllm_fleet.commands.deploy import add_fleet_arguments

    p = sub.add_parser("down", help="remove a deployment from its hosts (units, files, nginx site, firewall)",
                       description="Exit codes: 0 done; 1 spec/inventory problem, no host contacted; 2 usage; 3 pyinfra failed on a host.")
    add_fleet_arguments(p)
    p.add_argument("--purge", action="store_true", help="also remove the environment, weights and caches")
    p.add_argument("--dry", action="store_true", help="show what would be removed; change nothing")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask before changing hosts")
    p.set_defaults(func=cmd_down)
