"""How every command reports a spec's problems: each with its YAML path and fix on stderr, then
the count and "nothing was changed"; :func:`load_or_exit` exits 1 when there is an error."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from vllm_fleet.specs.load import Problem, SpecError
from vllm_fleet.specs.pipeline import load_checked


def print_problems(problems: Sequence[Problem], source: str, stream=None) -> None:
    stream = stream or sys.stderr
    errors = [p for p in problems if p.severity == "error"]
    warnings = [p for p in problems if p.severity != "error"]
    for p in errors + warnings:
        print(f"{source}: {p.format()}", file=stream)
    if errors:
        print(f"{source}: {len(errors)} error(s), {len(warnings)} warning(s); nothing was changed", file=stream)


def load_or_exit(path: str, *, hardware: bool = True) -> tuple[dict[str, Any], list[Problem]]:
    """The one :func:`vllm_fleet.specs.pipeline.load_checked`, for a command: (resolved spec,
    warnings); on errors every problem printed and exit 1."""
    try:
        resolved, warnings, _ = load_checked(path, hardware=hardware)
    except SpecError as exc:
        print_problems(exc.problems, path)
        raise SystemExit(1) from None
    return resolved, warnings
