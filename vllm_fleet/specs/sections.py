"""The sections of a resolved spec that one role reads, and nothing else.

A role takes the resolved spec of one deployment narrowed to the top-level sections it declares
(``name``, ``install``, ``proxy``, ... of deployment.schema.json), so what each role depends on is
written once beside it and a read outside it stops with the role's name instead of coupling the
role to the whole spec in silence::

    @deploy("nginx", data_defaults=DEFAULTS)
    @reads("name", "install", "proxy")
    def install_nginx(spec, rendered, ...):
        spec["proxy"]["routing"]   # fine
        spec["server"]             # SectionNotDeclared: install_nginx reads 'server' ...

Callers pass the whole resolved spec (or a wider view); the role sees a read-only
:class:`Sections` of just its own. A role that hands the spec on to another role must declare
every section that role reads (narrowing a view to a section it lacks is the same error), so the
declarations stay true transitively. The values inside a section are the resolved spec's own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from vllm_fleet.specs import document

F = TypeVar("F", bound=Callable[..., Any])


class SectionNotDeclared(Exception):
    """A role read a spec section it does not declare with :func:`reads` (a defect in the role,
    not in the user's spec). Not a KeyError, so ``spec.get(section)`` cannot hide it."""


class Sections(Mapping[str, Any]):
    """A resolved spec seen through the sections ``names`` that ``reader`` declares (read-only)."""

    __slots__ = ("_spec", "_names", "_reader")

    def __init__(self, spec: Mapping[str, Any], names: frozenset[str], reader: str) -> None:
        if isinstance(spec, Sections):
            missing = names - spec._names
            if missing:
                raise SectionNotDeclared(
                    f"{spec._reader} hands the spec to {reader}, which reads {_listed(missing)}: "
                    f"add {_listed(missing)} to {spec._reader}'s @reads"
                )
            spec = spec._spec
        self._spec, self._names, self._reader = spec, names, reader

    def _check(self, key: str) -> None:
        if key not in self._names:
            raise SectionNotDeclared(
                f"{self._reader} reads the spec's {key!r} section but declares only {_listed(self._names)}: "
                f"add {key!r} to its @reads (vllm_fleet.specs.sections)"
            )

    def __getitem__(self, key: str) -> Any:
        self._check(key)
        return self._spec[key]

    def __contains__(self, key: object) -> bool:
        self._check(str(key))
        return key in self._spec

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._spec if k in self._names)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"Sections({self._reader}: {_listed(self._names)})"

    @property
    def names(self) -> frozenset[str]:
        """The sections this view shows."""
        return self._names


def _listed(names: frozenset[str] | set[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))


def reads(*names: str, param: str = "spec") -> Callable[[F], F]:
    """Narrow a role's ``param`` argument (the resolved spec) to the sections ``names``.

    + names: top-level sections of deployment.schema.json the role reads, directly or through the
      helpers and roles it calls with the spec
    + param: the argument that holds the spec (positional or keyword)

    The declared names are on the function as ``spec_sections``; put this under ``@deploy`` so
    pyinfra's wrapper sees the role's own signature.
    """
    wanted = frozenset(names)
    unknown = wanted - set(document.schema()["properties"])
    if unknown:
        raise ValueError(f"@reads: {_listed(unknown)} is no top-level section of deployment.schema.json")

    def decorator(func: F) -> F:
        sig = inspect.signature(func)
        index = list(sig.parameters).index(param)
        reader = f"{func.__module__.removeprefix('vllm_fleet.')}.{func.__qualname__}"

        @functools.wraps(func)
        def narrowed(*args: Any, **kwargs: Any) -> Any:
            if param in kwargs:
                kwargs[param] = Sections(kwargs[param], wanted, reader)
            elif len(args) > index:
                args = (*args[:index], Sections(args[index], wanted, reader), *args[index + 1 :])
            return func(*args, **kwargs)

        narrowed.spec_sections = wanted  # type: ignore[attr-defined]
        return narrowed  # type: ignore[return-value]

    return decorator
