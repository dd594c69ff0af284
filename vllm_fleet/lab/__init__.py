"""The local lab: `vllm-fleet lab up|down|status` (systemd-nspawn hosts on a private bridge).

`add_cli(subparsers)` registers the `lab` subcommand; `main(argv)` runs it standalone
(`python -m vllm_fleet.lab up`). The implementation is in .nspawn; see docs/lab.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from vllm_fleet.lab.nspawn import LabConfig, LabError, down, format_hosts, status, up

__all__ = ["LabConfig", "LabError", "add_cli", "main", "up", "down", "status"]


def _cmd(args: argparse.Namespace) -> int:
    try:
        if args.lab_command == "up":
            st = up(n=args.hosts, timeout=args.timeout)
            print(format_hosts(status(probe=True)) if not args.json else json.dumps(status(), indent=2))
            return 0
        if args.lab_command == "down":
            down()
            return 0
        st = status(probe=True)
        if args.json:
            print(json.dumps(st, indent=2))
        elif not st["hosts"]:
            print(f"lab is down (no state in {st['state_dir']})")
        else:
            print(format_hosts(st))
        if not st["hosts"]:
            return 3
        return 0 if all(h["state"] == "running" for h in st["hosts"]) else 1
    except LabError as exc:
        print(f"lab {args.lab_command}: error: {exc}", file=sys.stderr)
        return 2


def add_cli(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "lab",
        help="the local lab: N systemd-nspawn hosts with sshd on a private bridge",
        description="Local lab hosts for deploys and tests (root; see docs/lab.md). "
        "Env: VLLM_FLEET_LAB_DIR, VLLM_FLEET_CACHE_DIR, VLLM_FLEET_LAB_BRIDGE, "
        "VLLM_FLEET_LAB_SUBNET.",
    )
    sub = p.add_subparsers(dest="lab_command", metavar="ACTION")
    sub.required = True
    u = sub.add_parser("up", help="install host packages, build/restore the rootfs, boot N hosts, wait for SSH")
    u.add_argument(
        "--hosts",
        type=int,
        default=3,
        metavar="N",
        help="number of hosts (default 3); a running lab is reconciled to N",
    )
    u.add_argument("--timeout", type=float, default=180, help="seconds to wait for each host's SSH (default 180)")
    u.add_argument("--json", action="store_true", help="print the lab state as JSON")
    d = sub.add_parser("down", help="stop the hosts, remove bridge, NAT rule, mounts, cgroups; restore ip_forward")
    s = sub.add_parser("status", help="the hosts and their state (exit 0 all running, 1 not all, 3 down)")
    s.add_argument("--json", action="store_true")
    for q in (u, d, s):
        q.set_defaults(func=_cmd)
    d.set_defaults(json=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-fleet")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["lab", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
