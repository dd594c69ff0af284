"""The one way a spec file becomes a checked deployment: load -> schema -> resolve -> model and
hardware facts -> semantic checks.

Every caller (``vllm-fleet validate/plan/render/status/rollout`` and the deploys through
``vllm_fleet.roles.common.load_deploy_spec``) goes through :func:`check`; nothing else strings the
stages together.

:func:`check` never stops at the first stage that finds errors: when the schema stage finds
some, the keys it named are set aside (their defaults take their place) and the later stages run
on what is left, so that one run lists every problem a user has to fix. A later stage's problem
on a path the schema already named is not repeated. Pure: no host, no secret, no pyinfra.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

from vllm_fleet.specs import checks, hwchecks
from vllm_fleet.specs import document as specmod
from vllm_fleet.specs.document import Problem, Spec, SpecError

#: Schema-error passes: each sets aside the keys the previous one named (nested mistakes).
_PRUNE_PASSES = 4


@dataclass
class Checked:
    """One spec through the pipeline: what loaded, what resolved, every problem found."""

    source: str
    spec: Spec | None = None
    resolved: dict[str, Any] | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def ok(self) -> bool:
        return self.resolved is not None and not self.errors

    def raise_for_errors(self) -> None:
        if not self.ok:
            raise SpecError(self.problems, self.source)


def _prune(raw: dict[str, Any], paths: set[str]) -> dict[str, Any]:
    """A copy of ``raw`` without the keys at the dotted ``paths`` (so that their defaults apply)."""
    out = copy.deepcopy(raw)
    for path in sorted(paths, key=len, reverse=True):
        if not path:
            continue
        parts = path.split(".")
        node: Any = out
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict):
            node.pop(parts[-1], None)
        elif isinstance(node, list) and parts[-1].isdigit() and int(parts[-1]) < len(node):
            node.pop(int(parts[-1]))
    return out


def _covered(path: str, reported: set[str]) -> bool:
    """Whether a problem at ``path`` is about a key the schema stage already reported."""
    return any(path == r or path.startswith(r + ".") or r.startswith(path + ".") for r in reported if r)


def check(path: str, *, hardware: bool = True, overrides: dict[tuple[str, str], Any] | None = None) -> Checked:
    """Run every stage on the spec at ``path``; never raises for a bad spec.

    ``overrides`` ({(section, key): value}, None values ignored) replace resolved values before
    the facts and checks (``vllm-fleet plan --gpu``).
    """
    out = Checked(str(path))
    try:
        spec = specmod.load(path)
    except SpecError as exc:
        out.problems = list(exc.problems)
        return out
    out.spec = spec
    out.problems = specmod.schema_problems(spec)
    schema_errors = [p for p in out.problems if p.severity == "error"]
    target = spec
    if schema_errors:
        reported = {p.path for p in schema_errors}
        pruned = set(reported)
        for _ in range(_PRUNE_PASSES):
            target = Spec(raw=_prune(spec.raw, pruned), lines=spec.lines, path=spec.path)
            more = {p.path for p in specmod.schema_problems(target) if p.severity == "error"}
            if not more:
                break
            if more <= pruned:  # a required key is missing: nothing left to set aside
                return out
            pruned |= more
        else:
            return out
    try:
        resolved = specmod.resolve(target)
        for (section, key), value in (overrides or {}).items():
            if value is not None:
                resolved[section][key] = value
        if hardware:
            hwchecks.apply_model_facts(resolved)
        later = checks.run(resolved, spec, hardware=hardware)
    except Exception:
        if not schema_errors:
            raise  # a clean spec that crashes a check is a bug: let it show
        return out  # the schema's problems stand; the rest could not be judged
    if schema_errors:
        # a later problem about a set-aside key (its default stood in for the bad value: e.g.
        # `accelerator: CPU` -> "install.accelerator is cuda but ...") says nothing true: drop it
        later = [
            p
            for p in later
            if not _covered(p.path, {q.path for q in schema_errors})
            and not any(q.path and q.path in p.message for q in schema_errors)
        ]
        out.problems += later
        return out  # resolved on a pruned spec: not a deployable result
    out.problems += later
    out.resolved = resolved
    return out


def load_checked(
    path: str, *, hardware: bool = True, overrides: dict[tuple[str, str], Any] | None = None
) -> tuple[dict[str, Any], list[Problem], Spec]:
    """:func:`check`, raising :class:`SpecError` (with every problem) unless the spec is valid.

    Returns (resolved spec, warnings, loaded spec).
    """
    c = check(path, hardware=hardware, overrides=overrides)
    c.raise_for_errors()
    assert c.resolved is not None and c.spec is not None
    return c.resolved, c.problems, c.spec


def check_many(paths: Sequence[str], *, hardware: bool = True) -> list[Checked]:
    return [check(p, hardware=hardware) for p in paths]
