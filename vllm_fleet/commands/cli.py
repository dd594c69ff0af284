"""The `vllm-fleet` command line: validate, plan, render, status, and the lab.

Exit codes: 0 success; 1 the spec (or inventory, or hosts) has problems, each printed on stderr
with its YAML path and a fix; 2 usage errors (argparse's own convention).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from vllm_fleet import __version__
from vllm_fleet.specs.load import Problem


from vllm_fleet.commands.problems import load_or_exit as _load, print_problems as _print_problems


# ---------------------------------------------------------------------------------------------


def _load_inventory(path: str | None, cmd: str) -> dict[str, Any] | None:
    from vllm_fleet.specs.inventory import InventoryError, load_inventory

    if not path:
        return None
    try:
        return load_inventory(path)
    except InventoryError as exc:
        print(f"vllm-fleet {cmd}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _fleet_problems(resolved: list[dict[str, Any]], sources: list[str], inventory: dict[str, Any] | None) -> list[str]:
    """The layout's problems of several specs (and an inventory) together: GPUs, ports, hosts."""
    from vllm_fleet.render.layout import LayoutError, build

    try:
        build(resolved, inventory, sources={r["name"]: s for r, s in zip(resolved, sources)})
    except LayoutError as exc:
        return exc.problems
    return []


def _gpus_here(
    resolved: list[dict[str, Any]], inventory_arg: str, cmd: str, json_out: bool, echo: bool = True
) -> tuple[list[str], list[str], list[str]]:
    """(lines, errors, warnings) of this machine's GPUs when the inventory holds @local: what a
    display server or another program holds is not planned with (vllm_fleet.roles.nvidia.gpumem).
    With ``echo`` the lines and warnings are printed here (lines on stdout, for the JSON forms on
    stderr); :func:`_echo_gpus_here` prints them later."""
    from vllm_fleet.roles.nvidia.gpumem import report_here

    got = report_here(resolved, _load_inventory(inventory_arg, cmd)) if resolved else None
    if got is None:
        return [], [], []
    if echo:
        _echo_gpus_here(got, json_out)
    return got


