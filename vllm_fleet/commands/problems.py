"""How every command reports a spec's problems: each with its YAML path and fix on stderr, then
the count and "nothing was changed"; load_checked exits 1 when there is an error."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from vllm_fleet.spec.load import Problem
from vllm_fleet.spec.pipeline import check


def print_problems(problems: Sequence[Problem], source: str, stream=None) -> None:
    stream = stream or sys.stderr
    errors = [p for p in problems if p.severity == "error"]
    warnings = [p for p in problems if p.severity != "error"]
    for p in errors + warnings:
        print(f"{source}: {p.format()}", file=stream)
    if errors:
        print(f"{source}: {len(errors)} error(s), {len(warnings)} warning(s); nothing was changed", file=stream)


def load_checked(path: str, *, hardware: bool = True, overrides: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[Problem]]:
    """Load + check a spec (vllm_fleet.spec.pipeline); print every problem and exit 1 on errors."""
    c = check(path, hardware=hardware, overrides=overrides)
    if not c.ok:
        print_problems(c.problems, path)
        raise SystemExit(1)
    return c.resolved, c.problems
