"""One step of the packaged rollout deploy (:func:`vllm_fleet.deploys.rollout.rollout_step`) run as
a pyinfra child process: its command line and environment, and the part of its output that says
what failed. `vllm-fleet rollout` (:mod:`vllm_fleet.commands.rollout`) runs its three steps per
batch through it, and `vllm-fleet tune` (:mod:`vllm_fleet.serving.tune`) its upstream step, so
both take a replica out of nginx's upstream the same way.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Sequence

#: The packaged deploy every step runs (``pyinfra INVENTORY vllm_fleet.deploys.rollout:rollout_step``).
DEPLOY = "vllm_fleet.deploys.rollout:rollout_step"

#: The steps rollout_step takes (VLLM_FLEET_ROLLOUT_STEP).
STEPS = ("upstream", "update")


def step_command(
    pyinfra: str,
    inventory: str,
    spec_path: str,
    step: str,
    *,
    limit: list[str],
    down: list[str],
    drain_timeout: float,
    update: list[str] | None = None,
    data: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of one step on the hosts in ``limit``.

    + pyinfra: the pyinfra executable
    + inventory: the inventory file, as the user gave it
    + spec_path: the spec (made absolute: the child may run elsewhere)
    + step: ``upstream`` (nginx's upstream with ``down`` marked down) or ``update`` (drain, update, check ``update``)
    + limit: the hosts the step runs on (``--limit`` each)
    + down: replicas (``HOST:N``) out of the upstream
    + drain_timeout: seconds a replica is given to finish its requests
    + update: the replicas the update step replaces
    + data: pyinfra's ``--data KEY=VALUE`` host data (an inline inventory's login), as the user gave it

    **Example:**

    .. code:: python

        argv, env = step_command("pyinfra", "inventory/lab.py", "lab.yaml", "upstream",
                                 limit=["lab1"], down=["lab2:0"], drain_timeout=30)
    """
    if step not in STEPS:
        raise ValueError(f"rollout step {step!r}: one of {', '.join(STEPS)}")
    env = {
        **os.environ,
        "VLLM_FLEET_SPEC": os.path.abspath(spec_path),
        "VLLM_FLEET_ROLLOUT_STEP": step,
        "VLLM_FLEET_UPSTREAM_DOWN": ",".join(down),
        "VLLM_FLEET_UPDATE": ",".join(update or []),
        "VLLM_FLEET_DRAIN_TIMEOUT": str(drain_timeout),
    }
    argv = [pyinfra, "-y", inventory, DEPLOY]
    for d in data:
        argv += ["--data", d]
    for host in limit:
        argv += ["--limit", host]
    return argv, env


def run_step(argv: list[str], env: dict[str, str], cwd: str | None = None) -> tuple[int, str]:
    """Run one step's ``(argv, env)`` from :func:`step_command` with no stdin: ``(exit status, stdout + stderr)``."""
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return r.returncode, r.stdout + r.stderr


def failure_tail(text: str, n: int = 25) -> str:
    """What a failed step's output says: from two lines before its first error line on, else its
    last ``n`` non-blank lines (at most ``n`` lines either way)."""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if re.search(r"Error|error:|FAIL|RuntimeError|not healthy", line)]
    if errors:
        start = max(0, errors[0] - 2)
        return "\n".join(lines[start : start + n])
    return "\n".join(lines[-n:])