def _echo_gpus_here(got: tuple[list[str], list[str], list[str]], json_out: bool) -> None:
    lines, _, warnings = got
    out = sys.stderr if json_out else sys.stdout
    for line in lines:
        print(line, file=out)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    from vllm_fleet.specs.pipeline import check

    inventory = _load_inventory(args.inventory, "validate")
    results = [check(path, hardware=not args.no_hardware) for path in args.spec]
    fleet: list[str] = []
    # The layout: replicas that fit, and with an inventory or several specs, GPUs, ports, hosts.
    # Also over specs with semantic errors (every problem in one run), unless one of those makes
    # the files themselves unbuildable: then over the valid ones only.
    for group in ([c for c in results if c.resolved is not None], [c for c in results if c.ok]):
        if not group:
            continue
        try:
            fleet = _fleet_problems([c.resolved for c in group], [c.source for c in group], inventory)
            break
        except Exception:
            if all(c.ok for c in group):
                raise  # valid specs that crash the layout: a bug, let it show
    if not fleet and args.inventory:  # @local: this machine's GPUs, their free memory (nothing contacted)
        fleet = _gpus_here([c.resolved for c in results if c.ok], args.inventory, "validate", args.json)[1]
    ok = all(c.ok for c in results) and not fleet
    if args.json:
        doc = [
            {
                "valid": c.ok,
                "spec": c.source,
                "errors": [p.as_dict() for p in c.errors],
                "warnings": [p.as_dict() for p in c.problems if p.severity != "error"],
            }
            for c in results
        ]
        out: Any = (
            {**doc[0], "valid": ok, "fleet": fleet}
            if len(doc) == 1 and not args.inventory
            else {"valid": ok, "specs": doc, "fleet": fleet}
        )
        print(json.dumps(out, indent=2))
        for c in results:
            if not c.ok:
                _print_problems(c.problems, c.source)
        return 0 if ok else 1
    where = args.inventory or "specs"
    for c in results:
        _print_problems(c.problems, c.source)
        if c.ok:
            r, problems = c.resolved, c.problems
            # not "valid" when the fleet (the inventory, the other specs) has errors: exit 1 follows
            verdict = "valid on its own" if fleet else "valid"
            print(
                f"{c.source}: {verdict} ({r['name']}: {r['model']['served_name']}, "
                f"{r['install']['accelerator']}, TP {r['parallel']['tensor']} x PP {r['parallel']['pipeline']}"
                f"{', ' + str(len(problems)) + ' warning(s)' if problems else ''})"
                + (f", but not on {where}: see below" if fleet else "")
            )
    for line in fleet:
        print(f"{where}: error: {line}", file=sys.stderr)
    if fleet:
        print(f"{where}: {len(fleet)} error(s) in the fleet layout; nothing was changed", file=sys.stderr)
    return 0 if ok else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from vllm_fleet.specs import planner

    if args.list_models:
        print(planner.list_models())
        return 0
    if args.list_gpus:
        print(planner.list_gpus())
        return 0
    if not args.spec:
        print("vllm-fleet plan: a SPEC is required (or --list-models / --list-gpus)", file=sys.stderr)
        return 2
    if args.gpu is not None:
        from vllm_fleet.specs import catalog

        if args.gpu.strip().lower() not in catalog.gpu_names():
            print(
                f"vllm-fleet plan: --gpu {args.gpu!r} is not in the GPU catalogue; known GPUs: "
                f"{', '.join(catalog.gpu_names())} (vllm-fleet plan --list-gpus)",
                file=sys.stderr,
            )
            return 2
        args.gpu = args.gpu.strip().lower()
    if args.gpus_per_node is not None and not 1 <= args.gpus_per_node <= 16:
        print(f"vllm-fleet plan: --gpus-per-node must be 1 to 16, got {args.gpus_per_node}", file=sys.stderr)
        return 2
    overrides = {("hardware", "gpu"): args.gpu, ("hardware", "gpus_per_node"): args.gpus_per_node}
    # The plan is the answer to "does it fit": compute it even when it does not, then say so.
    from vllm_fleet.specs.pipeline import check

    c = check(args.spec, hardware=True, overrides=overrides)
    problems = c.problems
    if c.resolved is None:  # not loadable, or schema errors: nothing to plan
        _print_problems(problems, args.spec)
        return 1
    resolved = c.resolved
    blocking = [
        p
        for p in problems
        if p.severity == "error" and not p.path.startswith(("engine.gpu_memory_utilization", "model.quantization"))
    ]
    try:
        result = planner.plan(resolved, gpu=args.gpu, gpus_per_node=args.gpus_per_node)
    except (KeyError, ValueError, OverflowError, ZeroDivisionError) as exc:
        _print_problems(problems, args.spec)
        print(f"{args.spec}: cannot plan: {exc}", file=sys.stderr)
        return 1
    here: tuple[list[str], list[str], list[str]] = ([], [], [])
    if args.inventory:  # what this machine's GPUs leave for it now (an @local host in the inventory)
        here = _gpus_here([resolved], args.inventory, "plan", args.json, echo=False)
        if here[1]:  # the plan's "fits" is this machine's answer: not with the memory free now
            result["fits"] = False
            result.setdefault("notes", []).append(
                "it does not fit in what this machine's GPU has free now (the error below)"
            )
    if args.json:
        if args.inventory:
            _echo_gpus_here(here, True)
            result["gpus_here"] = {"lines": here[0], "errors": here[1], "warnings": here[2]}
        try:
            text = json.dumps(result, indent=2, sort_keys=True, allow_nan=False)
        except ValueError:  # NaN or Infinity: not JSON, and not a plan
            print(
                f"{args.spec}: cannot plan: the numbers do not come out finite (check engine and model sizes)",
                file=sys.stderr,
            )
            return 1
        print(text)
    else:
        print(planner.format_plan(result))
        _echo_gpus_here(here, False)  # after the table: what this machine's GPUs leave for it
        for line in here[1]:
            print(f"{args.spec}: error: engine.gpu_memory_utilization: {line}", file=sys.stderr)
    _print_problems(problems, args.spec)
    return 0 if result.get("fits") and not blocking and not here[1] else 1


