"""The `vllm-fleet` command line: validate, plan, render, status, and the lab.

Exit codes: 0 success; 1 the spec (or inventory, or hosts) has problems, each printed on stderr
with its YAML path and a fix; 2 usage errors (argparse's own convention).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from . import __version__
from .spec import Problem, SpecError


def _print_problems(problems: Sequence[Problem], source: str, stream=None) -> None:
    stream = stream or sys.stderr
    errors = [p for p in problems if p.severity == "error"]
    warnings = [p for p in problems if p.severity != "error"]
    for p in errors + warnings:
        print(f"{source}: {p.format()}", file=stream)
    if errors:
        print(f"{source}: {len(errors)} error(s), {len(warnings)} warning(s); nothing was changed", file=stream)


def _load(path: str, *, hardware: bool = True, overrides: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[Problem]]:
    """Load + check a spec; print problems and exit 1 on errors."""
    from . import checks, spec as specmod

    try:
        spec = specmod.load(path)
        problems = specmod.schema_problems(spec)
        if any(p.severity == "error" for p in problems):
            raise SpecError(problems, path)
        resolved = specmod.resolve(spec)
        for (section, key), value in (overrides or {}).items():
            if value is not None:
                resolved[section][key] = value
        _apply_model_facts(resolved)
        problems += checks.run(resolved, spec, hardware=hardware)
        if any(p.severity == "error" for p in problems):
            raise SpecError(problems, path)
    except SpecError as exc:
        _print_problems(exc.problems, path)
        raise SystemExit(1) from None
    return resolved, problems


def _apply_model_facts(resolved: dict[str, Any]) -> None:
    try:
        from .hwchecks import apply_model_facts
    except ImportError:  # pragma: no cover
        return
    apply_model_facts(resolved)


# ---------------------------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    resolved, problems = _load(args.spec, hardware=not args.no_hardware)
    if args.json:
        print(json.dumps({"valid": True, "spec": args.spec, "warnings": [p.as_dict() for p in problems]}, indent=2))
    else:
        _print_problems(problems, args.spec)
        print(f"{args.spec}: valid ({resolved['name']}: {resolved['model']['served_name']}, "
              f"{resolved['install']['accelerator']}, TP {resolved['parallel']['tensor']} x PP {resolved['parallel']['pipeline']}"
              f"{', ' + str(len(problems)) + ' warning(s)' if problems else ''})")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from . import planner

    if args.list_models:
        print(planner.list_models())
        return 0
    if args.list_gpus:
        print(planner.list_gpus())
        return 0
    if not args.spec:
        print("vllm-fleet plan: a SPEC is required (or --list-models / --list-gpus)", file=sys.stderr)
        return 2
    overrides = {("hardware", "gpu"): args.gpu, ("hardware", "gpus_per_node"): args.gpus_per_node}
    # The plan is the answer to "does it fit": compute it even when it does not, then say so.
    from . import checks, spec as specmod

    try:
        spec = specmod.load(args.spec)
        problems = specmod.schema_problems(spec)
        if any(p.severity == "error" for p in problems):
            raise SpecError(problems, args.spec)
        resolved = specmod.resolve(spec)
        for (section, key), value in overrides.items():
            if value is not None:
                resolved[section][key] = value
        _apply_model_facts(resolved)
        problems += checks.run(resolved, spec, hardware=True)
    except SpecError as exc:
        _print_problems(exc.problems, args.spec)
        return 1
    blocking = [p for p in problems if p.severity == "error" and not p.path.startswith(("engine.gpu_memory_utilization", "model.quantization"))]
    try:
        result = planner.plan(resolved, gpu=args.gpu, gpus_per_node=args.gpus_per_node)
    except (KeyError, ValueError) as exc:
        _print_problems(problems, args.spec)
        print(f"{args.spec}: cannot plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(planner.format_plan(result))
    _print_problems(problems, args.spec)
    return 0 if result.get("fits") and not blocking else 1


def cmd_render(args: argparse.Namespace) -> int:
    from . import render
    from .inventory import InventoryError, load_inventory

    inventory = None
    if args.inventory:
        try:
            inventory = load_inventory(args.inventory)
        except InventoryError as exc:
            print(f"vllm-fleet render: {exc}", file=sys.stderr)
            return 1
    resolved, problems = _load(args.spec)
    _print_problems(problems, args.spec)
    try:
        targets = render.render(resolved, inventory)
    except render.RenderError as exc:
        print(f"{args.spec}: error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    count = 0
    manifest = []
    for target, files in sorted(targets.items()):
        for path, f in sorted(files.items()):
            # Control-machine files (the client target) live under ~: write them under HOME/.
            rel = "HOME/" + path[2:] if path.startswith("~/") else path.lstrip("/")
            dest = out / target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(f.content)
            os.chmod(dest, f.mode)
            manifest.append(f"{oct(f.mode)[2:]:>4} {(f.owner + ':' + f.group) if f.owner else '-':<10} {target}/{rel}")
            count += 1
    (out / "MANIFEST").write_text("\n".join(manifest) + "\n")
    print(f"rendered {count} file(s) for {len(targets)} target(s) into {out}/ (modes and owners in {out}/MANIFEST)")
    for line in manifest:
        print("  " + line)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .status import status_main

    return status_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-fleet", description="Declarative vLLM serving fleets on pyinfra: validate, plan and render a deployment spec; run the local lab.")
    parser.add_argument("--version", action="version", version=f"vllm-fleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("validate", help="check a spec: schema, options, parallelism, memory plan")
    p.add_argument("spec", metavar="SPEC")
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
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("render", help="write every file the deploy would place, per host or role")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--inventory", metavar="INV", help="pyinfra inventory file: render per host instead of per role")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("status", help="per host: unit state, vLLM version, served model, health")
    p.add_argument("inventory", metavar="INVENTORY")
    p.add_argument("--spec", help="the deployment spec (default: the VLLM_FLEET_SPEC env var or deployments/lab-tiny.yaml)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    for module in ("lab", "tinymodel", "rollout", "benchcmd", "tune"):
        try:
            mod = __import__(f"vllm_fleet.{module}", fromlist=["add_cli"])
        except ImportError:
            continue
        if hasattr(mod, "add_cli"):
            mod.add_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SystemExit as exc:
        return int(exc.code or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `vllm-fleet plan ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
