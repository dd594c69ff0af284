"""Load, validate and resolve a deployment spec: the names every caller takes.

The stages (YAML with line numbers, the JSON Schema, resolve) are :mod:`vllm_fleet.specs.document`;
:func:`load_and_check` runs them with the semantic and hardware checks
(:mod:`vllm_fleet.specs.pipeline`, the one place that orders them). The stages do not know the
pipeline, so neither imports the other back.

Nothing here touches a host or imports pyinfra.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_fleet.specs.document import (  # noqa: F401  (the spec's names)
    CONTROL_CHARS,
    HOST_PATH,
    HOST_PATH_PATTERN,
    MAX_DEPTH,
    MAX_NODES,
    MAX_NUMBER_CHARS,
    MAX_SPEC_BYTES,
    MULTILINE_TEXT,
    REMOVED_OPTIONS,
    RESOLVED_SECTIONS,
    ROUTER_POLICY,
    SCHEMA_PATH,
    Problem,
    Spec,
    SpecError,
    cuda_min_driver,
    did_you_mean,
    is_local_path,
    load,
    loads,
    resolve,
    routing_policies,
    schema,
    schema_problems,
    vllm_cuda,
)
from vllm_fleet.specs.pipeline import load_checked


def load_and_check(path: str | os.PathLike[str], *, hardware: bool = True) -> tuple[dict[str, Any], list[Problem]]:
    """Load, validate and resolve; return (resolved spec, warnings). Raise SpecError on errors.

    The stages live in :mod:`vllm_fleet.specs.pipeline` (one place); this keeps the short name.
    """
    resolved, problems, _ = load_checked(str(path), hardware=hardware)
    return resolved, problems