def cmd_render(args: argparse.Namespace) -> int:
    from vllm_fleet.render import files as render

    inventory = _load_inventory(args.inventory, "render")
    if not args.out.strip():
        print(
            "vllm-fleet render: --out is empty: name the directory to render into (e.g. --out build/rendered)",
            file=sys.stderr,
        )
        return 1
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(
            f"vllm-fleet render: --out {out} exists and is not a directory: name a new or existing directory",
            file=sys.stderr,
        )
        return 1
    resolved = []
    for path in args.spec:
        r, problems = _load(path)
        _print_problems(problems, path)
        resolved.append(r)
    try:
        targets = render.render_many(resolved, inventory, sources={r["name"]: p for r, p in zip(resolved, args.spec)})
    except render.RenderError as exc:
        for line in str(exc).splitlines():
            print(f"{args.inventory or ' '.join(args.spec)}: error: {line}", file=sys.stderr)
        return 1
    count = 0
    manifest = []
    try:
        top = out.resolve()
        for target, files in sorted(targets.items()):
            for path, f in sorted(files.items()):
                # Control-machine files (the client target) live under ~: write them under HOME/.
                rel = "HOME/" + path[2:] if path.startswith("~/") else path.lstrip("/")
                dest = out / target / rel
                if ".." in Path(target, rel).parts or not dest.resolve().is_relative_to(top):
                    print(
                        f"vllm-fleet render: {target}: {path} would be written outside {out}/; "
                        "nothing more was written",
                        file=sys.stderr,
                    )
                    return 1
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(f.content)
                os.chmod(dest, f.mode)
                manifest.append(
                    f"{oct(f.mode)[2:]:>4} {(f.owner + ':' + f.group) if f.owner else '-':<10} {target}/{rel}"
                )
                count += 1
        (out / "MANIFEST").write_text("\n".join(manifest) + "\n")
    except OSError as exc:
        where = exc.filename or out
        print(
            f"vllm-fleet render: cannot write {where}: {exc.strerror or exc}: pass --out a directory you can write",
            file=sys.stderr,
        )
        return 1
    print(f"rendered {count} file(s) for {len(targets)} target(s) into {out}/ (modes and owners in {out}/MANIFEST)")
    for line in manifest:
        print("  " + line)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from vllm_fleet.commands.status import status_main

    return status_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-fleet",
        description=(
            "Declarative vLLM serving fleets on pyinfra: validate, plan and render a deployment spec; run the "
            "local lab."
        ),
    )
    parser.add_argument("--version", action="version", version=f"vllm-fleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "validate",
        help=(
            "check spec(s): schema, options, parallelism, memory plan; with several specs and/or an inventory, the "
            "fleet (GPUs, ports, hosts)"
        ),
    )
    p.add_argument("spec", metavar="SPEC", nargs="+")
    p.add_argument(
        "--inventory", metavar="INV", help="pyinfra inventory file: also check the per-host layout of every spec on it"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-hardware", action="store_true", help="skip the checks that need model and GPU facts")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="the memory plan per GPU: weights, KV cache, capacity, fit")
    p.add_argument("spec", metavar="SPEC", nargs="?")
    p.add_argument("--gpu", help="GPU catalogue name (overrides hardware.gpu)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (overrides hardware.gpus_per_node)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--list-models", action="store_true", help="list the model catalogue")
    p.add_argument("--list-gpus", action="store_true", help="list the GPU catalogue")
    p.add_argument(
        "--inventory",
        metavar="INV",
        help="an inventory holding @local: plan with this machine's free GPU memory "
        "(nvidia-smi here; what a display server holds is not the spec's)",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("render", help="write every file the deploy would place, per host or role")
    p.add_argument("spec", metavar="SPEC", nargs="+", help="one or more specs (several deployments on one fleet)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--inventory", metavar="INV", help="pyinfra inventory file: render per host instead of per role")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("status", help="per host: unit state, vLLM version, served model, health")
    from vllm_fleet.commands.argtypes import add_inventory_arguments

    add_inventory_arguments(p)
    p.add_argument(
        "--spec",
        help="the deployment spec (default: each host's data vllm_fleet_spec, $VLLM_FLEET_SPEC; "
        "the lab inventory: deployments/lab-tiny.yaml)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    # every verb module is imported plainly: a broken one is an ImportError here, not a missing verb
    for module in (
        "lab",
        "lab.tinymodel",
        "commands.rollout",
        "commands.deploy",
        "commands.diff",
        "commands.down",
        "commands.stage",
        "commands.init",
        "commands.bench",
        "commands.tune",
    ):
        importlib.import_module(f"vllm_fleet.{module}").add_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe is reported here, not at exit
        return rc
    except SystemExit as exc:
        return int(exc.code or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `vllm-fleet validate bad.yaml 2>&1 | head -1`: not all was said
        _silence_stdio()
        return 1


def _silence_stdio() -> None:
    """After a broken pipe: point stdout and stderr at /dev/null so that the interpreter's final
    flush does not print a second traceback (the exit status says what happened)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
