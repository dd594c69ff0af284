"""Where a host's deployment spec comes from (the deploy, `vllm-fleet deploy/diff/down/status`).

In this order:

1. pyinfra data ``vllm_fleet_spec``: ``--data vllm_fleet_spec=PATH`` (what ``vllm-fleet deploy
   --spec`` passes), else host data, else group data (an inventory group's data or
   ``group_data/<group>.py``), so each group may have its own spec; pyinfra's own precedence;
2. the environment variable ``$VLLM_FLEET_SPEC``;
3. only for the hosts of the lab inventory (host data ``lab_kind``): ``deployments/lab-tiny.yaml``.

Anything else stops with :class:`SpecSourceError`, which says how to give one. Host data ``spec``
(e.g. ``--data spec=x.yaml``, a likely typo) is an error too, not silently ignored. A relative
path is relative to the directory pyinfra (or vllm-fleet) runs in.

Core module: no pyinfra import (the deploy passes ``host.data``, the CLI pyinfra's inventory JSON).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

DATA_KEY = "vllm_fleet_spec"
ENV = "VLLM_FLEET_SPEC"
LAB_SPEC = "deployments/lab-tiny.yaml"
#: Data keys a user may have meant as vllm_fleet_spec.
LIKELY_TYPOS = ("spec", "vllm_spec", "fleet_spec", "vllm_fleet_specs", "vllm-fleet-spec", "vllm_fleet_spec_path")

HOW = (
    "give the spec with `vllm-fleet deploy INVENTORY --spec SPEC`, pyinfra's `--data vllm_fleet_spec=SPEC`, "
    "host or group data `vllm_fleet_spec: SPEC` in the inventory, or $VLLM_FLEET_SPEC"
)


class SpecSourceError(Exception):
    """No spec for a host, or one given under a wrong name: the message says how to fix it."""


def spec_source(data: Mapping[str, Any], host: str = "", env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(the first spec path, where it came from) for a host with this pyinfra data."""
    paths, where = spec_sources(data, host, env)
    return paths[0], where


def _split(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if str(v)]
    return [p for p in str(value).split(os.pathsep) if p]


def spec_sources(
    data: Mapping[str, Any], host: str = "", env: Mapping[str, str] | None = None
) -> tuple[list[str], str]:
    """([spec paths], where they came from) for a host with this pyinfra data. Several
    deployments on one host: data ``vllm_fleet_spec`` as a list, or paths separated by ``:``
    (like PATH) in the data or in $VLLM_FLEET_SPEC."""
    env = os.environ if env is None else env
    who = f"host {host}" if host else "this host"
    value = data.get(DATA_KEY)
    if value and _split(value):
        return _split(value), f"data {DATA_KEY}"
    typos = [k for k in LIKELY_TYPOS if data.get(k)]
    if typos:
        raise SpecSourceError(
            f"{who}: data `{typos[0]}` is set ({typos[0]}={data[typos[0]]!r}) but vllm-fleet reads "
            f"`{DATA_KEY}`: use `--data {DATA_KEY}={data[typos[0]]}` (or rename the inventory key)"
        )
    if env.get(ENV) and _split(env[ENV]):
        return _split(env[ENV]), f"${ENV}"
    if data.get("lab_kind"):
        return [LAB_SPEC], "the lab inventory's default"
    raise SpecSourceError(f"{who}: no deployment spec: {HOW}")
